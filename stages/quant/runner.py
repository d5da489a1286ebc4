"""The host reference runner: drives the exported part graphs with onnxruntime (CPU) the way Genie
drives the context binaries on the phone.

Token ids become `inputs_embeds` and `per_layer_inputs` by LUT lookup (the float checkpoint tables,
or the quantized Genie LUT files); the prompt is prefilled in chunks of the prefill graph's AR (the
last chunk padded and masked), then decoding runs one graph call per token. Full-attention caches
are linear buffers (slot = position); sliding-window caches are ring buffers of `window` slots
(slot = position mod window), so the masks are what decides visibility, as in Genie's cache groups.
Export tests, quantize calibration and verify all use this one runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stages.core.errors import UserFixable
from stages.model.contract import (
    ATTENTION_MASK_MIN,
    INPUTS_EMBEDS,
    LOGITS,
    MASK_NAME,
    PER_LAYER_INPUTS,
    GraphSpec,
    LutSpec,
    cache_kind,
    cache_name,
    cache_slots,
    rope_name,
)
from stages.model.encoding import LutFile
from stages.model.geometry import FULL, SLIDING, Geometry
from stages.model.graphs import CALIBRATION_ROLE, qdq_file_name

# onnxruntime's constant-folding output limit for sessions that fold weights (its default is 1 GiB).
FOLD_LIMIT_BYTES = 1 << 40


class RunnerError(UserFixable, RuntimeError):
    pass


# ---- embeddings ----
class Embedder(Protocol):
    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """ids (T,) -> inputs_embeds (T,H) and per_layer_inputs (T,L,P) (None without PLE), float32."""
        ...


class CheckpointEmbedder:
    """Exact float embeddings read row by row from the checkpoint's safetensors (memory-mapped)."""

    def __init__(self, checkpoint):
        from stages.model.checkpoint import Checkpoint

        self.ckpt: Checkpoint = checkpoint
        geo = checkpoint.geometry
        self.geo = geo
        self._cache: dict[tuple[str, int], np.ndarray] = {}

    def _row(self, name: str, i: int) -> np.ndarray:
        key = (name, i)
        if key not in self._cache:
            self._cache[key] = self.ckpt.rows(name, i, i + 1).numpy()[0]
        return self._cache[key]

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        geo = self.geo
        emb = np.stack([self._row("embed_tokens.weight", int(i)) for i in ids]) * np.float32(
            geo.hidden_size**0.5
        )
        if not geo.ple_dim:
            return emb.astype(np.float32), None
        ple = np.stack([self._row("embed_tokens_per_layer.weight", int(i)) for i in ids])
        ple = (ple * np.float32(geo.ple_dim**0.5)).reshape(len(ids), geo.num_layers, geo.ple_dim)
        return emb.astype(np.float32), ple.astype(np.float32)


class LutEmbedder:
    """Embeddings from the exported Genie LUT files, dequantized exactly as Genie does."""

    def __init__(self, geo: Geometry, base: Path, luts: dict[str, LutSpec]):
        self.geo = geo
        self.tables = {k: LutFile(base / v.path, v.datatype, v.size) for k, v in luts.items()}
        self.specs = luts

    def _lookup(self, key: str, ids: np.ndarray) -> np.ndarray:
        spec = self.specs[key]
        q = np.asarray(self.tables[key][ids], dtype=np.float32)
        return ((q + np.float32(spec.offset)) * np.float32(spec.scale)).astype(np.float32)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        emb = self._lookup("embedding", ids)
        if "per_layer_embedding" not in self.specs:
            return emb, None
        ple = self._lookup("per_layer_embedding", ids).reshape(
            len(ids), self.geo.num_layers, self.geo.ple_dim
        )
        return emb, ple


