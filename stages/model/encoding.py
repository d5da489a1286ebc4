"""Tensor encodings in QNN's terms, and the rule by which Genie feeds a graph input from a LUT.

QNN writes a fixed-point encoding as a datatype (`ufixed8`, `ufixed16`, `sfixed8`, `sfixed16`), a
scale and an offset with real = (q + offset) * scale, so QNN's offset is minus ONNX's zero point.
Genie's LUT sections (`embedding`, `perlayer-embedding`) use the same three fields.

How Genie moves LUT rows into a graph input (read in Genie's public `qualla` source: the dialog's
`calculateRequantEncodings`, `m_t2eCallbacks` and `requantEmbedding`; docs/facts.md §3):
- the LUT's datatype, scale and offset equal the input's: the rows are copied byte for byte;
- both fixed-point, same signedness: each value is requantized into the input's encoding (a LUT may be
  4-bit, `ufixed4`, two entries per byte: measured on QAIRT 2.51's Genie, not in the public source);
- float32 LUT into a float32 input: copied;
- anything else (in particular a fixed-point LUT into a float input): Genie has no path. Qualcomm's
  own Gemma 4 bundle notes that such a mismatch does not error on the phone, it produces nonsense, so
  the bundle stage refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.model.contract import LOGITS, LutSpec

if TYPE_CHECKING:  # numpy is imported where arrays are handled: the tools image has no numpy
    import numpy as np

FLOAT_TYPES = {"float32": "float32", "float16": "float16"}
GRAPH_FIXED_TYPES = {"ufixed8": "uint8", "ufixed16": "uint16", "sfixed8": "int8", "sfixed16": "int16"}
# A LUT-only datatype: QAIRT 2.51's Genie reads a `ufixed4` LUT as two entries per byte, the even entry
# in the low nibble (measured: tests/integration/test_real_genie.py), and requantizes it into the graph
# input, which is never 4-bit. The numpy type is that of one unpacked entry.
PACKED_LUT_TYPES = {"ufixed4": "uint8"}
FIXED_TYPES = {**GRAPH_FIXED_TYPES, **PACKED_LUT_TYPES}
BITS = {
    "ufixed4": 4,
    "ufixed8": 8,
    "ufixed16": 16,
    "sfixed8": 8,
    "sfixed16": 16,
    "float16": 16,
    "float32": 32,
}
# ONNX tensor element types (onnx.TensorProto) of quantized graph I/O, by QNN datatype.
ONNX_ELEM_TYPE = {"ufixed8": 2, "sfixed8": 3, "ufixed16": 4, "sfixed16": 5, "float32": 1, "float16": 10}
# ONNX tensor element types by their numpy-style names, for the graph audits of quantize and compile.
ONNX_TYPE_NAMES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    10: "float16",
    21: "uint4",
    22: "int4",
}
COPY = "copy"
# A packed 4-bit LUT into the 8-bit input made for it (`Encoding.graph_input_of_lut`): Genie's
# requantization arithmetic, exact by construction.
UNPACK = "unpack"
REQUANTIZE = "requantize"


class QdqGraph:
    """An ONNX graph read through its QuantizeLinear/DequantizeLinear nodes: what type a node really
    consumes a tensor in, and whether the tensor is a constant. The quantize audit and the compile
    rules both read types here, so the two cannot trace Q/DQ chains differently."""

    def __init__(self, graph: Any) -> None:
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.inputs = {i.name: i.type.tensor_type.elem_type for i in graph.input}

    def is_constant(self, tensor: str) -> bool:
        """An initializer, or an initializer under its DequantizeLinear (a weight)."""
        p = self.producer.get(tensor)
        return tensor in self.inits or (
            p is not None and p.op_type == "DequantizeLinear" and p.input[0] in self.inits
        )

    def stored_type(self, tensor: str) -> str:
        """The type `tensor`'s values are stored in: under a DequantizeLinear the quantized type (its zero
        point has the type of its input, by ONNX's definition), else the tensor's own type; float32
        for a computed tensor, "?" where a DequantizeLinear's input type cannot be told."""
        p = self.producer.get(tensor)
        if p is not None and p.op_type == "DequantizeLinear":
            src = p.input[0]
            zp = p.input[2] if len(p.input) > 2 else ""
            if zp not in self.inits:
                q = self.producer.get(src)
                zp = (
                    q.input[2] if q is not None and q.op_type == "QuantizeLinear" and len(q.input) > 2 else ""
                )
            if src in self.inits:
                return _type_name(self.inits[src].data_type)
            if zp in self.inits:
                return _type_name(self.inits[zp].data_type)
            return _type_name(self.inputs[src]) if src in self.inputs else "?"
        if tensor in self.inits:
            return _type_name(self.inits[tensor].data_type)
        if tensor in self.inputs:
            return _type_name(self.inputs[tensor])
        return "float32"


