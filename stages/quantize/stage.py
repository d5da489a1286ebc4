"""The quantize stage: every exported graph calibrated, quantized, rewritten to its weight schemes and
audited, then measured against the float chain (`run_quantize`)."""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from stages.core.command import Context
from stages.core.config import PipelineConfig
from stages.core.report import REPORT_NAME, StageJob, read_report
from stages.model.graphs import calibration_kind, copy_graph, qdq_file_name
from stages.planning.results import ExportResult, QuantizeResult, StageReport, require_result
from stages.quant.gptq import collect_hessians
from stages.quant.quality import EVAL_SAMPLES, SQNR_TOKENS, compare_chains, output_sqnr, write_quality_html
from stages.quant.sensitivity import sensitivity_samples
from stages.quantize.analysis import (
    QuantizeError,
    analyse,
)
from stages.quantize.audit import audit
from stages.quantize.calibrate import (
    DECODE_CALIBRATION_STEPS,
    RangeCollector,
    calibrate_kind,
    qnn_config,
    quant_settings,
    quantize_with_ranges,
    twin_ranges,
)
from stages.quantize.passes import WEIGHT_PASSES, PassClock, PassTime, tokens_of
from stages.quantize.weights import (
    WeightRounder,
    _4bit_weights,
    _has_4bit_weights,
    lut_input_encodings,
    read_lut_inputs_quantized,
    rewrite_weights,
)


# ---- the stage ----
@dataclass
class QuantizedGraphs:
    paths: dict[str, Path]
    kv_ranges: dict[str, list[float]]
    boundary_ranges: dict[str, list[float]]
    figures: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    weights: dict[str, Any] = field(default_factory=dict)  # WeightRounder.figures(), with its time
    clock: PassClock = field(default_factory=PassClock)


def quantize_graphs(
    cfg: PipelineConfig,
    export_dir: Path,
    out_dir: Path,
    samples: list[list[int]],
    decode_steps: int,
    calibration_providers: list[str] | None = None,
    method: str = "minmax",
    stride: int | None = None,
) -> QuantizedGraphs:
    """Calibrate every graph (one chain pass per graph kind), then quantize, rewrite the weights to the
    precision's scheme and audit each graph. The prefill pass also fixes the KV and cross-part ranges
    that every graph shares, so prefill graphs are quantized before the decode pass runs."""

    from stages.core.progress import tqdm
    from stages.quant.runner import HostRunner

    runner = HostRunner.from_export(export_dir, luts=True)
    exported = ExportResult(export_dir, StageReport.read(export_dir))
    # The prefill kind calibrates on its twin when the export made one (calibration_ar).
    twin = (
        HostRunner.from_export(export_dir, luts=True, calibration_twin=True)
        if exported.job.calibration
        else None
    )
    luts = exported.luts
    result: QuantizedGraphs | None = None
    progress = tqdm(
        total=sum(len(g) for g in runner.graphs.values()), desc=f"quantize ({cfg.ple_policy})", unit="graph"
    )
    rounder: WeightRounder | None = None
    clock = PassClock()
    for role in ("prefill", "decode"):
        if role not in runner.graphs:
            continue
        # Scratch inside this stage's own folder (augmented graphs, ranges, links to the float graphs).
        with tempfile.TemporaryDirectory(prefix=".calibration-", dir=out_dir) as tmp:
            collector = RangeCollector() if role == "prefill" else None
            chain = twin if twin is not None and role == "prefill" else runner
            calibrated, share = _calibrate(
                cfg,
                chain,
                role,
                samples,
                decode_steps,
                Path(tmp),
                (calibration_providers, method, stride),
                collector,
                clock,
            )
            if rounder is None and _has_4bit_weights(cfg):
                # After the prefill calibration (its sessions released): Hessians, then every 4-bit
                # weight rounded once (decode graphs hold the same weights), then the Hessians go.
                rounder = _round_weights(
                    cfg,
                    chain,
                    [src for _, src in runner.graphs[role]],
                    samples,
                    Path(tmp),
                    clock,
                    exported.carried_grids(),
                )
            if collector is not None:
                ranges = collector.ranges()
                result = _shared_ranges_result(ranges, rounder, clock)
            write_t0 = time.perf_counter()
            _write_kind(
                cfg,
                runner.graphs[role],
                twin if chain is twin else None,
                calibrated,
                share,
                out_dir,
                Path(tmp),
                ranges,
                luts,
                rounder,
                (calibration_providers, method),
                result,
                progress,
            )
            clock.passes.append(
                PassTime(
                    f"write_{role}",
                    round(time.perf_counter() - write_t0, 2),
                    units=len(calibrated),
                    unit="graph",
                )
            )
    progress.close()
    assert result is not None  # every export has prefill graphs
    if rounder is not None and rounder.input_scales:
        # Compared as each graph was written, after the weights' figures were taken.
        result.weights["checkpoint_grids"]["static_input_scales"] = dict(sorted(rounder.input_scales.items()))
    result.clock = clock
    return result


