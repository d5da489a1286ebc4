"""The export stage: a downloaded checkpoint -> static-shape ONNX part graphs + host LUTs in exported/.

For each part of the job (layers balanced by weight bytes, `stages.planning.job.part_layers`; the plan
prices the same job) the part's weights are read from the memory-mapped safetensors as float32, every
graph kind (prefill AR-N, decode AR-1, and the calibration-only twin of the prefill kind at `calibration_ar`,
`stages.model.graphs.calibration_kind`) is exported with torch.onnx (dynamo, opset 23: fused RMSNormalization
and Gelu), checked against the torch module with onnxruntime, and the weights are dropped before the
next part: at most one part's weights are ever held in float32.

The host LUTs are written in Genie's formats: the token embedding (times sqrt(hidden)) as ufixed16
and the per-layer token table (times sqrt(ple_dim)) as ufixed8 or ufixed16, each with one scale and
offset (real = (q + offset) * scale), quantized in row blocks so memory stays flat.
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import numpy as np

from stages.core.command import Context
from stages.core.config import PipelineConfig
from stages.core.errors import UserFixable
from stages.core.report import REPORT_NAME, StageJob, read_report
from stages.model.checkpoint import Checkpoint
from stages.model.contract import ATTENTION_MASK_MIN, GraphSpec, LutSpec
from stages.model.encoding import pack_nibbles
from stages.model.geometry import Geometry
from stages.planning.job import Job
from stages.planning.results import ExportResult, StageReport
from stages.runtimes import get_runtime

OPSET = 23
# Graphs whose weights exceed this keep them in a side file (ONNX protobufs stop at 2 GiB).
EXTERNAL_DATA_BYTES = 512 << 20
# Rows sampled (evenly) for the range search of a LUT under 8 bits, and the range factors it tries.
CLIP_SAMPLE_ROWS = 4096
CLIP_RATIOS = tuple(round(0.4 + 0.025 * i, 3) for i in range(25))
LUT_BLOCK_ROWS = 8192
# ONNX vs torch on random inputs; float32 graphs should agree to rounding.
CHECK_TOLERANCE = 1e-3


class ExportError(UserFixable, ValueError):
    pass


def _example_inputs(spec: GraphSpec, seed: int) -> list:
    """Inputs with realistic ranges: masks 0 (everything visible), RoPE in [-1, 1], the rest normal."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for t in spec.inputs:
        if "mask" in t.name:
            out.append(torch.zeros(t.shape))
        elif "position_ids" in t.name:
            out.append(torch.rand(t.shape, generator=g) * 2 - 1)
        else:
            out.append(torch.randn(t.shape, generator=g))
    return out


def export_graph(geo: Geometry, spec: GraphSpec, weights: dict, path: Path) -> dict[str, Any]:
    """One graph to ONNX at `path`, checked with onnxruntime; returns figures for the report."""
    import onnxruntime as ort
    import torch

    from stages.model.decoder import DecoderPart

    module = DecoderPart(geo, spec, weights).eval()
    params = sum(p.numel() for p in module.parameters())
    example = _example_inputs(spec, seed=spec.part)
    t0 = time.perf_counter()
    # The exporter logs a line per missing torchvision op and deprecation chatter; none of it is ours.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            tuple(example),
            dynamo=True,
            opset_version=OPSET,
            input_names=[t.name for t in spec.inputs],
            output_names=[t.name for t in spec.outputs],
            optimize=True,
            verbose=False,
        )
    external = params * 4 > EXTERNAL_DATA_BYTES
    program.save(str(path), external_data=external)
    export_s = time.perf_counter() - t0
    del program

    with torch.no_grad():
        expected = [o.numpy() for o in module(*example)]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if names != [t.name for t in spec.inputs]:
        raise ExportError(
            f"{path.name}: graph inputs {names} differ from the contract's {[t.name for t in spec.inputs]}"
        )
    got = session.run(
        [o.name for o in spec.outputs], {t.name: x.numpy() for t, x in zip(spec.inputs, example, strict=True)}
    )
    worst = 0.0
    for o, a, b in zip(spec.outputs, got, expected, strict=True):
        if a.shape != tuple(o.shape):
            raise ExportError(
                f"{path.name}: output {o.name} has shape {a.shape}, the contract says {o.shape}"
            )
        worst = max(worst, float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max()))))
    if worst > CHECK_TOLERANCE:
        raise ExportError(f"{path.name}: onnxruntime and torch disagree (relative error {worst:.2e})")
    del session, module
    return {
        "params": params,
        "export_s": round(export_s, 3),
        "onnx_vs_torch_rel_error": worst,
        "external_data": external,
        # The graph file plus its external-data file, when there is one.
        "bytes": sum(f.stat().st_size for f in path.parent.glob(f"{path.name}*")),
    }


def _encoding(lo: float, hi: float, bits: int) -> tuple[float, int]:
    """A scale that is exactly a float32 (graph tensors hold float32 scales, and Genie copies LUT rows
    into a graph input only when the LUT's scale in genie_config.json equals the input's exactly)."""
    qmax = (1 << bits) - 1
    scale = float(np.float32((hi - lo) / qmax)) if hi > lo else 1.0
    return scale, int(round(lo / scale))


