"""Verify's first check: the bundle under the real Genie (real.py), on the cases a phone meets.

- `chat`: the prompt through the bundle's chat template, exactly as `make run` sends it, greedy;
- `long`: the raw prompt repeated past one prefill chunk and the sliding window, greedy;
- `crossing`: the raw prompt cut to end one token short of the sliding window, greedy, so that the
  answer's decode steps cross it (left out, and named in `not_run`, where no cut re-tokenizes exactly);
- `token limit`: GenieDialog_setMaxNumTokens stops the reply (no error status, no more tokens); the
  same greedy prompt as `chat`, so its ids must be the chat answer's first ids;
- `second query`: a short second chat turn in the same dialog, after the token-limit reply (left out,
  and absent from the report, when the two turns do not fit the context);
- `own sampler`: the bundle's own sampler config with no token limit, so the reply ends at EOS or at
  a full context: a clean stop (status >= 0: Genie's context warning is not an error). Where each
  call takes many seconds (the x86 emulation of a real-size bundle), sampling from the chat prompt to
  a full context would take hours: its prompt is then the raw prompt repeated to end a few tokens
  short of the context, so the reply meets the full context within a few decode steps.

The greedy answers are compared afterwards (compare()) in token ids, never as text: the chat answer
with transformers' greedy ids, the long ones with the emulator's on the same binaries. Genie answers
in text (GenieDialog_query); its ids are read from its own tensor dumps where verify asks for them
(run_short: at E2B geometry random weights answer in tokens whose text is empty; dumps.py), else
the text re-tokenized, used only where that is exact (the ids decode to the very text).
GenieDialog_tokenQuery, which answers in ids, cannot be used: QAIRT 2.51's
x86 libGenie.so leaves Gemma 4's per_layer_inputs unfilled on that path (docs/facts.md §3 (k)). A
comparison with nothing to compare (no tokens asked, an empty reference, an answer that does not
re-tokenize exactly) is reported as not checked, never as passed."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages.runtimes.genie.dumps import DumpError, bundle_greedy_ids
from stages.runtimes.genie.files import GENIE_CONFIG
from stages.runtimes.genie.real import (
    DIALOG_TIMEOUT_S,
    GREEDY,
    DialogRun,
    Query,
    RealGenieError,
    run_dialog,
)

# Tokens of the short reply the token-limit case asks for.
LIMIT_TOKENS = 3
# run_short's bound: at E2B the x86 HTP emulation reads 120-350 s per GB of weights (docs/verification.md),
# so a prefill call and a decode step over ~5 GB of binaries may take up to an hour.
SHORT_TIMEOUT_S = 3 * 3600
# A dialog's hang guard where each call is slow: this many seconds a call per GB of ctx-bins (twice the
# slowest rate measured, for a shared machine), for every prefill chunk and decode step its queries
# may take, on top of run_dialog's 1,800 s. Gemma 3 270M (0.27 GB) measured about 24 s a call, and its
# greedy dialog under VERIFY_REAL_GENIE=full (~50 calls) overran a flat 1,800 s while the machine was
# shared.
GUARD_S_PER_CALL_GB = 700


def call_guard_s(bundle_dir: Path) -> float:
    """The hang guard's seconds a call for this bundle (GUARD_S_PER_CALL_GB x its ctx-bins' GB)."""
    dialog = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    names = dialog["engine"]["model"]["binary"]["ctx-bins"]
    return GUARD_S_PER_CALL_GB * sum((bundle_dir / n).stat().st_size for n in names) / 1e9


def _dialog_timeout_s(prompts_and_replies: list[tuple[int, int]], ar: int, per_call_s: float | None) -> float:
    """run_dialog's timeout: DIALOG_TIMEOUT_S, plus per_call_s for each call the queries may take (a
    prompt of n tokens in ceil(n / ar) chunks, then a decode step a reply token)."""
    if per_call_s is None:
        return DIALOG_TIMEOUT_S
    calls = sum(-(-n // ar) + reply for n, reply in prompts_and_replies)
    return DIALOG_TIMEOUT_S + calls * per_call_s


@dataclass
class RealRuns:
    """The real Genie's runs of one verify, and the prompts transformers must answer too."""

    runs: list[tuple[tuple[str, ...], DialogRun]]  # (its queries' case names, the dialog)
    greedy_cases: list[tuple[str, list[int]]]  # (case, prompt ids) compared with transformers
    chat_query: str  # the text GenieDialog_query got: `make run`'s (prompt.query_text)
    new_tokens: int  # the greedy answers' token limit
    comparisons: list[Comparison] = field(default_factory=list)  # compare()'s, once made
    not_run: dict[str, str] = field(default_factory=dict)  # case -> why it did not run
    # The own sampler's prompt length where it is cut to end near a full context (None: the chat prompt).
    own_sampler_prompt_tokens: int | None = None
    dumped_ids: dict[str, list[int]] = field(default_factory=dict)  # case -> ids read from Genie's dumps
    dumps_unread: dict[str, str] = field(default_factory=dict)  # case -> why its dumps could not be read

    def per_case(self, what: str) -> dict[str, Any]:
        return {n: v for names, run in self.runs for n, v in zip(names, getattr(run, what), strict=True)}

    @property
    def log_dir(self) -> Path:
        return self.runs[0][1].log.parent

    def figures(self) -> dict[str, Any]:
        return {
            "ran": True,
            "library": "libGenie.so (onnxruntime-qnn, QAIRT 2.51) over the x86 HTP emulation",
            "chat_query": self.chat_query,
            "create_s": max(run.create_s for _, run in self.runs),
            "query_s": self.per_case("query_s"),
            "statuses": self.per_case("statuses"),
            "answers": self.per_case("answers"),
            "peak_rss_bytes": max(run.peak_rss_bytes for _, run in self.runs),
            "comparisons": [c.to_dict() for c in self.comparisons],
            "not_run": self.not_run,
            "own_sampler_prompt_tokens": self.own_sampler_prompt_tokens,
            # Where each compared case's ids come from: Genie's dumps, else its text re-tokenized.
            "ids_from_dumps": self.dumped_ids,
            "dumps_unread": self.dumps_unread,
        }


