"""compressed-tensors checkpoints: Google's `-ct` QAT releases, as the `compressed-tensors` library
writes them (config.json's `quantization_config`, `quant_method: compressed-tensors`).

A quantized Linear `X` is stored as `X.weight_packed` (int32 words, each holding 32 / bits integers),
`X.weight_scale` (one scale per output channel or per group of inputs) and `X.weight_shape`, and,
where its input activations have a static scale, `X.input_scale`. Reading one keeps the checkpoint's
integers and scales as they are: the library's own `unpack_from_int32` gives the integers, and the
float weight the rest of the pipeline sees (export's graphs, the transformers reference) is exactly
integer x scale, as the library's decompression makes it. `CompressedLayout` says which stored weights
are quantized and how; a layout this version cannot carry is refused naming what was found.

What is read: `pack-quantized` integer weights, symmetric, per channel or per group, at 2, 4 or 8
bits, with static per-tensor input scales where present. Refused: other formats (float, NVFP4/MXFP,
sparse), zero points (asymmetric), activation reordering (g_idx), transforms (rotations) and
strategies other than channel and group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from stages.core.errors import UserFixable

QUANT_METHOD = "compressed-tensors"
PACKED_FORMAT = "pack-quantized"
READABLE_BITS = (2, 4, 8)
READABLE_STRATEGIES = ("channel", "group")
# The stored parts of one quantized Linear, after its module name.
PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX, INPUT_SCALE = (
    ".weight_packed",
    ".weight_scale",
    ".weight_shape",
    ".weight_zero_point",
    ".weight_g_idx",
    ".input_scale",
)
PARTS = (PACKED, SCALE, SHAPE, ZERO_POINT, G_IDX, INPUT_SCALE)


class CompressedLayoutError(UserFixable, ValueError):
    pass


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's compressed-tensors `quantization_config` (top level, or the text config's), or
    None for an unquantized checkpoint."""
    for holder in (config, config.get("text_config") or {}):
        qc = holder.get("quantization_config")
        if isinstance(qc, dict):
            if qc.get("quant_method") != QUANT_METHOD:
                raise CompressedLayoutError(
                    f"config.json's quantization_config has quant_method {qc.get('quant_method')!r}; "
                    f"this version reads {QUANT_METHOD!r} checkpoints and unquantized ones"
                )
            return qc
    return None


@dataclass(frozen=True)
class WeightGrid:
    """How one stored weight is quantized: its scheme, and its stored scale's static input scale."""

    bits: int
    strategy: str  # "channel" or "group"
    group_size: int | None  # inputs per scale for "group"
    input_scale: bool  # whether X.input_scale holds a static activation scale
    input_bits: int | None  # that scale's integer width

    def group(self, inputs: int) -> int:
        return inputs if self.strategy == "channel" else int(self.group_size or 0)


def _value(x: Any) -> Any:
    """An enum's value (compressed-tensors' args hold enums), else the thing itself."""
    return getattr(x, "value", x)


@dataclass(frozen=True)
class _Scheme:
    targets: tuple[str, ...]
    grid: WeightGrid


