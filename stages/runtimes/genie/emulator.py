"""A host emulator of Genie driving a bundle's own context binaries, built from Genie's public source.

The emulator reads the bundle (genie_config.json, htp_backend_ext_config.json, the tokenizer, the
LUT files, the ctx-bins) and does what Genie's `qualla` engine does with them, keeping every tensor
in the binaries' raw quantized form. Two engines run the graphs:

- `htp`: the ctx-bins themselves, through onnxruntime-qnn's HTP backend, which emulates the target
  Hexagon (htp_arch and soc_model from htp_backend_ext_config.json) on x86: each binary is wrapped in
  an EPContext model (docs/facts.md §4).
- `cpu`: each binary's compiler input (the quantized QDQ graph with its boundary Q/DQ folded, exactly
  what the compile stage handed to the compiler) on onnxruntime's CPU EP; faster, for sizes where
  the emulation is too slow. It needs the work folder's quantized/ graphs.

Genie behaviours emulated, and the public file each follows (GENIE_BEHAVIOURS lists them for reports):
- LUT -> graph input: byte copy when datatype, scale and offset are equal; fixed -> fixed
  requantization otherwise, with Genie's arithmetic (q_in = (T)(s_l/s_i * q_l + s_l/s_i * o_l - o_i),
  a C cast: truncation, no clamp); float32 -> float32 copy; nothing else (qualla/dialog.cpp:
  calculateRequantEncodings, m_t2eCallbacks, requantEmbedding; stages/model/encoding.py states the table).
- Splits: graphs are bucketed by (AR, CL) and ordered by graph name (a std::set), tensors are wired by
  name through one shared buffer per name, so a part's output reaches the next part as raw bytes
  (qualla/engines/qnn-htp/nsp-model.cpp, initializeModel; QnnApi.cpp).
- Prefill chunking: the smallest AR >= the number of inputs, else the largest; chunks of that AR, the
  last one padded; every row past n_process gets the EOS embedding (kvmanager.cpp
  prepareInferenceStrategy; nsp-model.cpp setupInputEmbeddings).
- Attention masks of quantized type: raw all-ones (0xffff / 0xff) attends, 0 masks; float masks 0 /
  -1000. The default group's mask attends the valid cache slots and the new tokens causally; a
  sliding-window group's mask gathers the global mask's columns for the slots it holds and excludes
  positions at window distance or more (nsp-model.cpp setupAttentionMask;
  KVCache/context-manager.cpp SlidingWindow::translateAttentionMask).
- KV caches (SmartMask): quantized caches are cleared to 1 << (bits - 1) (0x80 / 0x8000), whatever
  the tensor's offset; after a step the n_process new entries of every `_out` tensor are copied into
  the `_in` buffer: the default group at n_valid.. (error when full), a sliding-window group into
  free slots, then over the oldest (its recency queue) (KVCache/kvmanager.cpp CacheGroup,
  KVCache/smart-mask.cpp updateKV, KVCache/context-manager.cpp ContextManager/SlidingWindow
  processUpdate).
- Inputs nobody writes are cleared to the tensor's zero (-offset) (nsp-model.cpp clearBuffer,
  initializeUnconnectedInputs).
- Decoding: the prompt is prefilled, a token is picked from the last row of the quantized logits, fed
  back one per step, and generation stops on any id of context.eos-token or a full context
  (qualla/dialogs/basic.cpp).
- The query: Genie prepends context.bos-token (when >= 0) to the ids of the text it is given, read
  with the tokenizer that tokenizer.path names, relative to the bundle (qualla/dialog.cpp
  Dialog::Dialog and Dialog::query: "Add BOS", then _tokenizer->encode). pad-token only fills token-id
  inputs (nsp-model.cpp setupInput); these binaries take embeddings, whose padded rows get the EOS
  embedding, so pad-token changes nothing here and verify holds it to the checkpoint instead.
- The sampler (qualla/samplers/basic-sampler.cpp): greedy when temp <= 0 or top-k == 1, otherwise
  top-k (0: all), top-p, softmax at temp, and a draw; its parameters are refused outside the ranges
  Genie accepts (stages/runtimes/genie/rules.py).
- QnnHtp kv-dim is the kv-dim of a cache group that names none (qualla engines/qnn-htp.cpp); the
  binaries' KV entries must have that width in some group.

Checked against the real Genie (tests/integration/test_real_genie.py): on the tiny bundle and the
demo prompt (13 prefill chunks past the sliding window, then decode steps), every graph input of every
call Genie ran equals the emulator's feed: LUT rows, padded rows, masks, RoPE tables of the valid rows
and hand-over rows exactly, KV caches within one step in at most 2% of entries (the RoPE tables'
last bit). Genie skips the last part of a prefill chunk whose logits it drops; the emulator runs it
(its outputs feed nothing).

Assumptions (Genie's Gemma 4 support, Genie >= 2.48, is newer than the public source):
- `per_layer_inputs` is fed from `perlayer-embedding` by the same T2E rule as `inputs_embeds`.
- Both RoPE tables follow `positional-encoding` (the entry without a prefix feeds `position_ids_*`, the
  `swa_` entry `swa_position_ids_*`); rope-dim is the table width; "proportional" zeroes the
  frequencies past partial-rotary-factor; the angles in double and cos/sin quantized into each
  input's encoding by truncation, as Genie does (checked against its dumps); padded rows continue the
  positions (Genie fills them otherwise; they attend nothing, so nothing reads them).
- Greedy picking takes the first index of the largest raw logit.
- A graph's tensor table (names, shapes, encodings, QNN graph name) is read from the compile stage's
  record of that very file (compiled/report.json, matched by sha256), where Genie reads it from the
  binary through the QNN system API.
- The chat template is rendered on the host as `make run` renders it (without its leading BOS text,
  which Genie adds as bos-token), and Genie's tokenizer adds no special tokens of its own (the
  tokenizers-cpp Encode(text) default).
- A sampled draw is the host runner's (`stages.quant.runner.Sampling`: temperature, then top-k and top-p)
  with numpy's generator seeded by sampler.seed, not Genie's std::mt19937: the same distribution, not
  the same draws.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.quiet import native_stdout_without
from stages.model.contract import INPUTS_EMBEDS, LOGITS, LUT_INPUTS, MASK_NAME
from stages.model.encoding import Encoding, EncodingError, LutFile, feed, feed_mode
from stages.model.geometry import FULL, SLIDING
from stages.planning.results import CompileResult
from stages.runtimes.genie.rules import (
    LUT_SECTION,
    SAMPLER_DEFAULTS,
    sampler_is_greedy,
    sampler_problems,
    window_overflow,
)

ENGINES = ("htp", "cpu")
GENIE_BEHAVIOURS = [
    {
        "behaviour": "LUT rows into inputs_embeds/per_layer_inputs: copy, fixed->fixed requantization, "
        "refusal",
        "source": "qualla/dialog.cpp (calculateRequantEncodings, m_t2eCallbacks, requantEmbedding)",
    },
    {
        "behaviour": "splits bucketed by (AR, CL), ordered by graph name, wired by tensor name as raw bytes",
        "source": "qualla/engines/qnn-htp/nsp-model.cpp (initializeModel), QnnApi.cpp",
    },
    {
        "behaviour": "prefill: smallest AR >= inputs else largest, chunked, padded rows get the EOS "
        "embedding",
        "source": "qualla/engines/qnn-htp/KVCache/kvmanager.cpp (prepareInferenceStrategy), "
        "nsp-model.cpp (setupInputEmbeddings)",
    },
    {
        "behaviour": "quantized masks: raw all-ones attends, 0 masks; sliding-window mask gathered from the "
        "global mask with the window exclusion zone",
        "source": "qualla/engines/qnn-htp/nsp-model.cpp (setupAttentionMask), "
        "KVCache/context-manager.cpp (SlidingWindow::translateAttentionMask)",
    },
    {
        "behaviour": "KV caches cleared to 1<<(bits-1); new entries copied after each step: default group "
        "sequentially, sliding-window group into free slots then over the oldest",
        "source": "qualla/engines/qnn-htp/KVCache/kvmanager.cpp, smart-mask.cpp (updateKV), "
        "context-manager.cpp (ContextManager/SlidingWindow::processUpdate)",
    },
    {
        "behaviour": "inputs no split writes are cleared to the tensor's zero",
        "source": "qualla/engines/qnn-htp/nsp-model.cpp (clearBuffer, initializeUnconnectedInputs)",
    },
    {
        "behaviour": "prefill, pick from the last logits row, decode one token a step, stop on the "
        "eos-token list",
        "source": "qualla/dialogs/basic.cpp",
    },
    {
        "behaviour": "the query: bos-token prepended to the ids of the text, read with the tokenizer "
        "tokenizer.path names; pad-token unused by embedding inputs",
        "source": "qualla/dialog.cpp (Dialog::Dialog, Dialog::query), "
        "engines/qnn-htp/nsp-model.cpp (setupInput)",
    },
    {
        "behaviour": "the sampler: greedy when temp <= 0 or top-k == 1, else top-k, top-p, softmax(temp), "
        "draw; parameters outside Genie's ranges refused",
        "source": "qualla/samplers/basic-sampler.cpp (BasicSampler), libGenie.so's dialog schema",
    },
    {
        "behaviour": "QnnHtp kv-dim: the kv-dim of a cache group that names none",
        "source": "qualla/engines/qnn-htp.cpp (NspEngine::NspEngine)",
    },
    {
        "behaviour": "ASSUMED: per_layer_inputs fed like inputs_embeds; both RoPE tables from "
        "positional-encoding, quantized into the inputs' encodings",
        "source": "not in the public source (Gemma 4 support is newer); "
        "see stages/runtimes/genie/emulator.py",
    },
]
# Each LUT-fed graph input and the genie_config.json section that feeds it.
INPUTS_EMBEDS_KEY = {tensor: LUT_SECTION[key] for tensor, key in LUT_INPUTS.items()}
FLOAT_MASKED = -1000.0
QNN_DATATYPES = {"uint8": "ufixed8", "uint16": "ufixed16", "int8": "sfixed8", "int16": "sfixed16"}


class EmulatorError(ValueError):
    """Genie could not run the bundle, or would run it wrongly without an error; the message says why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding

    @staticmethod
    def from_record(name: str, rec: dict[str, Any]) -> Tensor:
        dtype = rec["dtype"]
        if "scale" in rec:
            enc = Encoding(QNN_DATATYPES[dtype], float(rec["scale"]), int(rec["offset"]))
        else:
            enc = Encoding(dtype)
        return Tensor(name, tuple(rec["shape"]), enc)

    def cleared(self) -> np.ndarray:
        """Genie's clearBuffer: every value the encoding's zero."""
        zero = -self.encoding.offset if self.encoding.is_fixed else 0
        return np.full(self.shape, zero, dtype=self.encoding.numpy_dtype)


