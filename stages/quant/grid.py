"""Weights that already sit on a low-bit integer grid: what quantization-aware training leaves behind.

Google's `gemma-4-E2B-it-qat-q4_0-unquantized` stores bf16 weights that are each a float scale times
a small integer (Q4_0: symmetric int4, one scale per group of 32 inputs). Rounding those onto another
grid throws away what the training bought; quantize keeps them instead (`stages.quantize.weights`).

`find_grid` reads the grid from the data alone, never assuming it: for each candidate group size
along the input (the whole input = one scale per output channel, then 2048 down to 8), each group's
scale is its largest magnitude over k for the smallest k in 1..MAX_LEVEL that puts every value of the
group within GRID_TOLERANCE of an integer multiple; the largest group size at which every group fits
is the grid. Its integer range gives the bit width (symmetric: [-2^(b-1), 2^(b-1) - 1]). Each
group's scale is then refitted by least squares over its integers. Q4_0 sets a group's scale to its
largest-magnitude value over -8, so the scale is negative wherever that value is positive: such a
group's integers are [-7, 8] under a positive step, and the grid holds them negated, [-8, 7], under a
negative scale, as Q4_0 does.

bf16 keeps 8 significant bits, so a stored value s*q is off by up to |q| * 2^-9 steps, and the scale
read from a group's largest value by as much again: under 0.04 of a step for |q| <= 8. GRID_TOLERANCE
(0.125 of a step) leaves room for that and still refuses random weights: a group of 32 unrelated
values all lands that close to a grid with probability ~0.25^31.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID_TOLERANCE = 0.125
# The largest integer magnitude a group's biggest value may have: 8 covers int2 ([-2, 1]) and int4
# ([-8, 7]); 8-bit grids are not looked for (a weight that is only 8-bit exact is left to quantize).
MAX_LEVEL = 8
GROUP_SIZES = (2048, 1024, 512, 256, 128, 64, 32, 16, 8)


@dataclass(frozen=True)
class Grid:
    """A weight (out, in) as q * scale: q int8 (out, in); scale (out, in // group), float32."""

    bits: int
    group: int  # inputs per scale; == in for one scale per output channel
    q: np.ndarray
    scale: np.ndarray
    max_error: float  # the largest distance of a value from its grid point, in steps
    rel_rms_error: float  # ||W - q*scale|| / ||W||

    @property
    def per_channel(self) -> bool:
        return self.group == self.q.shape[1]

    def dequantized(self) -> np.ndarray:
        return (self.q.reshape(self.q.shape[0], -1, self.group) * self.scale[:, :, None]).reshape(
            self.q.shape
        )

    def describe(self) -> str:
        kind = "per output channel" if self.per_channel else f"groups of {self.group} inputs"
        return f"int{self.bits} {kind}, within {self.max_error:.3f} of a step"


# Groups tried first at each group size: weights on no grid (every weight of a model not trained for
# one) are turned away by these alone, so looking costs next to nothing for them.
PROBE_GROUPS = 64


def _fit_levels(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For groups (n, size): each group's smallest level k (its largest magnitude = k steps) that puts
    every value near a grid point, and the distance; None when some group fits no k <= MAX_LEVEL."""
    if len(groups) > PROBE_GROUPS and _fit_levels(groups[:PROBE_GROUPS]) is None:
        return None
    peak = np.abs(groups).max(axis=1)
    level = np.zeros(len(groups), np.int64)
    worst = np.full(len(groups), np.inf)
    open_ = peak > 0
    level[~open_] = 1
    worst[~open_] = 0.0
    for k in range(1, MAX_LEVEL + 1):
        if not open_.any():
            break
        idx = np.flatnonzero(open_)
        steps = groups[idx] * (k / peak[idx])[:, None]
        dist = np.abs(steps - np.rint(steps)).max(axis=1)
        fits = dist <= GRID_TOLERANCE
        level[idx[fits]] = k
        worst[idx[fits]] = dist[fits]
        open_[idx[fits]] = False
    if open_.any():
        return None
    return level, worst


def _passes_probe(w: np.ndarray, group: int) -> bool:
    """Whether the first PROBE_GROUPS groups of `group` inputs fit a grid: read from the first rows
    only, so a weight on no grid is never converted whole (at E2B that conversion was a tenth of the
    rounding pass)."""
    rows = min(w.shape[0], -(-PROBE_GROUPS * group // w.shape[1]))
    head = np.asarray(w[:rows], dtype=np.float64).reshape(-1, group)[:PROBE_GROUPS]
    return bool(np.isfinite(head).all()) and _fit_levels(head) is not None


def find_grid(w: np.ndarray) -> Grid | None:
    """The integer grid `w` (out, in) sits on, or None. See the module's docstring."""
    if np.ndim(w) != 2:
        return None
    out, inp = np.shape(w)
    sizes = [g for g in (inp, *(g for g in GROUP_SIZES if g < inp and inp % g == 0)) if _passes_probe(w, g)]
    if not sizes:
        return None
    w = np.asarray(w, dtype=np.float64)
    if not np.isfinite(w).all() or not np.abs(w).max() > 0:
        return None
    for group in sizes:
        groups = w.reshape(out * (inp // group), group)
        fitted = _fit_levels(groups)
        if fitted is None:
            continue
        level, worst = fitted
        peak = np.abs(groups).max(axis=1)
        step = np.where(peak > 0, peak / level, 1.0)
        q = np.rint(groups / step[:, None])
        # Symmetric b bits hold [-2^(b-1), 2^(b-1) - 1]; a group reaching +2^(b-1) (Q4_0's negative
        # scale) holds its integers negated under a negative scale.
        reach = int(np.maximum(-q.min(axis=1), q.max(axis=1)).max())
        if reach > 8:
            continue
        half = 2 if reach <= 2 else 8
        negative = q.max(axis=1) > half - 1
        q[negative] *= -1
        step = np.where(negative, -step, step)
        if q.min() < -half or q.max() > half - 1:
            continue  # a group spanning -2^(b-1) .. +2^(b-1): no b-bit grid
        bits = 2 if half == 2 else 4
        # Least-squares scale over the integers (the max-based one carries its value's bf16 rounding).
        denom = (q * q).sum(axis=1)
        scale = np.where(denom > 0, (groups * q).sum(axis=1) / np.where(denom > 0, denom, 1), step)
        deq = q * scale[:, None]
        err = float(np.sqrt(((deq - groups) ** 2).sum() / (groups**2).sum()))
        return Grid(
            bits=bits,
            group=group,
            q=q.astype(np.int8).reshape(out, inp),
            scale=scale.astype(np.float32).reshape(out, inp // group),
            max_error=float(worst.max()),
            rel_rms_error=err,
        )
    return None


def carried_grid(w: np.ndarray, scale: np.ndarray, bits: int) -> Grid:
    """The grid a checkpoint stored for `w` (out, in): its own scales (out, in / group), its integers
    read back as w / scale. Export's float weight is integer x scale to float32's last bit, so the
    integers come back exact; a weight that is not (a scale that does not belong to it) is refused."""
    out, inp = w.shape
    group = inp // scale.shape[1]
    steps = np.asarray(w, np.float64).reshape(out, -1, group) / np.where(scale == 0, 1, scale)[:, :, None]
    q = np.rint(steps)
    off = float(np.abs(steps - q).max()) if q.size else 0.0
    half = 1 << (bits - 1)
    if off > 1e-3 or q.min() < -half or q.max() > half - 1:
        raise ValueError(
            f"the weight is not its stored int{bits} integers x scales (off by {off:.3g} of a step, "
            f"integers {int(q.min())}..{int(q.max())})"
        )
    deq = q * scale[:, :, None]
    norm = float(np.sqrt((np.asarray(w, np.float64) ** 2).sum())) or 1.0
    return Grid(
        bits=bits,
        group=group,
        q=q.astype(np.int8).reshape(out, inp),
        scale=scale.astype(np.float32),
        max_error=off,
        rel_rms_error=float(np.sqrt(((deq.reshape(out, inp) - w) ** 2).sum())) / norm,
    )
