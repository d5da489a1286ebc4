"""The double's `qai_hub.client`: as in qai-hub 0.56.0, every class and exception lives here, and
`RateLimitedError` is NOT in `__all__`, so the top-level package does not export it."""

from __future__ import annotations

import configparser
import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

from . import public_rest_api as api
from .public_rest_api import ClientConfig

__all__ = [
    "Client",
    "ClientConfig",
    "CompileJob",
    "Device",
    "Error",
    "InternalError",
    "Job",
    "JobStatus",
    "LinkJob",
    "Model",
    "UserError",
]


class Error(Exception):
    def __init__(self, message):
        super().__init__(message)


class InternalError(Error):
    def __init__(self, message):
        super().__init__(message)


class UserError(Error):
    def __init__(self, message):
        super().__init__(message)


class RateLimitedError(Error):
    pass


@dataclass(frozen=True)
class Device:
    name: str = ""
    os: str = ""
    attributes: str | list[str] = field(default_factory=list)


@dataclass
class JobStatus:
    class State(Enum):
        SUCCESS = 4
        FAILED = 5
        CREATED = 1
        UNSPECIFIED = 0
        OPTIMIZING_MODEL = 2
        PROVISIONING_DEVICE = 3
        MEASURING_PERFORMANCE = 6
        RUNNING_INFERENCE = 7
        QUANTIZING_MODEL = 8
        LINKING_MODELS = 9

    state: JobStatus.State
    message: str | None = None

    @property
    def code(self) -> str:
        return self.state.name

    @property
    def success(self) -> bool:
        return self.state == JobStatus.State.SUCCESS

    @property
    def failure(self) -> bool:
        return self.state == JobStatus.State.FAILED

    @property
    def finished(self) -> bool:
        return self.success or self.failure

    @property
    def running(self) -> bool:
        return not self.finished and self.state != JobStatus.State.CREATED

    @property
    def pending(self) -> bool:
        return self.state == JobStatus.State.CREATED


# ---- the fake server ----
def _state_dir() -> Path:
    d = Path(os.environ["FAKE_QAI_HUB_STATE"])
    d.mkdir(parents=True, exist_ok=True)
    return d


def _scenario() -> dict[str, Any]:
    path = os.environ.get("FAKE_QAI_HUB_SCENARIO")
    return json.loads(Path(path).read_text()) if path else {}


@contextmanager
def _server():
    """The server's state, locked and saved back (one client at a time, like one HTTP request)."""
    d = _state_dir()
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = d / "server.json"
        state = (
            json.loads(path.read_text()) if path.exists() else {"calls": [], "models": {}, "jobs": {}, "n": 0}
        )
        yield state
        tmp = d / "server.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def _textbox(text: str) -> str:
    """qai-hub frames the messages of its errors in a box of this shape."""
    width = 70
    return (
        "\n\u250c"
        + "\u2500" * (width - 2)
        + "\u2510\n| "
        + text
        + " |\n\u2514"
        + "\u2500" * (width - 2)
        + "\u2518"
    )


def _api(method: str, name: str | None = None):
    """Count the call; raise the errors the scenario asks for, with the real client's messages."""
    scenario = _scenario()
    if scenario.get("no_network"):
        raise InternalError(
            "Internal API failure.\n"
            + _textbox(
                f"Could not connect to Qualcomm AI Hub. Please visit {api.DEFAULT_HUB_WEB_URL} to check."
            )
        )
    with _server() as s:
        s["calls"].append([method, name])
        seen = sum(1 for m, _ in s["calls"] if m == method)
    if seen <= scenario.get("rate_limit", {}).get(method, 0):
        raise RateLimitedError("Too many requests. Please try again later.")
    if seen <= scenario.get("internal_error", {}).get(method, 0):
        raise InternalError("Internal API failure.\n" + _textbox("Qualcomm AI Hub is unavailable right now."))


class Model:
    def __init__(self, model_id: str, name: str):
        self.model_id = model_id
        self.name = name

    def download(self, filename: str, timeout: int | None = None) -> str:
        with _server() as s:
            m = s["models"][self.model_id]
        ext = Path(m["file"]).suffix
        dest = filename if filename.endswith(ext) else filename + ext
        shutil.copyfile(m["file"], dest)
        return dest


class Job:
    _kind = "job"

    def __init__(self, owner: Client, job_id: str, name: str, options: str):
        self._owner = owner
        self.job_id = job_id
        self.name = name
        self.options = options
        self.date = datetime.now()

    @property
    def url(self) -> str:
        return f"{api.DEFAULT_HUB_WEB_URL}/jobs/{self.job_id}/"

    def get_status(self) -> JobStatus:
        self._owner._check()
        _api("get_status", self.name)
        polls = _scenario().get("polls_to_finish", 1)
        with _server() as s:
            job = s["jobs"][self.job_id]
            job["polls"] += 1
            if job["polls"] < polls:
                return JobStatus(JobStatus.State.OPTIMIZING_MODEL)
            if job["fail"]:
                return JobStatus(JobStatus.State.FAILED, job["fail"])
            if job["target"] is None:
                job["target"] = _make_target(s, job)
            return JobStatus(JobStatus.State.SUCCESS)

    def wait(self, timeout: int | None = None) -> JobStatus:
        while not (status := self.get_status()).finished:
            pass
        return status