def _calibrate(
    cfg: PipelineConfig,
    chain,
    role: str,
    samples: list[list[int]],
    decode_steps: int,
    tmp: Path,
    how: tuple[list[str] | None, str, int | None],
    collector: RangeCollector | None,
    clock: PassClock,
) -> tuple[dict[str, tuple[Path, int, int]], float]:
    """One graph kind's activation ranges from the chain, timed as its pass: (ranges file, calls,
    stride by graph name; each graph's share of the pass's time)."""
    providers, method, stride = how
    with clock.run(f"ranges_{role}", unit="call") as timed:
        calibrated = calibrate_kind(
            cfg,
            chain,
            role,
            samples[: cfg.calibration_samples],
            decode_steps,
            tmp,
            providers,
            method,
            stride,
            collector,
        )
        timed.units = max(count for _, count, _ in calibrated.values())
        timed.tokens = tokens_of(samples[: cfg.calibration_samples]) if role == "prefill" else timed.units
    return calibrated, timed.wall_s / len(calibrated)  # the pass's time, split evenly


def _shared_ranges_result(ranges, rounder: WeightRounder | None, clock: PassClock) -> QuantizedGraphs:
    """The result as the prefill pass starts it: the KV and cross-part ranges every graph shares, and
    the weights' figures once they are rounded."""
    result = QuantizedGraphs(
        paths={},
        kv_ranges={f"{k}_{layer}": list(v) for (k, layer), v in sorted(ranges.kv.items())},
        boundary_ranges={k: list(v) for k, v in sorted(ranges.boundary.items())},
    )
    if rounder is not None:
        rounding_s = sum(clock.seconds(name) for name in WEIGHT_PASSES)
        result.weights = {**rounder.figures(), "rounding_s": round(rounding_s, 1)}
    return result


def _write_kind(
    cfg: PipelineConfig,
    graphs: list[tuple[Any, Path]],
    twin,
    calibrated: dict[str, tuple[Path, int, int]],
    share: float,
    out_dir: Path,
    tmp: Path,
    ranges,
    luts,
    rounder: WeightRounder | None,
    calibration: tuple[list[str] | None, str],
    result: QuantizedGraphs,
    progress,
) -> None:
    """Each graph of one kind written as a QDQ graph with its calibrated ranges (`twin`: the runner of
    the calibration twin the ranges were taken on, moved onto the shipped graph), audited, and added
    to `result` with its figures."""
    providers, method = calibration
    for spec, src in graphs:
        t0 = time.perf_counter()
        if twin is not None:
            twin_spec, twin_src = twin.graphs["prefill"][spec.part - 1]
            calibrated_on = twin_spec.name
            ranges_file, count, graph_stride_used = calibrated[twin_spec.name]
            ranges_file = twin_ranges(twin_src, src, ranges_file, tmp / f"{spec.name}.ranges.json")
        else:
            calibrated_on = spec.name
            ranges_file, count, graph_stride_used = calibrated[spec.name]
        dest = out_dir / qdq_file_name(spec.name)
        checked, analysis = _write_graph(
            cfg,
            src,
            dest,
            ranges_file,
            ranges,
            luts,
            rounder,
            tmp / spec.name,
            (providers, method, graph_stride_used),
        )
        result.problems += [f"{spec.name}: {p}" for p in checked["problems"]]
        result.paths[spec.name] = dest
        result.figures.append(
            {
                "name": spec.name,
                "qdq_onnx": dest.name,
                "calibrated_on": calibrated_on,
                "calibration_calls": count,
                "calibration_stride": graph_stride_used,
                "quantize_s": round(share + time.perf_counter() - t0, 3),
                "kv_layers": sorted(f"{k}_{layer}" for k, layer in analysis.kv_groups),
                "audit": checked,
            }
        )
        progress.update()


