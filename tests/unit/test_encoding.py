"""Genie's LUT -> graph-input feeding rule (stages/encoding.py)."""

import numpy as np
import pytest

from stages.encoding import COPY, REQUANTIZE, Encoding, EncodingError, feed, feed_mode


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


def test_requantization_keeps_the_real_values_within_half_an_output_step():
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
    assert err[inside].max() <= 0.001 / 2 + 1e-6


def test_onnx_zero_point_is_minus_the_qnn_offset():
    e = Encoding.from_onnx(4, scale=np.float32(0.25), zero_point=32768)
    assert e == Encoding("ufixed16", 0.25, -32768)
    assert e.dequantize(np.array([32768], np.uint16))[0] == 0.0
