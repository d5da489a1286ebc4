"""Reading a downloaded checkpoint (any family in stages/model/families.py): its config, geometry and
language-model tensors.

Tensors are read one at a time from memory-mapped safetensors files, so a stage holds only what it
asks for; the vision and audio towers of a multimodal snapshot are never read.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from stages.core.errors import UserFixable
from stages.core.report import sha256_file
from stages.model.compressed import (
    INPUT_SCALE,
    PACKED,
    SCALE,
    SHAPE,
    CompressedLayout,
    WeightGrid,
    dequantize,
    module_of,
    quantization_config,
    unpack,
)
from stages.model.families import MODEL_TYPES, FamilyError, family_of, known_types
from stages.model.geometry import Geometry, GeometryError, Tensor, geometry_from_config, text_config_of

# Where the text decoder's weights sit in the -it (multimodal) snapshot; a text-only export uses `model.`.
TEXT_PREFIXES = ("model.language_model.", "model.")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(UserFixable, ValueError):
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
    config's eos_token_id and the family's end-of-turn token (Gemma 4's `<turn|>`, which ends an -it
    model's turn, docs/facts.md §1). Reads JSON only, so it works in every image.
    """
    from stages.model.chat import added_token_id

    directory = Path(checkpoint_dir)
    ids: set[int] = set()
    end_of_turn = "<turn|>"
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
        if name == "config.json":
            with contextlib.suppress(FamilyError):  # a foreign config fails where it is validated
                end_of_turn = family_of(data).end_of_turn
    if (directory / "tokenizer.json").is_file():
        turn_end = added_token_id(directory, end_of_turn)
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
        if model_type not in MODEL_TYPES:
            raise CheckpointError(
                f"{self.dir / 'config.json'} describes a {model_type!r} model, not a family this pipeline "
                f"builds (model_type {known_types()})"
            )
        try:
            return geometry_from_config(self.config)
        except GeometryError as e:
            raise CheckpointError(f"{self.dir / 'config.json'}: {e}") from None

    @cached_property
    def stored_files(self) -> dict[str, Path]:
        """Tensor name as stored -> the safetensors file holding it."""
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
    def compressed(self) -> dict[str, WeightGrid]:
        """The weights a compressed-tensors checkpoint stores quantized (stored name of the float
        weight `X.weight` -> its scheme); empty for an unquantized checkpoint."""
        qconfig = quantization_config(self.config)
        if qconfig is None:
            return {}
        layout = CompressedLayout(qconfig)
        out: dict[str, WeightGrid] = {}
        for stored, path in self.stored_files.items():
            if not stored.endswith(PACKED):
                continue
            module = stored[: -len(PACKED)]
            packed_cols, scale_cols, (_, inputs) = _compressed_shapes(path, module)
            out[module + ".weight"] = layout.scheme_of(module, inputs, scale_cols, packed_cols)
        return out

    @cached_property
    def files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it, as the model names its tensors: a
        compressed-tensors weight stored as X.weight_packed, X.weight_scale, ... is X.weight here."""
        if not self.compressed:
            return self.stored_files
        out = {}
        for stored, path in self.stored_files.items():
            parts = module_of(stored)
            if parts is None:
                out[stored] = path
            elif parts[1] == PACKED:
                out[parts[0] + ".weight"] = path
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

    def tensor(self, name: str, dtype: Any = None):
        """One language-model tensor (name relative to the language model) as torch, float32 unless
        `dtype` says otherwise (converted from the stored dtype directly: E2B's per-layer table is
        4.7 GB in bfloat16 and would pass through 9.4 GB of float32 on the way). A compressed-tensors
        weight is its integers x scales, exact in float32."""
        import torch
        from safetensors import safe_open

        path, stored = self._locate(name)
        if stored in self.compressed:
            return dequantize(*self.weight_grid(name)).to(dtype or torch.float32)
        with safe_open(path, framework="pt") as st:
            return st.get_tensor(stored).to(dtype or torch.float32)

    def weight_grid(self, name: str):
        """A compressed-tensors weight's (integers int8 (out, in), scales float32 (out, in / group)),
        as stored; name relative to the language model."""
        from safetensors import safe_open

        path, stored = self._locate(name)
        module = stored.removesuffix(".weight")
        with safe_open(path, framework="pt") as st:
            return unpack(
                st.get_tensor(module + PACKED),
                st.get_tensor(module + SCALE),
                st.get_tensor(module + SHAPE).tolist(),
                self.compressed[stored],
            )

    def input_scale(self, name: str) -> float | None:
        """The static input-activation scale a compressed-tensors checkpoint stores for weight
        `name`'s Linear, or None."""
        from safetensors import safe_open

        stored = self.prefix + name
        grid = self.compressed.get(stored)
        if grid is None or not grid.input_scale:
            return None
        key = stored.removesuffix(".weight") + INPUT_SCALE
        if key not in self.stored_files:
            return None
        with safe_open(self.stored_files[key], framework="pt") as st:
            return float(st.get_tensor(key).float().reshape(-1)[0])

    def rows(self, name: str, start: int, stop: int):
        """Rows start..stop-1 of a 2-D tensor as float32 torch, read without loading the rest."""
        import torch
        from safetensors import safe_open

        path, stored = self._locate(name)
        if stored in self.compressed:
            return self.tensor(name)[start:stop]
        with safe_open(path, framework="pt") as st:
            return st.get_slice(stored)[start:stop].to(torch.float32)


