"""transformers' Gemma 4 on the same checkpoint: the reference the exported and quantized chains are
measured against (tests and the verify stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def transformers_model(checkpoint_dir: Path) -> Any:
    """Gemma4ForCausalLM (eager attention, float32, eval) with the checkpoint's text weights.

    Built from the text config and loaded tensor by tensor: `from_pretrained` on a multimodal
    snapshot silently leaves every weight at its random init (docs/facts.md §1). The checkpoint's
    tensors are taken as transformers' own loader takes them: tensors the model has no place for (the
    K/V weights some checkpoints keep for KV-shared layers) are dropped; a tensor of the wrong shape,
    which transformers refuses too, or a missing one is a CheckpointError naming them.
    """
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from stages.checkpoint import Checkpoint, CheckpointError

    ckpt = Checkpoint(checkpoint_dir)
    text = {k: v for k, v in ckpt.geometry.config.items() if k != "model_type"}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text, attn_implementation="eager")).eval()
    own = model.state_dict()
    state, wrong = {}, []
    for stored in ckpt.files:
        if not stored.startswith(ckpt.prefix):
            continue  # the vision and audio towers of a multimodal snapshot
        name = stored.removeprefix(ckpt.prefix)
        key = "model." + name
        if key not in own:
            # transformers' loader drops these too: K/V weights of KV-shared layers silently, anything
            # else with a warning (the download report lists both as ignored).
            continue
        tensor = ckpt.tensor(name)
        if tuple(tensor.shape) != tuple(own[key].shape):
            wrong.append(f"{stored} {list(tensor.shape)} (model has {list(own[key].shape)})")
        state[key] = tensor
    missing = sorted(k for k in own if k not in state and k != "lm_head.weight")
    if wrong or missing:
        if wrong:
            what = f"tensors of the wrong shape: {', '.join(sorted(wrong)[:3])}"
        else:
            what = (
                f"tensors missing: {', '.join(ckpt.prefix + k.removeprefix('model.') for k in missing[:5])}"
            )
        raise CheckpointError(
            f"{checkpoint_dir}: transformers' Gemma 4 for config.json cannot load the checkpoint, {what}; "
            "run `make download` again or fix the checkpoint"
        )
    model.load_state_dict(state, strict=False)
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
