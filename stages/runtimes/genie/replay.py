"""Replay: the bundle's own ctx-bins on the HTP emulation, fed exactly what the CPU engine was fed.

At E2B size the HTP emulation runs about 120-350 s per GB of weights read (docs/verification.md),
so a whole Genie run on it (about 160 graph calls) takes hours. verify's `replay` engine therefore
runs Genie's dialog on the CPU engine (each binary's compiler input) and keeps the raw feeds and
outputs of a few chosen calls; each kept call then runs again through the very ctx-bins the phone
loads, on the HTP emulation, and every output is compared with the CPU engine's.

Which calls (`ReplayPlan`), in this order:
- required, whatever the time: the first call of every graph kind (AR) the run used, so that every
  ctx-bin of the bundle executes at least once (a prefill chunk; a decode step where decode has its
  own binaries);
- then, while the time budget lasts: the first call that wraps a sliding-window cache group (its
  window full, the oldest slots overwritten, the mask gathered around them), then decode steps.

Each output is compared on the rows Genie reads (`valid_rows`; a padded row is nobody's) and
relative to itself, so an 8-bit KV cache and 16-bit logits are judged alike: its SQNR (signal: the
CPU engine's output about its mean; noise: the difference), and its largest difference as a fraction
of its span. The logits rows also compare their top-1. Each part is fed the CPU engine's inputs, so a
part's error shows in its own outputs, not the next part's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.model.contract import KVSHARE_PREFIX, LOGITS
from stages.runtimes.genie.emulator import GenieEmulator, Graph, HtpEngine, RecordedCall

# A binary that computes what its compiler input computes differs from it by the compiler's own
# rounding: on the tiny w8a16 bundle every output of every replayed call is within 31.7 dB SQNR or
# better (the worst: a KV entry), and within 2.1% of its span at any one value. A compiler input
# changed after compiling (one MLP down projection's scales times 4) drops its part's outputs to
# 15.5-25.6 dB. The SQNR floor sits between the two; the span check catches a few values gone wrong
# that leave the power alone.
MIN_SQNR_DB = 23.0
# On real weights the compiler's rounding is as coarse as the quantization itself: Gemma 3 270M's
# w8a16 ctx-bins put the deepest sliding layers' 8-bit V entries 11.4-14.2 dB from their compiler
# inputs, where those inputs are 15.8-17.7 dB from the float graphs (quantize's held-out SQNR), while
# the logits stay at 34-42 dB and pick the same tokens. So an output whose quantization is noisier
# than the floor is held to its own quantization SQNR less this margin instead (270M's worst: 5.0 dB
# under it). The tiny model's outputs are 36-42 dB from float: its floors stay at MIN_SQNR_DB.
QUANTIZATION_MARGIN_DB = 10.0
MAX_SPAN_FRACTION = 0.15
# Greedy picks of the replayed logits rows against the CPU engine's (a runtime check, as
# verify's OWN_GRAPHS_MIN_TOP1).
MIN_LOGITS_TOP1 = 0.9
# Decode steps kept for the replay after the required calls and the window wrap.
DECODE_STEPS = 2
# verify's own bound, the real Genie's minutes apart (issue 23: 20 minutes on 2 cores); the optional
# calls replay while the time spent plus the last call's time stays under it, less a minute for the
# report.
VERIFY_BOUND_S = 20 * 60
REPORT_MARGIN_S = 60


def replay_budget_s(spent_s: float) -> float:
    """Seconds left for the replay's optional calls after spent_s of verify."""
    return max(0.0, VERIFY_BOUND_S - REPORT_MARGIN_S - spent_s)


@dataclass
class ReplayPlan:
    """Chooses the calls to keep while the CPU engine runs (GenieEmulator.record)."""

    decode_steps: int = DECODE_STEPS
    seen_ar: set[int] = field(default_factory=set)
    wrapped: bool = False
    decodes: int = 0

    def __call__(self, step: dict[str, Any]) -> bool:
        label = self.label(step)
        if label is not None:
            step["replay"] = label
        return label is not None

    def label(self, step: dict[str, Any]) -> str | None:
        if step["ar"] not in self.seen_ar:
            self.seen_ar.add(step["ar"])
            return FIRST
        if step["wraps"] and not self.wrapped:
            self.wrapped = True
            return WRAP
        if step["n_process"] == 1 and self.decodes < self.decode_steps:
            self.decodes += 1
            return DECODE
        return None