def _clipped_range(sample: np.ndarray, lo: float, hi: float, bits: int) -> tuple[float, float]:
    """The range, [lo, hi] shrunk by the factor with the least squared error on `sample`. At 4 bits
    the table's few extreme values would otherwise spend most of its 16 levels (the tiny model's
    per-layer LUT: KL 0.0044 at its min..max, 0.0014 clipped; docs/fitting.md)."""
    x = sample.astype(np.float32).ravel()
    best, best_err = (lo, hi), np.inf
    for ratio in CLIP_RATIOS:
        scale, offset = _encoding(lo * ratio, hi * ratio, bits)
        q = np.clip(np.rint(x / np.float32(scale)) - offset, 0, (1 << bits) - 1)
        err = float(np.square((q + offset) * np.float32(scale) - x).sum())
        if err < best_err:
            best, best_err = (lo * ratio, hi * ratio), err
    return best


def write_lut(ckpt: Checkpoint, name: str, multiplier: float, bits: int, path: Path) -> LutSpec:
    """Quantize a checkpoint table (times `multiplier`) to one global ufixed encoding, streaming."""
    from stages.core.progress import tqdm

    rows, size = next(t.shape for t in ckpt.geometry.all_tensors() if t.name == name)
    blocks = range(0, rows, LUT_BLOCK_ROWS)
    lo, hi = np.inf, -np.inf
    stride = max(1, rows // CLIP_SAMPLE_ROWS)
    sample = []
    for start in tqdm(blocks, desc=f"{name}: range", unit="block", leave=False):
        block = ckpt.rows(name, start, min(rows, start + LUT_BLOCK_ROWS)).numpy() * np.float32(multiplier)
        lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
        if bits < 8:
            sample.append(block[(-start) % stride :: stride])
    if bits < 8:
        lo, hi = _clipped_range(np.concatenate(sample), lo, hi, bits)
    del sample
    scale, offset = _encoding(lo, hi, bits)
    if bits < 8 and size * bits % 8:
        raise ExportError(f"{name}: rows of {size} entries do not pack into whole bytes at {bits} bits")
    dtype = np.uint16 if bits == 16 else np.uint8
    with open(path, "wb") as f:
        for start in tqdm(blocks, desc=f"{name}: ufixed{bits}", unit="block", leave=False):
            block = ckpt.rows(name, start, min(rows, start + LUT_BLOCK_ROWS)).numpy() * np.float32(multiplier)
            q = np.clip(np.rint(block.astype(np.float64) / scale - offset), 0, (1 << bits) - 1).astype(dtype)
            (pack_nibbles(q) if bits == 4 else q).tofile(f)
    return LutSpec(path=path.name, rows=rows, size=size, bits=bits, scale=scale, offset=offset)


def _relative(path: Path, root: Path) -> str:
    """Paths in reports are relative to the work folder, so a report does not depend on where it ran."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path.resolve())


def _priced_job(cfg: PipelineConfig, ckpt: Checkpoint, checkpoint_dir: Path):
    """The job of this config on the checkpoint, worked out once and priced as it will be built:
    refused here, before anything is written, when the runtime cannot run its layout, a binary would
    be over the SoC's per-context limit, or the checkpoint lacks a tensor. (job, plan)."""
    from stages.model.graphs import PartitionError
    from stages.planning.fitting import make_plan, over_context_limit

    geo = ckpt.geometry
    try:
        job = Job.build(geo, cfg)
    except (PartitionError, ValueError) as e:
        raise ExportError(str(e)) from None
    # After the graphs' own shape rules (a context too small for the window says so first).
    refused = get_runtime(cfg.runtime).layout_problems(cfg, geo)
    if refused:
        raise ExportError(refused[0])
    plan = make_plan(job, geo, cfg)
    too_big = over_context_limit(geo, cfg, plan)
    if too_big:
        raise ExportError(too_big)
    missing = [t.name for t in geo.all_tensors() if ckpt.prefix + t.name not in ckpt.files]
    if missing:
        raise ExportError(f"{checkpoint_dir}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")
    return job, plan


def _export_graphs(
    ckpt: Checkpoint, job: Job, out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, tuple[dict[str, Any], Any]]]:
    """Every graph of the job into out_dir, a part at a time: at most one part's weights are held in
    float32. (each graph's figures, the checkpoint's stored grids of the weights they hold)."""
    from stages.core.progress import tqdm
    from stages.model.decoder import matmul_layout, part_weight_names

    geo = ckpt.geometry
    graphs: list[dict[str, Any]] = []
    carried: dict[str, tuple[dict[str, Any], Any]] = {}
    progress = tqdm(total=len(job.specs), desc="export graphs", unit="graph")
    for p in range(len(job.parts)):
        part_specs = [s for s in job.specs if s.part == p + 1]
        names = part_weight_names(geo, part_specs[0])
        weights = {n: matmul_layout(ckpt.tensor(n)) for n in names}
        carried.update(carried_grids(ckpt, names))
        for spec in part_specs:
            path = out_dir / f"{spec.name}.onnx"
            figures = export_graph(geo, spec, weights, path)
            graphs.append({"name": spec.name, "onnx": path.name, "spec": spec.to_dict(), **figures})
            progress.update(1)
        del weights
        gc.collect()
    progress.close()
    return graphs, carried