def long_prompt_ids(encode, bos: int, text: str, over: int) -> tuple[str, list[int]]:
    """`text` repeated until Genie's query (bos, then the text) is longer than `over` tokens."""
    words = text
    while len(encode(words)) + 1 <= over:
        words = f"{words} {text}"
    return words, [bos, *encode(words)]


def cut_prompt_ids(
    encode, decode, bos: int, text: str, longest: int, shortest: int
) -> tuple[str, list[int]] | None:
    """`text` repeated and cut so that Genie's query (bos, then the text) holds between `shortest` and
    `longest` ids: the longest such cut whose text re-tokenizes to exactly its ids (what Genie reads),
    or None when none does."""
    words, _ = long_prompt_ids(encode, bos, text, longest)
    ids = encode(words)
    for length in range(longest, max(2, shortest) - 1, -1):
        cut = decode(ids[: length - 1])
        if cut and encode(cut) == ids[: length - 1]:
            return cut, [bos, *ids[: length - 1]]
    return None


def crossing_prompt_ids(
    encode, decode, bos: int, text: str, window: int, new_tokens: int
) -> tuple[str, list[int]] | None:
    """The prompt cut (cut_prompt_ids) to end before the sliding window so that the greedy answer's
    decode steps cross it: the query's ids fill positions 0..L-1 and the answer's first new_tokens - 1
    ids are fed at L, L+1, ..., so L <= window - 1 and L + new_tokens - 2 >= window. None where no
    cut re-tokenizes exactly, or the answer is too short to cross (under 3 tokens)."""
    if window < 2 or new_tokens < 3:
        return None
    return cut_prompt_ids(encode, decode, bos, text, window - 1, window - new_tokens + 2)