FIRST, WRAP, DECODE = "first call of its graph kind", "window wrap", "decode step"
PRIORITY = (FIRST, WRAP, DECODE)


def required(call: RecordedCall) -> bool:
    return call.step.get("replay") == FIRST


def valid_rows(name: str, x: np.ndarray, n: int, ar: int) -> np.ndarray:
    """What Genie reads of output `name` after a call of n tokens on an AR-`ar` graph: the rows of the
    n tokens (a cache's new entries, the hand-over, the logits); a kvshare hand-over keeps its past
    slots too. The padded rows are left out: nothing reads them, and a fully masked row's softmax is
    each engine's own (on Gemma 3 270M they differ by up to half the span; the valid rows by 9 %)."""
    pad = ar - n
    if name.startswith(KVSHARE_PREFIX):  # past slots then the AR new ones; the padded ones last
        if "_key_" in name:
            return x[..., : x.shape[-1] - pad]
        return x[..., : x.shape[-2] - pad, :]
    if "_key_" in name:  # (1, heads, head_dim, AR)
        return x[..., :n]
    if "_value_" in name:  # (1, heads, AR, head_dim)
        return x[..., :n, :]
    return x[:, :n]  # (1, AR, ...): hidden states, per-layer embeddings, logits


def sqnr_floor(quantization_db: float | None) -> float:
    """The SQNR an output must keep against its compiler input's: MIN_SQNR_DB, or less for an output
    the quantization itself leaves noisier (its held-out SQNR against float less
    QUANTIZATION_MARGIN_DB)."""
    if quantization_db is None:
        return MIN_SQNR_DB
    return round(min(MIN_SQNR_DB, quantization_db - QUANTIZATION_MARGIN_DB), 2)


