"""The compile stage's cloud backend: Qualcomm AI Hub through the `qai_hub` client.

One compile job per graph (to a QNN context binary; on SoCs with weight sharing, to a DLC per graph
and one link job per part). Every job goes into a ledger (`.g4v69/aihub_jobs.json` under WORKDIR,
copied into compiled/) written atomically after each submission and status change, keyed by the
prepared model's sha256, the device and the options, so a rerun after a crash or Ctrl-C reuses
finished jobs, waits on running ones and resubmits failed ones, at most MAX_ATTEMPTS times each.
Waiting polls all open jobs together behind one progress bar.

The token comes from QAI_HUB_API_TOKEN (handed to the client in memory, never written anywhere) or
the user's own ~/.qai_hub/client.ini (or QAIHUB_CLIENT_INI).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.config import PipelineConfig
from stages.core.report import sha256_file, write_json_atomic
from stages.model.graphs import Binary

MAX_ATTEMPTS = 3  # submissions per job before a failure stops the stage
RATE_LIMIT_RETRIES = 6
INTERNAL_ERROR_RETRIES = 3
LEDGER_VERSION = 1


def one_line(e: BaseException) -> str:
    """qai_hub's messages come framed in a multi-line text box; the stage prints one line."""
    text = " ".join(str(e).replace("\u2502", " ").split())
    text = "".join(c for c in text if c not in "\u250c\u2500\u2510\u2514\u2518|")
    return " ".join(text.split()) or type(e).__name__


def _poll_seconds() -> float:
    return float(os.environ.get("G4V69_AIHUB_POLL_S", "15"))


def _backoff_seconds() -> float:
    return float(os.environ.get("G4V69_AIHUB_BACKOFF_S", "5"))


class AihubError(ValueError):
    """An AI Hub setup or job failed in a way the user can act on; the message says how (the compile
    stage reports it as its own error)."""


class AiHub:
    """The `qai_hub` calls the stage makes, with its error handling: rate limits back off and retry,
    internal errors retry a few times, user errors become AihubErrors that say what to do."""

    def __init__(self, hub: Any):
        self.hub = hub
        self.error = AihubError
        token = os.environ.get("QAI_HUB_API_TOKEN", "").strip()
        ini = Path(os.environ.get("QAIHUB_CLIENT_INI", Path.home() / ".qai_hub" / "client.ini"))
        if token:
            self.client = hub.Client(config=hub.ClientConfig(api_token=token))
        elif ini.is_file():
            self.client = hub.Client()
        else:
            raise AihubError(
                "COMPILER=aihub needs an AI Hub API token: set QAI_HUB_API_TOKEN (from "
                "https://app.aihub.qualcomm.com/account) or run `qai-hub configure --api_token TOKEN`; "
                f"no token in the environment and no {ini}"
            )

    def call(self, what: str, fn, *args, **kwargs):
        hub = self.hub
        # qai-hub 0.56.0 defines RateLimitedError in qai_hub.client and does not export it at the top
        # level; network failures (no route, timeouts, 5xx) arrive as InternalError, and a few paths
        # (uploads) can still let a requests/OS error through.
        rate_limited = hub.client.RateLimitedError
        limited = internal = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except rate_limited as e:
                limited += 1
                if limited > RATE_LIMIT_RETRIES:
                    raise self.error(
                        f"AI Hub kept rate-limiting {what} ({one_line(e)}); wait a few minutes and rerun"
                    ) from None
                time.sleep(_backoff_seconds() * 2 ** (limited - 1))
            except (hub.InternalError, OSError) as e:
                internal += 1
                if internal > INTERNAL_ERROR_RETRIES:
                    raise self.error(
                        f"AI Hub failed {what} {internal} times: {one_line(e)}; it is on their side or the "
                        "network's: check the connection and rerun later (finished jobs are kept)"
                    ) from None
                time.sleep(_backoff_seconds())
            except hub.UserError as e:
                text = one_line(e)
                low = text.lower()
                if any(w in low for w in ("token", "unauthorized", "401", "403", "authentic")):
                    hint = "AI Hub rejected the API token: check QAI_HUB_API_TOKEN or ~/.qai_hub/client.ini"
                elif "quota" in low or "limit exceeded" in low:
                    hint = "your AI Hub quota is used up: wait for it to reset or ask Qualcomm for more"
                else:
                    hint = "AI Hub refused the request"
                raise self.error(f"{hint} ({what}): {text}") from None
            except hub.Error as e:
                raise self.error(f"AI Hub failed {what}: {one_line(e)}") from None

    def device(self, soc_name: str, device_name: str, chipset: str):
        devices = self.call("listing devices", self.client.get_devices, name=device_name)
        if devices:
            return self.hub.Device(device_name)
        known = self.call("listing devices", self.client.get_devices, attributes=chipset)
        names = sorted({d.name for d in known})
        raise self.error(
            f"AI Hub knows no device named {device_name!r} (the SoC table's device for {soc_name}); "
            f"devices with {chipset}: {', '.join(names) or 'none'}"
        )


