"""Checkpoints written by transformers itself (tests/hf_checkpoints.py), not by this project.

Every layout (both model classes, float32 and bfloat16, one file or sharded with an index, the
per_layer_config form transformers 5.23 saves or the global_head_dim form Google publishes, with and
without the K/V weights of KV-shared layers that the published E2B-it keeps) passes the download
stage's validation, and the reference model verify uses equals transformers' own from_pretrained on
the folder. Two representative layouts go further: imported with --from, exported, and the float
ONNX chain matches transformers token for token.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hf_checkpoints import CAUSAL, CONDITIONAL, Layout, load_with_transformers, save_with_transformers

from stages.core.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.model.checkpoint import CheckpointError, stop_token_ids, validate_checkpoint
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config
from stages.quant.runner import HostRunner

pytestmark = pytest.mark.slow

# Every pair of choices (class, dtype, sharding, config form, K/V leftovers) in 6 layouts rather than
# all 32: each choice is read by its own code path, so pairs are where two could interfere.
_CHOICES = (
    (CONDITIONAL, CAUSAL),
    ("float32", "bfloat16"),
    (None, "100KB"),
    ("per_layer_config", "global_head_dim"),
    (False, True),
)
_PAIRWISE = (
    (0, 0, 0, 0, 0),
    (0, 0, 0, 0, 1),
    (0, 1, 1, 1, 0),
    (1, 0, 1, 1, 0),
    (1, 1, 0, 1, 1),
    (1, 1, 1, 0, 1),
)
EVERY_LAYOUT = [Layout(*(c[i] for c, i in zip(_CHOICES, row, strict=True))) for row in _PAIRWISE]
# A fine-tune re-saved with transformers 5.23 from the published archive; a text-only save in the
# published config form.
END_TO_END = [
    Layout(CONDITIONAL, "bfloat16", "100KB", "per_layer_config", shared_kv_leftovers=True),
    Layout(CAUSAL, "float32", None, "global_head_dim"),
]
PROMPT = [2] + list(range(40, 60))  # longer than the sliding window (8)
NEW_TOKENS = 16


def test_the_layouts_cover_every_pair_of_choices():
    for (i, a), (j, b) in itertools.combinations(enumerate(_CHOICES), 2):
        for x, y in itertools.product(a, b):
            assert any(row[i] == a.index(x) and row[j] == b.index(y) for row in _PAIRWISE), (x, y)


def _ids(layout: Layout) -> str:
    return layout.name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One folder per layout, written on first use."""
    root = tmp_path_factory.mktemp("hf-saves")
    folders: dict[Layout, Path] = {}

    def get(layout: Layout) -> Path:
        if layout not in folders:
            folders[layout] = save_with_transformers(root / layout.name, layout)
        return folders[layout]

    return get


def _logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("layout", EVERY_LAYOUT, ids=_ids)
def test_every_layout_validates_and_the_reference_equals_from_pretrained(saved, layout):
    from stages.model.reference import transformers_model

    folder = saved(layout)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    if layout.config_form == "per_layer_config":
        # What transformers 5.23 writes: no global_head_dim, the full layers' head_dim per layer.
        assert "global_head_dim" not in text and text["per_layer_config"] == {
            "2": {"head_dim": 32},
            "5": {"head_dim": 32},
        }
    summary = validate_checkpoint(folder)
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    assert summary.text_tensors == len(geo.all_tensors()) and summary.unused_tensors == ()
    assert len(summary.ignored_tensors) == (9 if layout.shared_kv_leftovers else 0)
    assert summary.dtypes == (("F32",) if layout.dtype == "float32" else ("BF16",))
    ours = _logits(transformers_model(folder), PROMPT)
    theirs = _logits(load_with_transformers(folder, layout), PROMPT)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()


@pytest.fixture(scope="module", params=END_TO_END, ids=_ids)
def exported(request, saved, tmp_path_factory):
    layout = request.param
    work = tmp_path_factory.mktemp(f"e2e-{layout.name}")
    checkpoint = work / "checkpoints" / layout.name
    figures = run_download(layout.name, "main", checkpoint, from_dir=saved(layout))
    assert figures["source"] == "from"
    # One graph (AR-1) per part keeps the export short; the chain still prefills past the window.
    cfg = load_config("tiny", {"model": layout.name, "num_shards": 2, "prefill_ar": 1, "decode_ar": 1})
    run_export(cfg, work, checkpoint)
    return layout, checkpoint, work / "exported", figures


def test_download_report_lists_the_ignored_tensors(exported):
    layout, _, _, figures = exported
    if layout.shared_kv_leftovers:
        assert "model.language_model.layers.4.self_attn.v_proj.weight" in figures["ignored_tensors"]
        assert len(figures["ignored_tensors"]) == 9 and figures["extra_text_tensors"] == 9
    else:
        assert figures["ignored_tensors"] == []


def test_float_chain_matches_transformers_from_pretrained(exported, saved):
    import torch

    layout, checkpoint, export_dir, _ = exported
    model = load_with_transformers(saved(layout), layout)
    continuation = list(range(100, 100 + NEW_TOKENS - 1))
    hf_logits = _logits(model, PROMPT + continuation)
    runner = HostRunner.from_export(export_dir)
    got = np.concatenate([runner.prefill(PROMPT)] + [runner.step([t]) for t in continuation])
    span = float(hf_logits.max() - hf_logits.min())
    assert float(np.abs(got - hf_logits).max()) < 1e-4 * span
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    runner.reset()
    assert runner.generate(PROMPT, NEW_TOKENS).tokens == out[0, len(PROMPT) :].tolist()


def test_stop_tokens_come_from_the_checkpoint(exported):
    _, checkpoint, _, _ = exported
    # transformers' generation_config.json (eos 1), the text config (eos 1) and <turn|> (5).
    assert stop_token_ids(checkpoint) == [1, 5]


def test_a_shape_transformers_rejects_is_one_line_naming_the_tensor(saved, tmp_path):
    """A head size that disagrees with the weights: transformers refuses such a folder, so does download,
    and the reference model (for a checkpoint damaged after download) says which tensors."""
    from stages.model.reference import transformers_model

    layout = Layout(CAUSAL, "float32", None, "global_head_dim")
    folder = shutil.copytree(saved(layout), tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config["global_head_dim"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight \[64, 64\]"):
        validate_checkpoint(folder)
    with pytest.raises(
        CheckpointError,
        match=r"wrong shape: model\.layers\.2\.self_attn\.k_norm\.weight \[32\] \(model has \[64\]\)",
    ) as e:
        transformers_model(folder)
    assert "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers refuses it too
        load_with_transformers(folder, layout)