def _type_name(elem_type: int) -> str:
    return ONNX_TYPE_NAMES.get(elem_type, str(elem_type))


class EncodingError(ValueError):
    pass


@dataclass(frozen=True)
class Encoding:
    datatype: str
    scale: float = 1.0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.datatype not in FIXED_TYPES and self.datatype not in FLOAT_TYPES:
            raise EncodingError(f"unknown datatype {self.datatype!r}")

    @property
    def is_fixed(self) -> bool:
        return self.datatype in FIXED_TYPES

    @property
    def signed(self) -> bool:
        return self.datatype.startswith("s")

    @property
    def bits(self) -> int:
        return BITS[self.datatype]

    @property
    def numpy_dtype(self) -> str:
        return FIXED_TYPES.get(self.datatype) or FLOAT_TYPES[self.datatype]

    @staticmethod
    def from_onnx(elem_type: int, scale: float | None = None, zero_point: int | None = None) -> Encoding:
        """An ONNX tensor type (+ its Q/DQ scale and zero point for quantized types) in QNN's terms."""
        datatype = next((k for k, v in ONNX_ELEM_TYPE.items() if v == elem_type), None)
        if datatype is None:
            raise EncodingError(f"ONNX element type {elem_type} has no QNN datatype")
        if datatype in FLOAT_TYPES:
            return Encoding(datatype)
        return Encoding(datatype, float(scale), -int(zero_point or 0))

    @staticmethod
    def of_lut(lut: LutSpec) -> Encoding:
        """A LUT file's encoding (always unsigned)."""
        return Encoding(lut.datatype, float(lut.scale), int(lut.offset))

    @staticmethod
    def of_io(io: dict[str, Any]) -> Encoding:
        """A graph I/O tensor as compiled/report.json records it (`dtype` a numpy name, `scale`, `offset`)."""
        datatype = next(
            (k for k, v in {**GRAPH_FIXED_TYPES, **FLOAT_TYPES}.items() if v == io["dtype"]), None
        )
        if datatype is None:
            raise EncodingError(f"dtype {io['dtype']!r} has no QNN datatype")
        if datatype in FLOAT_TYPES:
            return Encoding(datatype)
        return Encoding(datatype, float(io["scale"]), int(io["offset"]))

    def describe(self) -> str:
        if not self.is_fixed:
            return self.datatype
        return f"{self.datatype} (scale {self.scale:.9g}, offset {self.offset})"

    def to_dict(self) -> dict[str, Any]:
        return {"datatype": self.datatype, "scale": self.scale, "offset": self.offset}

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        import numpy as np

        if not self.is_fixed:
            return np.asarray(q, dtype=np.float32)
        return ((np.asarray(q, dtype=np.float32) + np.float32(self.offset)) * np.float32(self.scale)).astype(
            np.float32
        )

    def quantize(self, x: np.ndarray) -> np.ndarray:
        import numpy as np

        if not self.is_fixed:
            return np.asarray(x, dtype=self.numpy_dtype)
        info = np.iinfo(self.numpy_dtype)
        top = info.max if self.bits == 8 * np.dtype(self.numpy_dtype).itemsize else (1 << self.bits) - 1
        q = np.rint(np.asarray(x, dtype=np.float32) / np.float32(self.scale)) - self.offset
        return np.clip(q, info.min, top).astype(self.numpy_dtype)

    def graph_input_of_lut(self) -> Encoding:
        """The encoding a graph input fed from this LUT gets: the LUT's own, except for a packed 4-bit
        LUT, whose input is 8-bit at a sixteenth of the scale and sixteen times the offset. Genie's
        requantization (`feed`) then multiplies each entry by exactly 16 (the scales are float32, so
        their ratio is exact) and adds exactly 0: lossless despite its truncation, where a ratio like
        255/15 = 17 computed in floating point could land just under and truncate a step away."""
        if self.datatype not in PACKED_LUT_TYPES:
            return self
        factor = 1 << (8 - self.bits)
        return Encoding("ufixed8", self.scale / factor, self.offset * factor)