@dataclass
class Ledger:
    path: Path
    jobs: dict[str, dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Ledger:
        if path.is_file():
            data = json.loads(path.read_text())
            if data.get("version") == LEDGER_VERSION:
                return cls(path, data["jobs"])
        return cls(path, {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, {"version": LEDGER_VERSION, "jobs": self.jobs})


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def compile_aihub(
    cfg: PipelineConfig,
    layout: list[Binary],
    prepared: dict[str, Path],
    out_dir: Path,
    ledger_path: Path,
    hub: Any = None,
) -> tuple[list[dict[str, Any]], str]:
    """Build every binary of the layout on AI Hub into out_dir; returns (figures per binary, QAIRT)."""
    if hub is None:
        try:
            import qai_hub as hub
        except ImportError:
            raise AihubError("COMPILER=aihub needs the qai-hub package: run in the compile image") from None
    soc = cfg.soc_info
    api = AiHub(hub)
    device = api.device(soc.name, soc.aihub_device, soc.aihub_chipset)
    ledger = Ledger.load(ledger_path)
    base = f"--qairt_version {cfg.qairt_version}"
    linking = any(b.weight_shared for b in layout)
    compile_options = f"--target_runtime {'qnn_dlc' if linking else 'qnn_context_binary'} {base}"
    runner = _JobRunner(api, ledger, device)
    shas = {g: sha256_file(p) for g, p in prepared.items()}
    compile_specs = [
        _JobSpec(
            name=g,
            key=_key(shas[g], soc.aihub_device, compile_options),
            submit=lambda g=g: _submit_compile(api, ledger, g, prepared[g], shas[g], device, compile_options),
        )
        for b in layout
        for g in b.graphs
    ]
    runner.run(compile_specs, "AI Hub compile")
    figures = []
    if not linking:
        for b in layout:
            (g,) = b.graphs
            figures.append(_download(api, ledger.jobs[g], out_dir / b.file, b, [g]))
        return figures, cfg.qairt_version
    link_specs = []
    for b in layout:
        models = [ledger.jobs[g]["target_model_id"] for g in b.graphs]
        link_specs.append(
            _JobSpec(
                name=b.file,
                key=_key(*models, soc.aihub_device, base),
                submit=lambda b=b, models=models: api.call(
                    f"submitting the link job for {b.file}",
                    api.client.submit_link_job,
                    [api.call("fetching a model", api.client.get_model, m) for m in models],
                    device=device,
                    name=b.file.removesuffix(".bin"),
                    options=base,
                ),
            )
        )
    runner.run(link_specs, "AI Hub link")
    for b in layout:
        figures.append(_download(api, ledger.jobs[b.file], out_dir / b.file, b, list(b.graphs)))
    return figures, cfg.qairt_version


@dataclass
class _JobSpec:
    name: str
    key: str
    submit: Any  # () -> job


def _submit_compile(api: AiHub, ledger: Ledger, graph: str, path: Path, sha: str, device, options: str):
    """Upload once (the model id is kept in the ledger, so a resubmission does not upload again)."""
    entry = ledger.jobs.get(graph, {})
    if entry.get("model_id") and entry.get("model_sha256") == sha:
        model = api.call(f"fetching the uploaded {graph}", api.client.get_model, entry["model_id"])
    else:
        model = api.call(f"uploading {graph}", api.client.upload_model, str(path), name=graph)
        entry.update(model_id=model.model_id, model_sha256=sha)
        ledger.jobs[graph] = entry
        ledger.save()
    return api.call(
        f"submitting the compile job for {graph}",
        api.client.submit_compile_job,
        model,
        device=device,
        name=graph,
        options=options,
        # The client's own retry loop sleeps up to 10 minutes printing boxes; the stage backs off itself.
        retry=False,
    )


class _JobRunner:
    def __init__(self, api: AiHub, ledger: Ledger, device):
        self.api, self.ledger, self.device = api, ledger, device
        self.tries: dict[str, int] = {}  # submissions in this run; the ledger counts all of them

    def _submit(self, spec: _JobSpec) -> Any:
        entry = self.ledger.jobs.get(spec.name, {})
        attempts = entry.get("attempts", 0) if entry.get("key") == spec.key else 0
        self.tries[spec.name] = self.tries.get(spec.name, 0) + 1
        job = spec.submit()
        entry = self.ledger.jobs.get(spec.name, {})
        entry.update(
            key=spec.key,
            job_id=job.job_id,
            url=job.url,
            status="SUBMITTED",
            attempts=attempts + 1,
            message=None,
        )
        self.ledger.jobs[spec.name] = entry
        self.ledger.save()
        return job

    def run(self, specs: list[_JobSpec], title: str) -> None:
        from stages.core.progress import tqdm

        api = self.api
        open_jobs: dict[str, Any] = {}
        done = 0
        for spec in specs:
            entry = self.ledger.jobs.get(spec.name)
            if entry and entry.get("key") == spec.key and entry.get("job_id"):
                if entry.get("status") == "SUCCESS":
                    done += 1
                    continue
                job = api.call(f"looking up job {entry['job_id']}", api.client.get_job, entry["job_id"])
                open_jobs[spec.name] = job
            else:
                open_jobs[spec.name] = self._submit(spec)
        by_name = {s.name: s for s in specs}
        with tqdm(total=len(specs), initial=done, desc=title, unit="job") as bar:
            while open_jobs:
                for name, job in list(open_jobs.items()):
                    status = api.call(f"checking job {job.job_id}", job.get_status)
                    entry = self.ledger.jobs[name]
                    if status.success:
                        entry.update(status="SUCCESS", message=None)
                        if hasattr(job, "get_target_model"):
                            target = api.call(f"reading job {job.job_id}", job.get_target_model)
                            entry["target_model_id"] = getattr(target, "model_id", None)
                        self.ledger.save()
                        del open_jobs[name]
                        bar.update()
                    elif status.failure:
                        entry.update(status="FAILED", message=status.message)
                        self.ledger.save()
                        tqdm.write(f"{title}: {name} failed: {status.message} ({job.url})", file=sys.stderr)
                        if self.tries.get(name, 0) >= MAX_ATTEMPTS:
                            raise api.error(
                                f"AI Hub job for {name} failed {self.tries[name]} times; last message: "
                                f"{status.message}; see {job.url}"
                            )
                        open_jobs[name] = self._submit(by_name[name])
                    else:
                        bar.set_postfix_str(f"{name}: {status.code}")
                if open_jobs:
                    time.sleep(_poll_seconds())


def _download(api: AiHub, entry: dict[str, Any], dest: Path, b: Binary, graphs: list[str]) -> dict[str, Any]:
    job = api.call(f"looking up job {entry['job_id']}", api.client.get_job, entry["job_id"])
    tmp = dest.with_name(f".{dest.name}.download")
    got = api.call(f"downloading the result of {entry['job_id']}", job.download_target_model, str(tmp))
    got = Path(got) if got else tmp
    if not got.is_file() or got.stat().st_size == 0:
        raise api.error(f"AI Hub job {entry['job_id']} ({entry['url']}) gave no binary for {b.file}")
    os.replace(got, dest)
    return {
        "file": b.file,
        "graphs": [{"name": g} for g in graphs],
        "aihub_job_id": entry["job_id"],
        "aihub_url": entry["url"],
        "attempts": entry["attempts"],
    }
