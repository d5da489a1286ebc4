"""Runtimes: what runs the compiled context binaries on the phone, and everything that must agree
with it. A runtime packages the compile stage's binaries into its bundle (the bundle stage), checks
that bundle on the host the way it will run it (the verify stage), and puts it on a phone and runs
it (`make push`, `make run`).

Genie (`stages/runtimes/genie/`) is the one there is. A second runtime is a package beside it whose
`RUNTIME` implements `Runtime`, and a row in the runtime table (`stages.core.pipeline.RUNTIMES`); the
config field `runtime` picks one, and the CLI reaches a runtime only through `get_runtime`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from stages.core.errors import UserFixable
from stages.core.pipeline import RUNTIMES

if TYPE_CHECKING:
    from stages.core.config import PipelineConfig
    from stages.model.geometry import Geometry


class RuntimeFailure(UserFixable, ValueError):
    """Bad input or a state the user can fix; the message says what failed and what to do. Every
    Runtime method raises this (or a subclass) for those, and the CLI prints it as one line."""


@runtime_checkable
class Runtime(Protocol):
    name: str

    def layout_problems(self, cfg: PipelineConfig, geo: Geometry) -> list[str]:
        """What this runtime cannot run in the config's layout for a model of this geometry, one line
        each: `make plan` and the export stage refuse it before anything is built."""
        ...

    def describe_layout(self, prefill_ar: int, decode_ar: int) -> str:
        """How this runtime runs a layout of these graph kinds (equal ARs: one kind), in one line for
        `make plan`'s layout table."""
        ...

    def usable_context(self, geo: Geometry, max_context: int, ars: list[int]) -> int:
        """The most tokens one conversation (prompts and replies together) holds in graphs of these ARs
        at this context: `make plan` states it for each layout, and the bundle writes it."""
        ...

    def lut_problems(self, lut_bytes: dict[str, int]) -> list[str]:
        """Which host LUTs (export report key -> bytes) this runtime cannot load, one line each:
        `make plan` warns of them before anything is built."""
        ...

    def package(self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path) -> dict[str, Any]:
        """The bundle stage: the compiled binaries and what the runtime needs beside them; its report."""
        ...

    def check(
        self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path, prompt: str, **options: Any
    ) -> dict[str, Any]:
        """The verify stage: the bundle driven on the host as the runtime drives it; its report."""
        ...

    def answer_on_host(self, workdir: Path, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """The bundle's quantized graphs on the host, fed as this runtime feeds them (`g4v69 generate
        --graphs quantized`): greedy `tokens`, `prefill_s`, `decode_s`, `stopped_by`, and each step's
        top-1 minus top-2 logit (`top2_margins`)."""
        ...

    def check_files(self, folder: Path, manifest: Path) -> list[str]:
        """A bundle folder against its manifest (`g4v69 bundle --check`): what differs, one line each."""
        ...

    def push(self, bundle_dir: Path, sdk_root: Path | None, serial: str | None, adb: str) -> dict[str, Any]:
        """The bundle (and the runtime's libraries from sdk_root) onto the phone; figures of the push."""
        ...

    def run(self, bundle_dir: Path, prompt: str, serial: str | None, adb: str) -> dict[str, Any]:
        """One user turn on the phone, streamed; the runtime's own figures (tokens/s) and the text."""
        ...


def get_runtime(name: str = "genie") -> Runtime:
    if name not in RUNTIMES:
        raise ValueError(f"runtime {name!r} is not known; allowed values: {', '.join(sorted(RUNTIMES))}")
    return importlib.import_module(RUNTIMES[name]).RUNTIME
