"""What a stage hands on, read back typed: every report.json as a `StageReport`, and the figures later
stages read of export, quantize and compile as `ExportResult`, `QuantizeResult` and `CompileResult`.
A stage that reads another's output goes through `require_result`, which also says, in one line, which
stage to run when the output is missing or incomplete.

Stdlib only: push, run and plan read reports in the tools image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from stages.core.errors import UserFixable
from stages.core.pipeline import output_dir
from stages.core.report import REPORT_NAME
from stages.model.contract import LutSpec
from stages.planning.job import Job


class OutdatedResult(UserFixable, ValueError):
    """A stage output written by an earlier version, without a figure this one reads."""


@dataclass(frozen=True)
class StageReport:
    """A report.json as stage_output wrote it (report.stage_output)."""

    stage: str
    options: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    tool_versions: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_bytes: int = 0
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageReport:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def read(cls, folder: Path) -> StageReport | None:
        """The report of a complete stage output, or None if the folder is absent or incomplete."""
        path = Path(folder) / REPORT_NAME
        if not path.is_file():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            return None


@dataclass(frozen=True)
class StageResult:
    """A finished stage's folder and its report; subclasses name the figures later stages read."""

    folder: Path
    report: StageReport

    @property
    def job(self) -> Job:
        """The job export worked out (`stages.planning.job.Job`), as this stage recorded it."""
        recorded = self.report.figures.get("job")
        if recorded is None:
            raise OutdatedResult(
                f"{self.folder} was written by an earlier version and does not record its job; "
                f"`make clean` (stage outputs only), then run the command again"
            )
        return Job.from_dict(recorded)


class ExportResult(StageResult):
    @property
    def graphs(self) -> list[dict[str, Any]]:
        """Every exported graph: name, spec, onnx (file name), bytes, export_s."""
        return self.report.figures["graphs"]

    @property
    def luts(self) -> dict[str, LutSpec]:
        """Genie's LUT files by key (embedding, per_layer_embedding), each path under exported/."""
        return {k: LutSpec(**v) for k, v in self.report.figures["luts"].items()}

    def graph_files(self) -> dict[str, Path]:
        """Each exported graph's ONNX file, by graph name."""
        return {g["name"]: self.folder / g["onnx"] for g in self.graphs}

    @property
    def parts(self) -> list[dict[str, Any]]:
        return self.report.figures["parts"]

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint it was exported from (recorded relative to the work folder)."""
        return self.folder.parent / self.report.figures["checkpoint_dir"]

    def carried_grids(self) -> dict[str, tuple[dict[str, Any], Any]]:
        """The weights a compressed-tensors checkpoint stored quantized: name -> (its scheme: bits,
        group, strategy, static input scale where stored; its scales (out, in / group)). Empty for
        any other checkpoint."""
        import numpy as np

        carried = self.report.figures.get("checkpoint_grids")
        if not carried:
            return {}
        with np.load(self.folder / carried["file"]) as scales:
            return {n: (meta, scales[n]) for n, meta in carried["weights"].items()}


class QuantizeResult(StageResult):
    @property
    def graphs(self) -> list[dict[str, Any]]:
        """Every quantized graph: name, qdq_onnx (file name), quantize_s, its audit."""
        return self.report.figures["graphs"]

    def graph_files(self) -> dict[str, Path]:
        """Each quantized graph's QDQ file, by graph name."""
        return {g["name"]: self.folder / g["qdq_onnx"] for g in self.graphs}

    @property
    def kv_cache_bits(self) -> int:
        return self.report.figures["kv_cache_bits"]

    @property
    def ple_policy(self) -> str:
        return self.report.figures["ple_policy"]

    @property
    def quality(self) -> dict[str, dict[str, Any]]:
        """Held-out quality against the float graphs, by PLE policy."""
        return self.report.figures["quality"]

    @property
    def output_sqnr_db(self) -> dict[str, dict[str, float]]:
        """Each quantized graph's outputs against the float graph's on held-out text (SQNR, dB), by
        graph name and tensor, under the PLE policy the graphs were kept with."""
        return self.quality.get(self.ple_policy, {}).get("sqnr_db", {})


@dataclass(frozen=True)
class CompiledGraph:
    """One graph of a context binary: its name, the name QNN gave it (the local compiler's; AI Hub
    does not report one) and its I/O encodings by direction and tensor (`IoTensor.to_dict` records)."""

    name: str
    io: dict[str, dict[str, dict[str, Any]]]
    qnn_graph_name: str | None = None


@dataclass(frozen=True)
class CompiledBinary:
    """One context binary as the compile stage recorded it."""

    file: str
    bytes: int
    weight_shared: bool
    graphs: tuple[CompiledGraph, ...]
    part: int | None = None
    sha256: str | None = None
    estimated_allocation_bytes: int | None = None  # our weights + I/O estimate
    peak_rss_bytes: int = 0  # of the compile that made it

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledBinary:
        return cls(
            file=d["file"],
            bytes=d["bytes"],
            weight_shared=d["weight_shared"],
            graphs=tuple(
                CompiledGraph(g["name"], g.get("io", {}), g.get("qnn_graph_name")) for g in d["graphs"]
            ),
            part=d.get("part"),
            sha256=d.get("sha256"),
            estimated_allocation_bytes=d.get("estimated_allocation_bytes"),
            peak_rss_bytes=d.get("peak_rss_bytes", 0),
        )


@dataclass(frozen=True)
class Backend:
    name: str  # local or aihub
    qairt_version: str


class CompileResult(StageResult):
    @property
    def binaries(self) -> list[CompiledBinary]:
        """Every context binary in Genie's ctx-bins order."""
        return [CompiledBinary.from_dict(b) for b in self.report.figures["binaries"]]

    @property
    def graph_io(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """Every compiled graph's I/O encodings, by graph name."""
        return {g.name: g.io for b in self.binaries for g in b.graphs}

    @property
    def backend(self) -> Backend:
        b = self.report.figures["backend"]
        return Backend(b["name"], b["qairt_version"])

    @property
    def soc(self) -> str:
        return self.report.figures["soc"]

    @property
    def dsp_arch(self) -> str:
        return self.report.figures["dsp_arch"]


R = TypeVar("R", ExportResult, QuantizeResult, CompileResult)


def read_result(workdir: Path, stage: str, kind: type[R]) -> R | None:
    """A finished stage's typed result under workdir, or None."""
    folder = output_dir(workdir, stage)
    report = StageReport.read(folder)
    return None if report is None else kind(folder, report)


def require_result(workdir: Path, stage: str, kind: type[R], error: type[Exception]) -> R:
    """A finished stage's typed result; raise `error` naming the stage to run when there is none."""
    result = read_result(workdir, stage, kind)
    if result is None:
        folder = output_dir(workdir, stage)
        raise error(f"{folder} holds no finished {stage} stage (no {REPORT_NAME}); run `make {stage}` first")
    return result
