"""What a full run of a config needs from the machine, said before it starts: disk in WORKDIR (the
plan's model of what each stage writes, `stages.fitting.job_disk_bytes`) and memory (the largest peak RSS
any bench run of a model of the same geometry measured, ci/bench-results/*.json).

`python3 -m stages.needs --preset P [--<field> V]...` prints `DISK_BYTES RAM_BYTES SOURCE` on one line
(RAM_BYTES 0 when no bench run measured this geometry); ci/check-runner.sh compares them with the
runner before the long work. Stdlib only: CI runs it with the runner's python3 before any image exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from stages.config import PipelineConfig
from stages.fitting import make_plan
from stages.geometry import KNOWN_GEOMETRIES, builtin_geometry

BENCH_RESULTS = Path(__file__).resolve().parent.parent / "ci" / "bench-results"


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


def job_needs(cfg: PipelineConfig, bench_dir: Path = BENCH_RESULTS) -> JobNeeds:
    geo = builtin_geometry(cfg.model)
    if geo is None:
        raise NeedsError(
            f"no built-in geometry for model {cfg.model!r}: the disk a run needs is priced from it "
            f"(known: {', '.join(KNOWN_GEOMETRIES)})"
        )
    plan = make_plan(geo, cfg)
    ram, source = measured_peak_rss(bench_dir, plan.params["total"])
    return JobNeeds(plan.job_disk_bytes, ram, source)


def main(argv: list[str], environ: dict[str, str]) -> str:
    """The same options as `python3 -m stages.config` (and G4V69_<FIELD> variables)."""
    from stages.config import options_config

    needs = job_needs(options_config(argv, environ, "python3 -m stages.needs"))
    return f"{needs.disk_bytes} {needs.ram_bytes} {needs.ram_source}"


if __name__ == "__main__":
    import os
    import sys

    from stages.config import ConfigError

    try:
        print(main(sys.argv[1:], dict(os.environ)))
    except (ConfigError, NeedsError) as e:
        sys.exit(f"error: {e}")