def _write_luts(ckpt: Checkpoint, ple_lut_bits: int, lut_dir: Path) -> dict[str, LutSpec]:
    """The host LUTs: the token embedding (times sqrt(hidden)) as ufixed16, and the per-layer
    embedding table (times sqrt(ple_dim)) at `ple_lut_bits`."""
    geo = ckpt.geometry
    lut_dir.mkdir()
    luts = {
        "embedding": write_lut(
            ckpt, geo.embedding.name, geo.hidden_size**0.5, 16, lut_dir / "embedding_ufixed16.bin"
        )
    }
    if geo.ple_table is not None:
        bits = ple_lut_bits
        luts["per_layer_embedding"] = write_lut(
            ckpt,
            geo.ple_table.name,
            geo.ple_dim**0.5,
            bits,
            lut_dir / f"per_layer_embedding_ufixed{bits}.bin",
        )
    return luts


def run_export(cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path) -> dict[str, Any]:
    """The whole stage; returns the report. Raises ExportError (or CheckpointError) on bad input,
    leaving no output folder behind."""
    if read_report(checkpoint_dir) is None:
        raise ExportError(
            f"{checkpoint_dir} is not a complete download (no {REPORT_NAME}); run `make download` first"
        )
    stage = StageJob("export", cfg, workdir)
    stage.check([checkpoint_dir])
    ckpt = Checkpoint(checkpoint_dir)
    job, plan = _priced_job(cfg, ckpt, checkpoint_dir)
    inputs = [checkpoint_dir / "config.json", *sorted(set(ckpt.files.values()))]
    # Each graph holds its part's weights in float32 (E2B: 18.2 GB of graphs + 3.2 GB of LUTs).
    need = 4 * sum(p.params for p in plan.parts) * len(job.specs) // len(job.parts) + sum(plan.luts.values())
    with stage.output(inputs, need) as run:
        graphs, carried = _export_graphs(ckpt, job, run.dir)
        luts = _write_luts(ckpt, cfg.ple_lut_bits, run.dir / "luts")
        if carried:
            # A compressed-tensors checkpoint's scales, for quantize to keep its grid as stored: the
            # graphs hold integer x scale exactly, so the integers are read back from them.
            np.savez(run.dir / CARRIED_GRIDS_FILE, **{n: scale for n, (_, scale) in carried.items()})
            run.figures["checkpoint_grids"] = {
                "format": "compressed-tensors",
                "file": CARRIED_GRIDS_FILE,
                "weights": {n: meta for n, (meta, _) in sorted(carried.items())},
            }
        run.figures.update(
            {
                "checkpoint_dir": _relative(checkpoint_dir, workdir),
                "opset": OPSET,
                "attention_mask_min": ATTENTION_MASK_MIN,
                "parts": [
                    {
                        "part": i + 1,
                        "layers": list(r),
                        "params": next(g["params"] for g in graphs if g["spec"]["part"] == i + 1),
                    }
                    for i, r in enumerate(job.parts)
                ],
                "graphs": graphs,
                "luts": {k: {**asdict(v), "path": f"luts/{v.path}"} for k, v in luts.items()},
                "job": job.to_dict(),
            }
        )
    return read_report(stage.out_dir)


CARRIED_GRIDS_FILE = "checkpoint_grids.npz"


def carried_grids(ckpt: Checkpoint, names: list[str]) -> dict[str, tuple[dict[str, Any], Any]]:
    """The weights among `names` that a compressed-tensors checkpoint stores quantized: name ->
    (bits, group, strategy, static input scale; the scales (out, in / group) float32)."""
    out = {}
    for n in names:
        grid = ckpt.compressed.get(ckpt.prefix + n)
        if grid is None:
            continue
        q, scale = ckpt.weight_grid(n)
        meta = {"bits": grid.bits, "group": grid.group(q.shape[1]), "strategy": grid.strategy}
        if grid.input_scale:
            meta["input_scale"] = ckpt.input_scale(n)
            meta["input_bits"] = grid.input_bits
        out[n] = (meta, scale.numpy())
    return out


# ---- the stage's command (`g4v69 export`; the stage table names it) ----
@click.command(name="export")
@click.pass_obj
def command(obj: Context) -> None:
    """Static-shape ONNX part graphs (prefill + decode) and the host LUTs into exported/."""
    from stages.export import run_export

    report = run_export(obj.config, obj.workdir, obj.checkpoint_dir())
    e = ExportResult(obj.workdir / "exported", StageReport.from_dict(report))
    click.echo(
        f"{e.folder}: {len(e.graphs)} graphs over {len(e.parts)} parts, {e.report.wall_s:.1f} s, "
        f"peak RSS {e.report.peak_rss_bytes / 2**30:.2f} GiB"
    )
