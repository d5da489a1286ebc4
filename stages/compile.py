"""The compile stage: quantized QDQ graphs -> QNN context binaries for the SoC's HTP, in compiled/.

Three steps, whichever backend builds the binaries:

1. prepare: the Q/DQ pairs at the graph boundary are folded into the graph's I/O, so each binary
   takes and returns the quantized tensors Genie moves (uint16 activations, uint8 KV on v69) with
   the encodings the quantize stage pinned (both LUT-fed inputs, `inputs_embeds` and
   `per_layer_inputs`, with their LUT's exact encoding, whatever the PLE policy); float I/O (the
   float16 PLE policy's `xfer_per_layer_embeds` between parts) stays float.
2. rules check (`check_rules`): what the SoC table says the target cannot do is refused here, with
   the offending nodes listed, before anyone waits on a compiler: activation x activation MatMuls
   with two 16-bit sides without a 16x16 matmul (v69 silently inserts a Convert instead of failing),
   graphs linked into one binary without weight sharing, a binary whose estimated allocation is over
   the SoC's per-context limit (the SoC table's context_allocation), and a tensor named by several
   graphs (crossing parts, or shared by prefill and decode) with different encodings, which Genie
   refuses at load (`stages.model.encoding.shared_tensor_mismatches`).
3. a backend: `local` runs onnxruntime-qnn's offline HTP preparation for the SoC's soc_model and
   htp_arch (CPU fallback off, so a node the HTP cannot take fails the compile and is named), one
   process per binary, as many at once as memory allows; `aihub` (stages/aihub.py) submits compile
   (and, with weight sharing, link) jobs to Qualcomm AI Hub with a resumable job ledger.

Every binary is checked after it is made: one HTP partition per graph, the SoC string the compiler
wrote into it, and the graph's I/O tensor names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import click

from stages.aihub import AihubError, compile_aihub
from stages.core.command import Context
from stages.core.config import PipelineConfig
from stages.core.errors import UserFixable
from stages.core.quiet import call_without_native_noise
from stages.core.report import (
    REPORT_NAME,
    StageJob,
    proc_field_bytes,
    process_peak_rss_bytes,
    read_report,
    sha256_file,
)
from stages.core.soc import Soc
from stages.model.contract import CACHE_PREFIX
from stages.model.encoding import IoTensor, QdqGraph, prepare_io, shared_tensor_mismatches
from stages.model.graphs import Binary, qdq_file_name
from stages.planning.results import CompileResult, QuantizeResult, StageReport, require_result

# Above this an ONNX file must keep its weights as external data (protobuf's 2 GB limit). Graphs below
# it are handed to onnxruntime as bytes: onnxruntime names the QNN graph after a hash of the model's
# path when it has one, which would make binaries differ between work folders.
EXTERNAL_DATA_BYTES = 1_900_000_000
# Peak RSS of onnxruntime-qnn's HTP preparation per byte of graph weights (docs/facts.md §4: a 455 MB graph
# peaked at 2 GB), plus a fixed overhead; used to decide how many graphs compile at once.
COMPILE_RSS_PER_WEIGHT_BYTE = 4.5
COMPILE_RSS_OVERHEAD = 600 << 20
# QNN's refusal of an oversized context (fa_alloc.cc); a successful compile prints no estimate, even
# at verbose log level (checked with QAIRT 2.51, soc 36 / v69).
COMPILER_ESTIMATE = re.compile(r"estimated allocation of (\d+) KB, limit is (\d+) KB")


class CompileError(UserFixable, ValueError):
    """The compile cannot go on; the message says what failed, where, and what to do."""


# ---- 1. prepare ----
def weight_bytes(model) -> int:
    return sum(_tensor_bytes(t.data_type, t.dims) for t in model.graph.initializer)


# ONNX element types narrower than a byte (numpy has no such dtype): INT4, UINT4.
SUB_BYTE_BITS = {21: 4, 22: 4}


def _tensor_bytes(data_type: int, dims) -> int:
    import numpy as np
    from onnx import helper

    n = int(np.prod(dims)) if len(dims) else 1
    if data_type in SUB_BYTE_BITS:
        return (n * SUB_BYTE_BITS[data_type] + 7) // 8
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize


def io_bytes(model) -> int:
    """Bytes of the graph's input and output tensors, which the HTP allocates with the context."""
    total = 0
    for v in (*model.graph.input, *model.graph.output):
        t = v.type.tensor_type
        total += _tensor_bytes(t.elem_type, [d.dim_value for d in t.shape.dim])
    return total