def _write_graph(
    cfg: PipelineConfig,
    src: Path,
    dest: Path,
    ranges_file: Path,
    ranges,
    luts: dict[str, Any],
    rounder: WeightRounder | None,
    scratch: Path,
    calibration: tuple[list[str] | None, str, int | None],
) -> tuple[dict[str, Any], Any]:
    """One graph quantized from its saved ranges into `dest`, its weights rewritten to the precision's
    schemes, its LUT-fed inputs read quantized, then audited: (the audit, the float graph's analysis).
    `calibration` is what the ranges were made with (providers, method, stride)."""
    import shutil

    import onnx

    model = onnx.load(str(src), load_external_data=False)
    analysis = analyse(model)
    io_names = {t.name for t in (*model.graph.input, *model.graph.output)}
    del model
    overrides, excluded = quant_settings(cfg, analysis, ranges, io_names, luts)
    linked = copy_graph(src, scratch / "quantize")
    qcfg = qnn_config(linked, None, overrides, excluded, *calibration)
    quantize_with_ranges(linked, dest, qcfg, ranges_file)
    shutil.rmtree(linked.parent)
    if rounder is not None:
        rewrite_weights(cfg, src, dest, rounder)
    qmodel = onnx.load(str(dest), load_external_data=False)
    lut_inputs = lut_input_encodings(luts, {i.name for i in qmodel.graph.input})
    if read_lut_inputs_quantized(qmodel, lut_inputs):
        # Weights stay where they are: an external-data graph keeps its references.
        onnx.save(qmodel, str(dest))
    if rounder is not None:
        rounder.compare_input_scales(qmodel)
    checked = audit(
        cfg,
        qmodel,
        analysis,
        lut_inputs,
        rounder.int8_weights if rounder else frozenset(),
        {n: rounder.rounded[n] for n in rounder.kept} if rounder else None,
    )
    return checked, analysis


