"""The Genie emulator's pieces that follow Genie's source line by line: requantization arithmetic,
AR choice, the two cache groups' slot bookkeeping and the RoPE tables."""

from __future__ import annotations

import numpy as np
import pytest

from stages.model.encoding import Encoding
from stages.model.encoding import feed as requantize
from stages.runtimes.genie.emulator import CacheGroup, EmulatorError, pick_ar, rope_table


def test_requantization_truncates_like_genies_c_cast():
    # requantScale 0.003/0.01 = 0.3: 0.9, 1.5, 2.7 and 76.5 truncate to 0, 1, 2 and 76
    # (rounding would give 1, 2, 3 and 77).
    lut, target = Encoding("ufixed8", 0.003, 0), Encoding("ufixed8", 0.01, 0)
    got = requantize(np.array([0, 3, 5, 9, 255], dtype=np.uint8), lut, target)
    assert got.dtype == np.uint8 and got.tolist() == [0, 0, 1, 2, 76]


def test_requantization_moves_between_offsets_and_widths():
    # real = (q - 100) * 0.02; into scale 0.001, offset -30000: q_in = 20 q - 2000 + 30000.
    lut, target = Encoding("ufixed8", 0.02, -100), Encoding("ufixed16", 0.001, -30000)
    got = requantize(np.array([100, 150, 0], dtype=np.uint8), lut, target)
    assert got.dtype == np.uint16 and got.tolist() == [30000, 31000, 28000]


def test_requantization_refuses_float():
    with pytest.raises(ValueError, match="cannot feed a float32 graph input"):
        requantize(np.zeros(2, np.uint8), Encoding("ufixed8", 0.1, 0), Encoding("float32"))


@pytest.mark.parametrize(
    "ars,n,want", [([1, 8], 1, 1), ([1, 8], 2, 8), ([1, 8], 8, 8), ([1, 8], 51, 8), ([1, 8, 64], 9, 64)]
)
def test_genie_picks_the_smallest_ar_that_holds_the_inputs_else_the_largest(ars, n, want):
    assert pick_ar(ars, n) == want


def test_sliding_window_group_fills_free_slots_then_overwrites_the_oldest():
    group = CacheGroup("swa_", "swa_attention_mask", window=4, kv_dim=16)
    slots = [group.destinations(n, budget=4) for n in (3, 3, 1, 1)]
    assert slots == [[0, 1, 2], [3, 0, 1], [2], [3]]  # position p ends in slot p mod 4
    assert group.n_valid == 4 and group.activated


def test_sliding_window_group_cannot_take_a_step_larger_than_its_window():
    group = CacheGroup("swa_", "swa_attention_mask", window=4, kv_dim=16)
    with pytest.raises(EmulatorError, match="prefill AR smaller than the window"):
        group.destinations(6, budget=4)


def test_default_group_fills_in_order_and_stops_when_full():
    group = CacheGroup("past_", "attention_mask", window=None, kv_dim=32)
    assert group.destinations(3, budget=5) == [0, 1, 2]
    with pytest.raises(EmulatorError, match="Context Size was exceeded"):
        group.destinations(3, budget=5)


def test_proportional_rope_rotates_only_the_partial_factor_of_the_frequencies():
    entry = {
        "rope-dim": 16,
        "rope-theta": 1e6,
        "rope-scaling": {"rope-type": "proportional", "partial-rotary-factor": 0.25},
    }
    positions = np.arange(5, 9)
    cos, sin = rope_table(entry, positions)
    assert cos.shape == (4, 16)
    # 0.25 of a 32-wide head: 4 of the 16 frequencies rotate, the first at 1 rad per position.
    assert np.allclose(cos[:, 4:], 1.0) and np.allclose(sin[:, 4:], 0.0)
    assert np.allclose(cos[:, 0], np.cos(positions)) and not np.allclose(sin[:, 3], 0.0)
    _, plain_sin = rope_table({"rope-dim": 8, "rope-theta": 1e4}, positions)
    assert not np.allclose(plain_sin[:, 7], 0.0)  # without scaling every frequency rotates
