"""Measured sensitivity of the model's output to each weight's 4 bits, for the mixed precision's choice.

A MatMul's own output error (`stages.quant.gptq.output_error`) does not say what the error does downstream:
on the trained tiny model the first layers' attention projections cost the most next-token KL per
parameter, which their local error does not single out. So each 4-bit decoder weight is measured end
to end: the float chain runs a few calibration tokens with that one weight replaced by its rounded
(dequantized) values, and the mean KL(float || that chain) of the next-token distributions is its
cost. The costs add up (tiny model: their sum, 0.040, is the all-int4 KL, 0.041), so keeping the
most cost per byte at int8 is a knapsack the greedy choice solves well.

Each part's graph is loaded once, with the measured weights turned into graph inputs, so a
measurement is a chain run with one input swapped, not a new session per weight; and the parts before
the weight's own replay what they computed for the reference instead of computing it again (E2B's
first part holds 15 of its 35 layers, so this saves about a tenth).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def sensitivity_samples(samples: list[list[int]], tokens: int) -> list[list[int]]:
    """The calibration samples' first `tokens` tokens, whole samples first."""
    out, left = [], tokens
    for s in samples:
        if left <= 0:
            break
        out.append(s[:left])
        left -= len(out[-1])
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def mean_kl(reference: np.ndarray, other: np.ndarray) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(other)), in nats."""
    return _KlFrom(reference)(other)


class _KlFrom:
    """mean_kl against one reference, its log-probabilities computed once (at E2B's 262k-token
    vocabulary they were a third of the numpy time of each sensitivity measurement)."""

    def __init__(self, reference: np.ndarray):
        self.log_p = _log_softmax(reference)
        self.p = np.exp(self.log_p)

    def __call__(self, other: np.ndarray) -> float:
        return float(np.mean(np.sum(self.p * (self.log_p - _log_softmax(other)), axis=-1)))


class _WeightFed:
    """A part's session whose measured weights are inputs: the float values, or an override. It
    records its outputs while the reference runs (`recording`), and replays them in order instead of
    computing (`replaying`) while a weight of a later part is measured: the parts before a weight's own
    compute exactly what they computed for the reference."""

    def __init__(self, session: Any, weights: dict[str, np.ndarray], overrides: dict[str, np.ndarray]):
        self.session, self.weights, self.overrides = session, weights, overrides
        self.recording = False
        self.recorded: list[list[np.ndarray]] = []
        self.replay: Any = None  # an iterator over `recorded` while replaying

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.replay is not None:
            return next(self.replay)
        mine = {n: self.overrides.get(n, w) for n, w in self.weights.items()}
        out = self.session.run(names, {**feeds, **mine})
        if self.recording:
            self.recorded.append(out)
        return out


def _weights_as_inputs(src: Path, names: set[str], folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A copy of the graph at src whose initializers `names` are graph inputs; and their values."""
    import onnx
    from onnx import helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / src.name
    model = onnx.load(str(src))
    values = {}
    kept = []
    for init in model.graph.initializer:
        if init.name in names:
            values[init.name] = numpy_helper.to_array(init).astype(np.float32)
            model.graph.input.append(
                helper.make_tensor_value_info(init.name, onnx.TensorProto.FLOAT, init.dims)
            )
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    data = copy.with_name(copy.name + ".data")
    large = src.with_name(src.name + ".data").exists()
    onnx.save(model, str(copy), save_as_external_data=large, location=data.name)
    return copy, values


def measure(runner, dequantized: dict[str, Any], samples: list[list[int]], scratch: Path) -> dict[str, float]:
    """Each weight's end-to-end cost: mean next-token KL(float || float with that weight replaced by
    `dequantized[name]()`) over the samples, each through the runner's prefill graphs from an empty
    cache.
    `dequantized` maps weight name -> a function returning its rounded float values (made one at a
    time: E2B's weights as float are 7 GB)."""
    import onnx
    import onnxruntime as ort

    from stages.core.progress import tqdm
    from stages.quant.runner import session_options

    overrides: dict[str, np.ndarray] = {}
    options = session_options()
    owner: dict[str, int] = {}  # weight -> its part
    parts: dict[int, _WeightFed] = {}

    def fed(spec, src: Path) -> _WeightFed:
        inits = {i.name for i in onnx.load(str(src), load_external_data=False).graph.initializer}
        names = set(dequantized) & inits
        copy, values = _weights_as_inputs(src, names, scratch / spec.name)
        session = ort.InferenceSession(str(copy), options, providers=["CPUExecutionProvider"])
        for f in list(copy.parent.iterdir()):  # the session holds what it needs
            f.unlink()
        owner.update(dict.fromkeys(names, spec.part))
        parts[spec.part] = _WeightFed(session, values, overrides)
        return parts[spec.part]

    with runner.standing_in("prefill", fed):

        def logits() -> np.ndarray:
            rows = []
            for tokens in samples:
                runner.reset()
                for i in range(0, len(tokens), runner.prefill_ar):
                    rows.append(runner.step(tokens[i : i + runner.prefill_ar], role="prefill"))
            return np.concatenate(rows)

        for part in parts.values():
            part.recording = True
        kl_from_reference = _KlFrom(logits())
        for part in parts.values():
            part.recording = False
        costs = {}
        for name in tqdm(sorted(owner), desc="measure weight sensitivity", unit="weight", leave=False):
            overrides[name] = np.asarray(dequantized[name](), dtype=np.float32)
            for index, part in parts.items():
                part.replay = iter(part.recorded) if index < owner[name] else None
            costs[name] = kl_from_reference(logits())
            overrides.clear()
        return costs