def _checked(names: tuple[str, ...], run: DialogRun) -> tuple[tuple[str, ...], DialogRun]:
    """The run, or RealGenieError in Genie's own words when it could not load the bundle or a query
    ended with an error status (negative; a positive status is a warning, e.g. a full context)."""
    if run.create_status != 0:
        raise RealGenieError(
            f"the real Genie could not load the bundle (status {run.create_status}): {run.errors()} "
            f"(log: {run.log})"
        )
    for name, status in zip(names, run.statuses, strict=True):
        if status < 0:
            raise RealGenieError(
                f"the real Genie failed the {name!r} query with status {status}: {run.errors()} "
                f"(log: {run.log})"
            )
    return names, run


def run_cases(
    bundle_dir: Path,
    raw_prompt: str,
    chat_text: str,
    follow_up: str,
    chat_ids: list[int],
    encode,
    decode,
    bos: int,
    window: int,
    past_window: int,
    max_new_tokens: int,
    context_size: int,
    logs: Path,
    own_sampler_room: int | None = None,
    per_call_s: float | None = None,
    ar: int = 1,
) -> RealRuns:
    """Every case, in two dialogs (greedy, then the bundle's own sampler). The sampled reply has no
    token limit, so it runs to EOS or a full context: from the chat prompt, or where `own_sampler_room`
    is given (each call slow), from the raw prompt cut to end `own_sampler_room` to twice that many
    tokens short of `context_size`. `per_call_s` (the slow sizes: call_guard_s) lengthens each
    dialog's hang guard by that much for every call of AR-`ar` chunks and decode steps it may take."""
    long_text, long_ids = long_prompt_ids(encode, bos, raw_prompt, past_window)
    crossing = crossing_prompt_ids(encode, decode, bos, raw_prompt, window, max_new_tokens)
    # The second turn follows the token-limit reply in the same dialog, when both turns fit the context.
    second = len(chat_ids) + LIMIT_TOKENS + len(encode(follow_up)) + LIMIT_TOKENS < context_size
    greedy = [
        Query(chat_text, max_new_tokens, reset_before=True),
        Query(long_text, max_new_tokens, reset_before=True),
        *([Query(crossing[0], max_new_tokens, reset_before=True)] if crossing else []),
        Query(chat_text, LIMIT_TOKENS, reset_before=True),
        *([Query(follow_up, LIMIT_TOKENS)] if second else []),
    ]
    names = ("chat", "long", *(("crossing",) if crossing else ()), "token limit")
    names += ("second query",) if second else ()
    room = own_sampler_room or 0
    near_full = (
        cut_prompt_ids(encode, decode, bos, raw_prompt, context_size - room, context_size - 2 * room)
        if room
        else None
    )
    if own_sampler_room and near_full is None:
        raise RealGenieError(
            f"no cut of the prompt {raw_prompt!r} ending within {2 * own_sampler_room} tokens of "
            f"context.size {context_size} re-tokenizes exactly; try another VERIFY_PROMPT"
        )
    own = [Query(near_full[0] if near_full else chat_text, context_size, reset_before=True)]
    greedy_s = _dialog_timeout_s(
        [(len(encode(q.text)) + 1, q.max_new_tokens) for q in greedy], ar, per_call_s
    )
    own_s = _dialog_timeout_s(
        [(len(near_full[1]), 2 * room + 1) if near_full else (len(chat_ids), context_size)], ar, per_call_s
    )
    runs = [
        _checked(names, run_dialog(bundle_dir, greedy, logs / "genie-greedy.log", GREEDY, greedy_s)),
        _checked(("own sampler",), run_dialog(bundle_dir, own, logs / "genie-sampled.log", timeout_s=own_s)),
    ]
    not_run = {}
    if not second:
        not_run["second query"] = (
            f"chat prompt, {LIMIT_TOKENS}-token reply and follow-up overfill context.size {context_size}"
        )
    if not crossing:
        not_run["crossing"] = (
            f"no cut of the prompt ending within {max_new_tokens - 1} tokens of the {window}-token "
            "sliding window re-tokenizes exactly"
            if window >= 2 and max_new_tokens >= 3
            else f"no sliding window to cross in {max_new_tokens} tokens"
        )
    cases = [("chat", chat_ids), ("long", long_ids), *([("crossing", crossing[1])] if crossing else [])]
    return RealRuns(
        runs,
        cases,
        chat_text,
        max_new_tokens,
        not_run=not_run,
        own_sampler_prompt_tokens=len(near_full[1]) if near_full else None,
    )


