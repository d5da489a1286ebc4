"""dumps.greedy_ids against a dump folder laid out as QAIRT 2.51's Genie writes one (`debug.dump-tensors`:
text_primary/spec.<graph>.json, text_primary/<graph>/<call>_in_<tensor>; the real layout is read in
tests/integration/test_real_genie.py, where the real Genie writes it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.runtimes.genie.dumps import DumpError, greedy_ids

HIDDEN, VOCAB, AR = 4, 10, 4
U16 = "QNN_DATATYPE_UFIXED_POINT_16"


def _lut() -> np.ndarray:
    return (np.arange(VOCAB * HIDDEN, dtype=np.uint16) * 7 + 3).reshape(VOCAB, HIDDEN)


def _dumps(tmp_path, prompt: list[int], picks: list[int], log_prompt: list[int] | None = None):
    """A one-kind AR-4 dialog of two parts: the prompt in AR-sized chunks (padded with row 1), then one
    call per pick but the last; the last part's logits favour each call's pick at its last valid row."""
    root = tmp_path / "dumps" / "text_primary"
    lut = _lut()
    lut.tofile(tmp_path / "lut.bin")
    first, last = "part001_of_002_x_1_of_2", "part002_of_002_x_2_of_2"
    for graph, tensors, outs in (
        (first, [("inputs_embeds", [1, 1, AR, HIDDEN])], []),
        (last, [], [("logits", [1, 1, AR, VOCAB])]),
    ):
        (root / graph).mkdir(parents=True)
        spec = {
            "graph_name": graph,
            "inputs": [{"name": n, "dims": d, "dtype": U16} for n, d in tensors],
            "outputs": [{"name": n, "dims": d, "dtype": U16} for n, d in outs],
        }
        (root / f"spec.{graph}.json").write_text(json.dumps(spec))
    chunks = [prompt[i : i + AR] for i in range(0, len(prompt), AR)] + [[t] for t in picks[:-1]]
    for k, chunk in enumerate(chunks):
        rows = np.stack([lut[t] for t in chunk + [1] * (AR - len(chunk))])
        rows.tofile(root / first / f"{k:03d}_in_inputs_embeds")
        logits = np.zeros((AR, VOCAB), np.uint16)
        pick_at = k - (len(chunks) - len(picks))
        if pick_at >= 0:
            logits[len(chunk) - 1, picks[pick_at]] = 60000
        logits.tofile(root / last / f"{k:03d}_out_logits")
    log = tmp_path / "genie.log"
    log.write_text(f"[4] embedding-tokens: {log_prompt or prompt}\n[4] input-logits: [0.5]\n")
    return tmp_path / "dumps", log, tmp_path / "lut.bin"


@pytest.mark.parametrize("prompt", [[2, 5, 6], [2, 5, 6, 7], [2, 5, 6, 7, 8, 9]])
def test_the_ids_genie_fed_and_picked(tmp_path, prompt):
    dumps, log, lut = _dumps(tmp_path, prompt, [3, 4, 0])
    assert greedy_ids(dumps, log, lut, HIDDEN) == [3, 4, 0]


def test_one_pick_comes_from_the_prefill_call(tmp_path):
    dumps, log, lut = _dumps(tmp_path, [2, 5, 6], [8])
    assert greedy_ids(dumps, log, lut, HIDDEN) == [8]


def test_dumps_that_disagree_with_genies_own_prompt_are_refused(tmp_path):
    dumps, log, lut = _dumps(tmp_path, [2, 5, 6], [3, 4], log_prompt=[2, 5, 7])
    with pytest.raises(DumpError, match="tokenized the prompt as"):
        greedy_ids(dumps, log, lut, HIDDEN)


def test_a_row_of_no_token_is_refused(tmp_path):
    dumps, log, lut = _dumps(tmp_path, [2, 5, 6], [3, 4])
    path = dumps / "text_primary" / "part001_of_002_x_1_of_2" / "001_in_inputs_embeds"
    np.full((AR, HIDDEN), 1, np.uint16).tofile(path)
    with pytest.raises(DumpError, match="row 0 is no row"):
        greedy_ids(dumps, log, lut, HIDDEN)


def test_a_log_without_the_prompt_is_refused(tmp_path):
    dumps, log, lut = _dumps(tmp_path, [2, 5, 6], [3])
    log.write_text("[3] quiet\n")
    with pytest.raises(DumpError, match="embedding-tokens"):
        greedy_ids(dumps, log, lut, HIDDEN)
