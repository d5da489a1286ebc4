"""verify's comparisons of the real Genie's answers (real_checks.compare): token ids, never text
prefixes, and nothing passes without something compared."""

from __future__ import annotations

from stages.runtimes.genie.real import DialogRun
from stages.runtimes.genie.real_checks import FAILED, NOT_CHECKED, PASSED, RealRuns, compare

VOCAB = ["<eos>", *"abcdefghijklmnopqrstuvwxyz \n"]


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text if c in VOCAB]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != 0)


def _runs(chat: str, limit: str = "ab", new_tokens: int = 8) -> RealRuns:
    run = DialogRun(answers=[chat, limit], statuses=[0, 0])
    return RealRuns([(("chat", "token limit"), run)], [("chat", [])], "", new_tokens)


def _verdicts(runs: RealRuns, want: str, min_tokens: int = 8) -> tuple[list[str], dict[str, tuple]]:
    problems, done = compare(runs, {"chat": ("transformers", encode(want))}, {0}, decode, encode, min_tokens)
    return problems, {c.case: (c.verdict, c.asked, c.agreed, c.why) for c in done}


def test_an_answer_may_part_from_transformers_only_at_a_runtime_near_tie():
    """Gemma 3 270M's case: transformers and the bundle's graphs on the host pick "The" over "What"
    (the graphs by 0.099 logits), the real Genie on the HTP picks "What". Within the measured runtime
    bound it passes, named; beyond it, or where the graphs themselves part (infinite), it fails."""
    from stages.runtimes.genie.verify import runtime_near_ties

    assert runtime_near_ties([1, 2, 3], [1, 2, 4], [1.5, 0.1, 0.2]) == [1.5, 0.1, float("inf")]
    margins = [1.19, 0.28, 1.17, 2.03]
    want = ("transformers", encode("abcd"), margins)
    runs = _runs("axyz")
    _, done = compare(runs, {"chat": want}, {0}, decode, encode, 4, quality_near_tie=0.5)
    chat = next(c for c in done if c.case == "chat")
    assert (chat.verdict, chat.asked, chat.agreed) == (PASSED, 4, 1)
    assert "top-2 margin on the same graphs is 0.2800 <= 0.5000: a near-tie" in chat.why
    problems, done = compare(runs, {"chat": want}, {0}, decode, encode, 4, quality_near_tie=0.2)
    chat = next(c for c in done if c.case == "chat")
    assert chat.verdict == FAILED and "0.2800" in problems[0]


def test_answers_agree_token_by_token_up_to_the_tokens_asked():
    problems, got = _verdicts(_runs("hello world"), "hello there", min_tokens=6)
    assert problems == [] and got["chat"] == (PASSED, 6, 6, "")
    assert got["token limit"] == (PASSED, 3, 2, "2 tokens")
    # The reference shorter than the tokens asked: all of it.
    problems, got = _verdicts(_runs("hello world"), "hell")
    assert problems == [] and got["chat"][:3] == (PASSED, 4, 4)


def test_a_different_token_fails_and_says_where():
    problems, got = _verdicts(_runs("help me"), "hello there")
    assert got["chat"][:3] == (FAILED, 8, 3) and "at token 3" in problems[0]
    # Everything they share is counted, beyond the tokens asked too.
    _, got = _verdicts(_runs("hello there"), "hello there", min_tokens=2)
    assert got["chat"][:3] == (PASSED, 2, 11)


def test_nothing_to_compare_is_not_checked_never_passed():
    # VERIFY_MIN_PREFIX=0: no tokens asked.
    problems, got = _verdicts(_runs("anything"), "hello", min_tokens=0)
    assert problems == [] and got["chat"] == (NOT_CHECKED, 0, 0, "no tokens asked (VERIFY_MIN_PREFIX=0)")
    # An empty reference (its answer was all special tokens) compares nothing either, whatever Genie said.
    problems, got = _verdicts(_runs("anything"), "")
    assert got["chat"] == (NOT_CHECKED, 0, 0, "the answer of transformers is empty")
    # No tokens asked of Genie.
    _, got = _verdicts(_runs("", new_tokens=0), "hello")
    assert got["chat"][0] == NOT_CHECKED


def test_an_answer_that_does_not_re_tokenize_exactly_is_not_checked():
    # "X" is no token of VOCAB: the ids decode to something else than Genie's text.
    problems, got = _verdicts(_runs("heXllo"), "hello")
    assert problems == [] and got["chat"][0] == NOT_CHECKED and "re-tokenize" in got["chat"][3]


def test_a_reply_past_its_token_limit_fails():
    problems, got = _verdicts(_runs("hello", limit="abcd"), "hello")
    assert got["token limit"][0] == FAILED and "past its token limit of 3" in problems[0]