def run_short(bundle_dir: Path, chat_text: str, chat_ids: list[int], new_tokens: int, logs: Path) -> RealRuns:
    """The chat prompt alone, greedy, a few tokens: what fits verify's budget at E2B geometry, where each
    call of the x86 HTP emulation takes minutes. Its ids are read from Genie's own dumps (dumps.py):
    random weights answer in tokens whose text is empty."""
    query = [Query(chat_text, new_tokens, reset_before=True)]
    dumps = logs / "genie-dumps"
    shutil.rmtree(dumps, ignore_errors=True)
    try:
        run = run_dialog(
            bundle_dir, query, logs / "genie-greedy.log", GREEDY, SHORT_TIMEOUT_S, dump_dir=dumps
        )
        run = _checked(("chat",), run)
        try:
            dumped, unread = {"chat": bundle_greedy_ids(dumps, run[1].log, bundle_dir)}, {}
        except DumpError as e:
            dumped, unread = {}, {"chat": str(e)}
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    why = (
        f"at this bundle's size each call of the x86 HTP emulation is slow (the chat query: "
        f"{run[1].query_s[0]:.0f} s for {new_tokens} tokens), so verify runs the chat prompt alone; "
        "VERIFY_REAL_GENIE=full runs every case"
    )
    skipped = {case: why for case in ("long", "crossing", "token limit", "second query", "own sampler")}
    return RealRuns(
        [run],
        [("chat", chat_ids)],
        chat_text,
        new_tokens,
        not_run=skipped,
        dumped_ids=dumped,
        dumps_unread=unread,
    )


PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not checked"


@dataclass(frozen=True)
class Comparison:
    """One real-Genie answer against its reference, in token ids: the first `asked` ids must be equal;
    with nothing to compare (`asked` 0) the verdict is NOT_CHECKED, which is never a pass."""

    case: str
    against: str  # who gave the reference, or what the reply is held to
    asked: int  # ids that must agree (the token limit: the most the reply may hold)
    agreed: int  # leading ids that do agree (the token limit: the ids the reply holds)
    verdict: str
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many ids the two sequences share from the first."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_ids(
    case: str,
    against: str,
    got: list[int],
    want: list[int],
    min_tokens: int,
    new_tokens: int,
    margins: list[float] | None = None,
    near_tie: float = 0.0,
) -> Comparison:
    """Genie's greedy ids against the reference's (stop tokens already left out of both): the first
    min(min_tokens, new_tokens, len(want)) must be equal, unless they part where `margins` (one per
    reference id: the top-2 margin of a pick the runtime's arithmetic may swap, infinite where none
    may) is within `near_tie` (measured by the caller): a near-tie, named with its margin. `agreed`
    counts all the equal leading ids."""
    asked = min(min_tokens, new_tokens, len(want))
    if asked == 0:
        why = (
            "no tokens asked (VERIFY_MIN_PREFIX=0)"
            if min_tokens <= 0
            else "no tokens asked of Genie"
            if new_tokens <= 0
            else f"the answer of {against} is empty"
        )
        return Comparison(case, against, 0, 0, NOT_CHECKED, why)
    agreed = leading_agreement(got, want)
    if agreed >= asked:
        return Comparison(case, against, asked, agreed, PASSED)
    margin = margins[agreed] if margins is not None and agreed < len(margins) else float("inf")
    where = f"parted at token {agreed}, where the top-2 margin on the same graphs is {margin:.4f}"
    if margin <= near_tie:
        return Comparison(case, against, asked, agreed, PASSED, f"{where} <= {near_tie:.4f}: a near-tie")
    return Comparison(case, against, asked, agreed, FAILED, where if margins is not None else "")


RUNTIME_REFERENCE = "the emulator on the same graphs"


