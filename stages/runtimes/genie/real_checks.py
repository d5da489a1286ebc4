"""Verify's first check: the bundle under the real Genie (real.py), on the cases a phone meets.

- `chat`: the prompt through the bundle's chat template, exactly as `make run` sends it, greedy;
- `long`: the raw prompt repeated past one prefill chunk and the sliding window, greedy (its answer
  crosses the window when the reply is longer than the window);
- `token limit`: GenieDialog_setMaxNumTokens stops the reply (no error status, no more tokens);
- `second query`: a short second chat turn in the same dialog, after the token-limit reply (left out,
  and absent from the report, when the two turns do not fit the context);
- `own sampler`: the bundle's own sampler config with no token limit, so the reply ends at EOS or at
  a full context: a clean stop (status >= 0: Genie's context warning is not an error).

The greedy answers are compared afterwards (compare()): the chat answer with transformers' greedy
continuation, the long one with the emulator's on the same binaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.runtimes.genie.real import GREEDY, DialogRun, Query, RealGenieError, run_dialog

# Tokens of the short reply the token-limit case asks for.
LIMIT_TOKENS = 3
# run_short's bound: at E2B the x86 HTP emulation reads 120-350 s per GB of weights (docs/verification.md),
# so a prefill call and a decode step over ~5 GB of binaries may take up to an hour.
SHORT_TIMEOUT_S = 3 * 3600


@dataclass
class RealRuns:
    """The real Genie's runs of one verify, and the prompts transformers must answer too."""

    runs: list[tuple[tuple[str, ...], DialogRun]]  # (its queries' case names, the dialog)
    greedy_cases: list[tuple[str, list[int]]]  # (case, prompt ids) compared with transformers
    chat_query: str  # the text GenieDialog_query got: `make run`'s (prompt.query_text)
    new_tokens: int  # the greedy answers' token limit

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
        }


def long_prompt_ids(encode, bos: int, text: str, over: int) -> tuple[str, list[int]]:
    """`text` repeated until Genie's query (bos, then the text) is longer than `over` tokens."""
    words = text
    while len(encode(words)) + 1 <= over:
        words = f"{words} {text}"
    return words, [bos, *encode(words)]


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
    bos: int,
    past_window: int,
    max_new_tokens: int,
    context_size: int,
    logs: Path,
) -> RealRuns:
    """Every case, in two dialogs (greedy, then the bundle's own sampler)."""
    long_text, long_ids = long_prompt_ids(encode, bos, raw_prompt, past_window)
    # The second turn follows the token-limit reply in the same dialog, when both turns fit the context.
    second = len(chat_ids) + LIMIT_TOKENS + len(encode(follow_up)) + LIMIT_TOKENS < context_size
    greedy = [
        Query(chat_text, max_new_tokens, reset_before=True),
        Query(long_text, max_new_tokens, reset_before=True),
        Query(chat_text, LIMIT_TOKENS, reset_before=True),
        *([Query(follow_up, LIMIT_TOKENS)] if second else []),
    ]
    names = ("chat", "long", "token limit", *(("second query",) if second else ()))
    own = [Query(chat_text, context_size, reset_before=True)]
    runs = [
        _checked(names, run_dialog(bundle_dir, greedy, logs / "genie-greedy.log", sampler=GREEDY)),
        _checked(("own sampler",), run_dialog(bundle_dir, own, logs / "genie-sampled.log")),
    ]
    return RealRuns(runs, [("chat", chat_ids), ("long", long_ids)], chat_text, max_new_tokens)


def run_short(bundle_dir: Path, chat_text: str, chat_ids: list[int], new_tokens: int, logs: Path) -> RealRuns:
    """The chat prompt alone, greedy, a few tokens: what fits verify's budget at E2B geometry, where each
    call of the x86 HTP emulation takes minutes. It loads the bundle and times a query."""
    query = [Query(chat_text, new_tokens, reset_before=True)]
    run = run_dialog(bundle_dir, query, logs / "genie-greedy.log", sampler=GREEDY, timeout_s=SHORT_TIMEOUT_S)
    run = _checked(("chat",), run)
    return RealRuns([run], [("chat", chat_ids)], chat_text, new_tokens)


def compare(
    runs: RealRuns, wants: dict[str, tuple[str, list[int]]], decode, encode, min_prefix: int
) -> list[str]:
    """Shortfalls of the real Genie's greedy answers against `wants`: per case, who answered and its
    greedy tokens (stop token excluded): transformers on the chat prompt (the quality bar), the
    emulator on the same binaries for the long one (the runtime bar: past the window, the two must
    agree whatever quantization did to the answer). Each answer must start with the first
    `min_prefix` tokens (at most the answers' own limit), decoded; the token-limit reply must hold
    no more tokens than asked; every other reply must be text."""
    problems = []
    answers = runs.per_case("answers")
    min_prefix = min(min_prefix, runs.new_tokens)
    for case, (who, tokens) in wants.items():
        want = decode(tokens[:min_prefix])
        if not answers[case].startswith(want):
            problems.append(
                f"the real Genie answers the {case!r} prompt {answers[case][:60]!r}, {who} "
                f"{decode(tokens)[:60]!r} (first {min(min_prefix, len(tokens))} tokens must agree)"
            )
    if "token limit" in answers and len(encode(answers["token limit"])) > LIMIT_TOKENS:
        problems.append(
            f"the real Genie answered {answers['token limit']!r} past its token limit of {LIMIT_TOKENS}"
        )
    for case in ("second query", "own sampler"):
        if case in answers and not answers[case]:
            problems.append(f"the real Genie gave no answer to the {case!r} query")
    return problems


__all__ = ["RealGenieError", "RealRuns", "compare", "run_cases", "run_short"]
