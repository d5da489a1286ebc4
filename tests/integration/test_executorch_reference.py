"""ExecuTorch's Gemma 4 text decoder as a second, independent reference: the tiny checkpoint through
its converter and modules, against transformers and against the exported FP32 ONNX chain; and the
E2B geometry (config only, meta device) built by it with every tensor the planner and export expect.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.core.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.model.builtin_models import TEXT_PREFIX, gemma4_config
from stages.model.executorch_reference import (
    executorch_config,
    executorch_model,
    greedy_tokens,
    logits_of,
    unsupported,
)
from stages.model.geometry import E2B_TEXT_CONFIG, FULL, SLIDING, e2b_geometry
from stages.quant.runner import HostRunner

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 41  # longer than the window (8) and than one AR-4 prefill chunk
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny checkpoint and its export (the tiny preset's parts), in one work folder."""
    work = tmp_path_factory.mktemp("et-ref")
    ckpt = work / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    run_export(load_config("tiny"), work, ckpt)
    return ckpt, work / "exported"


@pytest.fixture(scope="module")
def ids() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(7)
    prompt = [2] + rng.integers(6, 262, PROMPT_TOKENS - 1).tolist()
    return prompt, rng.integers(6, 262, NEW_TOKENS - 1).tolist()


@pytest.fixture(scope="module")
def three(tiny, ids):
    """Logits at every position of prompt + continuation, and greedy tokens from the prompt, from
    transformers, ExecuTorch and the exported graphs."""
    import torch

    from stages.model import reference

    ckpt, export_dir = tiny
    prompt, continuation = ids
    seq = prompt + continuation
    hf = reference.transformers_model(ckpt)
    et = executorch_model(ckpt, context=load_config("tiny").max_context)
    runner = HostRunner.from_export(export_dir)
    onnx_logits = np.concatenate([runner.prefill(prompt)] + [runner.step([t]) for t in continuation])
    with torch.no_grad():
        hf_tokens = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    return {
        "transformers": (reference.logits_of(hf, seq), hf_tokens),
        "executorch": (logits_of(et, seq), greedy_tokens(et, prompt, NEW_TOKENS)),
        "onnx": (onnx_logits, HostRunner.from_export(export_dir).generate(prompt, NEW_TOKENS).tokens),
    }


@pytest.mark.parametrize("other", ["transformers", "onnx"])
def test_executorch_logits_match(three, other):
    et, ref = three["executorch"][0], three[other][0]
    assert et.shape == ref.shape == (PROMPT_TOKENS + NEW_TOKENS - 1, 262)
    assert np.isfinite(et).all()  # the unused K/V projections of the shared layers are NaN
    span = float(ref.max() - ref.min())
    err = float(np.abs(et - ref).max())
    assert err < 1e-5 * span, f"executorch vs {other}: max |diff| {err:.3g} over a range of {span:.3g}"
    assert (et.argmax(-1) == ref.argmax(-1)).all()
    assert len(set(ref.argmax(-1).tolist())) > 10  # varied inputs, not one repeated token


def test_executorch_greedy_tokens_match(three):
    tokens = {name: toks for name, (_, toks) in three.items()}
    assert len(tokens["executorch"]) == NEW_TOKENS
    assert tokens["executorch"] == tokens["transformers"] == tokens["onnx"]


def test_executorch_builds_the_e2b_geometry(tmp_path):
    """Config only: ExecuTorch's modules on the meta device hold every E2B tensor of stages/model/geometry.py
    under its converter's names with the same shape, share KV from the same donors and compute the
    same RoPE frequencies as transformers."""
    import torch
    from executorch.examples.models.gemma4.text_decoder.convert_weights import _get_weight_mapping
    from executorch.examples.models.gemma4.text_decoder.gemma4_attention import Gemma4Attention
    from executorch.examples.models.gemma4.text_decoder.gemma4_transformer import Gemma4ForCausalLM
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(gemma4_config(E2B_TEXT_CONFIG)))
    cfg = executorch_config(config_json, context=512)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    names = _get_weight_mapping(cfg)  # what convert_hf_to_custom renames each checkpoint tensor to
    geo = e2b_geometry()
    assert {t.name: shapes[names[TEXT_PREFIX + t.name]] for t in geo.all_tensors()} == {
        t.name: t.shape for t in geo.all_tensors()
    }
    donors = [cfg.get_kv_shared_layer_index(i) for i in range(geo.num_layers)]
    assert [i if d is None else d for i, d in enumerate(donors)] == [layer.kv_donor for layer in geo.layers]
    assert [cfg.get_intermediate_size(i) for i in range(geo.num_layers)] == [
        layer.intermediate_size for layer in geo.layers
    ]

    text = {k: v for k, v in E2B_TEXT_CONFIG.items() if k != "model_type"}
    hf_rope = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**text))
    cfg.use_kv_cache = False  # one attention module on CPU, without its cache buffers
    for kind in (SLIDING, FULL):
        layer = next(layer.index for layer in geo.layers if layer.attention == kind)
        ours = Gemma4Attention(cfg, layer).inv_freq
        assert torch.equal(ours, getattr(hf_rope, f"{kind}_inv_freq")), kind


def test_unsupported_features_are_named():
    assert unsupported(E2B_TEXT_CONFIG) == []
    moe = {**E2B_TEXT_CONFIG, "enable_moe_block": True, "attention_k_eq_v": True}
    assert unsupported({"text_config": moe}) == [
        "enable_moe_block (mixture of experts)",
        "attention_k_eq_v (keys reused as values)",
    ]
    yarn = {**E2B_TEXT_CONFIG, "rope_parameters": {SLIDING: {"rope_type": "yarn", "factor": 4.0}}}
    assert unsupported(yarn) == ["sliding RoPE type 'yarn'", "RoPE scaling factor"]