def _compressed_shapes(path: Path, module: str) -> tuple[int, int, tuple[int, int]]:
    """A compressed-tensors module's stored (packed words a row, scales a row, (out, in))."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as st:
        keys = set(st.keys())
        missing = [module + p for p in (SCALE, SHAPE) if module + p not in keys]
        if missing:
            raise CheckpointError(f"{path}: {', '.join(missing)} missing beside {module}{PACKED}")
        packed = st.get_slice(module + PACKED).get_shape()
        scale = st.get_slice(module + SCALE).get_shape()
        shape = [int(v) for v in st.get_tensor(module + SHAPE).tolist()]
    if len(shape) != 2 or len(packed) != 2 or packed[0] != shape[0] or scale[0] != shape[0]:
        raise CheckpointError(
            f"{path}: {module} stores packed {list(packed)}, scales {list(scale)} for a weight of "
            f"shape {shape}; not a compressed-tensors Linear this version reads"
        )
    return int(packed[1]), int(scale[1]) if len(scale) > 1 else 1, (shape[0], shape[1])


# ---------------------------------------------------------------------------------------------------
# Validation: what every source (built-in, Hub, --from) must pass before the download counts as done
# ---------------------------------------------------------------------------------------------------

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class RemoteFile:
    """A file as the Hub lists it: size, and sha256 when it is stored with LFS."""

    name: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class CheckpointSummary:
    files: int
    bytes: int
    text_tensors: int
    text_params: int
    extra_text_tensors: int
    other_tensors: int
    dtypes: tuple[str, ...]
    text_prefix: str = TEXT_PREFIXES[0]
    # Stored language-model tensors the model has no place for, dropped as transformers drops them:
    # K/V weights of KV-shared layers, and (unused_tensors) anything else, which transformers warns about.
    ignored_tensors: tuple[str, ...] = ()
    unused_tensors: tuple[str, ...] = ()

    def figures(self) -> dict[str, Any]:
        return {
            "ignored_tensors": list(self.ignored_tensors),
            "unused_tensors": list(self.unused_tensors),
            "text_prefix": self.text_prefix,
            "files": self.files,
            "bytes": self.bytes,
            "text_tensors": self.text_tensors,
            "text_params": self.text_params,
            "extra_text_tensors": self.extra_text_tensors,
            "other_tensors": self.other_tensors,
            "dtypes": list(self.dtypes),
        }


def _first(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({str(e).splitlines()[0]})") from None


def check_config(path: Path) -> dict[str, Any]:
    """The parsed config.json, which must be a config of a known family that the geometry understands."""
    config = _read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a config object")
    model_type = config.get("model_type")
    try:
        family_of(config)
    except FamilyError:
        raise CheckpointError(
            f"{path} is not a Gemma 4 or Gemma 3 config (model_type {model_type!r}); this pipeline handles "
            f"model_type {known_types()}, e.g. google/gemma-4-E2B-it or google/gemma-3-270m"
        ) from None
    try:
        geometry_from_config(config)
    except (GeometryError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return config


def check_remote_files(folder: Path, remote: list[RemoteFile]) -> None:
    """Sizes and LFS sha256 values as the Hub lists them. A corrupt file is deleted (with its
    huggingface_hub resume metadata), so the next run fetches it again instead of trusting it."""
    for f in remote:
        path = folder / f.name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing after the download; run the download again")
        size = path.stat().st_size
        bad = None
        if f.size is not None and size != f.size:
            bad = f"is {size} bytes, the Hub lists {f.size}"
        elif f.sha256 and sha256_file(path) != f.sha256:
            bad = f"does not match the Hub's sha256 {f.sha256[:12]}..."
        if bad:
            path.unlink()
            for meta in (folder / ".cache" / "huggingface" / "download").glob(f"{f.name}.*"):
                meta.unlink()
            raise CheckpointError(f"{path} {bad}; it was deleted: run the download again to fetch it anew")


def validate_checkpoint(
    folder: Path, files: list[str] | None = None, remote: list[RemoteFile] | None = None
) -> CheckpointSummary:
    """Check a checkpoint folder; raise CheckpointError naming the first bad file or tensors.

    `files` limits the check to those names (a staging or user folder may hold other files);
    default: the names of `remote`, else every file in the folder.

    Checked: the required files exist and parse; config.json is of a known family; every safetensors file
    (and every file the index names) opens; every language-model tensor of the geometry is present
    under `model.language_model.` (or, for a text-only save, `model.`) with its shape. Non-text
    tensors (vision, audio) are skipped; extra text tensors are accepted and listed, as transformers
    accepts them: the K/V weights of KV-shared layers that the published E2B-it keeps (ignored_tensors,
    which transformers drops silently) and anything else (unused_tensors, which it drops with a
    warning). With `remote`, sizes and LFS sha256 values are compared too.
    """
    folder = Path(folder)
    if files is None:
        on_disk = sorted(p.name for p in folder.iterdir() if p.is_file())
        files = [f.name for f in remote] if remote else on_disk
    names = set(files)
    if remote:
        # First: a file damaged in transit is then deleted for a refetch whatever else fails.
        check_remote_files(folder, remote)
    missing = [n for n in REQUIRED_FILES if n not in names or not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{_first(missing)} missing from {folder}")
    config = check_config(folder / "config.json")
    geo = geometry_from_config(config)
    for name in ("tokenizer_config.json", "generation_config.json", INDEX_NAME):
        if name in names:
            _read_json(folder / name)
    _check_tokenizer(folder / "tokenizer.json")

    weights = [folder / n for n in sorted(names) if n.endswith(".safetensors")]
    if INDEX_NAME in names:
        named = set(_read_json(folder / INDEX_NAME).get("weight_map", {}).values())
        absent = sorted(n for n in named if n not in names or not (folder / n).is_file())
        if absent:
            raise CheckpointError(f"{INDEX_NAME} names {_first(absent)}, missing from {folder}")
    if not weights:
        raise CheckpointError(f"no *.safetensors weights in {folder}")

    shapes = _stored_shapes(weights)
    qconfig = quantization_config(config)
    if qconfig is not None:
        shapes = _logical_shapes(shapes, CompressedLayout(qconfig), weights)
    prefix = next((p for p in TEXT_PREFIXES if p + geo.embedding.name in shapes), TEXT_PREFIXES[0])
    found = {k[len(prefix) :]: v[0] for k, v in shapes.items() if k.startswith(prefix)}
    dtypes = {v[1] for k, v in shapes.items() if k.startswith(prefix)}
    expected: list[Tensor] = geo.all_tensors()
    absent_tensors = [prefix + t.name for t in expected if t.name not in found]
    if absent_tensors:
        raise CheckpointError(
            f"{len(absent_tensors)} language-model tensors missing from the safetensors in {folder}: "
            f"{_first(absent_tensors)}"
        )
    wrong = [
        f"{prefix}{t.name} {list(found[t.name])} (config says {list(t.shape)})"
        for t in expected
        if found[t.name] != t.shape
    ]
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} tensors have the wrong shape for config.json: {_first(wrong, 3)}"
        )
    extra = sorted(set(found) - {t.name for t in expected})
    return CheckpointSummary(
        ignored_tensors=tuple(prefix + n for n in extra if geo.is_shared_kv_leftover(n)),
        unused_tensors=tuple(prefix + n for n in extra if not geo.is_shared_kv_leftover(n)),
        files=len(names),
        bytes=sum((folder / n).stat().st_size for n in names),
        text_tensors=len(expected),
        text_params=sum(t.numel for t in expected),
        extra_text_tensors=len(found) - len(expected),
        other_tensors=len(shapes) - len(found),
        dtypes=tuple(sorted(dtypes)),
        text_prefix=prefix,
    )


def _stored_shapes(weights: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's shape and dtype as the safetensors headers give them (nothing is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shapes[key] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError, ValueError)
            raise CheckpointError(
                f"{path} is not a readable safetensors file, truncated or corrupt ({str(e).splitlines()[0]})"
            ) from None
    return shapes


def _logical_shapes(
    shapes: dict[str, tuple[tuple[int, ...], str]], layout: CompressedLayout, files: list[Path]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """A compressed-tensors checkpoint's stored shapes as the model's: each quantized Linear's parts
    (X.weight_packed, X.weight_scale, ...) become X.weight with its shape, checked against the
    layout (`CompressedLayout.scheme_of`)."""
    out = {k: v for k, v in shapes.items() if module_of(k) is None}
    for path in files:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            packed = [k[: -len(PACKED)] for k in f.keys() if k.endswith(PACKED)]
        for module in packed:
            packed_cols, scale_cols, shape = _compressed_shapes(path, module)
            grid = layout.scheme_of(module, shape[1], scale_cols, packed_cols)
            out[module + ".weight"] = (shape, f"int{grid.bits} ({grid.strategy}, compressed-tensors)")
    return out


def _check_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"{path} is not a loadable tokenizer ({str(e).splitlines()[0]})") from None
