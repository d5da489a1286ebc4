"""Stage outputs: written to a temporary folder, renamed into place only when complete, each with a
`report.json` (inputs with sha256, options, tool versions, wall time, peak RSS).

A folder that has a report.json is complete; a folder without one is never produced by a stage,
so a later run cannot mistake a crashed run's leftovers for a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPORT_NAME = "report.json"
# Distributions whose versions a report records when installed; the ones a stage uses are a subset.
TOOL_DISTRIBUTIONS = (
    "g4v69",
    "click",
    "jinja2",
    "torch",
    "transformers",
    "executorch",
    "safetensors",
    "huggingface_hub",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "datasets",
    "numpy",
    "qai-hub",
    "tokenizers",
)
# Names of environment variables whose values must never reach a report.
SECRET_ENV = ("HF_TOKEN", "QAI_HUB_API_TOKEN")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_inputs(paths: list[Path], root: Path) -> list[dict[str, Any]]:
    """Every file under the given paths, relative to root, with size and sha256, in sorted order."""
    files: list[Path] = []
    for p in paths:
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            rel = str(f.resolve().relative_to(root.resolve()))
        except ValueError:
            rel = str(f)
        out.append({"path": rel, "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return out


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in TOOL_DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def peak_rss_bytes() -> int:
    """Peak resident set of this process and its finished children (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024
    return max(own, children) * scale


def proc_field_bytes(proc_file: str, key: str) -> int | None:
    """A `Key:  N kB` line of a Linux /proc file (meminfo, self/status) in bytes; None elsewhere."""
    try:
        for line in Path(proc_file).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_peak_rss_bytes() -> int:
    """This process's own peak resident set. On Linux from VmHWM, because ru_maxrss of a process
    started by fork + exec (multiprocessing's spawn) starts at its parent's RSS at the fork, which
    made every compile worker report the compile stage's own peak."""
    hwm = proc_field_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def redact(value: Any) -> Any:
    """Replace any secret's value wherever it appears in a report-bound structure."""
    secrets = [os.environ[k] for k in SECRET_ENV if os.environ.get(k)]
    if not secrets:
        return value
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, "<redacted>")
    return value


@dataclass
class StageRun:
    stage: str
    dir: Path  # the temporary folder the stage writes into
    figures: dict[str, Any] = field(default_factory=dict)


class StageOutputError(RuntimeError):
    pass


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


@contextmanager
def stage_output(
    stage: str,
    out_dir: Path,
    inputs: list[Path],
    options: dict[str, Any],
    root: Path,
) -> Iterator[StageRun]:
    """Run a stage into a temporary sibling of out_dir; on success write report.json and swap it in.

    On any exception the temporary folder is removed and an existing out_dir is left untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    started = time.time()
    cpu0 = time.process_time()
    run = StageRun(stage=stage, dir=tmp)
    try:
        described = describe_inputs(inputs, root)
        yield run
        report = {
            "stage": stage,
            "inputs": described,
            "options": options,
            "outputs": describe_inputs([tmp], tmp),
            "tool_versions": tool_versions(),
            "wall_s": round(time.time() - started, 3),
            "cpu_s": round(time.process_time() - cpu0, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "figures": run.figures,
        }
        write_json_atomic(tmp / REPORT_NAME, redact(report))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_report(out_dir: Path) -> dict[str, Any] | None:
    """The report of a complete stage output, or None if the folder is absent or incomplete."""
    path = Path(out_dir) / REPORT_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
