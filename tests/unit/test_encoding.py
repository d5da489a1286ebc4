"""Genie's LUT -> graph-input feeding rule (stages/model/encoding.py)."""

import numpy as np
import pytest

from stages.model.contract import LutSpec
from stages.model.encoding import (
    COPY,
    REQUANTIZE,
    UNPACK,
    Encoding,
    EncodingError,
    LutFile,
    feed,
    feed_mode,
    lut_file_bytes,
    pack_nibbles,
    shared_tensor_mismatches,
    unpack_nibbles,
)


def test_equal_encodings_are_a_byte_copy():
    e = Encoding("ufixed8", 0.015625, -128)
    rows = np.array([[0, 7, 255]], dtype=np.uint8)
    assert feed_mode(e, Encoding("ufixed8", 0.015625, -128)) == COPY
    out = feed(rows, e, e)
    assert out.dtype == np.uint8 and out.tobytes() == rows.tobytes()


def test_float32_lut_into_float32_input_is_a_copy():
    assert feed_mode(Encoding("float32"), Encoding("float32")) == COPY


@pytest.mark.parametrize("graph", ["float32", "float16"])
def test_fixed_point_lut_cannot_feed_a_float_input(graph):
    lut = Encoding("ufixed8", 0.1, -128)
    assert feed_mode(lut, Encoding(graph)) is None
    with pytest.raises(EncodingError, match=f"cannot feed a {graph} graph input from a ufixed8"):
        feed(np.zeros((1, 2), np.uint8), lut, Encoding(graph))


def test_signedness_must_match_for_requantization():
    assert feed_mode(Encoding("ufixed8", 0.1, 0), Encoding("sfixed16", 0.1, 0)) is None


def test_requantization_keeps_the_real_values_within_one_output_step():
    # Genie truncates (a C cast), so up to one step, not half a step as rounding would.
    lut = Encoding("ufixed8", 0.05, -100)
    graph = Encoding("ufixed16", 0.001, -30000)
    assert feed_mode(lut, graph) == REQUANTIZE
    rows = np.arange(256, dtype=np.uint8).reshape(4, 64)
    out = feed(rows, lut, graph)
    assert out.dtype == np.uint16
    err = np.abs(graph.dequantize(out) - lut.dequantize(rows))
    inside = (lut.dequantize(rows) >= graph.dequantize(np.uint16(0))) & (
        lut.dequantize(rows) <= graph.dequantize(np.uint16(65535))
    )
    assert err[inside].max() < 0.001 + 1e-6


def test_onnx_zero_point_is_minus_the_qnn_offset():
    e = Encoding.from_onnx(4, scale=np.float32(0.25), zero_point=32768)
    assert e == Encoding("ufixed16", 0.25, -32768)
    assert e.dequantize(np.array([32768], np.uint16))[0] == 0.0


def test_report_descriptions_become_encodings():
    lut = LutSpec(path="luts/x.bin", rows=4, size=2, bits=8, scale=0.5, offset=-114)
    assert Encoding.of_lut(lut) == Encoding("ufixed8", 0.5, -114)
    assert Encoding.of_io({"dtype": "uint16", "shape": [1], "scale": 0.25, "offset": -3}) == Encoding(
        "ufixed16", 0.25, -3
    )
    assert Encoding.of_io({"dtype": "float32", "shape": [1]}) == Encoding("float32")
    with pytest.raises(EncodingError, match="int64"):
        Encoding.of_io({"dtype": "int64", "shape": [1]})


def _io(dtype: str, scale: float | None = None, offset: int | None = None) -> dict:
    d = {"dtype": dtype, "shape": [1, 1]}
    return d if scale is None else {**d, "scale": scale, "offset": offset}