class _TargetJob(Job):
    """As in qai-hub 0.56.0, only compile and link jobs have a target model (not Job itself)."""

    def get_target_model(self) -> Model | None:
        if not self.wait().success:
            return None
        with _server() as s:
            target = s["jobs"][self.job_id]["target"]
        return Model(target, self.name)

    def download_target_model(self, filename: str) -> str | None:
        _api("download_target_model", self.name)
        model = self.get_target_model()
        return None if model is None else model.download(filename)


class CompileJob(_TargetJob):
    _kind = "compile"


class LinkJob(_TargetJob):
    _kind = "link"


def _make_target(s: dict, job: dict) -> str:
    """A binary-like file: the I/O names of every input model and the device's SoC string."""
    device = next(d for d in _scenario().get("devices", []) if d["name"] == job["device"])
    names: list[str] = []
    for mid in job["models"]:
        names += s["models"][mid]["io"]
    s["n"] += 1
    model_id = f"m{s['n']:04d}"
    ext = ".dlc" if "qnn_dlc" in job["options"] else ".bin"
    path = _state_dir() / f"{model_id}{ext}"
    body = f"FAKE-QNN {job['kind']} {job['name']}\nsoc_type={device['soc']};arch={device['arch']};\n"
    path.write_text(body + "\n".join(names) + "\n")
    s["models"][model_id] = {"file": str(path), "name": job["name"], "io": names}
    return model_id


def _onnx_io(path: Path) -> list[str]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return [v.name for v in (*m.graph.input, *m.graph.output)]


class Client:
    def __init__(
        self,
        config: ClientConfig | None = None,
        profile: str | None = None,
        default_project_id=None,
        client_mode: str = "library",
    ):
        if config and profile:
            raise ValueError("Specify either config or profile, not both")
        self._config = config

    @property
    def config(self) -> ClientConfig:
        if self._config is None:
            ini = Path(os.environ.get("QAIHUB_CLIENT_INI", Path.home() / ".qai_hub" / "client.ini"))
            if not ini.is_file():
                raise UserError(f"Failed to load client configuration file.\n{ini} not found")
            parser = configparser.ConfigParser()
            parser.read(ini)
            self._config = ClientConfig(api_token=parser["api"]["api_token"])
        return self._config

    def _check(self) -> None:
        valid = _scenario().get("valid_tokens", [])
        if valid and self.config.api_token not in valid:
            raise UserError("Failed to authenticate: 401 Unauthorized. Please check your API token.")

    def get_devices(
        self, name: str = "", os: str = "", attributes: str | list[str] | None = None
    ) -> list[Device]:
        self._check()
        _api("get_devices", name)
        attrs = [attributes] if isinstance(attributes, str) else list(attributes or [])
        return [
            Device(d["name"], "", d["attributes"])
            for d in _scenario().get("devices", [])
            if (not name or d["name"] == name) and all(a in d["attributes"] for a in attrs)
        ]

    def upload_model(self, model: str, name: str | None = None, project=None) -> Model:
        self._check()
        _api("upload_model", name)
        src = Path(model)
        with _server() as s:
            s["n"] += 1
            model_id = f"m{s['n']:04d}"
            dest = _state_dir() / f"{model_id}{src.suffix}"
            shutil.copyfile(src, dest)
            s["models"][model_id] = {"file": str(dest), "name": name or src.name, "io": _onnx_io(src)}
        return Model(model_id, name or src.name)

    def get_model(self, model_id: str) -> Model:
        self._check()
        _api("get_model", model_id)
        with _server() as s:
            if model_id not in s["models"]:
                raise UserError(f"Model {model_id} does not exist")
            return Model(model_id, s["models"][model_id]["name"])

    def _submit(self, kind: str, models: list[Model], device: Device, name: str | None, options: str) -> Job:
        scenario = _scenario()
        if scenario.get("quota_exceeded"):
            raise UserError("You have exceeded your monthly job quota.")
        if device.name not in {d["name"] for d in scenario.get("devices", [])}:
            raise UserError(f"Device {device.name!r} is not available.")
        with _server() as s:
            s["n"] += 1
            job_id = f"j{s['n']:04d}"
            earlier = sum(1 for j in s["jobs"].values() if j["name"] == name)
            fails = scenario.get("fail", {}).get(name or "", [])
            s["jobs"][job_id] = {
                "kind": kind,
                "name": name,
                "device": device.name,
                "options": options,
                "models": [m.model_id for m in models],
                "polls": 0,
                "fail": fails[earlier] if earlier < len(fails) else None,
                "target": None,
            }
        cls = CompileJob if kind == "compile" else LinkJob
        return cls(self, job_id, name or "", options)

    def submit_compile_job(
        self,
        model,
        device,
        name=None,
        input_specs=None,
        options="",
        single_compile=True,
        calibration_data=None,
        retry=True,
        project=None,
    ):
        self._check()
        _api("submit_compile_job", name)
        if not isinstance(model, Model):
            model = self.upload_model(str(model), name=name)
        return self._submit("compile", [model], device, name, options)

    def submit_link_job(self, models, device, name=None, options="", project=None):
        self._check()
        _api("submit_link_job", name)
        return self._submit("link", list(models), device, name, options)

    def get_job(self, job_id: str, job_type=None) -> Job:
        self._check()
        _api("get_job", job_id)
        with _server() as s:
            if job_id not in s["jobs"]:
                raise UserError(f"Job {job_id} does not exist")
            job = s["jobs"][job_id]
        cls = CompileJob if job["kind"] == "compile" else LinkJob
        return cls(self, job_id, job["name"], job["options"])