def _round_weights(
    cfg: PipelineConfig,
    chain,
    graphs: list[Path],
    samples: list[list[int]],
    scratch: Path,
    clock: PassClock,
    carried: dict[str, Any],
) -> WeightRounder:
    """The 4-bit weights' passes, in order: GPTQ's Hessians from the first `hessian_samples`, every
    weight rounded once, the mixed precision's measured sensitivity on the first `sensitivity_tokens`,
    then the scale search of the weights left at 4 bits. Each is timed on `clock`. `carried`: the
    grids a compressed-tensors checkpoint stored (`ExportResult.carried_grids`)."""
    hessians = None
    if cfg.weight_rounding != "nearest":
        hessian_samples = samples[: cfg.hessian_samples]
        watched = {w for _, src in chain.graphs["prefill"] for w in _4bit_weights(cfg, src)}
        with clock.run("hessians", tokens_of(hessian_samples), unit="call") as timed:
            hessians = collect_hessians(chain, hessian_samples, watched, scratch / "hessians")
            timed.units = sum(-(-len(s) // chain.prefill_ar) for s in hessian_samples)
    rounder = WeightRounder(cfg, hessians, carried)
    del hessians  # round_all drops them when done
    with clock.run("rounding", unit="weight") as timed:
        rounder.round_all(graphs, scratch / "hessians-kept" if rounder.searches else None)
        timed.units = len(rounder.rounded)
    int8_share = cfg.decoder_scheme.int8_share
    if int8_share:
        measured = sensitivity_samples(samples, cfg.sensitivity_tokens)
        with clock.run("sensitivity", tokens_of(measured), unit="weight") as timed:
            rounder.measure(chain, measured, scratch / "sensitivity")
            timed.units = sum(1 for r in rounder.rounded.values() if r.kl_int4 is not None)
    chosen = rounder.choose_int8(int8_share) if int8_share else frozenset()
    rounder.int8_weights = chosen | rounder.given_int8
    if rounder.searches:
        with clock.run("scale_search", unit="weight") as timed:
            rounder.search_scales(graphs)
            timed.units = len(rounder.searched)
    return rounder


def sample_length(cfg: PipelineConfig) -> int:
    """Tokens per calibration sample: they must fit the context the graphs were built for (whole
    prefill chunks); on a twin, whole twin calls (a padded row would widen ranges with values the
    shipped graphs never compute)."""
    twin = calibration_kind(cfg)
    ar = twin.ar if twin else cfg.prefill_ar
    length = min(cfg.calibration_tokens, cfg.max_context - cfg.max_context % ar)
    return length - length % ar if twin else length


def heldout_samples(
    cfg: PipelineConfig, checkpoint_dir: Path, workdir: Path | None = None, count: int = EVAL_SAMPLES
) -> tuple[list[list[int]], int]:
    """The held-out token samples quality is measured on (`count` of them), and how many of each run
    as decode steps."""
    from stages.model.chat import ChatTokenizer
    from stages.model.checkpoint import Checkpoint
    from stages.quant.calibration import load_texts, token_samples

    length = sample_length(cfg)
    tok = ChatTokenizer(checkpoint_dir)
    bos = Checkpoint(checkpoint_dir).geometry.config.get("bos_token_id", 2)
    texts = load_texts(cfg, "heldout", None, workdir)
    return token_samples(texts, tok.encode, bos, count, min(length, 512)), min(
        DECODE_CALIBRATION_STEPS, length // 2
    )


def _quality(cfg, export_dir: Path, q: QuantizedGraphs, eval_samples, decode_steps) -> dict[str, Any]:
    from stages.quant.runner import HostRunner

    fp = HostRunner.from_export(export_dir, luts=True)
    quantized = HostRunner.from_export(
        export_dir, luts=True, graph_dir=next(iter(q.paths.values())).parent, fold_weights=True
    )
    # Float logits from the twin when prefill is the only kind: the same chain computed AR rows per
    # call (a held-out token is then 1/AR of a float call; the quantized side stays the shipped graphs).
    one_kind = not cfg.separate_prefill_and_decode
    fp_chain = (
        HostRunner.from_export(export_dir, luts=True, calibration_twin=True)
        if calibration_kind(cfg) and one_kind
        else fp
    )
    chains = compare_chains(fp_chain, quantized, eval_samples, decode_steps)
    prefill = {name: p for name, p in q.paths.items() if name.startswith("prefill")}
    # One sample's first SQNR_TOKENS: the per-graph SQNR reruns the float chain up to each graph, which
    # at AR-1 is a part call per token per graph (the whole tiny sample; a quarter of an E2B one).
    return {**chains, "sqnr_db": output_sqnr(fp, prefill, [eval_samples[0][:SQNR_TOKENS]])}


def _guarded(fn, *args):
    """Turn a broken graph file into an error that says which export to redo."""
    from google.protobuf.message import DecodeError
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf

    try:
        return fn(*args)
    except (DecodeError, Fail, InvalidGraph, InvalidProtobuf) as e:
        raise QuantizeError(
            f"an exported graph cannot be read ({e.__class__.__name__}: {str(e)[:200]}); "
            "the exported/ folder is corrupt or from another export: run `make export` again"
        ) from None


def _providers(provider: str) -> list[str]:
    """onnxruntime providers for calibration; ROCm only where an AMD GPU and the ROCm build are present."""
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider != "rocm":
        raise QuantizeError(f"--provider {provider!r} is not allowed; allowed values: cpu, rocm")
    import onnxruntime as ort

    if "ROCMExecutionProvider" not in ort.get_available_providers():
        raise QuantizeError(
            "--provider rocm: this onnxruntime has no ROCMExecutionProvider; run in the quant-rocm image "
            "(make quantize QUANT_IMAGE=quant-rocm QUANT_ARGS=--provider=rocm) or use --provider cpu"
        )
    if not Path("/dev/kfd").exists():
        raise QuantizeError(
            "--provider rocm: no AMD GPU here (/dev/kfd is missing; pass --device /dev/kfd "
            "--device /dev/dri to docker); use --provider cpu"
        )
    return ["ROCMExecutionProvider", "CPUExecutionProvider"]


def _check_kv_encodings_agree(graphs: QuantizedGraphs) -> None:
    """Every graph reads and writes each KV cache with one encoding: Genie keeps one buffer per cache."""
    encodings: dict[str, set] = defaultdict(set)
    for g in graphs.figures:
        for key, found in g["audit"]["kv_encodings"].items():
            encodings[key] |= {tuple(e) for e in found}
    split = [k for k, v in encodings.items() if len(v) != 1]
    if split:
        raise QuantizeError(f"KV caches {', '.join(split)} differ in encoding between graphs")


def _calibration_figures(
    cfg: PipelineConfig, calibration_files: list[Path] | None, workdir: Path, samples: int, twin
) -> dict[str, Any]:
    """What the calibration read: the text, how much of it each pass took, on which graph kind."""
    from stages.quant.calibration import text_source

    return {
        "dataset": cfg.calibration_dataset,
        "source": text_source(cfg, calibration_files, workdir),
        "files": [str(f) for f in calibration_files or []],
        "samples": min(cfg.calibration_samples, samples),
        "hessian_samples": min(cfg.hessian_samples, samples),
        "sensitivity_tokens": cfg.sensitivity_tokens,
        "tokens_per_call": twin.ar if twin else cfg.prefill_ar,
        "on_twin": twin is not None,
    }


def _figures(
    cfg: PipelineConfig,
    exported: ExportResult,
    main: QuantizedGraphs,
    quality: dict[str, Any],
    by_precision: dict[str, Any],
    calibration: dict[str, Any],
    eval_samples: list[list[int]],
) -> dict[str, Any]:
    """quantized/report.json's figures: the scheme, the weights, the calibration, each pass's time,
    the shared ranges, every graph's audit, the quality, and the job handed on."""
    return {
        "soc": cfg.soc,
        "precision": cfg.precision,
        "weight_scheme": cfg.decoder_scheme.name,
        "lm_head_scheme": cfg.lm_head_scheme.name,
        "weights": main.weights,
        "quality_by_precision": by_precision,
        "kv_cache_bits": cfg.kv_cache_bits,
        "ple_policy": cfg.ple_policy,
        "ple_lut_bits": getattr(exported.luts.get("per_layer_embedding"), "bits", None),
        "calibration": calibration,
        "evaluation": {"samples": len(eval_samples), "tokens_per_sample": len(eval_samples[0])},
        # What each pass took (the main precision's; the comparison runs are not timed).
        "passes": main.clock.figures(),
        "kv_ranges": main.kv_ranges,
        "boundary_ranges": main.boundary_ranges,
        "graphs": main.figures,
        "quality": quality,
        # Handed on as export worked it out, its binaries laid out for this SoC: compile reads it.
        "job": exported.job.on_soc(cfg.soc_info).to_dict(),
    }


def _calibration_samples(
    cfg: PipelineConfig,
    checkpoint_dir: Path,
    calibration_files: list[Path] | None,
    workdir: Path,
    length: int,
) -> list[list[int]]:
    """The calibration text as token samples of `length`, each starting with the model's BOS."""
    from stages.model.chat import ChatTokenizer
    from stages.model.checkpoint import Checkpoint
    from stages.quant.calibration import load_texts, token_samples

    tok = ChatTokenizer(checkpoint_dir)
    bos = Checkpoint(checkpoint_dir).geometry.config.get("bos_token_id", 2)
    texts = load_texts(cfg, "calibration", calibration_files, workdir)
    return token_samples(texts, tok.encode, bos, cfg.calibration_sequences, length)


def _judged(
    cfg: PipelineConfig, main: QuantizedGraphs, export_dir: Path, eval_samples, decode_steps: int
) -> dict[str, Any]:
    """The quantized graphs' quality on held-out text (timed as the evaluation pass); QuantizeError
    where they break the rules, disagree on a KV encoding, or fall below the preset's floor for this
    precision (then nothing is kept)."""
    from stages.quant.quality import below_floor

    if main.problems:
        raise QuantizeError("the quantized graphs break the rules: " + "; ".join(main.problems[:5]))
    _check_kv_encodings_agree(main)
    with main.clock.run("evaluation", tokens_of(eval_samples), len(eval_samples), "sample"):
        quality = _quality(cfg, export_dir, main, eval_samples, decode_steps)
    below = below_floor(cfg, quality)
    if below:
        raise QuantizeError(below)
    return quality


def run_quantize(
    cfg: PipelineConfig,
    workdir: Path,
    checkpoint_dir: Path,
    calibration_files: list[Path] | None = None,
    compare_ple_policies: bool = False,
    provider: str = "cpu",
    method: str = "minmax",
    stride: int | None = None,
    compare_precisions: bool = False,
) -> dict[str, Any]:
    """The whole stage; returns the report. Bad input raises QuantizeError and leaves nothing."""
    import dataclasses
    import tempfile

    calibration_providers = _providers(provider)
    exported = require_result(workdir, "export", ExportResult, QuantizeError)
    export_dir = exported.folder
    graph_files = exported.graph_files()
    missing = [p.name for p in graph_files.values() if not p.is_file()]
    if missing:
        raise QuantizeError(
            f"{export_dir} is incomplete: {', '.join(missing)} missing; run `make export` again"
        )
    job = StageJob("quantize", cfg, workdir)
    job.check([export_dir, checkpoint_dir])
    twin = exported.job.calibration
    length = sample_length(cfg)
    samples = _calibration_samples(cfg, checkpoint_dir, calibration_files, workdir, length)
    eval_samples, decode_steps = heldout_samples(cfg, checkpoint_dir, workdir)
    inputs = [export_dir / REPORT_NAME, *graph_files.values()]
    # QDQ graphs at the weight bits, plus one float graph's calibration copies at a time.
    graph_bytes = [g["bytes"] for g in exported.graphs]
    need = sum(graph_bytes) * cfg.precision_info.weight_bits // 32 + 2 * max(graph_bytes)
    with job.output(inputs, need) as run:

        def quantize_with(policy_cfg: PipelineConfig, out: Path) -> QuantizedGraphs:
            return _guarded(
                quantize_graphs,
                policy_cfg,
                export_dir,
                out,
                samples,
                decode_steps,
                calibration_providers,
                method,
                stride,
            )

        main = quantize_with(cfg, run.dir)
        quality = {cfg.ple_policy: _judged(cfg, main, export_dir, eval_samples, decode_steps)}

        def quality_of(other_cfg: PipelineConfig, scratch: Path) -> dict[str, Any]:
            with tempfile.TemporaryDirectory(dir=scratch) as tmp:
                other = quantize_with(other_cfg, Path(tmp))
                return {
                    **_quality(cfg, export_dir, other, eval_samples, decode_steps),
                    "audit_problems": other.problems,
                }

        if compare_ple_policies:
            for policy in (p for p in ("float16", "int16", "int8") if p != cfg.ple_policy):
                quality[policy] = quality_of(dataclasses.replace(cfg, ple_policy=policy), run.dir)
        # The other precisions on the same exported graphs (cut for this precision: the cut points
        # move nothing but which part a layer sits in), so the report ranks the weight schemes.
        by_precision = {cfg.precision: quality[cfg.ple_policy]}
        if compare_precisions:
            from stages.core.precision import usable_precisions

            for name in (p.name for p in usable_precisions(cfg.soc_info) if p.name != cfg.precision):
                other_cfg = dataclasses.replace(cfg, precision=name, int8_percent="auto")
                by_precision[name] = {
                    **quality_of(other_cfg, workdir),
                    "int8_percent": other_cfg.mixed_percent,
                }
        calibration = {
            **_calibration_figures(cfg, calibration_files, workdir, len(samples), twin),
            "tokens_per_sample": length,
            "decode_steps_per_sample": decode_steps,
            "method": method,
            "stride": stride,
        }
        run.figures.update(_figures(cfg, exported, main, quality, by_precision, calibration, eval_samples))
        write_quality_html(run.dir / "quality.html", run.figures)
    return read_report(job.out_dir)


# ---- the stage's command (`g4v69 quantize`; the stage table names it) ----
@click.command(name="quantize")
@click.option(
    "--calibration-files",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="text to calibrate on (.txt, .jsonl with 'text', .parquet with a 'text' column); repeatable",
)
@click.option(
    "--compare-ple-policies", is_flag=True, help="also measure the other PLE policies in the report"
)
@click.option(
    "--compare-precisions",
    is_flag=True,
    help="also measure every other precision the SoC runs (w8a16 and the 4-bit schemes) in the report",
)
@click.option(
    "--provider",
    type=click.Choice(["cpu", "rocm"]),
    default="cpu",
    show_default=True,
    help="onnxruntime provider for calibration (rocm: quant-rocm image with an AMD GPU)",
)
@click.pass_obj
def command(
    obj: Context,
    calibration_files: tuple[Path, ...],
    compare_ple_policies: bool,
    compare_precisions: bool,
    provider: str,
) -> None:
    """QDQ graphs at the precision for the SoC (8-bit KV on v69), audited, with a quality report."""

    report = run_quantize(
        obj.config,
        obj.workdir,
        obj.checkpoint_dir(),
        list(calibration_files) or None,
        compare_ple_policies,
        provider,
        compare_precisions=compare_precisions,
    )
    r = QuantizeResult(obj.workdir / "quantized", StageReport.from_dict(report))
    q = r.quality[obj.config.ple_policy]
    click.echo(
        f"{r.folder}: {len(r.graphs)} graphs; held-out top-1 agreement "
        f"{q['top1_agreement']:.3f}, perplexity {q['perplexity_fp']:.3f} -> {q['perplexity_quantized']:.3f}, "
        f"KL {q['kl_divergence']:.4f}; {r.report.wall_s:.1f} s, "
        f"peak RSS {r.report.peak_rss_bytes / 2**30:.2f} GiB"
    )
