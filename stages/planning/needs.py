"""What a full run of a config needs from the machine, said before it starts: disk in WORKDIR (the
plan's model of what each stage writes, `stages.planning.fitting.job_disk_bytes`), memory (the
largest peak RSS any bench run of a model of the same geometry measured, ci/bench-results/*.json),
and how long each stage should take here (`expected_stages`: the closest committed bench run, scaled
to this machine's cores).

`python3 -m stages.planning.needs --preset P [--<field> V]...` prints `DISK_BYTES RAM_BYTES SOURCE` on
one line (RAM_BYTES 0 when no bench run measured this geometry); ci/check-runner.sh compares them with the
runner before the long work. Stdlib only: CI runs it with the runner's python3 before any image exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stages.core.config import PipelineConfig
from stages.core.pipeline import STAGE_NAMES
from stages.model.geometry import KNOWN_GEOMETRIES, builtin_geometry
from stages.planning.fitting import plan_config

BENCH_RESULTS = Path(__file__).resolve().parents[2] / "ci" / "bench-results"


@dataclass(frozen=True)
class JobNeeds:
    disk_bytes: int
    ram_bytes: int  # 0: no bench run of this geometry
    ram_source: str


class NeedsError(ValueError):
    pass


def measured_peak_rss(bench_dir: Path, total_params: int) -> tuple[int, str]:
    """The largest peak RSS a bench run measured for a model with this many parameters (the same
    geometry), and the file that says so; (0, why) when none did."""
    best, source = 0, f"no bench run in {bench_dir} measured a model of {total_params:,} parameters"
    for path in sorted(bench_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        peak = data.get("max_peak_rss_bytes")
        params = (data.get("plan") or {}).get("params", {}).get("total")
        if peak and params == total_params and peak > best:
            best, source = peak, f"largest peak RSS of the bench runs of this geometry: {path.name}"
    return best, source


# Config fields that change a stage's work, most telling first: a bench run that matches more of them
# (after the geometry, which must match) is the better witness.
WORK_FIELDS = (
    "precision",
    "weight_rounding",
    "prefill_ar",
    "decode_ar",
    "num_shards",
    "max_context",
    "calibration_samples",
    "calibration_tokens",
    "hessian_samples",
    "sensitivity_tokens",
    "verify_engine",
)


@dataclass(frozen=True)
class ExpectedStage:
    stage: str
    wall_s: float  # on this machine
    bench_wall_s: float  # on the bench machine
    peak_rss_bytes: int


@dataclass(frozen=True)
class Expected:
    source: str  # the bench file
    cpus: int  # this machine's
    bench_cpus: int
    stages: list[ExpectedStage]
    differences: list[
        str
    ]  # config fields where the bench run differs from the config, "field: bench -> config"


def scaled_wall(wall_s: float, cpu_s: float, bench_cpus: int, cpus: int) -> float:
    """A stage's wall time on `cpus` cores from a run on `bench_cpus`, Amdahl's way: its time splits
    into a serial share S and a share Q that kept every bench core busy, read from wall = S + Q and
    CPU time = S + Q x bench_cpus; only Q scales with the cores. (One bench core tells nothing.)"""
    if bench_cpus <= 1:
        return wall_s
    q = min(max((cpu_s - wall_s) / (bench_cpus - 1), 0.0), wall_s)
    return (wall_s - q) + q * bench_cpus / cpus


def expected_stages(
    cfg: PipelineConfig, total_params: int, cpus: int, bench_dir: Path = BENCH_RESULTS
) -> Expected | None:
    """Each stage's expected wall time and peak memory for `cfg` on `cpus` cores: from the committed
    bench run of the same geometry that matches most of WORK_FIELDS (the newest among equals), each
    stage scaled by `scaled_wall`; None when no bench run measured this geometry. Where the run
    differs from the config (a cut calibration, another precision), `differences` says so: those
    are not scaled for."""
    best: tuple[tuple[int, str], Path, dict] | None = None
    for path in sorted(bench_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (data.get("plan") or {}).get("params", {}).get("total") != total_params or not data.get("stages"):
            continue
        config = data.get("config") or {}
        key = (sum(config.get(f) == getattr(cfg, f) for f in WORK_FIELDS), str(data.get("date", "")))
        if best is None or key >= best[0]:
            best = (key, path, data)
    if best is None:
        return None
    _, path, data = best
    bench_cpus = int(data.get("machine", {}).get("cpus") or 1)
    stages = [
        ExpectedStage(
            name,
            scaled_wall(float(st["wall_s"]), float(st.get("cpu_s", st["wall_s"])), bench_cpus, cpus),
            float(st["wall_s"]),
            int(st.get("peak_rss_bytes", 0)),
        )
        for name, st in data["stages"].items()
    ]
    order = {name: i for i, name in enumerate(STAGE_NAMES)}
    stages.sort(key=lambda e: order.get(e.stage, len(order)))
    config = data.get("config") or {}
    differences = [
        f"{f}: {config.get(f)} -> {getattr(cfg, f)}"
        for f in WORK_FIELDS
        if f in config and config.get(f) != getattr(cfg, f)
    ]
    return Expected(path.name, cpus, bench_cpus, stages, differences)


def render_expected(expected: Expected | None, model: str) -> list[str]:
    """The expected-time section `make plan` and `make bundle` print."""
    if expected is None:
        return [f"Expected time: no committed bench run measured {model}'s geometry (ci/bench-results/)"]
    total = sum(e.wall_s for e in expected.stages)
    out = [
        f"Expected time on this machine ({expected.cpus} cores), from {expected.source} "
        f"({expected.bench_cpus} cores, scaled by each stage's parallel share): {total / 60:.0f} min in all",
    ]
    out += [
        f"  {e.stage:<9} {e.wall_s / 60:7.1f} min   peak RSS {e.peak_rss_bytes / 2**30:5.1f} GiB"
        for e in expected.stages
    ]
    if expected.differences:
        out.append(
            "  that run differed from this config (not scaled for): " + "; ".join(expected.differences)
        )
    return out


def job_needs(cfg: PipelineConfig, bench_dir: Path = BENCH_RESULTS) -> JobNeeds:
    geo = builtin_geometry(cfg.model)
    if geo is None:
        raise NeedsError(
            f"no built-in geometry for model {cfg.model!r}: the disk a run needs is priced from it "
            f"(known: {', '.join(KNOWN_GEOMETRIES)})"
        )
    plan = plan_config(geo, cfg)
    ram, source = measured_peak_rss(bench_dir, plan.params["total"])
    return JobNeeds(plan.job_disk_bytes, ram, source)


def main(argv: list[str], environ: dict[str, str]) -> str:
    """The same options as `python3 -m stages.core.config` (and G4V69_<FIELD> variables)."""
    from stages.core.config import options_config

    needs = job_needs(options_config(argv, environ, "python3 -m stages.planning.needs"))
    return f"{needs.disk_bytes} {needs.ram_bytes} {needs.ram_source}"


if __name__ == "__main__":
    import os
    import sys

    from stages.core.config import ConfigError

    try:
        print(main(sys.argv[1:], dict(os.environ)))
    except (ConfigError, NeedsError) as e:
        sys.exit(f"error: {e}")
