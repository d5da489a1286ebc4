"""w4a16 end to end on the trained tiny model: 4-bit decoder weights in the QDQ graphs (audited), the
precisions ranked by measured quality as the precision table says, and v69 binaries from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.compile import run_compile
from stages.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.precision import PRECISIONS
from stages.quantize import run_quantize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("w4a16")
    cfg = load_config("tiny", {"precision": "w4a16"})
    ckpt = work / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    run_export(cfg, work, ckpt)
    return work, run_quantize(cfg, work, ckpt, compare_precisions=True)


def test_decoder_weights_are_lpbq_int4_and_the_lm_head_int8(w4a16):
    _, report = w4a16
    for graph in report["figures"]["graphs"]:
        audit = graph["audit"]
        assert audit["problems"] == []
        decoder = [w for w in audit["weights"] if w["role"] == "decoder"]
        assert decoder and all(w["type"] == "int4" and w["scheme"] == "int4-lpbq64" for w in decoder)
        assert all(0 < w["block_size"] <= 64 for w in decoder)
        heads = [w for w in audit["weights"] if w["role"] == "lm_head"]
        assert all(w["type"] == "int8" and w["block_size"] == 0 for w in heads)
    assert (
        sum(w["role"] == "lm_head" for g in report["figures"]["graphs"] for w in g["audit"]["weights"]) == 2
    )


def test_the_precision_table_ranks_as_measured(w4a16):
    _, report = w4a16
    quality = report["figures"]["quality_by_precision"]
    assert set(quality) == {"w8a16", "w4a16", "w4a16-channel"}
    assert all(not q.get("audit_problems") for q in quality.values())
    by_kl = sorted(quality, key=lambda name: quality[name]["kl_divergence"])
    assert by_kl == sorted(quality, key=lambda name: PRECISIONS[name].quality_rank)
    # 4 bits cost quality on this 64-wide model; the report says how much.
    assert quality["w8a16"]["top1_agreement"] > quality["w4a16"]["top1_agreement"] > 0.75


def test_4bit_graphs_compile_for_v69_in_one_partition(w4a16):
    work, _ = w4a16
    report = run_compile(load_config("tiny", {"precision": "w4a16"}), work)
    for b in report["figures"]["binaries"]:
        assert b["soc_type"] == "SM8450" and b["arch"] == 69
        assert b["estimated_allocation_bytes"] > b["weight_bytes"]
