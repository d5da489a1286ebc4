"""Weight schemes (stages/core/precision.py) written into the quantized graphs: int4 per channel, LPBQ, int8
kept by measured sensitivity; rounded by GPTQ or to nearest (`WeightRounder`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.config import PipelineConfig
from stages.core.precision import DECODER_ROLE, LM_HEAD_ROLE, LPBQ_BLOCK_SCALE_MAX, PLE_ROLE
from stages.model.contract import (
    LUT_INPUTS,
    LutSpec,
)
from stages.model.encoding import Encoding
from stages.quant.gptq import Hessian, best_scales, gptq
from stages.quant.grid import Grid, carried_grid, find_grid
from stages.quantize.analysis import (
    PLE_WEIGHT_SUFFIXES,
    QuantizeError,
    analyse,
)

# ---- weight schemes (stages/core/precision.py) ----
# onnxruntime's quantizer writes every MatMul weight as int8 per output channel; a precision with other
# decoder weights rewrites those DequantizeLinear nodes from the float weights afterwards. The lm_head
# and the PLE paths keep what the precision and the PLE policy give them.
LM_HEAD_WEIGHT = "lm_head.weight"


def weight_role(weight: str) -> str:
    """The role (stages.core.precision's *_ROLE) whose storage rule a MatMul weight follows."""
    if weight.endswith(LM_HEAD_WEIGHT):
        return LM_HEAD_ROLE
    if weight.endswith(PLE_WEIGHT_SUFFIXES):
        return PLE_ROLE
    return DECODER_ROLE


def expected_scheme(cfg: PipelineConfig, weight: str, int8_weights: frozenset[str] = frozenset()):
    """The WeightScheme a MatMul weight must have, or None where the PLE policy keeps it float.
    `int8_weights`: the decoder weights a mixed precision keeps at int8 (`WeightRounder.choose_int8`)."""
    scheme = cfg.weight_scheme(weight_role(weight), kept_int8=weight in int8_weights)
    return scheme if scheme.quantized else None


def _has_4bit_weights(cfg: PipelineConfig) -> bool:
    return 4 in (cfg.decoder_scheme.bits, cfg.lm_head_scheme.bits)


def _4bit_weights(cfg: PipelineConfig, src: Path) -> list[str]:
    """The MatMul weights of the graph at src that the precision stores in 4 bits."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    return [
        w
        for w in analyse(model).matmul_weights
        if (scheme := expected_scheme(cfg, w)) is not None and scheme.bits == 4
    ]


def _pack_int4(q: np.ndarray) -> bytes:
    """ONNX INT4 storage: two values per byte, the first in the low nibble."""
    flat = q.astype(np.int8).ravel()
    if flat.size % 2:
        flat = np.append(flat, np.int8(0))
    nibbles = (flat & 0x0F).astype(np.uint8)
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def _int4_tensor(name: str, q: np.ndarray):
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.INT4, list(q.shape), _pack_int4(q), raw=True)


# Candidate clipping ratios for int4 per-channel scales: a column's scale is ratio * max|w| / 7 for the
# ratio with the least squared weight error. Max-abs scaling (ratio 1) spends most of a 16-level grid
# on one outlier; on the trained tiny model the search took held-out KL from 0.110 to 0.074 and
# perplexity from 4.54 to 4.37 (float 4.17). Fixed candidates keep the result deterministic.
INT4_CLIP_RATIOS = np.linspace(0.5, 1.0, 26)
# weight_rounding "gptq-search": GPTQ moves rounding error onto the rows not yet rounded, so the ratio
# with the least weight error is not the one with the least output error after GPTQ. Each column of a
# weight left at 4 bits is rounded again under these steps of INT4_CLIP_RATIOS around its weight-error
# ratio (one GPTQ per step under one Hessian factor) and keeps the least output error. On the trained
# tiny model's 4-bit weights the best ratio under GPTQ lay below the weight-error one for 46 % of
# columns and above it for 37 %, further below than above; this window (9 of 26 ratios) reached 88 %
# of the whole grid's output-error gain, and the held-out and calibration-side KL of the grid.
SCALE_SEARCH_STEPS = range(-6, 3)


def _int4_error(w: np.ndarray, s: np.ndarray, buf: np.ndarray, axis: int) -> np.ndarray:
    """The squared error of `w` rounded to symmetric int4 at scale `s`, summed in float64 along `axis`;
    step by step in the reused float32 buffer `buf` (the arithmetic of the plain expression)."""
    np.divide(w, s, out=buf)
    np.rint(buf, out=buf)
    np.clip(buf, -8, 7, out=buf)
    np.multiply(buf, s, out=buf)
    np.subtract(buf, w, out=buf)
    np.square(buf, out=buf)
    return buf.sum(axis=axis, dtype=np.float64)


def _clip_scale(ratio: np.ndarray | float, safe: np.ndarray) -> np.ndarray:
    """The int4 scale of columns with max-abs `safe` clipped at `ratio` (a number or one per column)."""
    return (np.float32(ratio) * safe / np.float32(7.0)).astype(np.float32)


def _clip_search(w: np.ndarray, safe: np.ndarray) -> np.ndarray:
    """The index in INT4_CLIP_RATIOS of each column of `w` (in, cols)'s best clipping ratio; one reused
    buffer, the arithmetic of a plain expression step by step (float32, the error summed in float64
    row by row)."""
    best_err = np.full(w.shape[1], np.inf, np.float64)
    best = np.full(w.shape[1], len(INT4_CLIP_RATIOS) - 1)
    buf = np.empty_like(w)
    for i in range(len(INT4_CLIP_RATIOS) - 1, -1, -1):  # ratio 1 first: ties keep the unclipped scale
        err = _int4_error(w, _clip_scale(INT4_CLIP_RATIOS[i], safe), buf, axis=0)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, i, best)
    return best


def int4_channel(
    w: np.ndarray, workers: int | None = None, hessian: Hessian | None = None, search: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per output channel of a (in, out) weight: (values, scale per column), each
    column's scale the clipping ratio with the least squared weight error. With the input's `hessian`
    GPTQ picks the integers under those scales. (Weighting the clipping search by the Hessian's
    diagonal measured no better on the tiny model: held-out KL 0.042 vs 0.041.) With `search` too,
    each column keeps, of the ratios SCALE_SEARCH_STEPS around that one, the one whose GPTQ rounding
    leaves the least output error (`stages.quant.gptq.best_scales`; the weight-error ratio wins ties).

    Columns are searched independently, so blocks of columns go to threads (numpy releases the GIL):
    the same result on any number of threads, 2.5x faster on 2 cores at E2B's 1536 x 6144."""
    from concurrent.futures import ThreadPoolExecutor

    w = np.ascontiguousarray(w, dtype=np.float32)
    absmax = np.abs(w).max(axis=0)
    safe = np.where(absmax > 0, absmax, 1.0).astype(np.float32)
    workers = max(1, min(workers or os.cpu_count() or 1, w.shape[1]))
    bounds = np.linspace(0, w.shape[1], workers + 1).astype(int)
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    blocks = [(np.ascontiguousarray(w[:, a:b]), safe[a:b]) for a, b in spans]
    with ThreadPoolExecutor(workers) as pool:
        ratio = np.concatenate(list(pool.map(lambda block: _clip_search(*block), blocks)))
    scale = _clip_scale(INT4_CLIP_RATIOS[ratio], safe)
    if hessian is not None and search:
        last = len(INT4_CLIP_RATIOS) - 1
        candidates = [scale] + [
            _clip_scale(INT4_CLIP_RATIOS[np.clip(ratio + step, 0, last)], safe)
            for step in SCALE_SEARCH_STEPS
            if step
        ]
        q, best = best_scales(w, hessian, [c[None, :] for c in candidates])
        return q, best[0]
    if hessian is not None:
        return gptq(w, hessian, scale[None, :]), scale
    q = np.clip(np.rint(w / scale), -8, 7).astype(np.int8)
    return q, scale


def _block_scale_search(blocks: np.ndarray, channel: np.ndarray) -> np.ndarray:
    """The 4-bit scale of each block of `blocks` (nb, block, cols) with the least squared weight error,
    a block's scale being k * its column's `channel` scale for k in 1..LPBQ_BLOCK_SCALE_MAX; one reused
    buffer, the error summed in float64."""
    best_err = np.full((blocks.shape[0], blocks.shape[2]), np.inf, np.float64)
    q_scale = np.full(best_err.shape, LPBQ_BLOCK_SCALE_MAX, np.uint8)
    buf = np.empty_like(blocks)
    for k in range(LPBQ_BLOCK_SCALE_MAX, 0, -1):  # the largest first: ties keep the unclipped scale
        err = _int4_error(blocks, (np.float32(k) * channel).astype(np.float32), buf, axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        q_scale = np.where(better, np.uint8(k), q_scale)
    return q_scale


def int4_lpbq(
    w: np.ndarray, block: int, workers: int | None = None, hessian: Hessian | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LPBQ of a (in, out) weight, blocks of `block` input rows: (int4 values, 4-bit block scales as
    uint8 (in/block, out), float scale per column); a block's scale is its integer times its column's.

    A column's float scale is its largest block's max-abs scale / LPBQ_BLOCK_SCALE_MAX; each block then
    takes the integer (1..LPBQ_BLOCK_SCALE_MAX) with the least squared error, not the nearest one: it
    clips where that helps, and a quiet block's coarse integer is picked for its error. On the trained
    tiny model the search took held-out KL from 0.106 to 0.072 (before GPTQ; the 0.072 is in
    docs/stages/quantize.md, "Quality of 4-bit weights").
    Columns are independent: spans of them go to threads, as int4_channel's do. With the input's
    `hessian` GPTQ picks the integers under those block scales."""
    from concurrent.futures import ThreadPoolExecutor

    rows, cols = w.shape
    blocks = np.ascontiguousarray(w, dtype=np.float32).reshape(rows // block, block, cols)
    channel = np.abs(blocks).max(axis=(0, 1)) / np.float32(7 * LPBQ_BLOCK_SCALE_MAX)
    channel = np.where(channel > 0, channel, 1.0).astype(np.float32)
    workers = max(1, min(workers or os.cpu_count() or 1, cols))
    bounds = np.linspace(0, cols, workers + 1).astype(int)
    spans = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def search(span: slice) -> np.ndarray:
        return _block_scale_search(np.ascontiguousarray(blocks[:, :, span]), channel[span])

    with ThreadPoolExecutor(workers) as pool:
        q_scale = np.concatenate(list(pool.map(search, spans)), axis=1)
    if hessian is not None:
        return gptq(w, hessian, q_scale * channel), q_scale, channel
    effective = (q_scale * channel)[:, None, :]
    q = np.clip(np.rint(blocks / effective), -8, 7).astype(np.int8).reshape(rows, cols)
    return q, q_scale, channel


# A kept LPBQ grid's blocks must be this many input rows or more: QNN's HTP emulation agrees with LPBQ
# MatMuls from blocks of 16 rows (lpbq_block).
MIN_KEPT_LPBQ_BLOCK = 16


def lpbq_from_group_scales(scales: np.ndarray, energy: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """LPBQ's form of given per-group scales (ng, out): a float scale per column times a 4-bit integer
    (1..LPBQ_BLOCK_SCALE_MAX) per group, chosen to minimise the groups' scale error weighted by each
    group's integer energy (sum of q^2, so the error is the weight error the integers then carry).
    Per column: each candidate channel scale (the largest group scale over 16, times a ratio), the
    nearest integers under it, then the channel scale refitted by least squares and the integers again;
    the least error wins. Returns (integers uint8 (ng, out), channel scale (out,), relative residual
    sqrt(sum E (S k - s)^2 / sum E s^2))."""
    s = scales.astype(np.float64)
    e = np.maximum(energy.astype(np.float64), 1e-30)
    top = LPBQ_BLOCK_SCALE_MAX
    peak = np.where(s.max(axis=0) > 0, s.max(axis=0), 1.0)
    best_err = np.full(s.shape[1], np.inf)
    best_k = np.full(s.shape, top, np.int64)
    best_c = peak / top
    for ratio in np.linspace(0.5, 1.0, 51):
        c = peak * ratio / top
        for _ in range(2):
            k = np.clip(np.rint(s / c), 1, top)
            c = (e * k * s).sum(axis=0) / (e * k * k).sum(axis=0)
        k = np.clip(np.rint(s / c), 1, top)
        err = (e * (c * k - s) ** 2).sum(axis=0)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_k = np.where(better, k, best_k)
        best_c = np.where(better, c, best_c)
    residual = float(np.sqrt(best_err.sum() / (e * s * s).sum()))
    return best_k.astype(np.uint8), best_c.astype(np.float32), residual


def kept_grid(
    grid: Grid, scheme, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float, np.ndarray] | str:
    """A checkpoint's grid in the weight's 4-bit scheme, keeping its integers: (q (in, out), scale per
    column, block scales or None, relative scale residual, the checkpoint's integers (in, out) under
    those positive scales, before clipping), or why it cannot be kept.
    int4 per channel takes a per-channel grid as it is; LPBQ takes any grid at its group size (a
    per-channel one at the scheme's block), its group scales re-expressed as channel scale x 4-bit
    integer. Our int4 weights carry positive scales, so a group under a negative scale (Q4_0's, where
    its largest value is positive) keeps its integers negated, and the one that reaches +8 there is
    clipped to +7: one step off on one value of such a group, counted."""
    if grid.bits > 4:
        return f"an int{grid.bits} grid does not fit 4 bits"
    if not scheme.blockwise and not grid.per_channel:
        return (
            f"a grid of {grid.group}-input groups needs block scales; int4 per channel cannot keep it "
            "(precision w4a16-lpbq can)"
        )
    block = lpbq_block(scheme, rows) if grid.per_channel and scheme.blockwise else grid.group
    if scheme.blockwise and (block < MIN_KEPT_LPBQ_BLOCK or rows % block):
        return f"LPBQ blocks of {block} rows are not ones v69 runs (at least {MIN_KEPT_LPBQ_BLOCK})"
    out = grid.q.shape[0]
    sign = np.where(grid.scale < 0, -1, 1).astype(np.int16)
    signed = grid.q.reshape(out, -1, grid.group).astype(np.int16) * sign[:, :, None]
    checkpoint = np.ascontiguousarray(signed.reshape(out, -1).T)
    q = np.clip(signed, -8, 7).astype(np.int8).reshape(out, -1)
    magnitude = np.abs(grid.scale).astype(np.float32)
    if not scheme.blockwise:
        return np.ascontiguousarray(q.T), magnitude[:, 0], None, 0.0, checkpoint
    per_block = np.repeat(magnitude, grid.group // block, axis=1) if grid.per_channel else magnitude
    energy = (q.astype(np.float64) ** 2).reshape(out, -1, block).sum(axis=2)
    k, channel, residual = lpbq_from_group_scales(per_block.T, energy.T)
    return np.ascontiguousarray(q.T), channel, k, residual, checkpoint


def int8_channel_error(w: np.ndarray) -> np.ndarray:
    """What onnxruntime's int8 per-channel weight (symmetric, max-abs / 127) minus the float weight is."""
    absmax = np.abs(w).max(axis=0)
    scale = np.where(absmax > 0, absmax, 1.0) / 127.0
    return np.clip(np.rint(w / scale), -127, 127) * scale - w


@dataclass
class RoundedWeight:
    q: np.ndarray  # int4 values, (in, out)
    scale: np.ndarray  # per output channel (LPBQ: the float scale under the block scales)
    block_scales: np.ndarray | None
    params: int
    nsr_int4: float  # output noise-to-signal of the 4-bit weight on the calibration inputs
    nsr_int8: float  # the same for the int8 weight a mixed precision would keep instead
    kl_int4: float | None = None  # measured: next-token KL with this weight alone at 4 bits
    # A kept checkpoint grid's own integers (in, out) under positive scales, before clipping: what
    # the audit holds the stored integers to (None: rounded here, no checkpoint grid).
    checkpoint_q: np.ndarray | None = None

    def dequantized(self) -> np.ndarray:
        if self.block_scales is None:
            return self.q * self.scale
        block = self.q.shape[0] // self.block_scales.shape[0]
        return self.q * np.repeat(self.block_scales * self.scale, block, axis=0)


class WeightRounder:
    """Every 4-bit weight of the precision rounded once (GPTQ with `hessians`, else the clipping
    search alone), each with its MatMul's own output error at 4 and 8 bits and, where measured, the
    model's next-token KL with it alone at 4 bits: what the mixed precision ranks. With the
    `gptq-search` rounding, the weights left at 4 bits are then rounded again with their scales
    searched under GPTQ's output error (`search_scales`)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        hessians: dict[str, Hessian] | None,
        carried: dict[str, tuple[dict[str, Any], np.ndarray]] | None = None,
    ):
        self.cfg = cfg
        # The grids a compressed-tensors checkpoint stored, by weight: (scheme, scales (out, groups)).
        self.carried = carried or {}
        self.hessians = hessians or {}
        self.rounding = cfg.weight_rounding if self.hessians else "nearest"
        self.rounded: dict[str, RoundedWeight] = {}
        self.int8_weights: frozenset[str] = frozenset()
        self.searched: list[str] = []  # weights whose scales search_scales chose
        self.search_s = 0.0
        # Weights found on a checkpoint's own low-bit grid (quantization-aware training): what was
        # found, and whether the scheme kept it or why not (`kept_grid`).
        self.grids: dict[str, dict[str, Any]] = {}
        # Static input-activation scales a checkpoint stores, beside the calibrated ranges.
        self.input_scales: dict[str, dict[str, Any]] = {}

    @property
    def kept(self) -> frozenset[str]:
        """The weights whose checkpoint grid is kept: their integers are the checkpoint's, except in an
        output channel where a +8 had to be clipped (`_keep_grid`: GPTQ moves that channel's)."""
        return frozenset(n for n, g in self.grids.items() if g["kept"])

    @property
    def given_int8(self) -> frozenset[str]:
        """The decoder weights the checkpoint stores at 8 bits: they stay int8, whatever the precision."""
        return frozenset(
            n for n, (meta, _) in self.carried.items() if meta["bits"] == 8 and weight_role(n) == DECODER_ROLE
        )

    @property
    def searches(self) -> bool:
        return self.rounding == "gptq-search"

    def round_all(self, graphs: list[Path], keep_hessians_in: Path | None = None) -> None:
        """Round every 4-bit weight of the graphs, then drop the Hessians (E2B's take ~4 GB), or, with
        `keep_hessians_in`, move them to files there, mapped back on use (for `search_scales`)."""
        from stages.core.progress import tqdm

        names = {src: _4bit_weights(self.cfg, src) for src in graphs}
        with tqdm(total=sum(map(len, names.values())), desc="round 4-bit weights", unit="weight") as bar:
            for src in graphs:  # one graph's float weights in memory at a time
                weights = matmul_weights_by_name(src)
                for name in names[src]:
                    bar.update()
                    if name not in self.rounded:
                        self.round_weight(name, weights.pop(name))
                del weights
        self.hessians = _on_disk(self.hessians, keep_hessians_in) if keep_hessians_in else {}

    def search_scales(self, graphs: list[Path]) -> None:
        """Round each weight stored at 4 bits per channel again, its scales searched under GPTQ's
        output error (`int4_channel(search=True)`); after `choose_int8`, so a mixed precision
        searches only the weights it leaves at 4 bits. Its measured cost stays that of the first
        rounding (what the choice ranked). Drops the Hessians when done."""
        from stages.core.progress import tqdm

        t0 = time.perf_counter()
        names = {
            src: [
                n
                for n in _4bit_weights(self.cfg, src)
                if n not in self.int8_weights
                and n not in self.kept
                and not expected_scheme(self.cfg, n).blockwise
            ]
            for src in graphs
        }
        with tqdm(total=sum(map(len, names.values())), desc="search 4-bit scales", unit="weight") as bar:
            for src in graphs:
                weights = matmul_weights_by_name(src)
                for name in names[src]:
                    bar.update()
                    if name not in self.searched:
                        kl = self.rounded[name].kl_int4
                        self.round_weight(name, weights.pop(name), search=True).kl_int4 = kl
                        self.searched.append(name)
                del weights
        self.hessians = {}
        self.search_s = time.perf_counter() - t0

    def measure(self, runner, samples: list[list[int]], scratch: Path) -> None:
        """Each decoder weight's measured cost at 4 bits (`stages.quant.sensitivity`), on the runner's
        prefill graphs: what the mixed precision ranks by."""
        from stages.quant.sensitivity import measure

        decoder = {n: r.dequantized for n, r in self.rounded.items() if weight_role(n) == DECODER_ROLE}
        for name, kl in measure(runner, decoder, samples, scratch).items():
            self.rounded[name].kl_int4 = kl

    def round_weight(self, name: str, w: np.ndarray, search: bool = False) -> RoundedWeight:
        """One (in, out) weight rounded to its 4-bit scheme (per channel with `search`: its scales
        searched under GPTQ's output error), with the output error of 4 and 8 bits."""
        from stages.quant.gptq import output_errors

        scheme, hessian = expected_scheme(self.cfg, name), self.hessians.get(name)
        kept = self._keep_grid(name, w, scheme) if not search else None
        checkpoint = None
        if kept is not None:
            q, scale, block_scales, checkpoint = kept
            dequantized = (
                q * scale
                if block_scales is None
                else q * np.repeat(block_scales * scale, q.shape[0] // block_scales.shape[0], axis=0)
            )
        elif scheme.blockwise:
            block = lpbq_block(scheme, w.shape[0])
            if w.shape[0] % block:
                raise QuantizeError(
                    f"{name}: {w.shape[0]} input rows are not a multiple of its {scheme.name} "
                    f"block of {block} rows; use precision w4a16 (int4 per channel) for this model"
                )
            q, block_scales, scale = int4_lpbq(w, block, hessian=hessian)
            dequantized = q * np.repeat(block_scales * scale, block, axis=0)
        else:
            (q, scale), block_scales = int4_channel(w, hessian=hessian, search=search), None
            dequantized = q * scale
        hess = hessian or Hessian(np.ones(w.shape[0], np.float32))
        error4, error8 = output_errors(w, [dequantized, w + int8_channel_error(w)], hess)
        self.rounded[name] = RoundedWeight(q, scale, block_scales, w.size, error4, error8, None, checkpoint)
        return self.rounded[name]

    def _keep_grid(
        self, name: str, w: np.ndarray, scheme
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray] | None:
        """The weight's checkpoint grid in its scheme, where it sits on one and the scheme can keep it
        (recorded in `grids` either way): (q, scale, block scales, the checkpoint's integers); None to
        round it as any other weight."""
        if name in self.carried:
            meta, scales = self.carried[name]
            try:
                grid = carried_grid(w.T, scales, meta["bits"])
            except ValueError as e:
                raise QuantizeError(
                    f"{name}: {e}; exported/ does not match its checkpoint: run `make export` again"
                ) from None
            source = "compressed-tensors"
        else:
            grid, source = find_grid(w.T), "found in the values"
        if grid is None:
            return None
        kept = (
            kept_grid(grid, scheme, w.shape[0])
            if self.cfg.checkpoint_grid == "keep"
            else "checkpoint_grid=ignore"
        )
        entry = {
            "found": grid.describe(),
            "bits": grid.bits,
            "group": grid.group,
            "kept": not isinstance(kept, str),
            "source": source,
        }
        self.grids[name] = entry
        if isinstance(kept, str):
            entry["why_not"] = kept
            if name in self.given_int8:
                entry["stored"] = "int8 per channel, as the checkpoint gives it 8 bits"
            return None
        q, scale, block_scales, residual, checkpoint = kept
        clipped_columns = (checkpoint > 7).any(axis=0)
        entry.update(scale_residual=round(residual, 6), clipped=int((checkpoint > 7).sum()))
        hessian = self.hessians.get(name)
        if clipped_columns.any() and hessian is not None:
            # The clipped values (Q4_0's +8 under a negative scale; v69 takes neither negative weight
            # scales nor int4 zero points, docs/stages/quantize.md) move their output error onto the
            # other integers of their output channel: GPTQ under the grid's own scales. Only those
            # channels take its integers (elsewhere it would also zero the rows of inputs the
            # calibration never saw): every other channel keeps the checkpoint's exactly.
            scales = scale[None, :] if block_scales is None else block_scales * scale
            compensated = np.where(clipped_columns[None, :], gptq(w, hessian, scales), q)
            entry["integers_moved"] = int((compensated != q).sum())
            q = compensated
        return q, scale, block_scales, checkpoint

    def choose_int8(self, share: float) -> frozenset[str]:
        """The decoder weights kept at int8: the most measured cost (next-token KL at 4 bits; where
        not measured, the MatMul's own output error) removed per extra byte first, while their
        parameters stay within `share` of the decoder's (the precision's memory price). A weight on
        its checkpoint's kept grid stays at 4 bits: there its integers are exact, and int8 would
        round them onto another grid."""
        given = self.given_int8
        decoder = {
            n: r
            for n, r in self.rounded.items()
            if weight_role(n) == DECODER_ROLE and n not in self.kept and n not in given
        }
        # The weights the checkpoint gives at 8 bits spend the same budget first.
        given_params = sum(self.rounded[n].params for n in given if n in self.rounded)
        budget = share * (sum(r.params for r in decoder.values()) + given_params) - given_params

        def gain(n: str) -> float:
            r = decoder[n]
            return (r.kl_int4 if r.kl_int4 is not None else r.nsr_int4 - r.nsr_int8) / r.params

        chosen, used = [], 0
        for name in sorted(decoder, key=lambda n: (-gain(n), n)):
            if used + decoder[name].params <= budget:
                chosen.append(name)
                used += decoder[name].params
        return frozenset(chosen)

    def compare_input_scales(self, qmodel) -> None:
        """For each weight whose checkpoint stores a static input-activation scale: that scale's range
        beside the range its MatMul's input was calibrated to in the quantized graph `qmodel`, and
        which one the graph uses. Every precision here has 16-bit activations: the calibrated 16-bit
        range is kept, since an int8 scale's 255 steps over the same span would be the coarser grid."""
        from onnx import numpy_helper

        wanted = {n: meta for n, (meta, _) in self.carried.items() if meta.get("input_scale") is not None}
        if not wanted:
            return
        graph = qmodel.graph
        inits = {i.name: i for i in graph.initializer}
        producer = {o: node for node in graph.node for o in node.output}
        for node in graph.node:
            if node.op_type != "MatMul":
                continue
            dq_w, dq_x = producer.get(node.input[1]), producer.get(node.input[0])
            if dq_w is None or dq_x is None or dq_x.op_type != "DequantizeLinear":
                continue
            name = _weight_name(dq_w)
            if name not in wanted or name in self.input_scales:
                continue
            scale = float(numpy_helper.to_array(inits[dq_x.input[1]]))
            zero = numpy_helper.to_array(inits[dq_x.input[2]])
            kind = np.iinfo(zero.dtype)
            bits = kind.bits
            stored = wanted[name]["input_scale"]
            half = 1 << (wanted[name]["input_bits"] - 1)
            self.input_scales[name] = {
                "checkpoint": [round(-half * stored, 6), round((half - 1) * stored, 6)],
                "calibrated": [
                    round((kind.min - int(zero)) * scale, 6),
                    round((kind.max - int(zero)) * scale, 6),
                ],
                "used": "calibrated",
                "why": f"{bits}-bit activations: finer than the checkpoint's int{wanted[name]['input_bits']}",
            }

    def figures(self) -> dict[str, Any]:
        return {
            "rounding": self.rounding,
            "int8_weights": sorted(self.int8_weights),
            "int8_share": round(
                sum(self.rounded[n].params for n in self.int8_weights)
                / max(1, sum(r.params for n, r in self.rounded.items() if weight_role(n) == DECODER_ROLE)),
                4,
            ),
            "sensitivity": "measured"
            if any(r.kl_int4 is not None for r in self.rounded.values())
            else "local",
            "scales_searched": sorted(self.searched),
            "checkpoint_grids": {
                "kept": len(self.kept),
                "found": len(self.grids),
                "of": len(self.rounded),
                "weights": dict(sorted(self.grids.items())),
            },
            "scale_search_s": round(self.search_s, 1),
            "weights": {
                n: {
                    "nsr_int4": round(r.nsr_int4, 6),
                    "nsr_int8": round(r.nsr_int8, 8),
                    "params": r.params,
                    **({"kl_int4": round(r.kl_int4, 6)} if r.kl_int4 is not None else {}),
                }
                for n, r in sorted(self.rounded.items())
            },
        }


def _on_disk(hessians: dict[str, Hessian], folder: Path) -> dict[str, Hessian]:
    """The same Hessians (shared ones stay shared) saved under folder and memory-mapped back: the
    measured-sensitivity pass between rounding and the scale search then does not hold E2B's ~4 GB."""
    folder.mkdir(parents=True, exist_ok=True)
    mapped: dict[int, Hessian] = {}
    for h in hessians.values():
        if id(h) not in mapped:
            path = folder / f"{len(mapped)}.npy"
            np.save(path, h.matrix)
            mapped[id(h)] = Hessian(np.load(path, mmap_mode="r"), h.rows)
    return {name: mapped[id(h)] for name, h in hessians.items()}


def lpbq_block(scheme, rows: int) -> int:
    """The block size a weight with `rows` input rows gets: the scheme's, or one block per column
    where the whole column is shorter (tiny test models; every E2B input width is a multiple of 64).
    QNN's HTP emulation agrees with LPBQ MatMuls at blocks of 16 rows and up; at 8 rows only below 64
    output columns, at 4 rows not at all (the tiny model's narrowest input is 32 rows)."""
    return min(scheme.block_size, rows)


def _replace_init(graph, inits: dict[str, Any], name: str, tensor) -> None:
    graph.initializer.remove(inits[name])
    tensor.name = name
    graph.initializer.append(tensor)
    inits[name] = tensor


def _write_lpbq(graph, inits: dict[str, Any], dq, done):
    """A 4-bit weight written as LPBQ, in the pattern onnxruntime-qnn's LPBQ fusion takes: UINT8
    block scales (nb, out) under a per-channel float scale (axis 1, zero points 0) feeding the INT4
    weight's blockwise DequantizeLinear (axis 0, block_size, zero points 0). Returns the block-scale
    DequantizeLinear node, to go right before the weight's."""
    from onnx import helper, numpy_helper

    q_name, s_name, zp_name = dq.input[0], dq.input[1], dq.input[2]
    q, q_scale, channel = done.q, done.block_scales, done.scale
    block = q.shape[0] // q_scale.shape[0]  # the scheme's, or a kept grid's group
    base = q_name.removesuffix("_quantized")
    block_scales = f"{base}_block_scales"
    for suffix, arr in (
        ("_block_scales_q", q_scale),
        ("_channel_scale", channel),
        ("_block_scales_zero_point", np.zeros(channel.shape, np.uint8)),
    ):
        graph.initializer.append(numpy_helper.from_array(arr, base + suffix))
    node = helper.make_node(
        "DequantizeLinear",
        [base + "_block_scales_q", base + "_channel_scale", base + "_block_scales_zero_point"],
        [block_scales],
        name=f"{base}_block_scales_DequantizeLinear",
        axis=1,
    )
    _replace_init(graph, inits, q_name, _int4_tensor(q_name, q))
    graph.initializer.remove(inits.pop(s_name))
    _replace_init(graph, inits, zp_name, _int4_tensor(zp_name, np.zeros(q_scale.shape, np.int8)))
    dq.input[1] = block_scales
    del dq.attribute[:]
    dq.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", block)])
    return node


def apply_weight_scheme(
    cfg: PipelineConfig,
    qmodel,
    float_weights: dict[str, np.ndarray],
    rounder: WeightRounder | None = None,
) -> int:
    """Rewrite the int8 weight DequantizeLinear of every MatMul whose scheme is 4-bit (`float_weights`:
    MatMul node name -> its float (in, out) weight; `rounder`: the weights rounded already, and which
    a mixed precision keeps at int8). Returns how many weights were rewritten."""
    from onnx import numpy_helper

    graph = qmodel.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    rewritten, new_nodes = 0, {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.name not in float_weights:
            continue
        dq = producer.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        w = float_weights[node.name]
        scheme = expected_scheme(cfg, _weight_name(dq), rounder.int8_weights if rounder else frozenset())
        if scheme is None or scheme.bits != 4:
            continue
        q_name, s_name = dq.input[0], dq.input[1]
        if len(dq.input) < 3 or not dq.input[2]:  # symmetric weights may come without a zero point
            zp_name = f"{q_name}_zero_point4"
            graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int8), zp_name))
            inits[zp_name] = graph.initializer[-1]
            del dq.input[2:]
            dq.input.append(zp_name)
        zp_name = dq.input[2]
        done = rounder.rounded.get(_weight_name(dq)) if rounder else None
        done = done or WeightRounder(cfg, None).round_weight(_weight_name(dq), w)
        if not scheme.blockwise:
            _replace_init(graph, inits, q_name, _int4_tensor(q_name, done.q))
            _replace_init(graph, inits, s_name, numpy_helper.from_array(done.scale))
            _replace_init(graph, inits, zp_name, _int4_tensor(zp_name, np.zeros(done.scale.shape, np.int8)))
        else:
            new_nodes[dq.name] = _write_lpbq(graph, inits, dq, done)
        rewritten += 1
    if new_nodes:  # each block-scale DQ goes right before the weight DQ that reads it
        nodes = []
        for n in graph.node:
            if n.name in new_nodes:
                nodes.append(new_nodes[n.name])
            nodes.append(n)
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def rewrite_weights(cfg: PipelineConfig, src: Path, dest: Path, rounder: WeightRounder | None = None) -> None:
    """Give the quantized graph at dest the precision's decoder weights, from the float graph at src."""
    import onnx

    qmodel = onnx.load(str(dest))
    apply_weight_scheme(cfg, qmodel, matmul_float_weights(src), rounder)
    data = dest.with_name(dest.name + ".data")
    large = data.exists() or sum(len(i.raw_data) for i in qmodel.graph.initializer) > 1_900_000_000
    data.unlink(missing_ok=True)  # onnx appends to an existing external-data file
    onnx.save(qmodel, str(dest), save_as_external_data=large, location=data.name)


def matmul_weights_by_name(src: Path) -> dict[str, np.ndarray]:
    """Weight name -> its float (in, out) value, for every MatMul weight of the exported graph."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    return {
        n.input[1]: numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits
    }


def _weight_name(dq) -> str:
    """The float weight a weight DequantizeLinear stands for (onnxruntime names it <weight>_quantized)."""
    return dq.input[0].removesuffix("_quantized")


def matmul_float_weights(src: Path) -> dict[str, np.ndarray]:
    """MatMul node name -> its float weight, from the exported graph."""
    import onnx

    by_name = matmul_weights_by_name(src)
    model = onnx.load(str(src), load_external_data=False)
    return {
        n.name: by_name[n.input[1]]
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in by_name
    }


def lut_input_encodings(luts: dict[str, LutSpec], graph_tensors: set[str]) -> dict[str, Encoding]:
    """The encoding each LUT-fed input of a graph must have: its LUT's (export report `luts`), or for a
    4-bit LUT the 8-bit encoding Genie fills exactly from it (`Encoding.graph_input_of_lut`)."""
    return {
        name: Encoding.of_lut(luts[key]).graph_input_of_lut()
        for name, key in LUT_INPUTS.items()
        if key in luts and name in graph_tensors
    }


def read_lut_inputs_quantized(model, encodings: dict[str, Encoding]) -> list[str]:
    """Make every LUT-fed graph input enter through a QuantizeLinear -> DequantizeLinear pair with its
    LUT's encoding, where the quantizer left it float (it does when every reader of the input is an
    excluded float node: the float16 PLE policy's `per_layer_inputs`). Compile folds the pair's
    QuantizeLinear into the input, so the binary takes the LUT's bytes. Returns the inputs changed."""
    from onnx import helper

    g = model.graph
    changed = []
    for name, enc in encodings.items():
        readers = [n for n in g.node if name in n.input]
        if len(readers) == 1 and readers[0].op_type == "QuantizeLinear":
            continue  # the quantizer did it (with the override's encoding; the audit checks it)
        scale, zero_point = f"{name}_lut_scale", f"{name}_lut_zero_point"
        g.initializer.extend(
            [
                helper.make_tensor(scale, 1, [], [float(np.float32(enc.scale))]),
                helper.make_tensor(zero_point, {"uint8": 2, "uint16": 4}[enc.numpy_dtype], [], [-enc.offset]),
            ]
        )
        quantized, dequantized = f"{name}_lut_quantized", f"{name}_lut_dequantized"
        for n in readers:
            n.input[:] = [dequantized if i == name else i for i in n.input]
        pair = [
            helper.make_node(
                "QuantizeLinear", [name, scale, zero_point], [quantized], f"{name}_QuantizeLinear"
            ),
            helper.make_node(
                "DequantizeLinear", [quantized, scale, zero_point], [dequantized], f"{name}_DequantizeLinear"
            ),
        ]
        for k, node in enumerate(pair):
            g.node.insert(k, node)
        changed.append(name)
    return changed