def binary_allocation(models: list) -> int:
    """Weights + graph I/O of one context binary: the part of the compiler's estimated allocation
    that the graphs alone fix (the plan adds intermediates and spill-fill, which only the compiler
    knows exactly). Graphs linked into one context share its weights; their I/O never coexists."""
    return weight_bytes(models[0]) + max(io_bytes(m) for m in models)


# ---- 2. rules ----
def activation_matmuls(model) -> list[tuple[str, str, str]]:
    """(node, type of A, type of B) for every MatMul whose two operands are activations."""
    view = QdqGraph(model.graph)
    return [
        (n.name, view.stored_type(n.input[0]), view.stored_type(n.input[1]))
        for n in model.graph.node
        if n.op_type == "MatMul" and not view.is_constant(n.input[0]) and not view.is_constant(n.input[1])
    ]


def check_rules(
    soc: Soc,
    layout: list[Binary],
    graphs: dict[str, Any],
    encodings: dict[str, dict[str, dict[str, IoTensor]]],
) -> list[str]:
    """Every way the prepared graphs break the SoC's rules, as readable lines (empty: all good)."""
    problems = []
    for name, model in graphs.items():
        for node, ta, tb in activation_matmuls(model):
            if not soc.matmul_16x16 and ta in {"uint16", "int16"} and tb in {"uint16", "int16"}:
                problems.append(
                    f"{name}: MatMul {node} multiplies two 16-bit activations ({ta} x {tb}); "
                    f"{soc.name} ({soc.dsp_arch}) has no 16x16 activation matmul: quantize with an "
                    "8-bit side (kv_bits=auto or 8)"
                )
    for b in layout:
        if b.weight_shared and not soc.weight_sharing:
            problems.append(
                f"{b.file}: links {', '.join(b.graphs)} into one weight-shared binary, which "
                f"{soc.name} ({soc.dsp_arch}) cannot load (weight sharing needs v73+)"
            )
        models = [graphs[g] for g in b.graphs if g in graphs]
        if models:
            size = binary_allocation(models)
            limit = soc.limits.context_allocation.bytes
            if size > limit:
                problems.append(
                    f"{b.file}: needs an estimated allocation of at least {size // 1024} KB (weights + I/O), "
                    f"over {soc.name}'s per-context limit of {limit // 1024} KB ({soc.dsp_arch}): "
                    "raise num_shards (`g4v69 plan` names the smallest that fits)"
                )
    problems += _cross_part_mismatches(encodings)
    return problems


def _cross_part_mismatches(encodings: dict[str, dict[str, dict[str, IoTensor]]]) -> list[str]:
    """A tensor named by more than one graph (a part's output read by the next part, a cache, a mask,
    a LUT-fed input shared by prefill and decode) must be the same bytes in all of them."""
    io = {
        g: {d: {t: e.to_dict() for t, e in ts.items()} for d, ts in gio.items()}
        for g, gio in encodings.items()
    }
    return shared_tensor_mismatches(io, tuple(f"{p}_" for p in CACHE_PREFIX.values()))


# ---- 3. local backend ----
def qairt_version_of_onnxruntime_qnn() -> str:
    """The QAIRT version onnxruntime-qnn bundles, from its libQnnHtp.so (e.g. "2.51.0")."""
    import onnxruntime_qnn

    data = Path(onnxruntime_qnn.get_qnn_htp_path()).read_bytes()
    m = re.search(rb"v(\d+\.\d+\.\d+)\.\d{6,}", data)
    if m is None:
        raise CompileError(f"cannot read the QAIRT version from {onnxruntime_qnn.get_qnn_htp_path()}")
    return m.group(1).decode()


