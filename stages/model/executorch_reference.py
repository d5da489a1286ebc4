"""ExecuTorch's own Gemma 4 text decoder on the same checkpoint: a second reference for the export
parity tests, written independently of transformers and of stages/model/decoder.py.

ExecuTorch 1.5.1 ships it as `executorch.examples.models.gemma4.text_decoder`: a config reader
(`Gemma4Config.from_json`), a Hugging Face weight converter (`convert_hf_to_custom`, which reads
the -it layout's `model.language_model.` names) and eager torch modules (`Gemma4ForCausalLM`: a
self-decoder and a KV-sharing cross-decoder, per-layer head dims, PLE, double-wide MLPs on the shared
layers, proportional partial RoPE, layer scalars, final softcapping). No stage imports this module.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from stages.model.geometry import FULL, SLIDING, text_config_of


def unsupported(config: dict[str, Any]) -> list[str]:
    """What a Gemma 4 config uses that ExecuTorch 1.5.1's text decoder does not implement (empty when
    it can run the model). Read from its gemma4_config.py, gemma4_attention.py and
    gemma4_decoder_layer.py; the flat keys its `from_json` reads are handled by `executorch_config`."""
    cfg = text_config_of(config)
    rope = cfg.get("rope_parameters") or {}
    sliding, full = rope.get(SLIDING, {}), rope.get(FULL, {})
    inter = cfg.get("intermediate_size")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    found = {
        # One dense MLP per layer, no router or experts.
        "enable_moe_block (mixture of experts)": bool(cfg.get("enable_moe_block")),
        # K and V always come from their own projections, one KV-head count for every layer.
        "attention_k_eq_v (keys reused as values)": bool(cfg.get("attention_k_eq_v")),
        "num_global_key_value_heads": cfg.get("num_global_key_value_heads")
        not in (None, cfg.get("num_key_value_heads")),
        "attention_bias": bool(cfg.get("attention_bias")),
        "use_bidirectional_attention": bool(cfg.get("use_bidirectional_attention")),
        # Gemma4MLP and the PLE gate call F.gelu(approximate="tanh") whatever the config says.
        f"hidden_activation {act!r}": act != "gelu_pytorch_tanh",
        # from_json keeps intermediate_size[0] for every layer.
        "per-layer intermediate sizes": isinstance(inter, list) and len(set(inter)) > 1,
        # The converter only looks for lm_head under model.language_model.; else it copies embed_tokens.
        "untied lm_head": not cfg.get("tie_word_embeddings", True),
        # inv_freq = theta^(-2i/head_dim) for the first partial_rotary_factor of the angles, zeros after:
        # transformers' "proportional" type on full layers (plain RoPE on sliding ones), never scaled.
        f"sliding RoPE type {sliding.get('rope_type')!r}": sliding.get("rope_type", "default") != "default",
        f"full RoPE type {full.get('rope_type')!r}": full.get("rope_type", "proportional") != "proportional",
        "RoPE scaling factor": any(p.get("factor", 1.0) != 1.0 for p in (sliding, full)),
    }
    return [name for name, present in found.items() if present]


def executorch_config(config_json: Path, context: int) -> Any:
    """ExecuTorch's Gemma4Config for a checkpoint's config.json, for plain-torch CPU runs of `context`
    positions.

    `Gemma4Config.from_json` looks for flat `rope_theta`, `rope_local_base_freq` and
    `partial_rotary_factor` keys, which Gemma 4 configs do not have (they nest them in
    `rope_parameters`), so it would silently keep its E2B defaults; they are set from the config here.
    """
    import json

    from executorch.examples.models.gemma4.text_decoder import Gemma4Config

    text = text_config_of(json.loads(Path(config_json).read_text()))
    missing = unsupported(text)
    if missing:
        raise ValueError(
            f"{config_json}: ExecuTorch's Gemma 4 decoder does not implement {', '.join(missing)}"
        )
    cfg = Gemma4Config.from_json(str(config_json))
    rope = text.get("rope_parameters") or {}
    if SLIDING in rope:
        cfg.rope_local_base_freq = rope[SLIDING]["rope_theta"]
    if FULL in rope:
        cfg.rope_theta = rope[FULL]["rope_theta"]
        cfg.partial_rotary_factor = rope[FULL].get("partial_rotary_factor", 1.0)
    # None (no softcapping) would fail its `> 0` test; 0 is its own "off".
    cfg.final_logit_softcapping = text.get("final_logit_softcapping") or 0.0
    # Plain matmul attention: its custom_sdpa op needs ExecuTorch's native kernel library.
    cfg.use_custom_sdpa = False
    cfg.use_kv_cache = True
    cfg.max_seq_len = cfg.max_context_len = context
    return cfg


def executorch_model(checkpoint_dir: Path, context: int) -> Any:
    """ExecuTorch's Gemma4ForCausalLM (float32, eval) with the checkpoint's weights through its own
    converter. Raises ValueError when the converted weights do not cover the model."""
    import torch
    from executorch.examples.models.gemma4.text_decoder import convert_hf_to_custom
    from executorch.examples.models.gemma4.text_decoder.gemma4_transformer import Gemma4ForCausalLM

    cfg = executorch_config(Path(checkpoint_dir) / "config.json", context)
    model = Gemma4ForCausalLM(cfg).eval()
    state = convert_hf_to_custom(str(checkpoint_dir), cfg, dtype=torch.float32)
    result = model.load_state_dict(state, strict=False)
    # It builds K/V projections on the KV-shared layers too; the checkpoint has none and they are
    # never used (those layers read their donor's K/V). NaN makes any use show in the logits.
    shared = {
        f"model.cross_decoder.layers.{i}.self_attn.{name}.weight"
        for i in range(cfg.num_cross_decoder_layers)
        for name in ("k_proj", "v_proj", "k_norm")
    }
    missing = set(result.missing_keys)
    if missing - shared or result.unexpected_keys:
        raise ValueError(
            f"{checkpoint_dir}: ExecuTorch's converted weights do not match its model (missing "
            f"{sorted(missing - shared)[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in missing:
            params[name].fill_(math.nan)
    return model


def _last_logits(model: Any, ids: list[int], start: int) -> Any:
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        # Its KV cache calls torch._check_is_size, which torch 2.13 deprecates (a FutureWarning).
        warnings.filterwarnings("ignore", message="_check_is_size will be removed", category=FutureWarning)
        out = model(torch.tensor([ids]), torch.arange(start, start + len(ids)))
    return out[0, -1].float().numpy()


def logits_of(model: Any, ids: list[int]) -> Any:
    """Logits at every position of ids (positions, vocab), one token per call through its KV cache
    (its forward returns only the last position's logits)."""
    import numpy as np

    return np.stack([_last_logits(model, [tok], pos) for pos, tok in enumerate(ids)])


def greedy_tokens(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The prompt in one call, then one call per generated token."""
    tokens = [int(_last_logits(model, list(prompt_ids), 0).argmax())]
    while len(tokens) < max_new_tokens:
        pos = len(prompt_ids) + len(tokens) - 1
        tokens.append(int(_last_logits(model, [tokens[-1]], pos).argmax()))
    return tokens
