"""What Genie's runtime refuses, worded once for every module that checks it (the layout check before
export, the emulator while it runs the bundle). Stdlib only."""

from __future__ import annotations

from collections.abc import Iterable


def window_overflow(prefix: str, step: int, slots: int, evictable: int) -> str:
    """Why Genie cannot take a step of `step` tokens into a sliding-window cache group of `slots`
    past slots holding `evictable` entries it may evict; the emulator and the layout check say it
    alike."""
    return (
        f"cache group {prefix!r}: a step of {step} tokens overflows its {slots}-slot window by more than "
        f"the {evictable} entries it can evict (Genie's SlidingWindow::processUpdate pops an empty "
        "recency queue): use a prefill AR smaller than the window"
    )


def window_not_written(prefix: str, ar: int, slots: int) -> str:
    """Why a graph of `ar` tokens cannot read a sliding-window cache group of `slots` past slots.

    Measured on QAIRT 2.51's libGenie.so (x86, HTP emulation; docs/facts.md §3): when any graph's AR
    is as wide as the window (its `swa_*_in` and `swa_*_out` hold as many entries), Genie logs every
    KV$ copy into the group but the group's inputs keep their clear value, at every later call and
    for every graph kind, so each sliding layer attends to nothing and the answer is wrong from the
    second token. The tiny model (window 8) answers as transformers does at AR-7 and AR-4, not at AR-8.
    """
    return (
        f"cache group {prefix!r}: a graph of {ar} tokens is as wide as the {slots}-slot window or wider; "
        "Genie 2.51 then never writes the group's cache (measured): use a prefill AR smaller than the "
        "window"
    )


def dialog_context_size(past_entries: Iterable[int]) -> int:
    """genie_config.json's context.size for graph kinds whose full-attention caches hold these past
    entries each (a graph of AR t at context C holds C - t: `stages.model.contract.cache_slots`).

    Genie checks context.size only before a query and between decode steps, never against the past
    of the graph it runs; so the size is the smallest past. Measured on QAIRT 2.51's libGenie.so (x86,
    HTP emulation, tiny bundles at C 128; docs/facts.md §3 (c)): one kind at AR-4 (124 past entries),
    size 124 ends a full reply with a warning status and "Context limit exceeded (124 + 1 > 124)",
    the reply intact; 125 and 127 fail the query (status -6, "KV update count exceeds the total
    processed inputs": the AR-4 graph has no slot for the 125th entry). AR-4 prefill with AR-1 decode
    at 127: a second query bringing the dialog from 120 to 126 ran through the AR-4 graph past its 124
    entries with no error at all; at 124 Genie refuses it with "Context limit exceeded". With AR-1
    graphs alone, C - 1 stops cleanly and C fails."""
    return min(past_entries)


# Genie's basic sampler (qualla samplers/basic-sampler.cpp, BasicSampler::BasicSampler): the keys it
# reads and the defaults it takes when one is absent.
SAMPLER_DEFAULTS = {"temp": 0.1, "top-k": 0, "top-p": 0.8}


def sampler_is_greedy(sampler: dict) -> bool:
    """BasicSampler's rule: greedy (the first largest logit) when temp <= 0 or top-k == 1; otherwise
    it samples after top-k (0: the whole vocabulary), top-p and the temperature."""
    temp = sampler.get("temp", SAMPLER_DEFAULTS["temp"])
    return temp <= 0 or sampler.get("top-k", SAMPLER_DEFAULTS["top-k"]) == 1


def sampler_problems(sampler: dict, n_vocab: int) -> list[str]:
    """What Genie refuses in genie_config.json's sampler, one line per field: the ranges QAIRT 2.51's
    libGenie.so schema enforces (temp >= 0, top-k >= 0, 0 <= top-p <= 1; checked against it), an
    integer seed (-1: seeded from the clock, so no run repeats), and a top-k no larger than the
    vocabulary it picks from."""
    problems = []

    def number(key: str, integer: bool = False) -> float | None:
        value = sampler.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            problems.append(f"sampler.{key} is {value!r}, not {'an integer' if integer else 'a number'}")
            return None
        return value

    seed, temp = number("seed", integer=True), number("temp")
    top_k, top_p = number("top-k", integer=True), number("top-p")
    if seed is not None and seed < -1:
        problems.append(f"sampler.seed is {seed}; Genie takes -1 (clock) or a seed >= 0")
    if temp is not None and temp < 0:
        problems.append(f"sampler.temp is {temp}; Genie's schema needs temp >= 0 (0: greedy)")
    if top_k is not None and not 0 <= top_k <= n_vocab:
        problems.append(f"sampler.top-k is {top_k}; Genie takes 0 (all) to n-vocab {n_vocab} (1: greedy)")
    if top_p is not None and not 0 <= top_p <= 1:
        problems.append(f"sampler.top-p is {top_p}; Genie's schema needs 0 <= top-p <= 1")
    return problems


# How Genie runs each layout (qualla KVCache/kvmanager.cpp prepareInferenceStrategy: it picks the
# smallest AR >= the tokens to process, else the largest, and pads the last chunk on that graph).
SEPARATE_KINDS = "prompt in AR-{p} chunks (last one padded), each new token through AR-{d}"
ONE_KIND_SMALL = (
    "every prompt token is its own AR-{d} call: time to first token = prompt length / decode rate"
)
ONE_KIND_LARGE = (
    "prompt in AR-{p} chunks; each new token is an AR-{p} call with 1 of {p} rows used ({p}x the "
    "compute per decoded token)"
)