def test_the_short_run_names_every_case_it_does_not_run(monkeypatch, tmp_path):
    """At E2B size verify runs the chat prompt alone: the report lists the four other cases, each with
    why, so no case disappears without a word."""
    from stages.runtimes.genie import real_checks

    ran = DialogRun(answers=["ab"], statuses=[0], query_s=[716.0], log=tmp_path / "genie.log")
    monkeypatch.setattr(real_checks, "run_dialog", lambda *a, **k: ran)
    runs = real_checks.run_short(tmp_path, "hi", [2, 3], 2, tmp_path)
    fig = runs.figures()
    assert set(fig["statuses"]) == {"chat"}
    assert set(fig["not_run"]) == {"long", "crossing", "token limit", "second query", "own sampler"}
    assert all("716 s for 2 tokens" in why for why in fig["not_run"].values())


def test_the_sampled_reply_is_held_to_ending_by_itself():
    from stages.runtimes.genie.real_checks import _own_sampler_end

    assert _own_sampler_end(0, "abc", encode).verdict == PASSED
    assert "full context (status 4)" in _own_sampler_end(4, "abc", encode).why
    assert _own_sampler_end(0, "", encode).verdict == FAILED
    # From a prompt cut near a full context (each call slow): the verdict names that prompt.
    near = _own_sampler_end(4, "abcd", encode, prompt_tokens=2012)
    assert near.verdict == PASSED and "after a 2012-token prompt, ended by a full context" in near.why


def test_the_own_samplers_prompt_ends_near_a_full_context_where_calls_are_slow(monkeypatch, tmp_path):
    """With `own_sampler_room` the sampled reply starts room..2*room tokens short of context.size, so
    it meets the full context within a few decode steps; the prompt re-tokenizes to exactly its ids."""
    from stages.runtimes.genie import real_checks

    asked, timeouts = [], []

    def fake_dialog(bundle_dir, queries, log, sampler=None, timeout_s=1800, dump_dir=None):
        asked.append(queries)
        timeouts.append(timeout_s)
        n = len(queries)
        return DialogRun(answers=["x"] * n, statuses=[0] * n, query_s=[0.0] * n, log=log)

    monkeypatch.setattr(real_checks, "run_dialog", fake_dialog)
    args = ("the cat sat", "the cat sat", "ok", [0, *encode("the cat sat")], encode, decode, 0, 8, 8, 4, 100)
    runs = real_checks.run_cases(tmp_path, *args, tmp_path, own_sampler_room=4)
    own = asked[-1][0]
    n = runs.own_sampler_prompt_tokens
    assert 92 <= n <= 96 and len(encode(own.text)) + 1 == n and own.max_new_tokens == 100
    assert real_checks.run_cases(tmp_path, *args, tmp_path).own_sampler_prompt_tokens is None
    assert asked[-1][0].text == "the cat sat"
    assert timeouts == [1800] * 4


def test_a_slow_dialogs_hang_guard_grows_with_the_calls_it_may_take(monkeypatch, tmp_path):
    """Where each call is slow the timeout is 1,800 s plus per_call_s for every AR chunk of each prompt
    and every reply token: a flat 1,800 s cut 270M's greedy dialog (~50 calls of ~24 s) short."""
    from stages.runtimes.genie import real_checks

    assert real_checks._dialog_timeout_s([(100, 4), (3, 2)], 32, None) == 1800
    assert real_checks._dialog_timeout_s([(100, 4), (3, 2)], 32, 10.0) == 1800 + (4 + 4 + 1 + 2) * 10.0
    timeouts = []

    def fake_dialog(bundle_dir, queries, log, sampler=None, timeout_s=1800, dump_dir=None):
        timeouts.append(timeout_s)
        n = len(queries)
        return DialogRun(answers=["x"] * n, statuses=[0] * n, query_s=[0.0] * n, log=log)

    monkeypatch.setattr(real_checks, "run_dialog", fake_dialog)
    args = ("the cat sat", "the cat sat", "ok", [0, *encode("the cat sat")], encode, decode, 0, 8, 8, 4, 100)
    real_checks.run_cases(tmp_path, *args, tmp_path, own_sampler_room=4, per_call_s=10.0, ar=4)
    greedy, own = timeouts
    # own: a prompt of 92..96 tokens in AR-4 chunks, then up to 9 decode steps.
    assert 1800 + (23 + 9) * 10 <= own <= 1800 + (24 + 9) * 10 and greedy > 1800 + 20 * 10


def test_the_crossing_prompt_ends_before_the_window_and_its_answer_crosses_it():
    """Prompt positions 0..L-1, the answer's first new_tokens - 1 ids fed at L, L+1, ...: some decode
    step feeds a position at or past the window, none of the prompt's does, and its text re-tokenizes
    to exactly its ids."""
    from stages.runtimes.genie.real_checks import crossing_prompt_ids

    for window, new_tokens in ((8, 32), (8, 4), (20, 4), (20, 3)):
        text, ids = crossing_prompt_ids(encode, decode, 0, "the cat sat", window, new_tokens)
        assert ids[0] == 0 and encode(text) == ids[1:]
        assert len(ids) <= window - 1 and len(ids) + new_tokens - 2 >= window, (window, new_tokens)
    # Two new tokens feed one position, the prompt's next: it cannot cross; no window, nothing to cross.
    assert crossing_prompt_ids(encode, decode, 0, "the cat sat", 20, 2) is None
    assert crossing_prompt_ids(encode, decode, 0, "the cat sat", 0, 8) is None
    # No cut re-tokenizes exactly (its text gains a token): left out.
    assert crossing_prompt_ids(encode, lambda ids: decode(ids) + "a", 0, "the cat", 20, 4) is None


