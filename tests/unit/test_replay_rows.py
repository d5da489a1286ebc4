"""replay.valid_rows: what of each output Genie reads after a call with padded rows."""

import numpy as np

from stages.model.contract import LOGITS, kvshare_name
from stages.runtimes.genie.replay import valid_rows


def test_valid_rows_keep_the_tokens_of_the_call_and_a_kvshare_hand_overs_past():
    n, ar, past, d = 3, 4, 6, 2
    key = np.arange(d * ar).reshape(1, 1, d, ar)
    value = np.arange(ar * d).reshape(1, 1, ar, d)
    logits = np.arange(ar * 5).reshape(1, ar, 5)
    assert (valid_rows("swa_key_0_h0_out", key, n, ar) == key[..., :n]).all()
    assert (valid_rows("past_value_3_h0_out", value, n, ar) == value[:, :, :n]).all()
    assert (valid_rows(LOGITS, logits, n, ar) == logits[:, :n]).all()
    assert valid_rows("xfer_hidden_states_layer2", np.zeros((1, ar, 8)), n, ar).shape == (1, n, 8)
    shared_key = np.zeros((1, 1, d, past + ar))
    shared_value = np.zeros((1, 1, past + ar, d))
    assert valid_rows(kvshare_name(13, "key"), shared_key, n, ar).shape == (1, 1, d, past + n)
    assert valid_rows(kvshare_name(13, "value"), shared_value, n, ar).shape == (1, 1, past + n, d)
    full = np.ones((1, 1, d, ar))
    assert valid_rows("past_key_1_h0_out", full, ar, ar).shape == full.shape


def test_an_output_the_quantization_leaves_noisy_is_held_to_its_own_sqnr_less_a_margin():
    """Gemma 3 270M's deep V entries are 16.45 dB from float after quantization and 11.4 dB from their
    compiler inputs on the HTP: held to 6.45 dB; the tiny model's (36-42 dB) stay at the fixed floor."""
    from stages.runtimes.genie.replay import MIN_SQNR_DB, sqnr_floor

    assert sqnr_floor(None) == sqnr_floor(40.0) == MIN_SQNR_DB
    assert sqnr_floor(16.45) == 6.45 < 11.44