@dataclass
class Graph:
    """One QNN graph of one ctx-bin."""

    file: str
    qnn_name: str
    name: str  # the pipeline's graph name (quantized/<name>.qdq.onnx is its compiler input)
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]

    @property
    def ar(self) -> int:
        """The tokens a call takes: the rows of its mask, the full-attention one or, in a part that
        holds only sliding layers (E2B at w4a16: layers 0-3), the sliding window's."""
        mask = next((MASK_NAME[k] for k in (FULL, SLIDING) if MASK_NAME[k] in self.inputs), None)
        return self.inputs[mask].shape[-2] if mask is not None else -1


def read_graphs(bundle_dir: Path, compiled: CompileResult) -> list[Graph]:
    """The ctx-bins' graphs in genie_config.json order, with their tensor tables."""
    from stages.core.report import sha256_file
    from stages.runtimes.genie.files import GENIE_CONFIG

    cfg = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    records = {b.file: b for b in compiled.binaries}
    graphs = []
    files = cfg["engine"]["model"]["binary"]["ctx-bins"]
    twice = sorted({f for f in files if files.count(f) > 1})
    if twice:
        raise EmulatorError(
            f"ctx-bins lists {', '.join(twice)} more than once: Genie would load the same graphs twice"
        )
    for file in files:
        path = bundle_dir / file
        rec = records.get(file)
        if rec is None or not path.is_file():
            raise EmulatorError(f"ctx-bin {file}: missing from the bundle or unknown to compiled/report.json")
        if sha256_file(path) != rec.sha256:
            raise EmulatorError(f"{path}: not the binary compiled/report.json describes (sha256 differs)")
        for g in rec.graphs:
            io = g.io
            graphs.append(
                Graph(
                    file=file,
                    qnn_name=g.qnn_graph_name,
                    name=g.name,
                    inputs={n: Tensor.from_record(n, r) for n, r in io["inputs"].items()},
                    outputs={n: Tensor.from_record(n, r) for n, r in io["outputs"].items()},
                )
            )
    return graphs