def compile_local(
    soc_model: int,
    htp_arch: int,
    binary_file: str,
    graphs: list[tuple[str, str]],
    out_dir: str,
    weight_sharing: bool,
) -> dict[str, Any]:
    """Compile one binary (its graphs, in order) in this process; run in a fresh child per binary.

    `graphs` is [(graph name, prepared .onnx path)]. Returns the binary's figures.
    """

    import onnxruntime as ort
    import onnxruntime_qnn

    ep = onnxruntime_qnn.get_ep_name()
    if ep not in {d.ep_name for d in ort.get_ep_devices()}:
        ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep]
    work = Path(out_dir) / f".{binary_file}.work"
    work.mkdir()
    started = time.perf_counter()
    contexts = []
    for k, (name, path) in enumerate(graphs):
        ctx = work / f"{name}_ctx.onnx"
        so = _context_session_options(ctx, severity=3)
        if weight_sharing:
            so.add_session_config_entry("ep.share_ep_contexts", "1")
            if k == len(graphs) - 1:
                so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
        options = {
            "backend_path": onnxruntime_qnn.get_qnn_htp_path(),
            "soc_model": str(soc_model),
            "htp_arch": str(htp_arch),
            "enable_htp_prepare_only": "1",
            # Float nodes (the float16 PLE paths) run in fp16 on the HTP.
            "enable_htp_fp16_precision": "1",
            "offload_graph_io_quantization": "0",
            "htp_graph_finalization_optimization_mode": "3",
        }
        if weight_sharing:
            options["enable_htp_weight_sharing"] = "1"
        so.add_provider_for_devices(devices, options)
        t0 = time.perf_counter()
        try:
            ort.InferenceSession(_model_source(path), so)
        except Exception as e:  # onnxruntime raises its own Fail/RuntimeException classes
            detail = _why_refused(str(e), path, devices, options, work)
            raise CompileError(
                f"{name}: onnxruntime-qnn could not compile it for soc_model {soc_model} / "
                f"v{htp_arch}: {detail}"
            ) from None
        contexts.append((name, ctx, round(time.perf_counter() - t0, 3)))
    figures = _one_binary(binary_file, contexts, work, Path(out_dir))
    shutil.rmtree(work)
    figures["compile_s"] = round(time.perf_counter() - started, 3)
    figures["peak_rss_bytes"] = process_peak_rss_bytes()
    return figures


def _why_refused(detail: str, path: str, devices, options: dict[str, str], work: Path) -> str:
    """onnxruntime-qnn's refusal, made actionable: the nodes the HTP cannot take, the compiler log's
    causes of a MEM_ALLOC, or its own allocation estimate against its per-context limit."""
    if "fallback to CPU EP has been explicitly disabled" in detail:
        nodes = _nodes_left_on_cpu(path, devices, options, work)
        detail = f"the HTP cannot take these nodes: {', '.join(nodes[:20]) or '(unknown)'}"
    elif "QNN_COMMON_ERROR_MEM_ALLOC" in detail:
        # QNN says MEM_ALLOC also when its graph optimizer cannot build an op it made itself
        # (docs/facts.md §4); only its verbose log tells which.
        causes = _compiler_log_errors(path, options, work)
        if causes:
            detail += "; the compiler's log: " + "; ".join(causes)
    estimate = COMPILER_ESTIMATE.search(detail)
    if estimate:  # the compiler's own figure, which it prints only when it refuses
        detail = (
            f"the compiler estimates {estimate.group(1)} KB, over its limit of {estimate.group(2)} "
            "KB per context: raise num_shards (`g4v69 plan` prices each binary)"
        )
    return detail