def test_the_runtime_comparison_takes_the_whole_answer_and_allows_only_a_near_tie():
    from stages.runtimes.genie.real_checks import compare_runtime

    want, margins = encode("abcdef"), [1.0, 1.0, 1.0, 0.01, 1.0, 1.0]
    assert compare_runtime("chat", encode("abcdef"), want, margins, 0.05).verdict == PASSED
    tie = compare_runtime("chat", encode("abcxyz"), want, margins, 0.05)
    assert (tie.verdict, tie.agreed, tie.asked) == (PASSED, 3, 6) and "near-tie" in tie.why
    wrong = compare_runtime("chat", encode("abxxxx"), want, margins, 0.05)
    assert wrong.verdict == FAILED and "parted at token 2" in wrong.why
    assert compare_runtime("chat", [], [], [], 0.05).verdict == NOT_CHECKED


def test_a_reference_whose_ids_do_not_survive_decoding_is_not_checked_when_the_texts_agree():
    """At E2B with random weights the reference's two tokens decode to nothing and Genie answers "":
    nothing can be said of the ids; with other text, they differ."""
    runs = RealRuns([(("chat",), DialogRun(answers=[""], statuses=[0]))], [("chat", [])], "", 2)
    runtime = {"chat": ([0, 0], [1.0, 1.0])}
    _, done = compare(runs, {}, set(), decode, encode, 8, runtime, 0.0)
    assert [c.verdict for c in done] == [NOT_CHECKED]
    runs = RealRuns([(("chat",), DialogRun(answers=["x"], statuses=[0]))], [("chat", [])], "", 2)
    problems, done = compare(runs, {}, set(), decode, encode, 8, runtime, 0.0)
    assert [c.verdict for c in done] == [FAILED] and problems


def test_the_runtime_comparison_stops_at_the_tokens_genie_was_asked_for():
    """The E2B short query asks Genie for 2 tokens: the emulator's longer answer is compared on those."""
    runs = RealRuns([(("chat",), DialogRun(answers=["ab"], statuses=[0]))], [("chat", [])], "", 2)
    _, done = compare(runs, {}, set(), decode, encode, 8, {"chat": (encode("abcdef"), [1.0] * 6)}, 0.0)
    assert [(c.verdict, c.asked, c.agreed) for c in done] == [(PASSED, 2, 2)]


def test_ids_read_from_genies_dumps_are_compared_where_its_text_says_nothing():
    """E2B with random weights: Genie's text is empty, the ids it picked (read from its dumps) are
    compared with the emulator's all the same, passing or failing on them."""
    runtime = {"chat": ([7, 8, 9, 10], [1.0] * 4)}
    ran = DialogRun(answers=[""], statuses=[0])
    same = RealRuns([(("chat",), ran)], [("chat", [])], "", 4, dumped_ids={"chat": [7, 8, 9, 10]})
    _, done = compare(same, {}, set(), decode, encode, 8, runtime, 0.0)
    assert [(c.verdict, c.asked, c.agreed) for c in done] == [(PASSED, 4, 4)]
    other = RealRuns([(("chat",), ran)], [("chat", [])], "", 4, dumped_ids={"chat": [7, 8, 3, 10]})
    problems, done = compare(other, {}, set(), decode, encode, 8, runtime, 0.0)
    assert [(c.verdict, c.agreed) for c in done] == [(FAILED, 2)] and "parted at token 2" in problems[0]


def test_a_part_of_sliding_layers_only_takes_its_ar_from_the_windows_mask():
    """E2B at w4a16 puts layers 0-3 (all sliding) alone in part 1: no full-attention mask there."""
    from stages.runtimes.genie.emulator import Graph, Tensor

    def graph(*masks: str) -> Graph:
        inputs = {m: Tensor(m, (1, 1, 32, 544), None) for m in masks}
        return Graph("p.bin", "q", "prefill_ar32_part1_of_4", inputs, {})

    assert graph("swa_attention_mask").ar == graph("attention_mask", "swa_attention_mask").ar == 32
    assert graph().ar == -1


def test_a_graph_without_the_full_attention_mask_is_refused_for_genie():
    from stages.runtimes.genie.rules import context_length_problems

    io = {"p1": {"inputs": {"swa_attention_mask": {}}}, "p2": {"inputs": {"attention_mask": {}}}}
    (problem,) = context_length_problems(io, "attention_mask")
    assert problem.startswith("graph p1 takes no attention_mask") and "NUM_SHARDS" in problem