def test_a_tensor_named_by_several_graphs_must_have_one_encoding():
    hidden, kv_in, kv_out = _io("uint16", 0.01, -3), _io("uint8", 0.02, -128), _io("uint8", 0.02, -128)
    io = {
        "prefill_part1": {
            "inputs": {"past_key_0_h0_in": kv_in},
            "outputs": {"hidden": hidden, "logits": hidden},
        },
        "decode_part1": {"inputs": {"past_key_0_h0_in": kv_in}, "outputs": {"past_key_0_h0_out": kv_out}},
        "prefill_part2": {"inputs": {"hidden": hidden}, "outputs": {"logits": _io("uint16", 0.5, 0)}},
    }
    assert shared_tensor_mismatches(io, ("past_", "swa_")) == []  # the logits output is not compared
    io["prefill_part2"]["inputs"]["hidden"] = _io("uint16", 0.01, -4)
    (problem,) = shared_tensor_mismatches(io, ("past_", "swa_"))
    assert problem.startswith(
        "hidden has 2 encodings across the graphs (ufixed16 (scale 0.01, offset -3) in "
    )
    assert "prefill_part2 input hidden" in problem
    # A cache input is its output's buffer: a new entry written with another encoding is caught.
    io["prefill_part2"]["inputs"]["hidden"] = hidden
    io["decode_part1"]["outputs"]["past_key_0_h0_out"] = _io("uint16", 0.02, -128)
    (problem,) = shared_tensor_mismatches(io, ("past_", "swa_"))
    assert problem.startswith("past_key_0_h0_out has 2 encodings")
    # Outside the cache groups an _in tensor is its own name.
    assert shared_tensor_mismatches(io, ("swa_",)) == []


def test_nibbles_pack_the_even_entry_low_and_unpack_back():
    values = np.array([1, 2, 15, 0, 7, 9], dtype=np.uint8)
    packed = pack_nibbles(values)
    assert packed.tolist() == [0x21, 0x0F, 0x97]  # Genie's order, measured: even entry in the low nibble
    assert unpack_nibbles(packed).tolist() == values.tolist()
    assert unpack_nibbles(packed.reshape(3, 1)).shape == (3, 2)


@pytest.mark.parametrize("scale", [0.517071843, 0.1, 3.0e-5, 7.0])
@pytest.mark.parametrize("offset", [-7, -15, 0, -3])
def test_a_4_bit_lut_feeds_its_8_bit_input_exactly_despite_truncation(scale, offset):
    """Genie truncates what it requantizes; the 8-bit input quantize gives a 4-bit LUT's rows must come
    out as exactly 16 times each entry, whatever float32 scale the LUT has."""
    lut = Encoding("ufixed4", float(np.float32(scale)), offset)
    graph = lut.graph_input_of_lut()
    assert graph.datatype == "ufixed8" and feed_mode(lut, graph) == UNPACK
    rows = np.arange(16, dtype=np.uint8).reshape(1, 16)
    out = feed(rows, lut, graph)
    assert out.tolist() == (16 * rows).tolist()
    assert np.array_equal(graph.dequantize(out), lut.dequantize(rows))
    # any other 8-bit input is a plain (lossy) requantization, which the bundle warns about
    assert feed_mode(lut, Encoding("ufixed8", graph.scale * 2, graph.offset)) == REQUANTIZE


def test_a_4_bit_encoding_quantizes_into_its_sixteen_levels():
    e = Encoding("ufixed4", 0.5, -8)
    assert e.quantize(np.array([-100.0, 0.0, 100.0])).tolist() == [0, 8, 15]


def test_lut_file_reads_packed_rows_as_entries(tmp_path):
    entries = np.random.default_rng(0).integers(0, 16, size=(5, 6)).astype(np.uint8)
    path = tmp_path / "lut.bin"
    pack_nibbles(entries).tofile(path)
    assert path.stat().st_size == lut_file_bytes("ufixed4", 5, 6) == 15
    lut = LutFile(path, "ufixed4", 6)
    assert len(lut) == 5 and lut[np.array([3, 0])].tolist() == entries[[3, 0]].tolist()
    wide = np.arange(12, dtype=np.uint16).reshape(3, 4)
    wide.tofile(tmp_path / "wide.bin")
    assert LutFile(tmp_path / "wide.bin", "ufixed16", 4)[[2]].tolist() == wide[[2]].tolist()
    with pytest.raises(EncodingError, match="not rows of 4 ufixed16"):
        LutFile(path, "ufixed16", 4)
    with pytest.raises(EncodingError, match="whole bytes"):
        LutFile(path, "ufixed4", 5)