def _one_binary(
    binary_file: str, contexts: list[tuple[str, Path, float]], work: Path, out_dir: Path
) -> dict[str, Any]:
    """Each graph's EP context checked to be one HTP partition, all of them in one context binary,
    moved to out_dir as `binary_file`; the binary's figures."""
    import onnx

    figures: dict[str, Any] = {"file": binary_file, "graphs": []}
    bins = set()
    for name, ctx, seconds in contexts:
        m = onnx.load(str(ctx))
        nodes = [(n.op_type, n.name) for n in m.graph.node]
        if [t for t, _ in nodes] != ["EPContext"]:
            raise CompileError(
                f"{name}: the HTP took the graph in {sum(t == 'EPContext' for t, _ in nodes)} partitions "
                f"with {sum(t != 'EPContext' for t, _ in nodes)} nodes outside; one partition is required"
            )
        attrs = {a.name: (a.s.decode() if a.s else a.i) for a in m.graph.node[0].attribute}
        bins.add(attrs["ep_cache_context"])
        figures["graphs"].append(
            {"name": name, "qnn_graph_name": attrs["partition_name"], "compile_s": seconds}
        )
        figures["qairt_sdk"] = attrs["ep_sdk_version"]
    if len(bins) != 1:
        raise CompileError(
            f"{binary_file}: expected one context binary, onnxruntime-qnn wrote {sorted(bins)}"
        )
    os.replace(work / bins.pop(), out_dir / binary_file)
    return figures


def _context_session_options(ctx: Path | str, severity: int, cpu_fallback: bool = False):
    """Session options that make onnxruntime-qnn write the graph's context binary beside `ctx`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = severity
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(ctx))
    so.add_session_config_entry("ep.context_embed_mode", "0")
    if not cpu_fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def _model_source(path: str) -> str | bytes:
    """What onnxruntime loads: the path when the weights are external data, else the model's bytes
    (a model given by path gets its QNN graph named after a hash of the path: `EXTERNAL_DATA_BYTES`)."""
    return path if Path(f"{path}.data").exists() else Path(path).read_bytes()


# The lines of QNN's verbose log that say why a graph failed.
QNN_LOG_ERROR = re.compile(r"(?:<E>|::ERROR:)\s*(.*)")
MAX_LOG_CAUSES = 4


def _compiler_log_errors(path: str, options: dict[str, str], work: Path) -> list[str]:
    """Compile again in a fresh interpreter with QNN's verbose log on its stderr (the EP's logger keeps
    the severity it was registered under, and this process may have registered it quietly); the
    first distinct errors of that log."""
    log = work / "diagnose.log"
    with log.open("wb") as f:
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from stages.compile import compile_verbose; compile_verbose(*sys.argv[1:])",
                path,
                json.dumps(options),
                str(work / "diagnose_log_ctx.onnx"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=f,
            check=False,
        )
    causes: list[str] = []
    with log.open(errors="replace") as f:
        for line in f:
            m = QNN_LOG_ERROR.search(line)
            # The per-node echoes of one failure, and an option notice every compile here prints.
            if not m or "generated: could not create op" in line or "GraphHtpSettings option" in line:
                continue
            cause = m.group(1).strip()
            if cause and cause not in causes:
                causes.append(cause)
            if len(causes) == MAX_LOG_CAUSES:
                break
    log.unlink()
    return causes


def compile_verbose(path: str, options_json: str, ctx: str) -> None:
    """One compile with onnxruntime's and QNN's logs at their most verbose, on stderr (a diagnosis run)."""
    import onnxruntime as ort
    import onnxruntime_qnn

    ort.set_default_logger_severity(0)
    ep = onnxruntime_qnn.get_ep_name()
    ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
    so = _context_session_options(ctx, severity=0)
    options = {**json.loads(options_json), "qnn_log_level": "verbose"}
    so.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == ep], options)
    try:
        ort.InferenceSession(_model_source(path), so)
    except Exception:  # the failure being diagnosed; its log is the output
        pass


def _nodes_left_on_cpu(path: str, devices, options: dict[str, str], work: Path) -> list[str]:
    """Compile again with CPU fallback allowed; the nodes outside the EPContext are the HTP's refusals."""
    import onnx
    import onnxruntime as ort

    ctx = work / "diagnose_ctx.onnx"
    so = _context_session_options(ctx, severity=3, cpu_fallback=True)
    so.add_provider_for_devices(devices, options)
    try:
        ort.InferenceSession(_model_source(path), so)
        return [f"{n.name} ({n.op_type})" for n in onnx.load(str(ctx)).graph.node if n.op_type != "EPContext"]
    except Exception:
        return []


