"""A toy Gemma 3 checkpoint written by transformers itself (Gemma3ForCausalLM.save_pretrained, a base
model: no chat template) through download (imported) and export (parity with transformers' own
Gemma 3).

The toy has what separates Gemma 3 from Gemma 4 in the graphs: RMSNorm weights stored minus one,
query_pre_attn_scalar unlike head_dim (the score scale), no value norm, no layer scalar, plain RoPE
on both kinds of layer with two bases, a window (8) shorter than the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.core.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.quant.runner import HostRunner

pytestmark = pytest.mark.slow

MODEL = "toy-gemma3"
TOY_GEMMA3 = {
    "vocab_size": 262,  # the built-in byte-level tokenizer's
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def write_toy_gemma3(dest: Path) -> Path:
    """The toy as transformers saves it, with random (non-trivial) weights, norms included, and the
    built-in tokenizer without its chat template (a base model)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from stages.model.builtin_models import write_tokenizer_files

    torch.manual_seed(3)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TOY_GEMMA3)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights stored minus one start at zero; spread them so the offset matters.
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 4.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(str(dest))
    write_tokenizer_files(dest, 1024)
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((dest / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dest


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A work folder with the toy downloaded (imported) as checkpoints/toy-gemma3."""
    work = tmp_path_factory.mktemp("gemma3")
    src = write_toy_gemma3(work / "saved")
    run_download(MODEL, "main", work / "checkpoints" / MODEL, from_dir=src)
    return work


def _cfg(**overrides):
    return load_config("tiny", {"model": MODEL, **overrides})


def test_geometry_names_every_tensor_transformers_has(toy):
    """The geometry's tensors are transformers' own parameter names and shapes, one for one."""
    from safetensors import safe_open

    from stages.model.checkpoint import Checkpoint

    ckpt = Checkpoint(toy / "checkpoints" / MODEL)
    geo = ckpt.geometry
    assert geo.family.name == "Gemma 3" and ckpt.prefix == "model."
    with safe_open(str(toy / "saved" / "model.safetensors"), "np") as f:
        stored = {k.removeprefix("model."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == {t.name: t.shape for t in geo.all_tensors()}
    assert geo.config["global_head_dim"] == 16 and geo.config["num_kv_shared_layers"] == 0


@pytest.fixture(scope="module")
def exported(toy) -> Path:
    run_export(_cfg(), toy, toy / "checkpoints" / MODEL)
    return toy / "exported"


def test_export_matches_transformers_gemma3(toy, exported):
    """Prefill in AR-4 chunks past the window, then AR-1 steps: the ONNX chain's logits are
    transformers' Gemma3ForCausalLM's at every position."""
    import torch

    from stages.model.reference import transformers_model

    hf = transformers_model(toy / "checkpoints" / MODEL)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    rng = np.random.default_rng(5)
    prompt = [2] + rng.integers(6, 262, 20).tolist()
    continuation = rng.integers(6, 262, 24).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + continuation])).logits[0].numpy()
    runner = HostRunner.from_export(exported)
    got = np.concatenate([runner.prefill(prompt)] + [runner.step([t]) for t in continuation])
    span = float(want.max() - want.min())
    assert float(np.abs(got - want).max()) < 1e-4 * span
    assert (got.argmax(-1) == want.argmax(-1)).all()
