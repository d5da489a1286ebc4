"""The trained tiny fixture: its corpus split, its tokenizer agreement and that it learned something."""

from __future__ import annotations

import json

import pytest

from stages.download import write_builtin_checkpoint
from stages.model import tiny_model
from stages.model.builtin_models import build_tokenizer
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config


def test_corpus_parts_are_disjoint_by_module():
    parts = {"train": [], "calibration": [], "heldout": []}
    for i, name in enumerate(tiny_model.CORPUS_MODULES):
        parts["calibration" if i % 10 == 3 else "heldout" if i % 10 == 7 else "train"].append(name)
    assert len(set(tiny_model.CORPUS_MODULES)) == len(tiny_model.CORPUS_MODULES)
    assert not set(parts["train"]) & set(parts["calibration"])
    assert not set(parts["train"]) & set(parts["heldout"])
    assert not set(parts["calibration"]) & set(parts["heldout"])
    sizes = {p: len(tiny_model.read_corpus(p)) for p in tiny_model.CORPUS_PARTS}
    assert sizes["train"] > 300_000 and sizes["calibration"] > 50_000 and sizes["heldout"] > 30_000
    # No held-out paragraph was trained on (a paragraph, not a shared stock phrase).
    train = tiny_model.read_corpus("train")
    paragraphs = [p for p in tiny_model.read_corpus("heldout").split("\n\n") if len(p) > 200]
    assert paragraphs and sum(p in train for p in paragraphs) / len(paragraphs) < 0.05


def test_encode_matches_the_builtin_tokenizer():
    text = tiny_model.read_corpus("calibration")[:2000] + " héllo ✓"
    assert tiny_model.encode(text) == build_tokenizer().encode(text, add_special_tokens=False).ids


def test_fixture_learned_and_download_writes_it(tmp_path):
    report = json.loads(tiny_model.FIXTURE_REPORT.read_text())
    # Byte-level text: untrained ~5.6 nats (uniform over 262) or worse; a trained model far below.
    assert report["heldout_nats_per_byte_after"] < 2.5 < report["heldout_nats_per_byte_before"]
    fixture = tiny_model.load_fixture()
    names = {t.name for t in geometry_from_config(TINY_TEXT_CONFIG).all_tensors()}
    assert set(fixture) == names
    write_builtin_checkpoint("tiny", tmp_path)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "model.safetensors"))
    name = "layers.3.mlp.down_proj.weight"
    assert (written["model.language_model." + name] == fixture[name]).all()


@pytest.mark.slow
def test_trained_tiny_predicts_held_out_text(tmp_path):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    text = {k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text)).eval()
    fixture = tiny_model.load_fixture()
    model.load_state_dict({"model." + k: v.float() for k, v in fixture.items()}, strict=False)
    model.tie_weights()
    ids = tiny_model.encode(tiny_model.read_corpus("heldout")[:4000])
    x = torch.tensor([[tiny_model.BOS_ID, *ids[:511]]])
    with torch.no_grad():
        pred = model(x).logits[0, :-1].argmax(-1)
    accuracy = float((pred == x[0, 1:]).float().mean())
    assert accuracy > 0.35  # a uniform guess over 262 ids gets 0.004
