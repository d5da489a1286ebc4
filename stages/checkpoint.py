"""Reading a downloaded Gemma 4 checkpoint: its config, geometry and language-model tensors.

Tensors are read one at a time from memory-mapped safetensors files, so a stage holds only what it
asks for; the vision and audio towers of a multimodal snapshot are never read.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from stages.geometry import Geometry, GeometryError, geometry_from_config, text_config_of

# Where the text decoder's weights sit in the -it (multimodal) snapshot; a text-only export uses `model.`.
TEXT_PREFIXES = ("model.language_model.", "model.")
INDEX_NAME = "model.safetensors.index.json"
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")


class CheckpointError(ValueError):
    pass


def _token_ids(value: Any, where: str) -> list[int]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where} eos_token_id is {value!r}, not a token id or a list of them")
    return values


def stop_token_ids(checkpoint_dir: Path) -> list[int]:
    """The token ids that end a reply, sorted: the one list the host runner (`g4v69 generate`), the
    bundle's genie_config.json (and so `make run` on the phone), verify and the Genie emulator use.

    The union of generation_config.json's eos_token_id (the published E2B-it lists several), the text
    config's eos_token_id and `<turn|>`, which ends an -it model's turn (FACTS.md s.1). Reads JSON only,
    so it works in every image.
    """
    from stages.chat import END_OF_TURN, added_token_id

    directory = Path(checkpoint_dir)
    ids: set[int] = set()
    for name, pick in (("config.json", text_config_of), ("generation_config.json", lambda c: c)):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        try:
            ids.update(_token_ids(pick(data).get("eos_token_id"), str(path)))
        except GeometryError as e:
            raise CheckpointError(f"{path}: {e}") from None
    if (directory / "tokenizer.json").is_file():
        turn_end = added_token_id(directory, END_OF_TURN)
        if turn_end is not None:
            ids.add(turn_end)
    return sorted(ids)


class Checkpoint:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        if not (self.dir / "config.json").is_file():
            raise CheckpointError(f"{self.dir} has no config.json; run `make download` first")

    @cached_property
    def config(self) -> dict[str, Any]:
        path = self.dir / "config.json"
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None

    @cached_property
    def geometry(self) -> Geometry:
        model_type = self.config.get("model_type")
        if model_type not in GEMMA4_MODEL_TYPES:
            raise CheckpointError(
                f"{self.dir / 'config.json'} describes a {model_type!r} model, not Gemma 4 "
                "(model_type gemma4 or gemma4_text)"
            )
        try:
            return geometry_from_config(self.config)
        except GeometryError as e:
            raise CheckpointError(f"{self.dir / 'config.json'}: {e}") from None

    @cached_property
    def files(self) -> dict[str, Path]:
        """Tensor name (as stored) -> the safetensors file holding it."""
        from safetensors import safe_open

        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.dir / f for name, f in weight_map.items()}
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir} has no *.safetensors files")
        out: dict[str, Path] = {}
        for f in files:
            with safe_open(f, framework="pt") as st:
                out.update(dict.fromkeys(st.keys(), f))
        return out

    @cached_property
    def prefix(self) -> str:
        for p in TEXT_PREFIXES:
            if f"{p}embed_tokens.weight" in self.files:
                return p
        raise CheckpointError(
            f"{self.dir}: no text decoder weights found (looked for "
            f"{' or '.join(p + 'embed_tokens.weight' for p in TEXT_PREFIXES)})"
        )

    def _locate(self, name: str) -> tuple[Path, str]:
        stored = self.prefix + name
        if stored not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {stored} is missing; the snapshot is incomplete")
        return self.files[stored], stored

    def tensor(self, name: str):
        """One language-model tensor (name relative to the language model) as float32 torch."""
        import torch
        from safetensors import safe_open

        path, stored = self._locate(name)
        with safe_open(path, framework="pt") as st:
            return st.get_tensor(stored).to(torch.float32)

    def rows(self, name: str, start: int, stop: int):
        """Rows start..stop-1 of a 2-D tensor as float32 torch, read without loading the rest."""
        import torch
        from safetensors import safe_open

        path, stored = self._locate(name)
        with safe_open(path, framework="pt") as st:
            return st.get_slice(stored)[start:stop].to(torch.float32)
