"""The job (stages/planning/job.py): worked out once by export, handed on typed, read back as written."""

from __future__ import annotations

import json

import pytest

from stages.core.config import load_config
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config
from stages.model.graphs import CALIBRATION_ROLE, binary_layout
from stages.planning.job import Job
from stages.planning.results import OutdatedResult, QuantizeResult, StageReport


def _job(**overrides) -> tuple[Job, object]:
    cfg = load_config("tiny", overrides)
    return Job.build(geometry_from_config(TINY_TEXT_CONFIG), cfg), cfg


def test_a_job_survives_its_report_and_matches_what_the_config_derives():
    job, cfg = _job(prefill_ar=4, decode_ar=1)
    again = Job.from_dict(json.loads(json.dumps(job.to_dict())))
    assert again == job
    assert list(job.binaries) == binary_layout(cfg)
    assert len(job.parts) == cfg.num_shards and sorted(i for p in job.parts for i in p) == list(range(6))
    assert all(s.role != CALIBRATION_ROLE for s in job.shipped_specs)
    assert job.shipped_graphs == tuple(g for b in binary_layout(cfg) for g in b.graphs)


def test_quantize_lays_the_binaries_out_for_its_own_soc():
    """The SoC is a quantize field: an export made for one SoC serves another, binaries laid out anew."""
    job, _ = _job(prefill_ar=4, decode_ar=1)
    sharing_cfg = load_config("tiny", {"prefill_ar": 4, "decode_ar": 1, "soc": "SM8550"})
    moved = job.on_soc(sharing_cfg.soc_info)
    assert list(moved.binaries) == binary_layout(sharing_cfg)
    assert all(b.weight_shared for b in moved.binaries) and not any(b.weight_shared for b in job.binaries)
    assert moved.parts == job.parts and moved.specs == job.specs


def test_an_output_without_a_job_asks_for_a_clean_rebuild(tmp_path):
    result = QuantizeResult(tmp_path / "quantized", StageReport(stage="quantize", figures={}))
    with pytest.raises(OutdatedResult, match=r"does not record its job; `make clean`"):
        result.job  # noqa: B018