def lut_file_bytes(datatype: str, rows: int, size: int) -> int:
    """The bytes of a LUT file of `rows` x `size` entries (packed types: entries * bits / 8)."""
    return rows * size * BITS[datatype] // 8


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit entries (an even number, flat) into bytes as Genie reads a ufixed4 LUT: the even entry
    in the low nibble."""
    import numpy as np

    v = np.asarray(values, dtype=np.uint8).reshape(-1, 2)
    return (v[:, 0] | (v[:, 1] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of `pack_nibbles`, keeping the leading shape: (..., n) bytes -> (..., 2n) entries."""
    import numpy as np

    b = np.asarray(packed, dtype=np.uint8)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


class LutFile:
    """A Genie LUT file memory-mapped (E2B's per-layer LUT is gigabytes; a prompt reads a few rows):
    `lut[ids]` gives those rows' raw entries, unpacked where the datatype is packed."""

    def __init__(self, path: Any, datatype: str, size: int) -> None:
        import numpy as np

        self.path, self.datatype, self.size = path, datatype, size
        bits = BITS[datatype]
        if datatype in PACKED_LUT_TYPES and (size * bits) % 8:
            raise EncodingError(f"{path}: {datatype} rows of {size} entries do not fill whole bytes")
        row_bytes = size * bits // 8
        nbytes = path.stat().st_size
        if nbytes % row_bytes:
            raise EncodingError(f"{path}: {nbytes} bytes are not rows of {size} {datatype} entries")
        dtype = np.uint8 if datatype in PACKED_LUT_TYPES else np.dtype(FIXED_TYPES.get(datatype, datatype))
        self.rows = np.memmap(path, dtype=dtype, mode="r").reshape(nbytes // row_bytes, -1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, ids: Any) -> np.ndarray:
        import numpy as np

        rows = np.asarray(self.rows[ids])
        return unpack_nibbles(rows) if self.datatype in PACKED_LUT_TYPES else rows


def feed_mode(lut: Encoding, graph_input: Encoding) -> str | None:
    """How Genie fills `graph_input` from rows of `lut`: COPY, UNPACK, REQUANTIZE, or None (it cannot)."""
    if lut == graph_input or (not lut.is_fixed and lut.datatype == graph_input.datatype == "float32"):
        return COPY
    if lut.datatype in PACKED_LUT_TYPES and graph_input == lut.graph_input_of_lut():
        return UNPACK
    if lut.is_fixed and graph_input.is_fixed and lut.signed == graph_input.signed:
        return REQUANTIZE
    return None


def feed(rows: np.ndarray, lut: Encoding, graph_input: Encoding) -> np.ndarray:
    """The values Genie writes into `graph_input` for LUT `rows` (raw LUT values).

    Requantization is Genie's own arithmetic (qualla dialog.cpp `requantEmbedding`):
    (T)(requantScale * q + requantOffset) with requantScale = s_lut / s_in and requantOffset =
    requantScale * o_lut - o_in, a C cast: truncation toward zero and no clamp (out-of-range values
    wrap here, as the cast's result is undefined in C)."""
    import numpy as np

    mode = feed_mode(lut, graph_input)
    if mode is None:
        raise EncodingError(
            f"Genie cannot feed a {graph_input.describe()} graph input from a {lut.describe()} LUT"
        )
    if mode == COPY:
        return np.asarray(rows, dtype=graph_input.numpy_dtype)
    scale = lut.scale / graph_input.scale
    offset = scale * lut.offset - graph_input.offset
    values = np.trunc(scale * np.asarray(rows).astype(np.float64) + offset)
    return values.astype(np.int64).astype(graph_input.numpy_dtype)


def shared_tensor_mismatches(
    io: dict[str, dict[str, dict[str, dict[str, Any]]]],
    cache_prefixes: tuple[str, ...],
    skip: frozenset[str] = frozenset({LOGITS}),
) -> list[str]:
    """Tensors named in more than one graph whose encodings differ, one line each (empty: none).

    `io` is {graph: {"inputs": {tensor: desc}, "outputs": {...}}} with compiled/report.json's tensor
    descriptions. Genie checks this when it loads the binaries (Genie's `qualla` QnnNspModel model
    validation, "Quantization parameter match": every tensor name across all graphs, a cache input
    `{prefix}..._in` counted as its `_out`, the logits output skipped, must have one scale and
    offset, else "Non-identical quantization parameters found for the same tensor" and the dialog
    fails to load), because it binds one buffer to every graph that names the tensor and hands part
    outputs to the next part as raw bytes. The datatype is compared too: raw bytes of another width
    are another tensor.
    """
    seen: dict[str, list[tuple[str, Encoding]]] = {}
    for graph, tensors in io.items():
        for direction in ("inputs", "outputs"):
            for name, desc in tensors.get(direction, {}).items():
                if name in skip:
                    continue
                key = name
                if name.endswith("_in") and name.startswith(cache_prefixes):
                    key = name[: -len("_in")] + "_out"
                seen.setdefault(key, []).append((f"{graph} {direction[:-1]} {name}", Encoding.of_io(desc)))
    problems = []
    for key, uses in sorted(seen.items()):
        found: dict[Encoding, list[str]] = {}
        for where, enc in uses:
            found.setdefault(enc, []).append(where)
        if len(found) > 1:
            detail = "; ".join(
                f"{enc.describe()} in {', '.join(w[:2])}{' ...' * (len(w) > 2)}" for enc, w in found.items()
            )
            problems.append(
                f"{key} has {len(found)} encodings across the graphs ({detail}); Genie binds one buffer per "
                "tensor name and passes it between graphs as raw bytes (it refuses to load such binaries): "
                "quantize again with this version (it pins shared tensors to one encoding)"
            )
    return problems


# ---- graph I/O as compiled: the boundary Q/DQ folded into the inputs and outputs ----
@dataclass(frozen=True)
class IoTensor:
    """A graph input or output as compiled/report.json records it (read back by encoding.Encoding.of_io)."""

    dtype: str
    shape: tuple[int, ...]
    scale: float | None = None
    offset: int | None = None  # Genie's convention: real = (q + offset) * scale, offset = -zero_point

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.scale is not None:
            d.update(scale=self.scale, offset=self.offset)
        return d


def prepare_io(model) -> dict[str, dict[str, IoTensor]]:
    """Fold boundary QuantizeLinear/DequantizeLinear into the graph's inputs and outputs, in place.

    An input read only by a QuantizeLinear becomes that quantized tensor; an output written by a
    DequantizeLinear becomes the quantized tensor before it (a DequantizeLinear stays for any node
    inside the graph that reads the float value). Returns the I/O encodings: {"inputs", "outputs"}.
    """
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}

    def scalar(name: str) -> Any:
        return numpy_helper.to_array(inits[name]).item()

    def consumers(name: str) -> list:
        return [n for n in g.node if name in n.input]

    def shape(v) -> tuple[int, ...]:
        return tuple(d.dim_value for d in v.type.tensor_type.shape.dim)

    encodings: dict[str, dict[str, IoTensor]] = {"inputs": {}, "outputs": {}}
    drop = []
    for inp in g.input:
        readers = consumers(inp.name)
        q = readers[0] if len(readers) == 1 and readers[0].op_type == "QuantizeLinear" else None
        if q is None or len(q.input) < 3:
            encodings["inputs"][inp.name] = IoTensor(
                ONNX_TYPE_NAMES[inp.type.tensor_type.elem_type], shape(inp)
            )
            continue
        zp = inits[q.input[2]]
        inp.type.tensor_type.elem_type = zp.data_type
        for n in consumers(q.output[0]):
            n.input[:] = [inp.name if i == q.output[0] else i for i in n.input]
        drop.append(q)
        encodings["inputs"][inp.name] = IoTensor(
            ONNX_TYPE_NAMES[zp.data_type], shape(inp), scalar(q.input[1]), -int(scalar(q.input[2]))
        )
    producers = {o: n for n in g.node for o in n.output}
    for out in g.output:
        dq = producers.get(out.name)
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            encodings["outputs"][out.name] = IoTensor(
                ONNX_TYPE_NAMES[out.type.tensor_type.elem_type], shape(out)
            )
            continue
        quantized = dq.input[0]
        zp = inits[dq.input[2]]
        out.type.tensor_type.elem_type = zp.data_type
        # The quantized tensor takes the output's name; float readers keep a DequantizeLinear.
        for n in g.node:
            if n is not dq:
                n.input[:] = [out.name if i == quantized else i for i in n.input]
                n.output[:] = [out.name if o == quantized else o for o in n.output]
        inner = [n for n in consumers(out.name) if n is not dq]
        if inner:
            dq.input[0], dq.output[0] = out.name, f"{out.name}_float"
            for n in inner:
                n.input[:] = [dq.output[0] if i == out.name else i for i in n.input]
        else:
            drop.append(dq)
        encodings["outputs"][out.name] = IoTensor(
            ONNX_TYPE_NAMES[zp.data_type], shape(out), scalar(dq.input[1]), -int(scalar(dq.input[2]))
        )
    for n in drop:
        g.node.remove(n)
    return encodings