def layout_behaviour(prefill_ar: int, decode_ar: int) -> str:
    """How Genie runs prefill and decode graphs of these ARs (one graph kind where they are equal)."""
    if prefill_ar != decode_ar:
        how = SEPARATE_KINDS
    else:
        how = ONE_KIND_SMALL if prefill_ar == 1 else ONE_KIND_LARGE
    return how.format(p=prefill_ar, d=decode_ar)


# ---- the host LUTs (genie_config.json's dialog sections that name a LUT file) ----
# The dialog section of each LUT, by the export report's key (stages.model.contract.LUT_INPUTS).
LUT_SECTION = {"embedding": "embedding", "per_layer_embedding": "perlayer-embedding"}
# LUT entry datatypes Genie reads, by bits (4: two entries per byte; stages.model.encoding.LutFile).
LUT_DATATYPES = {4: "ufixed4", 8: "ufixed8", 16: "ufixed16"}
# Genie reads a LUT's size as uint32: the largest LUT file it can take.
LUT_LIMIT_BYTES = 2**32 - 1


def lut_problems(lut_bytes: dict[str, int]) -> list[str]:
    """The LUTs (export report key -> bytes) Genie cannot load, one line each: the plan says it
    before anything is built, the bundle checks the files it writes."""
    return [
        f"{name} LUT is {size / 2**30:.2f} GiB, over Genie's 4 GiB LUT limit (uint32 sizes); "
        "use ple_lut_bits=8"
        for name, size in lut_bytes.items()
        if size > LUT_LIMIT_BYTES
    ]


def swamask_path(dialog: dict) -> bool:
    """Whether QAIRT 2.51's libGenie.so runs this dialog's caches on its `SWAMASK` path (its log prints
    `SWAMASK` lines): measured, it does so exactly when the dialog has no perlayer-embedding LUT (a
    Gemma 3, or a Gemma 4 built without per-layer embeddings). Two things break there (docs/facts.md
    §3 (l)): the sliding-window mask (`sliding_mask_problems`), and a query after GenieDialog_reset
    that follows a wrapped window (`runInference(req): setupInput failed` with two parts, `graph-exec
    failed` with one, status -1, or the process dies on a null buffer, exit -11; without the reset, or
    with the LUT, it runs; intermittent: some runs pass). Both are reproduced by
    tests/integration/test_gemma3.py."""
    return LUT_SECTION["per_layer_embedding"] not in dialog


def sliding_mask_problems(dialog: dict) -> list[str]:
    """Why Genie would run a sliding-window cache group of this dialog wrongly (empty: it would not).

    On the SWAMASK path Genie fills a sliding-window group's attention mask by token index: a query's
    own tokens are marked visible at cache columns n_past, n_past + 1, ... instead of at the graph's
    new-token columns (window, window + 1, ...), so every sliding-window layer attends to empty cache
    slots and never to the tokens it is given. Measured on Gemma 3 270M's bundle (a prompt of 8
    tokens: row r visible at columns 0..r, where the graph's own rows sit at 512..512 + r; with
    Genie's dumped feeds the host runner answers Genie's garbage, with that one mask replaced it
    answers as transformers does), held by tests/integration/test_gemma3.py on a toy. Export therefore
    never builds that layout (`stages.model.contract.window_cache`: such a model's sliding layers live
    in the full-attention group, the window applied in the graph); this guards configs and graphs from
    elsewhere."""
    if not swamask_path(dialog):
        return []
    groups = dialog.get("engine", {}).get("cache-groups", [])
    sliding = [g["prefix"] for g in groups if g.get("longcontext", {}).get("type") == "sliding-window"]
    return [
        f"Genie 2.51 masks the sliding-window cache group {prefix!r} of a dialog without a "
        "perlayer-embedding LUT by token index (a query's own tokens at cache columns, not at the graph's "
        "new-token columns): every sliding-window layer would attend to empty slots and the bundle would "
        "answer garbage on the phone (docs/facts.md §3 (l)). Export puts the sliding layers of a model "
        "without per-layer embeddings in the full-attention group: run `make export` again (these graphs "
        "come from another layout)"
        for prefix in sliding
    ]


def context_length_problems(io: dict[str, dict[str, dict]], mask: str) -> list[str]:
    """Graphs Genie cannot size: QAIRT 2.51's libGenie.so reads a graph's context length from its
    full-attention mask; a graph without one (a part of sliding layers alone, in the window-cache
    layout) fails the load ("Couldn't determine context length from tensors. Attempting to parse
    context length from graph name", then `stoi: out of range`, status -1). Measured on E2B at
    PRECISION=w4a16 (2026-12-07), whose split then put layers 0-3 alone in part 1. `mask`: the
    full-attention mask's name (the contract's)."""
    return [
        f"graph {graph} takes no {mask}: QAIRT 2.51's Genie cannot tell its context length and refuses "
        "the bundle (docs/facts.md §3 (m)); every part needs a full-attention layer: choose NUM_SHARDS so "
        "that each part can hold one"
        for graph, g in io.items()
        if mask not in g["inputs"]
    ]