def parallel_compiles(binary_bytes: list[int], cpus: int | None = None) -> int:
    """How many binaries may compile at once: CPUs, and the memory the largest one is expected to need."""
    cpus = cpus or os.cpu_count() or 1
    need = max(binary_bytes, default=0) * COMPILE_RSS_PER_WEIGHT_BYTE + COMPILE_RSS_OVERHEAD
    return max(1, min(cpus, len(binary_bytes), int(available_memory_bytes() // need)))


def available_memory_bytes() -> int:
    return proc_field_bytes("/proc/meminfo", "MemAvailable") or 4 << 30


def sortable_graph_name(name: str, part: int, num_parts: int) -> str:
    """`name` with its start replaced by `part001_of_002_` and its end by `_1_of_2`: the same length.

    Genie buckets the graphs of one AR and context length and runs them in split order: by the
    `<prefix>_<split>_of_<total>` ending when every name has one (QAIRT 2.51 warns about, and orders
    last, a name without it), else in the bucket's lexicographic order (qualla nsp-model.cpp).
    onnxruntime-qnn names graphs after a hash, so part 2 could sort before part 1: the name carries
    the part both ways."""
    tag, tail = f"part{part:03d}_of_{num_parts:03d}_", f"_{part}_of_{num_parts}"
    if len(name) <= len(tag) + len(tail):
        raise CompileError(f"QNN graph name {name!r} is too short to carry the part order")
    return tag + name[len(tag) : len(name) - len(tail)] + tail


def rename_graph(path: Path, name: str, part: int, num_parts: int) -> str:
    """Rewrite the graph's name inside the context binary (same length, every occurrence); returns it."""
    new = sortable_graph_name(name, part, num_parts)
    data = path.read_bytes()
    if name.encode() not in data:
        raise CompileError(f"{path.name}: the graph name {name} is not in the binary")
    tmp = path.with_name(f".{path.name}.renamed")
    tmp.write_bytes(data.replace(name.encode(), new.encode()))
    os.replace(tmp, path)  # a new inode: a hard link elsewhere keeps the old bytes
    return new


# ---- checks on a finished binary ----
def check_binary(path: Path, soc: Soc, io_names: list[str]) -> dict[str, Any]:
    """The compiler wrote the SoC we asked for, and the graph I/O tensors are in the binary."""
    data = path.read_bytes()
    if not data:
        raise CompileError(f"{path.name} is empty")
    socs = sorted({m.decode() for m in re.findall(rb"soc_type=(\w+);arch=\d+", data)})
    archs = sorted({int(m) for m in re.findall(rb"soc_type=\w+;arch=(\d+)", data)})
    if not socs:
        # Without the string nothing says which Hexagon the binary was prepared for: refused, not
        # passed unchecked.
        raise CompileError(
            f"{path.name} carries no soc_type=...;arch=... string, so it cannot be confirmed to be "
            f"built for {soc.name} / arch {soc.htp_arch}; compile again with the pinned onnxruntime-qnn "
            "(docker/compile/requirements.lock), whose binaries carry it"
        )
    if socs != [soc.name] or archs != [soc.htp_arch]:
        raise CompileError(
            f"{path.name} was built for {socs} / arch {archs}, not {soc.name} / {soc.htp_arch}"
        )
    missing = [t for t in io_names if t.encode() not in data]
    if missing:
        raise CompileError(f"{path.name} lacks the graph I/O tensors {', '.join(missing[:8])}")
    return {"soc_type": socs[0], "arch": archs[0]}


# ---- the stage ----
def _load_quantized(workdir: Path) -> tuple[QuantizeResult, dict[str, Path]]:
    quantized = require_result(workdir, "quantize", QuantizeResult, CompileError)
    paths = quantized.graph_files()
    wanted = quantized.job.shipped_graphs
    missing = [qdq_file_name(g) for g in wanted if g not in paths or not paths[g].is_file()]
    if missing:
        raise CompileError(f"{quantized.folder} lacks {', '.join(missing)}; run `make quantize` again")
    return quantized, {g: paths[g] for g in wanted}


def prepare_graphs(
    sources: dict[str, Path], dest: Path
) -> tuple[dict[str, Path], dict[str, Any], dict[str, dict[str, dict[str, IoTensor]]]]:
    """Prepared copies of the QDQ graphs in dest; returns (paths, models without weights, encodings)."""
    import onnx

    paths, models, encodings = {}, {}, {}
    for name, src in sources.items():
        model = onnx.load(str(src))
        encodings[name] = prepare_io(model)
        out = dest / f"{name}.onnx"
        large = weight_bytes(model) > EXTERNAL_DATA_BYTES
        onnx.save(model, str(out), save_as_external_data=large, location=f"{out.name}.data")
        paths[name] = out
        models[name] = model
    return paths, models, encodings


def run_compile(
    cfg: PipelineConfig, workdir: Path, jobs: int | None = None, aihub_module: Any = None
) -> dict[str, Any]:
    """The whole stage; returns its report. Bad input raises CompileError and leaves nothing."""
    soc = cfg.soc_info
    quantized, sources = _load_quantized(workdir)
    q_dir = quantized.folder
    job = StageJob("compile", cfg, workdir)
    job.check([q_dir])
    layout = list(quantized.job.binaries)
    inputs = [q_dir / REPORT_NAME, *sources.values()]
    # Prepared copies of the graphs, then binaries of about their size.
    need = 2 * sum(f.stat().st_size for s in sources.values() for f in s.parent.glob(f"{s.name}*"))
    with job.output(inputs, need) as run:
        prepared_dir = run.dir / ".prepared"
        prepared_dir.mkdir()
        paths, models, encodings = prepare_graphs(sources, prepared_dir)
        problems = check_rules(soc, layout, models, encodings)
        if problems:
            raise CompileError(
                f"the graphs break {soc.name}'s rules ({len(problems)}):\n  " + "\n  ".join(problems)
            )
        sizes = {b.file: sum(weight_bytes(models[g]) for g in b.graphs) for b in layout}
        allocations = {b.file: binary_allocation([models[g] for g in b.graphs]) for b in layout}
        del models
        started = time.perf_counter()
        # Local compiles at once: `jobs`, or as many as the CPUs and the memory of the largest allow.
        workers = jobs or (parallel_compiles(list(sizes.values())) if cfg.compiler == "local" else 1)
        figures, backend = _compile_binaries(cfg, layout, paths, run.dir, workdir, workers, aihub_module)
        shutil.rmtree(prepared_dir)
        for b, fig in zip(layout, figures, strict=True):
            sized = (sizes[b.file], allocations[b.file])
            _check_and_record(fig, b, run.dir / b.file, soc, len(quantized.job.parts), encodings, sized)
        run.figures.update(
            {
                "soc": soc.name,
                "soc_model": soc.soc_model,
                "dsp_arch": soc.dsp_arch,
                "backend": backend,
                "binaries": figures,
                "compile_wall_s": round(time.perf_counter() - started, 3),
                "kv_cache_bits": quantized.kv_cache_bits,
                "ple_policy": quantized.ple_policy,
            }
        )
    return read_report(job.out_dir)


def _compile_binaries(
    cfg: PipelineConfig,
    layout: list[Binary],
    paths: dict[str, Path],
    out: Path,
    workdir: Path,
    workers: int,
    aihub_module: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every binary by the config's compiler: here with onnxruntime-qnn (its QAIRT must be the
    config's), or on AI Hub (its jobs in a ledger, so a rerun picks them up). (each binary's figures,
    the backend's record)."""
    from stages.core.progress import tqdm

    soc = cfg.soc_info
    if cfg.compiler == "local":
        qairt = qairt_version_of_onnxruntime_qnn()
        if not qairt.startswith(cfg.qairt_version + "."):
            raise CompileError(
                f"qairt_version={cfg.qairt_version}, but onnxruntime-qnn here bundles QAIRT {qairt}; "
                "set QAIRT_VERSION to match or use COMPILER=aihub"
            )
        figures = _compile_all_local(soc, layout, paths, out, workers, tqdm)
        return figures, {"name": "local", "qairt_version": qairt, "parallel": workers}
    ledger = workdir / ".g4v69" / "aihub_jobs.json"
    try:
        figures, qairt = compile_aihub(cfg, layout, paths, out, ledger, aihub_module)
    except AihubError as e:
        raise CompileError(str(e)) from None
    shutil.copy2(ledger, out / "aihub_jobs.json")
    return figures, {"name": "aihub", "qairt_version": qairt, "device": soc.aihub_device}


def _check_and_record(
    fig: dict[str, Any],
    b: Binary,
    path: Path,
    soc: Soc,
    n_parts: int,
    encodings: dict[str, Any],
    sized: tuple[int, int],
) -> None:
    """A compiled binary checked (`check_binary`: its I/O tensor names, its SoC) and its figures
    completed: graph names as Genie reads them, part, weight bytes and estimated allocation (`sized`),
    size, hash, every graph's I/O encodings."""
    for gf in fig["graphs"]:
        if "qnn_graph_name" in gf:  # AI Hub does not report its graph names
            gf["qnn_graph_name"] = rename_graph(path, gf["qnn_graph_name"], b.part, n_parts)
    io_names = [t for g in b.graphs for d in ("inputs", "outputs") for t in encodings[g][d]]
    fig.update(check_binary(path, soc, io_names))
    fig.update(
        part=b.part,
        weight_shared=b.weight_shared,
        weight_bytes=sized[0],
        # Ours (weights + I/O): the compiler prints its own estimate only when it refuses.
        estimated_allocation_bytes=sized[1],
        allocation_limit_bytes=soc.limits.context_allocation.bytes,
        bytes=path.stat().st_size,
        sha256=sha256_file(path),
    )
    for gf in fig["graphs"]:
        gf["io"] = {
            d: {t: e.to_dict() for t, e in encodings[gf["name"]][d].items()} for d in encodings[gf["name"]]
        }


def _compile_all_local(soc: Soc, layout: list[Binary], paths: dict[str, Path], out: Path, workers: int, tqdm):
    """One fresh process per binary (a crash or a leak stays there; its peak RSS is its own)."""
    results: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        futures = {
            pool.submit(
                call_without_native_noise,
                compile_local,
                soc.soc_model,
                soc.htp_arch,
                b.file,
                [(g, str(paths[g])) for g in b.graphs],
                str(out),
                b.weight_shared,
            ): b.file
            for b in layout
        }
        with tqdm(total=len(futures), desc=f"compile for {soc.name} ({soc.dsp_arch})", unit="binary") as bar:
            try:
                for f in futures:
                    results[futures[f]] = f.result()
                    bar.update()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    return [results[b.file] for b in layout]


# ---- the stage's command (`g4v69 compile`; the stage table names it) ----
@click.command(name="compile")
@click.option(
    "--jobs",
    type=click.IntRange(1),
    default=None,
    help="binaries compiled at once by the local backend (default: as many as CPUs and memory allow)",
)
@click.pass_obj
def command(obj: Context, jobs: int | None) -> None:
    """QNN context binaries for the SoC's HTP into compiled/ (compiler: local or aihub)."""
    from stages.compile import run_compile

    report = run_compile(obj.config, obj.workdir, jobs)
    c = CompileResult(obj.workdir / "compiled", StageReport.from_dict(report))
    total = sum(b.bytes for b in c.binaries)
    # The binaries compile in child processes; the stage's own peak RSS misses theirs.
    peak = max([c.report.peak_rss_bytes] + [b.peak_rss_bytes for b in c.binaries])
    click.echo(
        f"{c.folder}: {len(c.binaries)} binaries for {c.soc} ({c.dsp_arch}), {total / 1e6:.1f} MB, "
        f"QAIRT {c.backend.qairt_version} ({c.backend.name}); {c.report.wall_s:.1f} s, "
        f"peak RSS {peak / 2**30:.2f} GiB"
    )