class CompressedLayout:
    """A compressed-tensors `quantization_config`, parsed by the library itself and checked against
    what this version can carry."""

    def __init__(self, qconfig: dict[str, Any]):
        try:
            from compressed_tensors.quantization import QuantizationConfig
        except ImportError:
            raise CompressedLayoutError(
                "the checkpoint is in compressed-tensors format, but the compressed-tensors library is "
                "not installed here; rebuild the images (make images) or the venv (make venv)"
            ) from None
        try:
            parsed = QuantizationConfig.model_validate(
                {k: v for k, v in qconfig.items() if k not in ("quant_method", "version")}
            )
        except Exception as e:  # pydantic's ValidationError: name the first problem and where
            errors = e.errors() if hasattr(e, "errors") else [{"loc": (), "msg": str(e)}]
            where = ".".join(str(p) for p in errors[0]["loc"] if "[" not in str(p))
            first = f"{where}: {errors[0]['msg']}" if where else errors[0]["msg"]
            raise CompressedLayoutError(
                f"config.json's quantization_config is not one compressed-tensors reads: {first}"
            ) from None
        if qconfig.get("transform_config"):
            raise CompressedLayoutError(
                "the checkpoint's weights are transformed (compressed-tensors transform_config, e.g. "
                "rotations); this version cannot undo that"
            )
        self.ignore = tuple(parsed.ignore or ())
        self.schemes: list[_Scheme] = []
        for name, group in parsed.config_groups.items():
            fmt = _value(getattr(group, "format", None) or parsed.format)
            w = group.weights
            if w is None:
                continue  # activations only: nothing stored for the weights
            where = f"quantization_config.config_groups.{name}"
            strategy, actorder = _value(w.strategy), _value(w.actorder)
            problems = []
            if fmt != PACKED_FORMAT:
                problems.append(f"format {fmt!r} (this version reads {PACKED_FORMAT!r})")
            if _value(w.type) != "int":
                problems.append(f"{_value(w.type)} weights (this version reads int)")
            if w.num_bits not in READABLE_BITS:
                problems.append(f"{w.num_bits}-bit weights (this version reads {READABLE_BITS})")
            if not w.symmetric:
                problems.append("asymmetric weights with zero points (v69's int4 takes none)")
            if strategy not in READABLE_STRATEGIES:
                problems.append(f"strategy {strategy!r} (this version reads channel and group)")
            if actorder in ("group", "dynamic"):
                # Stored as a permutation of the inputs (weight_g_idx) that the graphs do not apply.
                problems.append(f"activation ordering {actorder!r} (weight_g_idx)")
            if w.dynamic:
                problems.append("dynamic weight scales")
            if problems:
                raise CompressedLayoutError(f"{where}: {'; '.join(problems)}; this layout cannot be carried")
            a = group.input_activations
            static = a is not None and not a.dynamic and _value(a.strategy) == "tensor"
            self.schemes.append(
                _Scheme(
                    tuple(group.targets),
                    WeightGrid(
                        bits=w.num_bits,
                        strategy=strategy,
                        group_size=w.group_size,
                        input_scale=static,
                        input_bits=a.num_bits if static else None,
                    ),
                )
            )
        if not self.schemes:
            raise CompressedLayoutError("config.json's quantization_config quantizes no weights")

    def scheme_of(self, module: str, inputs: int, scale_cols: int, packed_cols: int) -> WeightGrid:
        """The scheme of a stored quantized module: the config group whose targets name it (a `re:`
        pattern on its name; a class name such as Linear matches any packed Linear) and whose bits and
        strategy its stored shapes agree with. Shapes decide between groups that all target a class."""

        def named(target: str) -> bool:
            return target.startswith("re:") and re.match(target[3:], module) is not None

        by_name = [s for s in self.schemes if any(named(t) for t in s.targets)]
        candidates = by_name or [s for s in self.schemes if any(not t.startswith("re:") for t in s.targets)]
        fits = [s.grid for s in candidates if _stored_shapes_fit(s.grid, inputs, scale_cols, packed_cols)]
        if not fits:
            found = f"packed width {packed_cols}, {scale_cols} scales a row, {inputs} inputs"
            raise CompressedLayoutError(
                f"{module}: its stored weight ({found}) fits none of quantization_config's groups "
                f"({', '.join(_describe(s.grid) for s in candidates) or 'none targets it'})"
            )
        return fits[0]


def _stored_shapes_fit(grid: WeightGrid, inputs: int, scale_cols: int, packed_cols: int) -> bool:
    if packed_cols != -(-inputs * grid.bits // 32):
        return False
    if grid.strategy == "channel":
        return scale_cols == 1
    return bool(grid.group_size) and inputs % grid.group_size == 0 and scale_cols == inputs // grid.group_size


def _describe(grid: WeightGrid) -> str:
    return f"int{grid.bits} {grid.strategy}" + (f" {grid.group_size}" if grid.strategy == "group" else "")


def module_of(stored: str) -> tuple[str, str] | None:
    """(module, part) for a stored compressed-tensors part name, else None."""
    for part in PARTS:
        if stored.endswith(part):
            return stored[: -len(part)], part
    return None


def unpack(packed, scale, shape, grid: WeightGrid):
    """(integers int8 (out, in), scales float32 (out, in / group)) as torch, by the library's own
    unpacking; the integers are checked to lie in the scheme's signed range."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out, inputs = (int(s) for s in shape)
    q = unpack_from_int32(packed, grid.bits, torch.Size((out, inputs)))
    half = 1 << (grid.bits - 1)
    if int(q.min()) < -half or int(q.max()) > half - 1:
        raise CompressedLayoutError(f"unpacked integers {int(q.min())}..{int(q.max())} exceed int{grid.bits}")
    return q.to(torch.int8), scale.to(torch.float32).reshape(out, -1)


def dequantize(q, scale):
    """The float weight q x scale (float32), each scale over its group of inputs."""
    import torch

    group = q.shape[1] // scale.shape[1]
    return q.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group, dim=1)