# ---- engines ----
class HtpEngine:
    """The ctx-bins on onnxruntime-qnn's HTP backend (x86 emulation of the target's htp_arch)."""

    name = "htp"

    def __init__(self, bundle_dir: Path, soc_model: int, htp_arch: int):
        self.bundle_dir = bundle_dir.resolve()
        self.options = {"soc_model": str(soc_model), "htp_arch": str(htp_arch)}
        self._tmp = tempfile.TemporaryDirectory(prefix="genie-emulator-")
        self._sessions: dict[str, Any] = {}

    def _wrapper(self, graph: Graph) -> Path:
        """An EPContext model around the graph's ctx-bin (embed_mode 0: the file is referenced)."""
        import onnx
        from onnx import helper

        from stages.model.encoding import ONNX_ELEM_TYPE

        def value(t: Tensor):
            return helper.make_tensor_value_info(t.name, ONNX_ELEM_TYPE[t.encoding.datatype], list(t.shape))

        node = helper.make_node(
            "EPContext",
            list(graph.inputs),
            list(graph.outputs),
            name=graph.qnn_name,
            domain="com.microsoft",
            embed_mode=0,
            ep_cache_context=graph.file,
            source="QNNExecutionProvider",
            partition_name=graph.qnn_name,
        )
        g = helper.make_graph(
            [node],
            graph.name,
            [value(t) for t in graph.inputs.values()],
            [value(t) for t in graph.outputs.values()],
        )
        model = helper.make_model(
            g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        model.ir_version = 10  # onnxruntime 1.31 reads IR <= 13
        path = Path(self._tmp.name) / f"{graph.name}_ctx.onnx"
        onnx.save(model, str(path))
        # onnxruntime refuses an ep_cache_context outside the wrapper's folder; a link keeps the
        # bundle untouched.
        link = Path(self._tmp.name) / graph.file
        if not link.exists():
            link.symlink_to(self.bundle_dir / graph.file)
        return path

    def _session(self, graph: Graph) -> Any:
        import onnxruntime as ort
        import onnxruntime_qnn

        if graph.name not in self._sessions:
            ep = onnxruntime_qnn.get_ep_name()
            if ep not in {d.ep_name for d in ort.get_ep_devices()}:
                ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
            devices = [d for d in ort.get_ep_devices() if d.ep_name == ep]
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
            so.add_provider_for_devices(
                devices,
                {
                    "backend_path": onnxruntime_qnn.get_qnn_htp_path(),
                    **self.options,
                    "offload_graph_io_quantization": "0",
                },
            )
            try:
                # libQnnHtp prints a LIBNATIVE configuration notice on stdout when it loads.
                with native_stdout_without():
                    self._sessions[graph.name] = ort.InferenceSession(str(self._wrapper(graph)), so)
            except Exception as e:  # onnxruntime raises its own exception classes
                raise EmulatorError(f"{graph.file}: the HTP emulation could not load it: {e}") from None
        return self._sessions[graph.name]

    def run(self, graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = list(graph.outputs)
        return dict(zip(names, self._session(graph).run(names, feeds), strict=True))

    def close(self) -> None:
        """Drop the sessions (and the graphs they hold); the next run loads them again."""
        self._sessions.clear()


class CpuEngine:
    """Each binary's compiler input (quantized graph, boundary Q/DQ folded) on the CPU EP."""

    name = "cpu"

    def __init__(self, quantized_dir: Path):
        self.quantized_dir = quantized_dir
        self._sessions: dict[str, Any] = {}

    def _session(self, graph: Graph) -> Any:
        import onnx
        import onnxruntime as ort

        from stages.model.encoding import prepare_io
        from stages.model.graphs import qdq_file_name

        if graph.name not in self._sessions:
            path = self.quantized_dir / qdq_file_name(graph.name)
            if not path.is_file():
                raise EmulatorError(f"the cpu engine needs {path}; run `make quantize` or use the htp engine")
            model = onnx.load(str(path))
            prepare_io(model)
            self._sessions[graph.name] = ort.InferenceSession(
                model.SerializeToString(), providers=["CPUExecutionProvider"]
            )
        return self._sessions[graph.name]

    def run(self, graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = list(graph.outputs)
        return dict(zip(names, self._session(graph).run(names, feeds), strict=True))

    def close(self) -> None:
        """Drop the sessions (and the graphs they hold); the next run loads them again."""
        self._sessions.clear()


def pick_ar(ars: list[int], n_inputs: int) -> int:
    """kvmanager.cpp's pick: the smallest AR >= n, else the largest AR below it."""
    above = [a for a in ars if a >= n_inputs]
    return min(above) if above else max(ars)


# ---- RoPE ----
def rope_table(entry: dict[str, Any], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (T, rope-dim) for one `positional-encoding` entry."""
    from stages.quant.runner import inverse_frequencies

    width = int(entry["rope-dim"])
    scaling = entry.get("rope-scaling") or {}
    partial = scaling.get("partial-rotary-factor") if scaling.get("rope-type") == "proportional" else None
    inv = inverse_frequencies(float(entry["rope-theta"]), 2 * width, partial)
    # In double, as Genie computes the angles (its dumped tables match only so).
    freqs = positions.astype(np.float64)[:, None] * np.asarray(inv, dtype=np.float64)[None, :]
    return np.cos(freqs), np.sin(freqs)


def quantize_truncating(enc: Encoding, x: np.ndarray) -> np.ndarray:
    """x into a fixed-point encoding as Genie quantizes its RoPE tables: q = (T)(x / scale - offset),
    a C cast that truncates (measured: QAIRT 2.51's dumped position_ids_* equal this in every entry
    on the tiny bundle; rounding to nearest differed in up to 59 of 64)."""
    if not enc.is_fixed:
        return np.asarray(x, dtype=enc.numpy_dtype)
    info = np.iinfo(enc.numpy_dtype)
    q = np.trunc(np.asarray(x, dtype=np.float64) / enc.scale - enc.offset)
    return np.clip(q, info.min, info.max).astype(enc.numpy_dtype)


# ---- cache groups ----
@dataclass
class CacheGroup:
    """One `cache-groups` entry and Genie's state for it (KVCache/kvmanager.cpp CacheGroup)."""

    prefix: str
    mask_name: str
    window: int | None  # sliding-window span, None without longcontext
    kv_dim: int
    buffers: dict[str, np.ndarray] = field(default_factory=dict)  # `<name>_in` -> raw cache, max slots
    tensors: dict[str, Tensor] = field(default_factory=dict)
    n_valid: int = 0
    slot_position: list[int] = field(default_factory=list)
    activated: bool = False
    recent: deque = field(default_factory=deque)

    def matches(self, name: str) -> bool:
        return re.match(rf"^{re.escape(self.prefix)}(?:key|value)_.*_in$", name) is not None

    def clear(self) -> None:
        for name, t in self.tensors.items():
            bits = t.encoding.bits
            value = 1 << (bits - 1) if t.encoding.is_fixed else 0
            self.buffers[name] = np.full(self.buffers[name].shape, value, dtype=t.encoding.numpy_dtype)
        self.n_valid, self.activated = 0, False
        self.slot_position = [-1] * self.max_slots
        self.recent = deque()

    @property
    def max_slots(self) -> int:
        return max((b.shape[-1] if "_key_" in n else b.shape[-2]) for n, b in self.buffers.items())

    def budget(self, splits: list[Graph]) -> int:
        """Slots of this group's past in one variant's graphs (ctx - AR for the group)."""
        name, t = next((n, t) for g in splits for n, t in g.inputs.items() if self.matches(n))
        return t.shape[-1] if "_key_" in name else t.shape[-2]

    def destinations(self, n_update: int, budget: int) -> list[int]:
        """Where the n_update new entries go (ContextManager / SlidingWindow::processUpdate)."""
        if self.window is None:
            if n_update > budget - self.n_valid:
                raise EmulatorError(
                    f"cache group {self.prefix!r}: {self.n_valid} + {n_update} entries exceed its {budget} "
                    "slots and it has no longcontext: Genie stops with 'Context Size was exceeded'"
                )
            dst = list(range(self.n_valid, self.n_valid + n_update))
            self.n_valid += n_update
            return dst
        n_empty = min(n_update, budget - self.n_valid)
        n_evict = n_update - n_empty
        if not self.activated and n_evict > 0:
            self.activated = True
            self.recent = deque(range(self.n_valid))
        if n_evict > len(self.recent):
            raise EmulatorError(window_overflow(self.prefix, n_update, budget, len(self.recent)))
        dst = list(range(self.n_valid, self.n_valid + n_empty))
        dst += [self.recent.popleft() for _ in range(n_evict)]
        if self.activated:
            self.recent.extend(dst)
        self.n_valid = min(budget, self.n_valid + n_update)
        return dst

    def accept(self, outputs: dict[str, np.ndarray], n: int, budget: int, positions: np.ndarray) -> None:
        """Copy the first n entries of every `_out` into the `_in` buffers (SmartMask::updateKV)."""
        dst = self.destinations(n, budget)
        for name, buf in self.buffers.items():
            out = outputs.get(name[: -len("_in")] + "_out")
            if out is None:
                continue
            for j, d in enumerate(dst):  # later writes win, as memcpy in order does
                if "_key_" in name:
                    buf[..., d] = out[..., j]
                else:
                    buf[..., d, :] = out[..., j, :]
        for j, d in enumerate(dst):
            self.slot_position[d] = int(positions[j])


# ---- the emulator ----
@dataclass
class RecordedCall:
    """One graph call as the engine ran it: its step, then every split's feeds and outputs (raw
    quantized tensors, copied: the emulator reuses its buffers), for a replay on another engine."""

    step: dict[str, Any]
    runs: list[tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]]


@dataclass
class Emulation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # dequantized rows the tokens were picked from
    steps: list[dict[str, Any]] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped_by: str = "max_new_tokens"


class GenieEmulator:
    """Genie's dialog over a bundle: `generate` runs a prompt, `prefill`/`step` expose the logits."""

    def __init__(
        self,
        bundle_dir: Path,
        compiled: CompileResult,
        engine: str = "htp",
        quantized_dir: Path | None = None,
    ):
        from stages.runtimes.genie.files import GENIE_CONFIG

        if engine not in ENGINES:
            raise EmulatorError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
        self.bundle_dir = bundle_dir
        self.config = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
        self.graphs = read_graphs(bundle_dir, compiled)
        if engine == "htp":
            self.engine: HtpEngine | CpuEngine = HtpEngine(bundle_dir, *self.htp_device())
        else:
            if quantized_dir is None:
                raise EmulatorError("the cpu engine needs the work folder's quantized/ graphs")
            self.engine = CpuEngine(quantized_dir)
        self.variants = self._variants()
        self.groups = self._cache_groups()
        self._check_backend_kv_dim()
        self.tokenizer = self._tokenizer()
        self.sampler = dict(self.config["sampler"])
        problems = sampler_problems(self.sampler, int(self.config["context"]["n-vocab"]))
        if problems:
            raise EmulatorError("Genie would refuse its sampler: " + "; ".join(problems))
        self.bos = int(self.config["context"].get("bos-token", -1))
        self.luts = self._luts()
        self.rope = self._rope_entries()
        self.context = int(self.config["context"]["size"])
        self.eos = [int(t) for t in np.atleast_1d(self.config["context"]["eos-token"])]
        self.buffers: dict[str, np.ndarray] = {}
        # A predicate over a step (its index in the run, ar, n_process, n_past, and `wraps`: the
        # sliding-window groups that evict in it); the calls it accepts are kept in `recorded`.
        self.record: Callable[[dict[str, Any]], bool] | None = None
        self.recorded: list[RecordedCall] = []
        # Over the emulator's life (every run): graph calls made and seconds spent in the engine.
        self.calls_run = 0
        self.engine_s = 0.0
        self.reset()

    # -- set-up: what Genie derives from the config and the binaries --
    def htp_device(self) -> tuple[int, int]:
        """soc_model and htp_arch from htp_backend_ext_config.json, as the HTP backend reads them."""
        ext = json.loads((self.bundle_dir / self.config["engine"]["backend"]["extensions"]).read_text())
        device = ext["devices"][0]
        return int(device["soc_model"]), int(str(device["dsp_arch"]).lstrip("v"))

    def _variants(self) -> dict[int, list[Graph]]:
        """Splits per AR, ordered as Genie orders them: by QNN graph name."""
        by_ar: dict[int, list[Graph]] = {}
        for g in self.graphs:
            if g.ar < 0:
                raise EmulatorError(f"{g.file}: graph {g.qnn_name} has no attention mask input")
            by_ar.setdefault(g.ar, []).append(g)
        writers: dict[str, Tensor] = {}
        for ar, splits in by_ar.items():
            splits.sort(key=lambda g: g.qnn_name)
            written: set[str] = set()
            for k, g in enumerate(splits):
                for name, t in g.inputs.items():
                    later = [s for s in splits[k + 1 :] if name in s.outputs]
                    if later and name not in written:
                        raise EmulatorError(
                            f"AR-{ar}: Genie orders splits by graph name "
                            f"({', '.join(s.file for s in splits)}), so {g.file} runs before "
                            f"{later[0].file}, which writes its input {name}; name the "
                            "graphs so that they sort in part order"
                        )
                    w = writers.get(name)
                    if name in written and w is not None and w.encoding != t.encoding:
                        raise EmulatorError(
                            f"{name} leaves one split as {w.encoding.describe()} and enters {g.file} as "
                            f"{t.encoding.describe()}: Genie hands over the raw bytes, so {g.file} "
                            "misreads it"
                        )
                written |= set(g.outputs)
                writers.update(g.outputs)
            if LOGITS not in splits[-1].outputs:
                raise EmulatorError(f"AR-{ar}: the last split ({splits[-1].file}) has no logits output")
        return dict(sorted(by_ar.items()))

    def _cache_groups(self) -> list[CacheGroup]:
        groups = []
        for entry in self.config["engine"]["cache-groups"]:
            lc = entry.get("longcontext") or {}
            window = None
            if lc:
                if lc.get("type") != "sliding-window":
                    raise EmulatorError(
                        f"cache group {entry['prefix']!r}: longcontext {lc.get('type')!r} is not emulated"
                    )
                window = int(lc["sliding-window"]["window-size"])
            groups.append(
                CacheGroup(entry["prefix"], entry["attention-mask-tensor-name"], window, int(entry["kv-dim"]))
            )
        kv_inputs = {n for g in self.graphs for n in g.inputs if re.search(r"_(?:key|value)_\d+_h\d+_in$", n)}
        for group in groups:
            for g in self.graphs:
                for name, t in g.inputs.items():
                    if not group.matches(name):
                        continue
                    slots = t.shape[-1] if "_key_" in name else t.shape[-2]
                    dim = t.shape[-2] if "_key_" in name else t.shape[-1]
                    if dim != group.kv_dim:
                        raise EmulatorError(
                            f"cache group {group.prefix!r}: kv-dim {group.kv_dim} in genie_config.json, but "
                            f"{name} "
                            f"in {g.file} holds {dim}-wide entries"
                        )
                    old = group.buffers.get(name)
                    if old is None or (old.shape[-1] if "_key_" in name else old.shape[-2]) < slots:
                        group.buffers[name] = np.zeros(t.shape, dtype=t.encoding.numpy_dtype)[0, 0]
                        group.tensors[name] = t
            if not group.buffers:
                raise EmulatorError(
                    f"cache group prefix {group.prefix!r} matches no KV cache input of the binaries "
                    f"(they have {', '.join(sorted({n.split('_')[0] + '_' for n in kv_inputs}))})"
                )
            if not any(group.mask_name in g.inputs for g in self.graphs):
                raise EmulatorError(f"cache group {group.prefix!r}: no binary has its mask {group.mask_name}")
        orphans = sorted(n for n in kv_inputs if not any(gr.matches(n) for gr in groups))
        if orphans:
            raise EmulatorError(
                f"KV inputs {', '.join(orphans[:4])} belong to no cache group: Genie would feed them zeros"
            )
        return groups

    def _check_backend_kv_dim(self) -> None:
        kv_dim = self.config["engine"]["backend"].get("QnnHtp", {}).get("kv-dim", 128)
        widths = sorted({g.kv_dim for g in self.groups})
        if kv_dim not in widths:
            raise EmulatorError(
                f"QnnHtp kv-dim {kv_dim} in genie_config.json, but the binaries' KV caches hold "
                f"{' and '.join(map(str, widths))}-wide entries: a cache group without its own kv-dim "
                "would be read at the wrong width"
            )

    def _tokenizer(self):
        """The tokenizer tokenizer.path names, opened relative to the bundle as genie-t2t-run opens it
        from the bundle folder; a path outside the bundle is refused (it would not be pushed)."""
        from tokenizers import Tokenizer

        name = self.config["tokenizer"]["path"]
        path = (self.bundle_dir / name).resolve()
        if not path.is_relative_to(self.bundle_dir.resolve()) or not path.is_file():
            raise EmulatorError(f"tokenizer.path {name!r} names no file of the bundle {self.bundle_dir}")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise EmulatorError(f"tokenizer.path {name!r}: not a tokenizer Genie can read ({e})") from None

    def query_ids(self, text: str) -> list[int]:
        """The ids Genie feeds for a query text: bos-token (when >= 0), then the text's own ids."""
        return ([self.bos] if self.bos >= 0 else []) + self.tokenizer.encode(
            text, add_special_tokens=False
        ).ids

    def pick(self, raw: np.ndarray, greedy: bool) -> int:
        """One token from one row of raw logits: greedy (the first largest) where asked or where the
        sampler is greedy, otherwise a draw after top-k, top-p and the temperature."""
        if greedy or sampler_is_greedy(self.sampler):
            return int(np.argmax(raw))
        return self._draw(self.logits_encoding.dequantize(raw))

    def _luts(self) -> dict[str, tuple[LutFile, Encoding, Encoding]]:
        """graph input -> (LUT rows, LUT encoding, input encoding), refused where Genie cannot feed."""
        first = {n: t for g in self.graphs for n, t in g.inputs.items()}
        luts = {}
        for name, key in INPUTS_EMBEDS_KEY.items():
            section = self.config.get(key)
            if name not in first:
                if section is not None:
                    raise EmulatorError(f"genie_config.json has {key!r} but no binary takes {name}")
                continue
            if section is None:
                raise EmulatorError(f"the binaries take {name}, but genie_config.json has no {key!r} LUT")
            q = section.get("quant-param", {})
            lut = Encoding(section["datatype"], float(q.get("scale", 1.0)), int(q.get("offset", 0)))
            target = first[name].encoding
            if feed_mode(lut, target) is None:
                raise EmulatorError(
                    f"{name}: Genie cannot feed a {target.describe()} input from the {lut.describe()} LUT "
                    f"{section['lut-path']} (dialog.cpp m_t2eCallbacks has no such path)"
                )
            size = int(section["size"])
            if size != int(np.prod(first[name].shape[2:])):
                raise EmulatorError(
                    f"{key}.size is {size}, the input {name} takes {int(np.prod(first[name].shape[2:]))} "
                    "per token"
                )
            try:
                rows = LutFile(self.bundle_dir / section["lut-path"], lut.datatype, size)
            except EncodingError as e:
                raise EmulatorError(str(e)) from None
            luts[name] = (rows, lut, target)
        if INPUTS_EMBEDS not in luts:
            raise EmulatorError("the binaries take no inputs_embeds; only LUT-fed models are emulated")
        return luts

    def _rope_entries(self) -> dict[str, dict[str, Any]]:
        """Tensor-name prefix -> positional-encoding entry."""
        entries = self.config["engine"]["model"].get("positional-encoding", [])
        entries = entries if isinstance(entries, list) else [entries]
        return {e.get("prefix", ""): e for e in entries if e.get("type", "rope") == "rope"}

    # -- state --
    def reset(self) -> None:
        from stages.quant.runner import Sampling

        s = {**SAMPLER_DEFAULTS, **self.sampler}
        # BasicSampler::reset reseeds; -1 seeds from the clock.
        seed = int(s.get("seed", -1))
        self._draw = Sampling(s["temp"], s["top-k"], s["top-p"], seed if seed >= 0 else None).picker()
        self.n_past = 0
        self.steps: list[dict[str, Any]] = []
        for group in self.groups:
            group.clear()
        self.buffers = {n: t.cleared() for g in self.graphs for n, t in {**g.inputs, **g.outputs}.items()}

    def pick_ar(self, n_inputs: int) -> int:
        return pick_ar(list(self.variants), n_inputs)

    # -- one graph call --
    def _embed(self, name: str, ids: list[int], ar: int) -> np.ndarray:
        rows, lut, target = self.luts[name]
        pad = self.eos[0]
        if max(ids + [pad]) >= len(rows):
            raise EmulatorError(f"token id {max(ids + [pad])} is outside the {len(rows)}-row LUT for {name}")
        raw = rows[np.array(ids + [pad] * (ar - len(ids)))]
        values = feed(raw, lut, target)
        return values.reshape(next(g.inputs[name].shape for g in self.variants[ar] if name in g.inputs))

    def _masks(self, ar: int, n: int, splits: list[Graph]) -> dict[str, np.ndarray]:
        out = {}
        q = self.n_past + np.arange(ar)
        for group in self.groups:
            t = next(
                (g.inputs[group.mask_name] for g in self.variants[ar] if group.mask_name in g.inputs), None
            )
            if t is None:
                continue
            budget = group.budget(splits)
            pos = np.array(group.slot_position[:budget])
            past = (pos[None, :] >= 0) & (pos[None, :] <= q[:, None])
            if group.window is not None:
                # The exclusion zone of setupAttentionMask: positions at window distance or more.
                past &= q[:, None] - pos[None, :] < group.window
            new = np.arange(ar)[None, :] <= np.arange(ar)[:, None]
            attend = np.concatenate([past, new], axis=1)
            attend[n:] = False
            enc = t.encoding
            if enc.is_fixed:
                on = np.iinfo(enc.numpy_dtype).max
                values = np.where(attend, on, 0).astype(enc.numpy_dtype)
            else:
                values = np.where(attend, 0.0, FLOAT_MASKED).astype(enc.numpy_dtype)
            out[group.mask_name] = values.reshape(t.shape)
        return out

    def _rope(self, ar: int) -> dict[str, np.ndarray]:
        tensors = {n: t for g in self.variants[ar] for n, t in g.inputs.items()}
        positions = self.n_past + np.arange(ar)
        out = {}
        for prefix, entry in self.rope.items():
            cos, sin = rope_table(entry, positions)
            for which, values in (("cos", cos), ("sin", sin)):
                t = tensors.get(f"{prefix}position_ids_{which}")
                if t is None:
                    continue
                if values.shape[-1] != t.shape[-1]:
                    raise EmulatorError(
                        f"positional-encoding {prefix or '(global)'} rope-dim {values.shape[-1]}, but "
                        f"{t.name} is {t.shape[-1]} wide"
                    )
                out[t.name] = quantize_truncating(t.encoding, values).reshape(t.shape)
        return out

    def call(self, ids: list[int]) -> np.ndarray:
        """One inference step of len(ids) tokens with the AR Genie picks; returns the raw logits rows."""
        ar = self.pick_ar(len(ids))
        n = len(ids)
        if n > ar:
            raise EmulatorError(f"a step takes at most AR-{ar} tokens, got {n}")
        if self.n_past + n > self.context:
            raise EmulatorError(
                f"context full: {self.n_past} + {n} tokens exceed context.size {self.context}"
            )
        splits = self.variants[ar]
        fed = {name: self._embed(name, list(ids), ar) for name in self.luts}
        fed.update(self._masks(ar, n, splits))
        fed.update(self._rope(ar))
        self.buffers.update(fed)
        for group in self.groups:
            for name, buf in group.buffers.items():
                budget = group.budget(splits)
                self.buffers[name] = (buf[:, :budget] if "_key_" in name else buf[:budget])[None, None]
        step = {
            "index": len(self.steps),
            "ar": ar,
            "n_process": n,
            "n_past": self.n_past,
            "wraps": [
                g.prefix for g in self.groups if g.window is not None and g.n_valid + n > g.budget(splits)
            ],
        }
        keep = self.record is not None and self.record(step)
        runs = []
        outputs: dict[str, np.ndarray] = {}
        for g in splits:
            feeds = {name: self.buffers[name].reshape(t.shape) for name, t in g.inputs.items()}
            t0 = time.perf_counter()
            result = self.engine.run(g, feeds)
            self.engine_s += time.perf_counter() - t0
            if keep:
                runs.append(
                    (g, {k: v.copy() for k, v in feeds.items()}, {k: v.copy() for k, v in result.items()})
                )
            self.buffers.update(result)
            outputs.update(result)
        if keep:
            self.recorded.append(RecordedCall(step, runs))
        positions = self.n_past + np.arange(n)
        for group in self.groups:
            kv = {k: v[0, 0] for k, v in outputs.items() if k.startswith(group.prefix) and k.endswith("_out")}
            group.accept(kv, n, group.budget(splits), positions)
        self.n_past += n
        self.calls_run += 1
        self.steps.append({"ar": ar, "n_process": n, "wraps": step["wraps"]})
        return outputs[LOGITS][0, :n]

    def prefill_rows(self, ids: list[int]) -> np.ndarray:
        """The prompt in Genie's chunks; returns the raw logits of every prompt token."""
        ar = self.pick_ar(len(ids))
        return np.concatenate([self.call(ids[i : i + ar]) for i in range(0, len(ids), ar)])

    def prefill(self, ids: list[int]) -> np.ndarray:
        """The prompt in Genie's chunks; returns the raw logits of the last prompt token."""
        return self.prefill_rows(ids)[-1]

    @property
    def logits_encoding(self) -> Encoding:
        return self.variants[min(self.variants)][-1].outputs[LOGITS].encoding

    def generate(self, prompt_ids: list[int], max_new_tokens: int, greedy: bool = False) -> Emulation:
        """Genie's answer to the prompt ids; greedy=True picks greedily whatever the config's sampler
        (as Genie does with top-k 1 applied to its sampler)."""
        self.reset()
        run = Emulation(list(prompt_ids))
        t0 = time.perf_counter()
        raw = self.prefill(list(prompt_ids))
        run.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        while True:
            run.logits.append(self.logits_encoding.dequantize(raw))
            tok = self.pick(raw, greedy)
            run.tokens.append(tok)
            if tok in self.eos:
                run.stopped_by = f"eos-token {tok}"
                break
            if len(run.tokens) >= max_new_tokens:
                break
            if self.n_past + 1 > self.context:
                run.stopped_by = "context full"
                break
            raw = self.call([tok])[-1]
        run.decode_s = time.perf_counter() - t0
        run.steps = list(self.steps)
        return run

    def logits_along(self, prompt_ids: list[int], path: list[int]) -> np.ndarray:
        """Dequantized logits after the prompt and after each token of `path` (teacher forcing), as
        Genie computes them for a prompt that holds the path: in prefill chunks, AR times fewer calls
        than one decode step a token (generate runs the decode steps)."""
        self.reset()
        rows = self.prefill_rows(list(prompt_ids) + list(path))[len(prompt_ids) - 1 :]
        return self.logits_encoding.dequantize(rows)