def inverse_frequencies(theta: float, dim: int, partial_rotary_factor: float | None = None) -> np.ndarray:
    """The dim/2 RoPE frequencies of a head of `dim`, float32 as transformers computes them; with
    "proportional" scaling (a partial_rotary_factor) the frequencies past that fraction are zero."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if partial_rotary_factor is not None:
        inv[int(partial_rotary_factor * dim // 2) :] = 0.0
    return inv


def rope_tables(geo: Geometry, positions: np.ndarray) -> dict[str, np.ndarray]:
    """cos/sin for the given absolute positions, shaped (1,1,T,D/2), for both attention kinds, in
    float32 as transformers computes them.

    Full layers use "proportional" RoPE: the table is global_head_dim/2 wide but only the first
    partial_rotary_factor of the frequencies are real, the rest are zero (cos 1, sin 0), which is the
    layout Genie's proportional rope-scaling expects.
    """
    cfg = geo.config
    out: dict[str, np.ndarray] = {}
    for kind, dim in ((FULL, cfg["global_head_dim"]), (SLIDING, cfg["head_dim"])):
        params = cfg["rope_parameters"][kind]
        partial = (
            params.get("partial_rotary_factor", 1.0) if params.get("rope_type") == "proportional" else None
        )
        inv = inverse_frequencies(params["rope_theta"], dim, partial)
        freqs = positions.astype(np.float32)[:, None] * inv[None, :]
        out[rope_name(kind, "cos")] = np.cos(freqs)[None, None]
        out[rope_name(kind, "sin")] = np.sin(freqs)[None, None]
    return out


# ---- sampling ----
@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = 0  # None: seeded from the clock

    def picker(self) -> Callable[[np.ndarray], int]:
        rng = np.random.default_rng(self.seed)

        def pick(logits: np.ndarray) -> int:
            if self.temperature <= 0:
                return int(np.argmax(logits))
            z = logits.astype(np.float64) / self.temperature
            order = np.argsort(-z, kind="stable")
            if self.top_k > 0:
                order = order[: self.top_k]
            p = np.exp(z[order] - z[order[0]])
            p /= p.sum()
            if self.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
                order, p = order[:keep], p[:keep] / p[:keep].sum()
            return int(rng.choice(order, p=p))

        return pick


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped_by: str = "max_new_tokens"

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return max(len(self.tokens) - 1, 0) / self.decode_s if self.decode_s else 0.0


# ---- the chain ----
class _Caches:
    """KV caches for the owner layers, in the graphs' layouts, one entry per KV head."""

    def __init__(self, geo: Geometry, context: int):
        self.geo = geo
        self.window = geo.sliding_window
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        for layer in geo.layers:
            if layer.owns_kv:
                slots = context if cache_kind(geo, layer.attention) == FULL else self.window
                self.keys[layer.index] = np.zeros((geo.num_kv_heads, layer.head_dim, slots), np.float32)
                self.values[layer.index] = np.zeros((geo.num_kv_heads, slots, layer.head_dim), np.float32)
        # Absolute position held by each sliding-window slot (-1: empty).
        self.swa_positions = np.full(self.window, -1, np.int64)

    def write(self, layer: int, kind: str, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """keys (kv,D,n) and values (kv,n,D) for positions start..start+n-1, into a cache of this
        kind (`cache_kind`)."""
        n = keys.shape[-1]
        if kind == FULL:
            self.keys[layer][:, :, start : start + n] = keys
            self.values[layer][:, start : start + n] = values
        else:
            for j in range(max(0, n - self.window), n):
                slot = (start + j) % self.window
                self.keys[layer][:, :, slot] = keys[:, :, j]
                self.values[layer][:, slot] = values[:, j]


def session_options(threads: int = 0, fold_weights: bool = False) -> Any:
    """onnxruntime session options for the host chains.

    `fold_weights` (for QDQ graphs): onnxruntime leaves a weight's DequantizeLinear in the graph while
    its QDQ transformers are on, so every call dequantizes every int8/int4 weight again (at E2B width a
    decode step is about 10x slower than the MatMuls themselves). With them off, constant folding runs
    each weight's DequantizeLinear once at load, through the same kernel, so the weights are the same
    floats bit for bit, and prepacking stays off so MatMul sums in the same order. The one other change:
    the default path fuses 8-bit Concats (the KV caches) into QLinearConcat, which the folded session
    runs as plain Q/DQ; on the tiny model that moves logits by 3e-5 of their range and no greedy choice
    (tests/integration/test_quantize.py).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Where QDQ transformers run, onnxruntime fuses a 4-bit per-channel weight DequantizeLinear +
    # MatMul into MatMulNBits and by default (accuracy level 4) quantizes its activations to int8: an
    # error the HTP does not make. Level 1 computes in float32.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if threads:
        options.intra_op_num_threads = threads
    if fold_weights:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        options.add_session_config_entry("session.disable_prepacking", "1")
        # Constant folding skips an output over 1 GiB by default, so E2B's lm_head (262144 x 1536,
        # 1.6 GB as float) stayed a DequantizeLinear run on every call: ~1.6 s per decode token, most
        # of the quantized evaluation's time. No limit: a folded part is at most its float export.
        options.add_session_config_entry(
            "optimization.constant_folding_max_output_size_in_bytes", str(FOLD_LIMIT_BYTES)
        )
    return options


class HostRunner:
    """Runs prompts through the graphs of one export: `graphs` maps role -> the part specs and
    their ONNX files, in part order."""

    def __init__(
        self,
        geo: Geometry,
        graphs: dict[str, list[tuple[GraphSpec, Path]]],
        embedder: Embedder,
        pad_token_id: int = 0,
        threads: int = 0,
        fold_weights: bool = False,
    ):
        self.geo = geo
        self.graphs = graphs
        self.embed = embedder
        self.pad = pad_token_id
        self.context = next(iter(graphs.values()))[0][0].context
        self._options = session_options(threads, fold_weights)
        # Created on first use and released per role: a session holds its graph's weights, and
        # E2B's prefill and decode graphs together (17 GB in float32) do not fit 24 GB with the rest.
        self._sessions: dict[Path, Any] = {}
        self.observer: (
            Callable[[GraphSpec, dict[str, np.ndarray], dict[str, np.ndarray], int], None] | None
        ) = None
        self.reset()

    @classmethod
    def from_export(
        cls,
        export_dir: Path,
        luts: bool = False,
        graph_dir: Path | None = None,
        calibration_twin: bool = False,
        **kw,
    ) -> HostRunner:
        """A runner over exported/ (its report.json lists the graphs), with the checkpoint's float
        embeddings, or with the quantized Genie LUTs when `luts`. `graph_dir` swaps in other files of
        the same graphs (the quantized ones: `<graph>.qdq.onnx`). The calibration-only twins are left
        out, or with `calibration_twin` are the only graphs, run as the prefill kind."""
        from stages.model.checkpoint import Checkpoint
        from stages.planning.results import ExportResult, StageReport

        report = StageReport.read(export_dir)
        if report is None:
            raise RunnerError(f"{export_dir} holds no finished export stage; run `make export` first")
        exported = ExportResult(export_dir, report)
        ckpt = Checkpoint(exported.checkpoint_dir)
        graphs: dict[str, list[tuple[GraphSpec, Path]]] = {}
        files = exported.graph_files()
        for spec in exported.job.specs:
            if (spec.role == CALIBRATION_ROLE) != calibration_twin:
                continue
            path = graph_dir / qdq_file_name(spec.name) if graph_dir else files[spec.name]
            graphs.setdefault("prefill" if calibration_twin else spec.role, []).append((spec, path))
        if not graphs:
            raise RunnerError(f"{export_dir / 'report.json'} lists no {'twin ' * calibration_twin}graphs")
        for parts in graphs.values():
            parts.sort(key=lambda sp: sp[0].part)
        if luts:
            embedder: Embedder = LutEmbedder(ckpt.geometry, export_dir, exported.luts)
        else:
            embedder = CheckpointEmbedder(ckpt)
        return cls(ckpt.geometry, graphs, embedder, **kw)

    def _session(self, path: Path) -> Any:
        import onnxruntime as ort

        if path not in self._sessions:
            self._sessions[path] = ort.InferenceSession(
                str(path), self._options, providers=["CPUExecutionProvider"]
            )
        return self._sessions[path]

    def use_session(self, path: Path, session: Any) -> None:
        """Run `session` (anything with onnxruntime's run(names, feeds)) for the graph at `path` until
        its kind is released: the quantize stage's calibrators stand in for the graphs this way."""
        self._sessions[path] = session

    @contextmanager
    def standing_in(
        self,
        role: str,
        session_for: Callable[[GraphSpec, Path], Any],
        observer: Callable[[GraphSpec, dict[str, np.ndarray], dict[str, np.ndarray], int], None]
        | None = None,
    ) -> Iterator[None]:
        """Within the block, `session_for(spec, path)` runs for each graph of `role` (a calibrator, a
        Hessian collector, a graph fed other weights) and `observer` sees every call; after it, those
        stand-ins are released and the graphs' own sessions come back on use. The quantize stage's
        passes over the float chain all run this way."""
        try:
            for spec, path in self.graphs[role]:
                self.use_session(path, session_for(spec, path))
            self.observer = observer
            yield
        finally:
            self.observer = None
            self.release(role)

    def load(self, role: str) -> None:
        """Build the sessions of one graph kind now (so timings do not include loading)."""
        for _, path in self.graphs.get(role, []):
            self._session(path)

    def release(self, role: str) -> None:
        """Drop the sessions of one graph kind (they are rebuilt when needed again)."""
        for _, path in self.graphs.get(role, []):
            self._sessions.pop(path, None)

    def snapshot(self) -> tuple[int, _Caches]:
        """The position and a copy of the caches, to continue from later with restore()."""
        import copy

        return self.position, copy.deepcopy(self.caches)

    def restore(self, state: tuple[int, _Caches]) -> None:
        import copy

        self.position, self.caches = state[0], copy.deepcopy(state[1])

    def reset(self) -> None:
        self.position = 0
        self.caches = _Caches(self.geo, self.context)

    @property
    def prefill_ar(self) -> int:
        return self.graphs["prefill"][0][0].ar

    def _graph_for(self, n: int) -> list[tuple[GraphSpec, Path]]:
        if "decode" in self.graphs and n <= self.graphs["decode"][0][0].ar:
            return self.graphs["decode"]
        return self.graphs["prefill"]

    def _masks(self, t: int, n: int) -> dict[str, np.ndarray]:
        """Additive masks for T query rows (n real tokens) at positions self.position... ."""
        p0, w = self.position, self.geo.sliding_window
        q = p0 + np.arange(t)
        new = p0 + np.arange(t)
        causal_new = new[None, :] <= q[:, None]
        full_slots = self.context - t
        full_past = np.arange(full_slots)[None, :] < p0
        full = np.concatenate([np.broadcast_to(full_past, (t, full_slots)), causal_new], axis=1)
        swa_pos = self.caches.swa_positions
        swa_past = (swa_pos[None, :] >= 0) & (q[:, None] - swa_pos[None, :] < w)
        swa = np.concatenate([swa_past, causal_new & (q[:, None] - new[None, :] < w)], axis=1)
        to_mask = lambda v: np.where(v, 0.0, ATTENTION_MASK_MIN).astype(np.float32)[None, None]  # noqa: E731
        return {MASK_NAME[FULL]: to_mask(full), MASK_NAME[SLIDING]: to_mask(swa)}

    def prefill_samples(self, samples: list[list[int]], progress: Any = None) -> None:
        """Each sample from an empty cache through the prefill graphs in AR chunks (what calibration
        and its statistics see); `progress` (a tqdm bar) advances once per call."""
        for sample in samples:
            self.reset()
            for i in range(0, len(sample), self.prefill_ar):
                self.step(sample[i : i + self.prefill_ar], role="prefill")
                if progress is not None:
                    progress.update()

    def step(self, ids: list[int], role: str | None = None, parts: int | None = None) -> np.ndarray | None:
        """Run one graph call over `ids` (at most the graph's AR) at the current position; returns
        their logits (n,V) and advances the position and the caches. `role` picks the graph;
        by default the decode graph when the ids fit it. `parts` runs only the first parts of the
        chain (calibrating a part needs nothing after it); then only their caches advance and no
        logits come back. `observer`, when set, sees every graph call: (spec, feeds, outputs, n)."""
        n = len(ids)
        graph = self.graphs[role] if role else self._graph_for(n)
        t = graph[0][0].ar
        if n == 0 or n > t:
            raise RunnerError(f"a graph call takes 1..{t} tokens, got {n}")
        if self.position + t > self.context:
            raise RunnerError(
                f"context full: position {self.position} + AR {t} exceeds max_context {self.context}"
            )
        padded = np.array(list(ids) + [self.pad] * (t - n), dtype=np.int64)
        emb, ple = self.embed(padded)
        rope = rope_tables(self.geo, np.arange(self.position, self.position + t))
        tensors: dict[str, np.ndarray] = {INPUTS_EMBEDS: emb[None], **self._masks(t, n), **rope}
        if ple is not None:
            tensors[PER_LAYER_INPUTS] = ple[None]
        for layer, keys in self.caches.keys.items():
            attention = self.geo.layers[layer].attention
            kind = cache_kind(self.geo, attention)
            slots = cache_slots(self.geo, attention, self.context, t)
            for h in range(self.geo.num_kv_heads):
                tensors[cache_name(layer, kind, "key", h, "in")] = keys[h : h + 1, :, :slots][None]
                tensors[cache_name(layer, kind, "value", h, "in")] = self.caches.values[layer][
                    h : h + 1, :slots
                ][None]
        for spec, path in graph[:parts]:
            feeds = {s.name: tensors[s.name] for s in spec.inputs}
            results = dict(
                zip(
                    (o.name for o in spec.outputs),
                    self._session(path).run([o.name for o in spec.outputs], feeds),
                    strict=True,
                )
            )
            if self.observer is not None:
                self.observer(spec, feeds, results, n)
            tensors.update(results)
        for layer in self.caches.keys:
            kind = cache_kind(self.geo, self.geo.layers[layer].attention)
            if cache_name(layer, kind, "key", 0, "out") not in tensors:
                continue
            keys = np.concatenate(
                [tensors[cache_name(layer, kind, "key", h, "out")][0] for h in range(self.geo.num_kv_heads)]
            )
            values = np.concatenate(
                [tensors[cache_name(layer, kind, "value", h, "out")][0] for h in range(self.geo.num_kv_heads)]
            )
            self.caches.write(layer, kind, self.position, keys[:, :, :n], values[:, :n])
        new_positions = self.position + np.arange(n)
        for p in new_positions[-self.geo.sliding_window :]:
            self.caches.swa_positions[p % self.geo.sliding_window] = p
        self.position += n
        return tensors[LOGITS][0, :n] if LOGITS in tensors else None

    def prefill(self, ids: list[int]) -> np.ndarray:
        """All prompt tokens in chunks of the prefill AR; returns the logits of every prompt position."""
        ar = self.prefill_ar
        if self.position + len(ids) + (-len(ids)) % ar > self.context:
            raise RunnerError(
                f"a prompt of {len(ids)} tokens (padded to whole AR-{ar} chunks) does not fit "
                f"max_context {self.context}"
            )
        return np.concatenate([self.step(ids[i : i + ar], role="prefill") for i in range(0, len(ids), ar)])

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: set[int] = frozenset(),
        sampling: Sampling = Sampling(),
    ) -> Generation:
        self.reset()
        gen = Generation(prompt_ids=list(prompt_ids))
        pick = sampling.picker()
        self.load("prefill")
        t0 = time.perf_counter()
        logits = self.prefill(list(prompt_ids))
        gen.prefill_s = time.perf_counter() - t0
        if "decode" in self.graphs:
            self.release("prefill")
            self.load("decode")
        last = logits[-1]
        t0 = time.perf_counter()
        for _ in range(max_new_tokens):
            tok = pick(last)
            gen.tokens.append(tok)
            if tok in stop_ids:
                gen.stopped_by = f"stop token {tok}"
                break
            if len(gen.tokens) == max_new_tokens:
                break
            if self.position + self._graph_for(1)[0][0].ar > self.context:
                gen.stopped_by = "context full"
                break
            last = self.step([tok])[-1]
        gen.decode_s = time.perf_counter() - t0
        return gen
