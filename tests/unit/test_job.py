"""The job (stages/planning/job.py): worked out once by export, handed on typed, read back as written."""

from __future__ import annotations

import json

import pytest

from stages.core.config import load_config
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config
from stages.model.graphs import CALIBRATION_ROLE
from stages.planning.job import Job
from stages.planning.results import OutdatedResult, QuantizeResult, StageReport


def _job(**overrides) -> tuple[Job, object]:
    cfg = load_config("tiny", overrides)
    return Job.build(geometry_from_config(TINY_TEXT_CONFIG), cfg), cfg


def test_a_job_survives_its_report_and_matches_what_the_config_derives():
    job, cfg = _job(prefill_ar=4, decode_ar=1)
    again = Job.from_dict(json.loads(json.dumps(job.to_dict())))
    assert again == job
    # v69 has no weight sharing: every graph is its own binary, prefill before decode in each part.
    assert [b.file for b in job.binaries] == [
        "prefill_ar4_part1_of_2.bin",
        "decode_ar1_part1_of_2.bin",
        "prefill_ar4_part2_of_2.bin",
        "decode_ar1_part2_of_2.bin",
    ]
    assert len(job.parts) == cfg.num_shards and sorted(i for p in job.parts for i in p) == list(range(6))
    assert all(s.role != CALIBRATION_ROLE for s in job.shipped_specs)
    assert job.shipped_graphs == tuple(b.file.removesuffix(".bin") for b in job.binaries)
    assert {s.name for s in job.shipped_specs} == set(job.shipped_graphs)


def test_quantize_lays_the_binaries_out_for_its_own_soc():
    """The SoC is a quantize field: an export made for one SoC serves another, binaries laid out anew."""
    job, _ = _job(prefill_ar=4, decode_ar=1)
    sharing_cfg = load_config("tiny", {"prefill_ar": 4, "decode_ar": 1, "soc": "SM8550"})
    moved = job.on_soc(sharing_cfg.soc_info)
    assert [b.file for b in moved.binaries] == ["part1_of_2.bin", "part2_of_2.bin"]
    assert moved.binaries == Job.build(geometry_from_config(TINY_TEXT_CONFIG), sharing_cfg).binaries
    assert all(b.weight_shared for b in moved.binaries) and not any(b.weight_shared for b in job.binaries)
    assert moved.parts == job.parts and moved.specs == job.specs


def test_an_output_without_a_job_asks_for_a_clean_rebuild(tmp_path):
    result = QuantizeResult(tmp_path / "quantized", StageReport(stage="quantize", figures={}))
    with pytest.raises(OutdatedResult, match=r"does not record its job; `make clean`"):
        result.job  # noqa: B018


def test_the_plan_prices_the_job_it_is_given():
    """make_plan reads the job's parts, kinds and binaries instead of deriving them from the config:
    the same job laid out for a weight-sharing SoC is priced with its shared binaries."""
    import inspect

    from stages.planning import fitting

    job, cfg = _job(prefill_ar=4, decode_ar=1)
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    plan = fitting.make_plan(job, geo, cfg)
    assert [b.file for b in plan.binaries] == [b.file for b in job.binaries]
    assert [p.layers for p in plan.parts] == [list(p) for p in job.parts]
    assert [(c.role, c.ar) for c in plan.calls] == [(k.role, k.ar) for k in job.kinds]
    assert fitting.plan_config(geo, cfg).to_dict() == plan.to_dict()

    shared = job.on_soc(load_config("tiny", {"soc": "SM8550"}).soc_info)
    priced = fitting.make_plan(shared, geo, cfg)
    assert [b.graphs for b in priced.binaries] == [list(b.graphs) for b in shared.binaries]
    assert len(priced.binaries) < len(plan.binaries)
    source = inspect.getsource(fitting.make_plan) + inspect.getsource(fitting._graph_plans)
    source += inspect.getsource(fitting._binary_plans)
    for call in ("part_layers(", "graph_kinds(", "lay_out_binaries(", "Job.build("):
        assert call not in source, call
