"""Error-minimizing rounding of 4-bit weights from calibration activations (GPTQ).

Round-to-nearest picks each weight's integer alone; GPTQ (Frantar et al., 2022, "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers") rounds the input rows of a
weight one at a time and moves each row's rounding error onto the rows not yet rounded, weighted by
the inverse Hessian H = X^T X of the MatMul's calibration inputs X, so the MatMul's *output* error
||X W - X W_q||^2 shrinks rather than the weight error. Deterministic: no random order; the Hessian
is factored in float64, the rows are updated in float32 as the reference implementation does.

What is kept from the reference implementation: dampening 1 % of the mean diagonal, dead inputs
(zero diagonal) zeroed, act-order (rows in order of decreasing H diagonal) with static scales, lazy
batch updates in blocks of 128 rows. The scales are the scheme's own (int4 per channel: the clipping
search, weighted here by H's diagonal so it minimizes the output error to first order; LPBQ: its
block scales); GPTQ only chooses the integers under them.

Hessians come from one pass of the float chain over the calibration samples (`HessianCollector`), keyed
by weight name (the same in a graph and its calibration twin). An input wider than
`FULL_HESSIAN_MAX_WIDTH` keeps only its diagonal (`stages.planning.fitting.hessian_shape`; E2B's
12,288-wide MLP down projections would take 604 MB each in float32): GPTQ then rounds to nearest
under output-weighted scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.planning.fitting import hessian_shape

DAMPENING = 0.01
BLOCK_ROWS = 128


class Hessian:
    """Sum of x x^T over the calibration rows x of one MatMul input (or of x*x where only the
    diagonal is kept), and how many rows went in.

    `add` updates one triangle in place with BLAS's symmetric rank-k update (syrk): half the
    multiply-adds of x^T x and no (in, in) temporary, which at E2B's 6,144-wide inputs made the
    Hessian pass six times faster; `matrix` mirrors the triangle when it is read after an add."""

    def __init__(self, matrix: np.ndarray, rows: int = 0):
        self._matrix = matrix
        self.rows = rows
        self._one_triangle = False  # the lower triangle is the sum; the upper is stale

    @property
    def matrix(self) -> np.ndarray:  # (in, in), or (in,) when diagonal
        if self._one_triangle:
            m = self._matrix
            m[...] = np.tril(m) + np.tril(m, -1).T
            self._one_triangle = False
        return self._matrix

    @property
    def diagonal_only(self) -> bool:
        return self._matrix.ndim == 1

    @property
    def diag(self) -> np.ndarray:
        return self.matrix if self.diagonal_only else np.diagonal(self.matrix)

    def add(self, x: np.ndarray) -> None:
        x = x.astype(np.float32, copy=False)
        if self.diagonal_only:
            self._matrix += np.einsum("ij,ij->j", x, x, dtype=np.float64).astype(np.float32)
        else:
            from scipy.linalg.blas import ssyrk

            # The C-ordered matrix's transpose is Fortran-ordered: syrk updates it in place, its
            # upper triangle being the matrix's lower one.
            out = ssyrk(1.0, x, beta=1.0, c=self._matrix.T, trans=1, lower=0, overwrite_c=1)
            if not np.shares_memory(out, self._matrix):  # a matrix syrk could not update in place
                self._matrix = np.ascontiguousarray(out.T)
            self._one_triangle = True
        self.rows += x.shape[0]


@dataclass(frozen=True)
class Factor:
    """All GPTQ needs of a Hessian, computed once for any number of roundings under it: the inputs that
    never fire, the act-order permutation, and the upper Cholesky factor of the permuted, dampened
    inverse (at E2B's 6,144-row inputs the factor is ~16 s of a ~18 s rounding)."""

    dead: np.ndarray  # (in,) bool
    perm: np.ndarray  # (in,) act-order: rows by decreasing H diagonal
    u: np.ndarray  # (in, in) float32: row i holds what rounding row i does to the rows after it


def factor(h: Hessian) -> Factor:
    """`h`'s GPTQ factor (a full Hessian)."""
    hm = h.matrix.astype(np.float64)
    dead = np.diagonal(hm) == 0
    hm[dead, dead] = 1.0
    perm = np.argsort(-np.diagonal(hm), kind="stable")  # act-order
    hm = hm[np.ix_(perm, perm)]
    hm[np.diag_indices(len(hm))] += DAMPENING * float(np.mean(np.diagonal(hm)))
    return Factor(dead, perm, upper_cholesky_of_inverse(hm).astype(np.float32))


def gptq(
    w: np.ndarray,
    h: Hessian,
    scale: np.ndarray,
    qmin: int = -8,
    qmax: int = 7,
    factored: Factor | None = None,
) -> np.ndarray:
    """Integers for a (in, out) weight under fixed scales. `scale` is (in/b, out): one row of scales
    per block of b input rows (b = in for per-channel). Returns int8 values in [qmin, qmax].
    `factored`: `factor(h)`, where the caller rounds under one Hessian more than once."""
    rows = w.shape[0]
    block = rows // scale.shape[0]
    if h.diagonal_only or h.rows == 0:
        scale64 = np.repeat(scale.astype(np.float64), block, axis=0)
        return np.clip(np.rint(w / scale64), qmin, qmax).astype(np.int8)
    return _gptq_full(w, factored or factor(h), scale, qmin, qmax)[0]


def _gptq_full(
    w: np.ndarray, f: Factor, scale: np.ndarray, qmin: int, qmax: int
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ under a full Hessian's factor: the integers, and each column's output error under the
    dampened Hessian, (w - wq)^T (H + damp I) (w - wq), which GPTQ gets for free as the sum of its
    scaled row errors squared (Frantar et al.'s loss; no in^2 x out product)."""
    rows, cols = w.shape
    block = rows // scale.shape[0]
    W = np.where(f.dead[:, None], np.float32(0), w.astype(np.float32))[f.perm]
    row_scale = np.repeat(scale.astype(np.float32), block, axis=0)[f.perm]
    u = f.u
    q = np.empty((rows, cols), np.int8)
    loss = np.zeros(cols, np.float64)
    for i1 in range(0, rows, BLOCK_ROWS):
        i2 = min(i1 + BLOCK_ROWS, rows)
        w1 = W[i1:i2].copy()
        err = np.empty_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            s = row_scale[i1 + i]
            qi = np.clip(np.rint(w1[i] / s), qmin, qmax)
            q[i1 + i] = qi
            e = (w1[i] - qi * s) / u1[i, i]
            w1[i:] -= np.outer(u1[i, i:], e)
            err[i] = e
        W[i2:] -= u[i1:i2, i2:].T @ err
        loss += np.square(err, dtype=np.float64).sum(axis=0)
    out = np.empty_like(q)
    out[f.perm] = q
    return out, loss


def best_scales(
    w: np.ndarray, h: Hessian, candidates: list[np.ndarray], qmin: int = -8, qmax: int = 7
) -> tuple[np.ndarray, np.ndarray]:
    """Of several scale candidates (each (in/b, out), as `gptq` takes them), each output column's
    that leaves the least output error after GPTQ, and GPTQ's integers under it: (q, scale).

    GPTQ moves a row's rounding error along the same column only, so columns are rounded independently
    and the columns' choices combine into one rounding (the result is gptq(w, h, scale) for the
    returned scale). Ties keep the earlier candidate. One Hessian factor serves every candidate, and
    a full Hessian's error comes with the rounding (under the dampening GPTQ minimizes); a diagonal
    one rounds to nearest and weighs each row's error by its diagonal."""
    full = not (h.diagonal_only or h.rows == 0)
    f = factor(h) if full else None
    block = w.shape[0] // candidates[0].shape[0]
    best_q = best_scale = best_err = None
    for scale in candidates:
        if f is not None:
            q, err = _gptq_full(w, f, scale, qmin, qmax)
        else:
            q = gptq(w, h, scale, qmin, qmax)
            err = column_errors(w, q * np.repeat(scale, block, axis=0), h)
        if best_err is None:
            best_q, best_scale, best_err = q, scale.copy(), err
            continue
        better = err < best_err
        best_q[:, better] = q[:, better]
        best_scale[:, better] = scale[:, better]
        best_err = np.where(better, err, best_err)
    return best_q, best_scale


def _lower_triangular_inverse(lower: np.ndarray) -> np.ndarray:
    """The inverse of a lower-triangular matrix, by halves ([[A, 0], [C, B]]^-1 = [[A^-1, 0],
    [-B^-1 C A^-1, B^-1]]): matrix products instead of a general inverse (numpy has no triangular
    inverse; a general one took 14 s of the 20 s GPTQ spent on a 6,144-row weight)."""
    n = lower.shape[0]
    if n <= 256:
        return np.linalg.inv(lower)
    k = n // 2
    a_inv = _lower_triangular_inverse(lower[:k, :k])
    b_inv = _lower_triangular_inverse(lower[k:, k:])
    out = np.zeros_like(lower)
    out[:k, :k] = a_inv
    out[k:, k:] = b_inv
    out[k:, :k] = -b_inv @ (lower[k:, :k] @ a_inv)
    return out


def upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """U upper-triangular with U^T U = H^-1, without forming H^-1: with P the order reversal and
    P H P = L L^T, H^-1 = (P L^-1 P)^T (P L^-1 P), and P L^-1 P is upper-triangular."""
    lower = np.linalg.cholesky(h[::-1, ::-1])
    return np.ascontiguousarray(_lower_triangular_inverse(lower)[::-1, ::-1])


def _column_energy(x: np.ndarray, h: Hessian) -> np.ndarray:
    """||X x_j||^2 for each column x_j of a (in, out) x, from the Hessian alone (the diagonal
    approximation where only the diagonal was kept); float32 products summed in float64."""
    x = x.astype(np.float32)
    if h.diagonal_only:
        return (h.matrix[:, None] * x * x).sum(axis=0, dtype=np.float64)
    # A BLAS product: in^2 x out multiply-adds (E2B's 6144-row weights: ~1 s).
    return (x * (h.matrix @ x)).sum(axis=0, dtype=np.float64)


def column_errors(w: np.ndarray, dequantized: np.ndarray, h: Hessian) -> np.ndarray:
    """||X (w_j - wq_j)||^2 of each output column j on the calibration inputs."""
    return _column_energy(dequantized - w, h)


def output_error(w: np.ndarray, dequantized: np.ndarray, h: Hessian) -> float:
    """||X (W - W_q)||^2 / ||X W||^2 on the calibration inputs (the diagonal approximation where only
    the diagonal was kept): the noise-to-signal ratio the rounding adds to this MatMul's output."""
    return output_errors(w, [dequantized], h)[0]


def output_errors(w: np.ndarray, roundings: list[np.ndarray], h: Hessian) -> list[float]:
    """`output_error` of several roundings of one weight, its signal ||X W||^2 computed once (each
    term is an in x in x out product: at E2B's 6,144-row weights about a second)."""
    den = float(_column_energy(w, h).sum())
    return [float(column_errors(w, d, h).sum()) / den if den > 0 else 0.0 for d in roundings]


# ---- collecting the Hessians from the float chain ----
def weight_inputs(model) -> dict[str, str]:
    """Weight initializer name -> the activation tensor its MatMul reads (MatMul(x, W) only)."""
    inits = {i.name for i in model.graph.initializer}
    return {
        n.input[1]: n.input[0]
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits and n.input[0] not in inits
    }


@dataclass
class HessianCollector:
    """Stands in for each graph's session in the host runner (`session_for`) and, as the runner's
    observer, adds the real rows of every watched MatMul input to that input's Hessian."""

    watched: set[str]  # weight names whose Hessians are wanted
    hessians: dict[str, Hessian] = field(default_factory=dict)  # weight name -> its input's Hessian
    _pending: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    _inputs: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # graph -> tensor -> weights

    def session_for(self, graph_name: str, src: Path, scratch: Path, options: Any) -> Any:
        """A session over a copy of the graph at src that also returns the watched MatMul inputs."""
        import onnx
        import onnxruntime as ort

        from stages.model.graphs import copy_graph

        model = onnx.load(str(src), load_external_data=False)
        by_tensor: dict[str, list[str]] = {}
        for weight, tensor in weight_inputs(model).items():
            if weight in self.watched:
                by_tensor.setdefault(tensor, []).append(weight)
        outputs = {o.name for o in model.graph.output}
        for tensor in by_tensor:
            if tensor not in outputs:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
        copy = copy_graph(src, scratch / graph_name)
        onnx.save(model, str(copy))  # the graph only: its external data stays in the copied file
        session = ort.InferenceSession(str(copy), options, providers=["CPUExecutionProvider"])
        for f in list(copy.parent.iterdir()):  # the session holds the weights: a part's copy less on disk
            f.unlink()
        self._inputs[graph_name] = by_tensor
        return _HessianSession(self, graph_name, session, list(by_tensor))

    def observe(self, spec, _feeds: Any, _outputs: Any, n: int) -> None:
        for tensor, x in self._pending.pop(spec.name, {}).items():
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] == spec.ar:  # batch 1: the first n rows are the real tokens
                rows = rows[:n]
            weights = self._inputs[spec.name][tensor]
            first = weights[0]
            if first not in self.hessians:
                width = rows.shape[1]
                shape = hessian_shape(width)
                hess = Hessian(np.zeros(shape, np.float32))
                for w in weights:  # the MatMuls reading one tensor share one Hessian
                    self.hessians[w] = hess
            self.hessians[first].add(rows)


class _HessianSession:
    def __init__(self, owner: HessianCollector, graph_name: str, session: Any, extra: list[str]):
        self.owner, self.graph_name, self.session, self.extra = owner, graph_name, session, extra

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.session.run(list(names) + self.extra, feeds)
        self.owner._pending[self.graph_name] = dict(zip(self.extra, out[len(names) :], strict=True))
        return out[: len(names)]


def collect_hessians(
    runner, samples: list[list[int]], watched: set[str], scratch: Path
) -> dict[str, Hessian]:
    """One prefill pass of the float chain over the samples; the Hessian of every watched weight's
    MatMul input (the runner's prefill graphs: the calibration twin's where the stage uses one)."""
    from stages.core.progress import tqdm
    from stages.quant.runner import session_options

    collector = HessianCollector(watched)
    options = session_options()
    with runner.standing_in(
        "prefill",
        lambda spec, src: collector.session_for(spec.name, src, scratch, options),
        collector.observe,
    ):
        total = sum(-(-len(s) // runner.prefill_ar) for s in samples)
        with tqdm(total=total, desc="weight rounding statistics", unit="call", leave=False) as progress:
            runner.prefill_samples(samples, progress)
    return collector.hessians