def top2_margins(rows) -> list[float]:
    """Each logits row's top-1 minus top-2: how far the pick was from a tie."""
    import numpy as np

    return [float(np.diff(np.sort(np.asarray(row, dtype=np.float64))[-2:])[0]) for row in rows]


def compare_runtime(
    case: str, got: list[int], want: list[int], margins: list[float], near_tie: float
) -> Comparison:
    """Genie's greedy ids against the emulator's on the same graphs (stop tokens left out of both), over
    the whole answer: the runtime question, whatever quantization did to the answer. They may part only
    at a near-tie: where the emulator's top-1 and top-2 logits were within `near_tie` (what the two
    arithmetics move a logit, measured by the caller), and the comparison names where and by how much."""
    if not want:
        return Comparison(case, RUNTIME_REFERENCE, 0, 0, NOT_CHECKED, "the emulator's answer is empty")
    agreed = leading_agreement(got, want)
    if agreed == len(want) == len(got):
        return Comparison(case, RUNTIME_REFERENCE, len(want), agreed, PASSED)
    margin = margins[agreed] if agreed < len(margins) else float("inf")
    where = f"parted at token {agreed}, where the emulator's top-2 margin is {margin:.4f}"
    if margin <= near_tie:
        return Comparison(
            case, RUNTIME_REFERENCE, len(want), agreed, PASSED, f"{where} <= {near_tie:.4f}: a near-tie"
        )
    return Comparison(case, RUNTIME_REFERENCE, len(want), agreed, FAILED, f"{where} > {near_tie:.4f}")


LOSSY = (
    "the reference's ids do not survive decoding (special or empty tokens) and its text equals Genie's: "
    "the ids cannot be told apart from text"
)


def _lossy(want: list[int], answer: str, encode, decode) -> bool:
    """The reference's ids decode to exactly Genie's text but do not come back from it: Genie's text
    answer cannot say whether its ids were the same (with different text, they were not)."""
    text = decode(want)
    return text == answer and encode(text) != want


def exact_ids(text: str, encode, decode) -> list[int] | None:
    """`text` re-tokenized, where that is exact (decoding the ids gives the text back), else None."""
    ids = encode(text)
    return ids if decode(ids) == text else None


def _token_limit(answer: str, encode, decode) -> tuple[Comparison, str | None]:
    """The token-limit reply re-tokenized exactly: at most LIMIT_TOKENS ids. (the comparison, the
    problem or None)."""
    against = f"its limit of {LIMIT_TOKENS} tokens"
    ids = exact_ids(answer, encode, decode)
    if ids is None:
        return Comparison(
            "token limit", against, 0, 0, NOT_CHECKED, "the reply does not re-tokenize exactly"
        ), None
    counted = f"{len(ids)} tokens"
    if len(ids) > LIMIT_TOKENS:
        problem = f"the real Genie answered {answer!r} ({counted}) past its token limit of {LIMIT_TOKENS}"
        return Comparison("token limit", against, LIMIT_TOKENS, len(ids), FAILED, counted), problem
    return Comparison("token limit", against, LIMIT_TOKENS, len(ids), PASSED, counted), None


