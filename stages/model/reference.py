"""transformers' own model of the checkpoint's family (Gemma 4, Gemma 3) on the same checkpoint: the
reference the exported and quantized chains are
measured against (tests and the verify stage)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Up to this many bytes of float32 weights the reference computes in float32 (the tiny model: its
# figures are exact); above it in bfloat16, the checkpoint's own dtype: E2B's 4.6 B text parameters
# are 18.5 GB in float32, more than verify's 16 GiB bound, and 9.3 GB in bfloat16.
FLOAT32_MAX_BYTES = 4 * 2**30


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no random init) and their
    buffers as usual (RoPE frequencies are computed in __init__ and never stored in a checkpoint)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def transformers_model(checkpoint_dir: Path) -> Any:
    """The family's ForCausalLM (Gemma4ForCausalLM, Gemma3ForCausalLM; eager attention, eval) with the
    checkpoint's text weights: float32, or
    bfloat16 above FLOAT32_MAX_BYTES of float32 weights.

    Built from the text config with its parameters on the meta device and loaded tensor by tensor
    (each checkpoint tensor becomes the parameter: one copy of the weights in memory): `from_pretrained`
    on a multimodal snapshot silently leaves every weight at its random init (docs/facts.md §1). The
    checkpoint's tensors are taken as transformers' own loader takes them: tensors the model has no
    place for (the K/V weights some checkpoints keep for KV-shared layers) are dropped; a tensor of the
    wrong shape, which transformers refuses too, or a missing one is a CheckpointError naming them.
    """
    import torch
    import transformers

    from stages.model.checkpoint import Checkpoint, CheckpointError

    ckpt = Checkpoint(checkpoint_dir)
    family = ckpt.geometry.family
    causal_lm = getattr(transformers, family.causal_lm)
    text_config = getattr(transformers, family.text_config_class)
    text = {k: v for k, v in ckpt.geometry.config.items() if k != "model_type"}
    with _parameters_on_meta():
        model = causal_lm(text_config(**text, attn_implementation="eager")).eval()
    own = model.state_dict()
    float32_bytes = 4 * sum(p.numel() for p in model.parameters())
    dtype = torch.float32 if float32_bytes <= FLOAT32_MAX_BYTES else torch.bfloat16
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
        tensor = ckpt.tensor(name, dtype)
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
            f"{checkpoint_dir}: transformers' {family.name} for config.json cannot load the checkpoint, "
            f"{what}; "
            "run `make download` again or fix the checkpoint"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    for name, p in model.named_parameters():
        if p.is_meta:
            raise CheckpointError(f"{checkpoint_dir}: transformers' {family.name} has no weight for {name}")
    _quantize_static_inputs(model, ckpt)
    return model


def _quantize_static_inputs(model: Any, ckpt: Any) -> None:
    """A compressed-tensors checkpoint's static input-activation scales, applied as transformers'
    own loader applies them (through compressed-tensors: each such Linear's input rounded onto the
    symmetric integer grid of its scale, zero point 0, on every forward call), so the reference is
    the model as transformers runs that checkpoint (tests/unit/test_compressed.py compares them)."""
    import torch

    for stored, grid in ckpt.compressed.items():
        name = stored.removeprefix(ckpt.prefix)
        scale = ckpt.input_scale(name)
        if scale is None:
            continue
        half = 1 << (grid.input_bits - 1)

        def fake_quant(_module, args, scale=scale, half=half):
            x = args[0]
            q = torch.clamp(torch.round(x / scale), -half, half - 1)
            return (q * scale).to(x.dtype), *args[1:]

        model.get_submodule("model." + name.removesuffix(".weight")).register_forward_pre_hook(fake_quant)


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
