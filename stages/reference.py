"""transformers' Gemma 4 on the same checkpoint: the reference the exported and quantized chains are
measured against (tests and the verify stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def transformers_model(checkpoint_dir: Path) -> Any:
    """Gemma4ForCausalLM (eager attention, float32, eval) with the checkpoint's text weights.

    Built from the text config and loaded tensor by tensor: `from_pretrained` on a multimodal
    snapshot silently leaves every weight at its random init (FACTS.md section 1).
    """
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from stages.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint_dir)
    text = {k: v for k, v in ckpt.geometry.config.items() if k != "model_type"}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text, attn_implementation="eager")).eval()
    state = {
        "model." + name.removeprefix(ckpt.prefix): ckpt.tensor(name.removeprefix(ckpt.prefix))
        for name in ckpt.files
        if name.startswith(ckpt.prefix)
    }
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{checkpoint_dir}: transformers' Gemma 4 does not match the checkpoint "
            f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    model.tie_weights()
    return model


def greedy_tokens(model: Any, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """transformers' own greedy generation, stopping at a stop token (kept) or the length."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def logits_of(model: Any, ids: list[int]) -> Any:
    """Logits at every position of ids, as a numpy array (positions, vocab)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
