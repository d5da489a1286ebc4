"""Checkpoints written by transformers itself, in the layouts users have.

`save_with_transformers` builds a Gemma 4 model with transformers 5.23 (Gemma4ForConditionalGeneration
or Gemma4ForCausalLM), fills it with the trained tiny weights, and saves it with `save_pretrained`
(float32 or bfloat16, one file or sharded with an index). Two changes on top reproduce what Google
publishes: the config in the `global_head_dim` form instead of the `per_layer_config` transformers
writes, and the K/V weights of KV-shared layers that the published E2B-it archive still stores.
The tokenizer is the tiny model's, so the chat template and stop tokens are real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.model.builtin_models import write_tokenizer_files
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config

CONDITIONAL = "Gemma4ForConditionalGeneration"
CAUSAL = "Gemma4ForCausalLM"
# Where each class keeps the text decoder in its state dict (and so in the saved safetensors).
TEXT_PREFIX = {CONDITIONAL: "model.language_model.", CAUSAL: "model."}


@dataclass(frozen=True)
class Layout:
    model_class: str = CONDITIONAL
    dtype: str = "bfloat16"
    max_shard_size: str | None = None  # e.g. "100KB": several files and an index
    config_form: str = "per_layer_config"  # as transformers 5.23 saves, or "global_head_dim" as published
    shared_kv_leftovers: bool = False  # K/V weights of KV-shared layers, as in the published E2B-it

    @property
    def name(self) -> str:
        parts = [
            "mm" if self.model_class == CONDITIONAL else "causal",
            self.dtype,
            "sharded" if self.max_shard_size else "single",
            self.config_form.replace("_", "-"),
        ]
        return "-".join(parts + (["kv-leftovers"] if self.shared_kv_leftovers else []))


def _model(layout: Layout) -> Any:
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    from stages.model.tiny_model import load_fixture

    text = Gemma4TextConfig(**{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"})
    if layout.model_class == CONDITIONAL:
        config = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
        model = Gemma4ForConditionalGeneration(config)
        decoder = model.model.language_model
    else:
        model = Gemma4ForCausalLM(text)
        decoder = model.model
    result = decoder.load_state_dict(load_fixture(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    model.tie_weights()
    return model.to(getattr(torch, layout.dtype)).eval()


def _add_shared_kv_leftovers(dest: Path, layout: Layout) -> list[str]:
    """Store K/V weights for the KV-shared layers, shaped as an owner layer's, in the first weight file."""
    import torch
    from safetensors.torch import load_file, save_file

    geo = geometry_from_config(TINY_TEXT_CONFIG)
    prefix = TEXT_PREFIX[layout.model_class]
    index = dest / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    file = sorted(set(weight_map.values()))[0] if weight_map else "model.safetensors"
    tensors = load_file(str(dest / file))
    gen = torch.Generator().manual_seed(1)
    added = []
    for layer in geo.layers:
        if layer.owns_kv:
            continue
        n_kv = geo.num_kv_heads
        for name, shape in (
            ("k_proj.weight", (n_kv * layer.head_dim, geo.hidden_size)),
            ("v_proj.weight", (n_kv * layer.head_dim, geo.hidden_size)),
            ("k_norm.weight", (layer.head_dim,)),
        ):
            key = f"{prefix}layers.{layer.index}.self_attn.{name}"
            tensors[key] = torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))
            added.append(key)
    save_file(tensors, str(dest / file), metadata={"format": "pt"})
    if weight_map is not None:
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(added, file))
        index.write_text(json.dumps(data, indent=2))
    return added


def _to_global_head_dim_form(dest: Path, layout: Layout) -> None:
    """config.json as Google publishes it: global_head_dim (and num_global_key_value_heads null)."""
    path = dest / "config.json"
    config = json.loads(path.read_text())
    text = config["text_config"] if layout.model_class == CONDITIONAL else config
    del text["per_layer_config"]
    text["global_head_dim"] = TINY_TEXT_CONFIG["global_head_dim"]
    text["num_global_key_value_heads"] = None
    path.write_text(json.dumps(config, indent=2))


def save_with_transformers(dest: Path, layout: Layout) -> Path:
    """A checkpoint folder in `layout`, written by transformers' save_pretrained; returns `dest`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # The tiny model's tokenizer files first: save_pretrained then writes its own generation_config.json.
    write_tokenizer_files(dest, TINY_TEXT_CONFIG["max_position_embeddings"])
    kwargs = {"max_shard_size": layout.max_shard_size} if layout.max_shard_size else {}
    _model(layout).save_pretrained(str(dest), **kwargs)
    if layout.shared_kv_leftovers:
        _add_shared_kv_leftovers(dest, layout)
    if layout.config_form == "global_head_dim":
        _to_global_head_dim_form(dest, layout)
    return dest


def load_with_transformers(folder: Path, layout: Layout) -> Any:
    """The saved folder loaded back by the class that wrote it, float32 eval: the ground truth."""
    import torch
    import transformers

    cls = getattr(transformers, layout.model_class)
    return cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
