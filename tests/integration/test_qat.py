"""A quantization-aware-trained checkpoint keeps its own grid: the tiny QAT fixtures (Q4_0's int4 grid
per channel and per group of 32 inputs, `python -m stages.model.tiny_model --qat`) written by transformers'
save_pretrained as bf16, imported as a user imports a folder, through quantize and, for the group
grid kept as LPBQ at blocks of 32, through compile and verify under the real Genie."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stages.core.config import load_config
from stages.tools.bench import save_qat_checkpoint

pytestmark = pytest.mark.slow
PROMPT = "Return the first element of a list."


def _quantized(work: Path, kind: str, overrides: dict) -> dict:
    from stages.download import run_download
    from stages.export import run_export
    from stages.quantize import run_quantize

    model = f"tiny-qat-{kind}"
    ckpt = work / "checkpoints" / model
    if not ckpt.is_dir():
        run_download(model, "main", ckpt, from_dir=save_qat_checkpoint(work / "src", kind))
    for stage in ("exported", "quantized"):
        shutil.rmtree(work / stage, ignore_errors=True)
    cfg = load_config("tiny", {"model": model, **overrides})
    run_export(cfg, work, ckpt)
    return run_quantize(cfg, work, ckpt)["figures"]


@pytest.fixture(scope="module")
def group32(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The group-32 QAT checkpoint quantized ignoring its grid, then keeping it (left in the folder)."""
    work = tmp_path_factory.mktemp("qat-group32")
    ignored = _quantized(work, "group32", {"precision": "w4a16-lpbq", "checkpoint_grid": "ignore"})
    kept = _quantized(work, "group32", {"precision": "w4a16-lpbq"})
    return work, kept, ignored


def test_every_decoder_weight_is_found_on_its_grid_and_kept_as_lpbq_blocks_of_32(group32):
    _, kept, _ = group32
    grids = kept["weights"]["checkpoint_grids"]
    assert grids["found"] == grids["kept"] == grids["of"] == 36
    for name, g in grids["weights"].items():
        assert (g["bits"], g["group"]) == (4, 32) and g["scale_residual"] < 0.05, (name, g)
    audited = [w for graph in kept["graphs"] for w in graph["audit"]["weights"] if w.get("checkpoint_grid")]
    assert audited and all(w["block_size"] == 32 for w in audited if w["role"] == "decoder")
    assert all(graph["audit"]["problems"] == [] for graph in kept["graphs"])


def test_keeping_the_group_grid_beats_rounding_it_again(group32):
    """Measured on held-out text against the QAT checkpoint's own float graphs (docs/fitting.md)."""
    _, kept, ignored = group32
    k, i = kept["quality"]["float16"], ignored["quality"]["float16"]
    assert k["kl_divergence"] < 0.75 * i["kl_divergence"]
    assert k["top1_agreement"] >= i["top1_agreement"]


def test_the_kept_lpbq_32_bundle_runs_under_the_real_genie(group32):
    """Blocks of the checkpoint's 32 rows, not the scheme's 64: compiled for v69, the binaries agree
    with the quantized graphs on the host, and the real Genie answers."""
    from stages.compile import run_compile
    from stages.runtimes.genie.bundle import run_bundle
    from stages.runtimes.genie.verify import run_verify

    work, _, _ = group32
    cfg = load_config("tiny", {"model": "tiny-qat-group32", "precision": "w4a16-lpbq"})
    ckpt = work / "checkpoints" / "tiny-qat-group32"
    run_compile(cfg, work)
    run_bundle(cfg, work, ckpt)
    fig = run_verify(cfg, work, ckpt, PROMPT)["figures"]
    assert all(status >= 0 for status in fig["real_genie"]["statuses"].values())
    assert fig["real_genie"]["answers"]["chat"][:8] == fig["transformers_text"][:8]


def test_mixed_precision_leaves_a_qat_checkpoint_all_4_bit(tmp_path):
    """Its per-channel grid kept in int4 per channel: no weight is worth moving to int8, where its
    exact integers would be rounded onto another grid."""
    fig = _quantized(tmp_path, "channel", {"precision": "w4a16-mixed"})
    assert fig["weights"]["int8_share"] == 0.0 and fig["weights"]["checkpoint_grids"]["kept"] == 36