def compare(
    runs: RealRuns,
    wants: dict[str, tuple[str, list[int]]],
    stop_ids: set[int],
    decode,
    encode,
    min_tokens: int,
    runtime: dict[str, tuple[list[int], list[float]]] | None = None,
    near_tie: float = 0.0,
    quality_near_tie: float = 0.0,
) -> tuple[list[str], list[Comparison]]:
    """Shortfalls of the real Genie's greedy answers, and each comparison made, on two questions:
    quality, against `wants` (case -> who answered, its greedy ids and, optionally, the margins of the
    picks the runtime may swap: transformers on the chat prompt; the first min(min_tokens, the
    answers' limit, the reference's length) must be equal, parting only at such a pick within
    `quality_near_tie`: `compare_ids`), and runtime
    fidelity, against `runtime` (case -> the emulator's greedy ids and top-2 margins on the same graphs;
    the whole answer, parting only at a near-tie: `compare_runtime`). Stop tokens are left out; Genie's
    ids are its answer re-tokenized, only where that is exact (`exact_ids`). The token-limit reply must
    be no more than LIMIT_TOKENS ids; every other reply must be text."""
    problems: list[str] = []
    done: list[Comparison] = []
    answers = runs.per_case("answers")
    runtime = runtime or {}
    got_ids = {
        case: runs.dumped_ids[case] if case in runs.dumped_ids else exact_ids(answers[case], encode, decode)
        for case in {*wants, *runtime}
        if case in answers
    }
    for case, (who, want, *margins) in wants.items():
        got = got_ids[case]
        if got is None:
            c = Comparison(case, who, 0, 0, NOT_CHECKED, "Genie's answer does not re-tokenize exactly")
        elif case not in runs.dumped_ids and _lossy(want, answers[case], encode, decode):
            c = Comparison(case, who, 0, 0, NOT_CHECKED, LOSSY)
        else:
            kept = [t for t in got if t not in stop_ids]
            c = compare_ids(
                case,
                who,
                kept,
                want,
                min_tokens,
                runs.new_tokens,
                margins=margins[0] if margins else None,
                near_tie=quality_near_tie,
            )
        done.append(c)
        if c.verdict == FAILED:
            problems.append(
                f"the real Genie's greedy ids for the {case!r} prompt differ from those of {who} at token "
                f"{c.agreed} (the first {c.asked} must agree{'; ' + c.why if c.why else ''}): "
                f"Genie {answers[case][:60]!r}, {who} {decode(want)[:60]!r}"
            )
    for case, (want, margins) in runtime.items():
        # Genie answered at most runs.new_tokens ids (at E2B size only a few): compare those.
        want, margins = want[: runs.new_tokens], margins[: runs.new_tokens]
        got = got_ids.get(case)
        if got is None:
            c = Comparison(
                case, RUNTIME_REFERENCE, 0, 0, NOT_CHECKED, "Genie's answer does not re-tokenize exactly"
            )
        elif case not in runs.dumped_ids and _lossy(want, answers[case], encode, decode):
            c = Comparison(case, RUNTIME_REFERENCE, 0, 0, NOT_CHECKED, LOSSY)
        else:
            c = compare_runtime(case, [t for t in got if t not in stop_ids], want, margins, near_tie)
        done.append(c)
        if c.verdict == FAILED:
            problems.append(
                f"the real Genie's greedy ids for the {case!r} prompt part from the emulator's on the same "
                f"graphs ({c.why}): Genie {answers[case][:60]!r}, the emulator {decode(want)[:60]!r}"
            )
    if "token limit" in answers:
        c, problem = _token_limit(answers["token limit"], encode, decode)
        done.append(c)
        problems += [problem] if problem else []
    for case in ("second query", "own sampler"):
        if case in answers and not answers[case]:
            problems.append(f"the real Genie gave no answer to the {case!r} query")
    if "own sampler" in answers:
        status = runs.per_case("statuses")["own sampler"]
        done.append(_own_sampler_end(status, answers["own sampler"], encode, runs.own_sampler_prompt_tokens))
    return problems, done


def _own_sampler_end(status: int, answer: str, encode, prompt_tokens: int | None = None) -> Comparison:
    """The sampled reply, with no token limit, must end by itself: at an EOS token (status 0) or at a
    full context (Genie's clean stop, a positive warning status). Its tokens are sampled, so nothing is
    compared with a reference; how it ended is what is checked. `prompt_tokens`: the length of a prompt
    cut to end near a full context, named in the verdict (None: the chat prompt)."""
    n = len(encode(answer))
    if not answer:
        return Comparison("own sampler", "its own end", 1, 0, FAILED, "no answer")
    how = "an EOS token (status 0)" if status == 0 else f"a full context (status {status})"
    after = f" after a {prompt_tokens}-token prompt" if prompt_tokens else ""
    return Comparison("own sampler", "its own end", 1, 1, PASSED, f"{n} ids{after}, ended by {how}")


__all__ = ["Comparison", "RealGenieError", "RealRuns", "compare", "run_cases", "run_short"]