def compare_output(graph: Graph, name: str, got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """One output of one binary against its compiler input's: SQNR (the CPU engine's output power
    about its mean over the power of the difference, dB), the largest difference in LSB and as a
    fraction of the output's span."""
    enc = graph.outputs[name].encoding
    want64 = want.astype(np.float64)
    diff = np.abs(got.astype(np.float64) - want64)
    noise = float(np.mean(diff**2))
    signal = float(np.mean((want64 - want64.mean()) ** 2))
    span = float(want64.max() - want64.min())
    return {
        "tensor": name,
        "sqnr_db": round(10 * math.log10(signal / noise), 2)
        if noise and signal
        else (math.inf if not noise else 0.0),
        "max_lsb": float(diff.max()) if enc.is_fixed else None,
        "max_abs": float(diff.max()) * (enc.scale if enc.is_fixed else 1.0),
        "span_fraction": round(float(diff.max()) / span, 5) if span else float(diff.max() > 0),
    }


@dataclass
class ReplayResult:
    calls: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    binaries: list[str]
    seconds: float
    problems: list[str]

    @property
    def logits_max_abs(self) -> float:
        """The largest difference of a replayed logit from the CPU engine's (in logits): what the
        HTP's arithmetic moves a logit."""
        rows = [c["logits_output"] for c in self.calls if c["logits_output"] is not None]
        return max((r["max_abs"] for r in rows), default=0.0)

    def figures(self) -> dict[str, Any]:
        return {
            "what": "calls of the CPU engine's Genie run replayed through the bundle's ctx-bins on the HTP "
            "emulation with the same raw inputs, every output compared",
            "calls": self.calls,
            "skipped_for_time": self.skipped,
            "binaries_executed": self.binaries,
            "seconds": round(self.seconds, 1),
            "thresholds": {
                "min_sqnr_db": MIN_SQNR_DB,
                "quantization_margin_db": QUANTIZATION_MARGIN_DB,
                "max_span_fraction": MAX_SPAN_FRACTION,
                "min_logits_top1": MIN_LOGITS_TOP1,
            },
        }


def replay(
    bundle_dir: Path,
    emulator: GenieEmulator,
    recorded: list[RecordedCall],
    budget_s: float,
    quantization_sqnr_db: dict[str, dict[str, float]] | None = None,
) -> ReplayResult:
    """Run the recorded calls through the ctx-bins on the HTP emulation (required ones always, the
    others while budget_s lasts) and compare every output with the CPU engine's, each held to its
    `sqnr_floor` (`quantization_sqnr_db`: quantize's held-out SQNR by graph and tensor)."""
    from stages.core.progress import tqdm

    htp = HtpEngine(bundle_dir, *emulator.htp_device())
    calls: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    problems: list[str] = []
    executed: list[str] = []
    t0 = time.perf_counter()
    order = sorted(recorded, key=lambda c: PRIORITY.index(c.step["replay"]))
    with tqdm(
        total=sum(len(c.runs) for c in order), desc="replay on the HTP emulation", unit="graph", leave=False
    ) as bar:
        for call in order:
            spent = time.perf_counter() - t0
            if not required(call) and calls and spent + calls[-1]["seconds"] > budget_s:
                skipped.append({k: call.step[k] for k in ("index", "ar", "n_process", "n_past", "replay")})
                bar.update(len(call.runs))
                continue
            start = time.perf_counter()
            rows = []
            for graph, feeds, want in call.runs:
                got = htp.run(graph, feeds)
                if graph.file not in executed:
                    executed.append(graph.file)
                n, ar = call.step["n_process"], call.step["ar"]
                quantized = (quantization_sqnr_db or {}).get(graph.name, {})
                for name in graph.outputs:
                    mine, theirs = (valid_rows(name, x[name], n, ar) for x in (got, want))
                    row = {"binary": graph.file, **compare_output(graph, name, mine, theirs)}
                    rows.append(row | {"min_sqnr_db": sqnr_floor(quantized.get(name))})
                    if name == LOGITS:
                        rows[-1]["top1"] = float((mine[0].argmax(-1) == theirs[0].argmax(-1)).mean())
                bar.update()
            worst = min(rows, key=lambda r: r["sqnr_db"] - r["min_sqnr_db"])
            logits = next((r for r in rows if "top1" in r), None)
            calls.append(
                {
                    **{k: call.step[k] for k in ("index", "ar", "n_process", "n_past", "wraps", "replay")},
                    "seconds": round(time.perf_counter() - start, 1),
                    "outputs": len(rows),
                    "worst": worst,
                    "logits_output": logits,
                }
            )
            where = f"call {call.step['index']} ({call.step['replay']}, AR-{call.step['ar']})"
            if worst["sqnr_db"] < worst["min_sqnr_db"]:
                problems.append(
                    f"{where}: {worst['binary']} output {worst['tensor']} is {worst['sqnr_db']} dB from its "
                    f"compiler input's (SQNR; at least {worst['min_sqnr_db']} dB)"
                )
            spiked = max(rows, key=lambda r: r["span_fraction"])
            if spiked["span_fraction"] > MAX_SPAN_FRACTION:
                problems.append(
                    f"{where}: {spiked['binary']} output {spiked['tensor']} differs from its compiler "
                    f"input's by {spiked['span_fraction']:.1%} of its span at one value (at most "
                    f"{MAX_SPAN_FRACTION:.0%})"
                )
            if logits is not None and logits["top1"] < MIN_LOGITS_TOP1:
                problems.append(
                    f"{where}: the binaries' logits pick the CPU engine's top-1 in {logits['top1']:.3f} of "
                    f"rows (at least {MIN_LOGITS_TOP1})"
                )
    missing = [g.file for g in emulator.graphs if g.file not in executed]
    if missing:
        problems.append(f"the replay executed no call of {', '.join(sorted(set(missing)))}")
    return ReplayResult(calls, skipped, executed, time.perf_counter() - t0, problems)
