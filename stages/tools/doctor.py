"""`g4v69 doctor`: what this environment can run, and what is missing, without changing anything."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stages.core.config import PipelineConfig
from stages.model.geometry import resolve_geometry
from stages.runtimes.genie.files import QAIRT_RUNTIME_LIBS

# The Python modules each stage imports; the stage images carry exactly these.
STAGE_MODULES = {
    "export": ("torch", "transformers", "safetensors", "huggingface_hub", "onnx", "onnxscript"),
    "quantize": ("onnx", "onnxruntime", "numpy", "datasets"),
    "compile": ("onnxruntime", "onnxruntime_qnn", "qai_hub"),
    "bundle": ("jinja2", "onnxruntime_qnn"),
    "verify": ("torch", "transformers", "onnxruntime", "tokenizers"),
    "push/run": ("jinja2",),
}


@dataclass
class Check:
    name: str
    status: str  # ok | warn | missing
    detail: str


def _modules(names: tuple[str, ...]) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def disk_need_bytes(cfg: PipelineConfig, workdir: Path) -> int | None:
    """Rough disk a full run needs (the plan's job_disk_bytes), None without a geometry."""
    from stages.core.pipeline import output_dir

    geo = resolve_geometry(cfg.model, output_dir(workdir, "download", cfg.checkpoint_name))
    if geo is None:
        return None
    from stages.planning.fitting import plan_config

    return plan_config(geo, cfg).job_disk_bytes


def run_checks(cfg: PipelineConfig, workdir: Path) -> list[Check]:
    checks = [
        Check(
            "python",
            "ok" if sys.version_info >= (3, 11) else "missing",
            f"{sys.version.split()[0]} (3.11+ needed)",
        )
    ]
    for stage, mods in STAGE_MODULES.items():
        missing = _modules(mods)
        checks.append(
            Check(
                f"{stage} packages",
                "ok" if not missing else "warn",
                "all present"
                if not missing
                else f"missing {', '.join(missing)} "
                f"(fine with RUNNER=docker; for RUNNER=local run `make venv`)",
            )
        )
    checks += _docker_check()
    checks += _disk_check(cfg, workdir)
    checks += _credential_checks(cfg)
    checks += _phone_checks()
    return checks


def _docker_check() -> list[Check]:
    """A Docker engine that answers (RUNNER=docker)."""
    out: list[Check] = []
    docker = shutil.which("docker")
    if docker is None:
        out.append(Check("docker", "warn", "no docker client; only RUNNER=local works"))
    else:
        try:
            r = subprocess.run(
                [docker, "version", "--format", "{{.Server.Version}}"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            ok = r.returncode == 0
            detail = f"engine {r.stdout.strip()}" if ok else "client present, engine not answering"
        except subprocess.TimeoutExpired:
            ok, detail = False, "engine did not answer within 20 s"
        out.append(Check("docker", "ok" if ok else "warn", detail))
    return out


def _disk_check(cfg: PipelineConfig, workdir: Path) -> list[Check]:
    """Free disk in WORKDIR against the plan's model of a full run."""
    out: list[Check] = []
    existing = workdir.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    need = disk_need_bytes(cfg, workdir)
    if need is None:
        out.append(Check("disk", "ok", f"{free / 1e9:.0f} GB free in {workdir}"))
    else:
        out.append(
            Check(
                "disk",
                "ok" if free >= need else "warn",
                f"{free / 1e9:.0f} GB free in {workdir}; a full {cfg.model} run needs about "
                f"{need / 1e9:.0f} GB",
            )
        )
    return out


def _credential_checks(cfg: PipelineConfig) -> list[Check]:
    """HF_TOKEN for a gated model, an AI Hub token for COMPILER=aihub."""
    out: list[Check] = []
    if not cfg.is_builtin_model:
        out.append(
            Check(
                "HF_TOKEN",
                "ok" if os.environ.get("HF_TOKEN") else "warn",
                "set"
                if os.environ.get("HF_TOKEN")
                else f"not set; {cfg.model} is gated: accept its license and export HF_TOKEN",
            )
        )
    if cfg.compiler == "aihub":
        ini = Path(os.environ.get("QAIHUB_CLIENT_INI", Path.home() / ".qai_hub" / "client.ini"))
        have = bool(os.environ.get("QAI_HUB_API_TOKEN")) or ini.is_file()
        out.append(
            Check(
                "AI Hub token",
                "ok" if have else "missing",
                "found" if have else "set QAI_HUB_API_TOKEN or run `qai-hub configure`",
            )
        )
    return out


def _phone_checks() -> list[Check]:
    """What `make push` and `make run` need: the QAIRT runtime libraries and adb."""
    out: list[Check] = []
    sdk = os.environ.get("QNN_SDK_ROOT")
    if not sdk:
        out.append(Check("QNN_SDK_ROOT", "warn", "not set; needed only by `make push`"))
    else:
        libdir = Path(sdk) / "lib" / "aarch64-android"
        absent = [lib for lib in QAIRT_RUNTIME_LIBS if not (libdir / lib).is_file()]
        out.append(
            Check(
                "QNN_SDK_ROOT",
                "ok" if not absent else "missing",
                f"{sdk}" if not absent else f"{libdir} lacks {', '.join(absent)}",
            )
        )
    out.append(
        Check(
            "adb",
            "ok" if shutil.which("adb") else "warn",
            shutil.which("adb") or "not on PATH; the tools image carries one for `make push`",
        )
    )
    return out


def render_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    marks = {"ok": "ok  ", "warn": "warn", "missing": "FAIL"}
    return "\n".join(f"[{marks[c.status]}] {c.name:<{width}}  {c.detail}" for c in checks)
