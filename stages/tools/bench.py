"""The scale benchmark's report: what each stage of a finished (or partly finished) run cost.

`make bench` runs every stage from download to verify for the bench model (full E2B geometry,
random weights) through the ordinary stage targets, so a finished stage is not redone when the
bench is resumed, then `g4v69 bench-report` reads the stages' own report.json files and writes
`<output>/<date>-<machine>.json` and a markdown table beside it: wall time, CPU time and peak RSS
per stage and per graph, the bytes of every artifact, and the `g4v69 plan` figures next to the
measured ones. No figure here is timed by the bench itself: each comes from the stage that did it.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any

from stages.core.config import PipelineConfig
from stages.core.pipeline import STAGE_NAMES, output_dir
from stages.core.report import proc_field_bytes, read_report
from stages.core.soc import GIB

STAGES = ("download", "export", "quantize", "compile", "bundle", "verify")


def _stage_dirs(cfg: PipelineConfig, workdir: Path) -> dict[str, Path]:
    return {name: output_dir(workdir, name, cfg.checkpoint_name) for name in STAGES}


def _machine() -> dict[str, Any]:
    import os

    mem = proc_field_bytes("/proc/meminfo", "MemTotal") or 0
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "machine": platform.machine(),
        "node": platform.node(),
    }


def collect(cfg: PipelineConfig, workdir: Path, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per stage and per graph costs from the stage reports under workdir (missing stages: null)."""
    stages: dict[str, Any] = {}
    # What ran is what the stages recorded, not this command's config: a bench whose calibration was
    # set in the environment of the stage run must not be reported with the preset's calibration.
    ran: dict[str, Any] = {}
    for stage, folder in _stage_dirs(cfg, workdir).items():
        report = read_report(folder)
        if report is None:
            stages[stage] = None
            continue
        ran.update(report.get("options", {}))
        fig = report.get("figures", {})
        children = [b.get("peak_rss_bytes", 0) for b in fig.get("binaries", [])]
        stages[stage] = {
            "wall_s": report["wall_s"],
            "cpu_s": report["cpu_s"],
            "peak_rss_bytes": max([report["peak_rss_bytes"], *children]),
            "output_bytes": sum(f["bytes"] for f in report["outputs"]),
            "outputs": {f["path"]: f["bytes"] for f in report["outputs"]},
        }
    graphs: dict[str, dict[str, Any]] = {}
    export = read_report(output_dir(workdir, "export"))
    for g in (export or {}).get("figures", {}).get("graphs", []):
        graphs.setdefault(g["name"], {}).update(export_s=g.get("export_s"), onnx_bytes=g.get("bytes"))
    quant = read_report(output_dir(workdir, "quantize"))
    for g in (quant or {}).get("figures", {}).get("graphs", []):
        graphs.setdefault(g["name"], {}).update(quantize_s=g.get("quantize_s"))
    compiled = read_report(output_dir(workdir, "compile"))
    for b in (compiled or {}).get("figures", {}).get("binaries", []):
        for g in b["graphs"]:
            graphs.setdefault(g["name"], {}).update(
                compile_s=g.get("compile_s"),
                compile_peak_rss_bytes=b.get("peak_rss_bytes"),
                binary_bytes=b["bytes"] if len(b["graphs"]) == 1 else None,
            )
    verify = read_report(output_dir(workdir, "verify"))
    verified = None
    if verify is not None:
        fig = verify["figures"]
        replayed = fig.get("htp_replay") or {}
        verified = {
            "engine": fig["engine"]["name"],
            "calls": fig.get("emulator_calls"),
            "htp_replay_calls": [
                {k: c[k] for k in ("replay", "ar", "n_process", "n_past", "seconds")}
                | {"worst_sqnr_db": c["worst"]["sqnr_db"]}
                for c in replayed.get("calls", [])
            ],
            "htp_replay_skipped_for_time": replayed.get("skipped_for_time", []),
            "htp_replay_s": replayed.get("seconds"),
            "binaries_executed_on_htp": len(replayed.get("binaries_executed", [])),
            # Older reports (before verify ran the real Genie) have none.
            "real_genie": {
                k: fig["real_genie"].get(k)
                for k in (
                    "create_s",
                    "query_s",
                    "statuses",
                    "answers",
                    "peak_rss_bytes",
                    "comparisons",
                    "not_run",
                )
            }
            if fig.get("real_genie", {}).get("ran")
            else None,
            "seconds": fig.get("seconds"),
        }
    done = [s for s in ("export", "quantize", "compile") if stages.get(s)]
    return {
        # Where quantize's time went (reports before the pass clock have none).
        "quantize_passes": (quant or {}).get("figures", {}).get("passes"),
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "config": {**cfg.to_dict(), **ran},
        "config_from_stage_reports": sorted(ran),
        "stages": stages,
        "graphs": graphs,
        "export_quantize_compile_wall_s": sum(stages[s]["wall_s"] for s in done),
        "verify": verified,
        "max_peak_rss_bytes": max((stages[s]["peak_rss_bytes"] for s in stages if stages[s]), default=0),
        "plan": plan,
    }


def to_markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    lines = [
        f"# Bench {result['date']}: {result['config']['model']} on {m['cpus']} CPUs, "
        f"{m['memory_bytes'] / GIB:.0f} GiB",
        "",
        f"Command: `{command}`",
        "",
        "| stage | wall | CPU | peak RSS | output |",
        "|---|---|---|---|---|",
    ]
    # Pipeline order: a result read back from its JSON has its keys sorted.
    for stage in sorted(result["stages"], key=STAGE_NAMES.index):
        s = result["stages"][stage]
        if s is None:
            lines.append(f"| {stage} | not run | | | |")
            continue
        lines.append(
            f"| {stage} | {s['wall_s'] / 60:.1f} min | {s['cpu_s'] / 60:.1f} min | "
            f"{s['peak_rss_bytes'] / GIB:.1f} GiB | {s['output_bytes'] / 1e9:.2f} GB |"
        )
    lines += [
        "",
        f"Export + quantize + compile: {result['export_quantize_compile_wall_s'] / 60:.1f} min wall; "
        f"largest peak RSS {result['max_peak_rss_bytes'] / GIB:.1f} GiB.",
        "",
    ]
    lines += passes_markdown(result.get("quantize_passes"))
    lines += _verify_markdown(result.get("verify"))
    lines += [
        "| graph | export | quantize | compile | compile peak RSS | ONNX (float32) | binary |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, g in sorted(result["graphs"].items()):
        cells = [
            _fmt(g, "export_s", 1, "{:.0f} s"),
            _fmt(g, "quantize_s", 1, "{:.0f} s"),
            _fmt(g, "compile_s", 1, "{:.0f} s"),
            _fmt(g, "compile_peak_rss_bytes", GIB, "{:.1f} GiB"),
            _fmt(g, "onnx_bytes", 1e9, "{:.2f} GB"),
            _fmt(g, "binary_bytes", 1e6, "{:.0f} MB"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _plan_markdown(result.get("plan"))
    return "\n".join(lines) + "\n"


def _verify_markdown(verified: dict[str, Any] | None) -> list[str]:
    """The verify stage's engine calls, its HTP replay and the real Genie's run."""
    if not verified:
        return []
    lines: list[str] = []
    calls = verified.get("calls") or {}
    lines += [
        f"Verify ({verified['engine']} engine): {calls.get('calls', '?')} graph calls on the "
        f"{calls.get('engine', '?')} engine ({calls.get('engine_s', 0) / 60:.1f} min), then "
        f"{len(verified['htp_replay_calls'])} calls replayed through the "
        f"{verified['binaries_executed_on_htp']} ctx-bins on the HTP emulation "
        f"({(verified['htp_replay_s'] or 0) / 60:.1f} min; "
        f"{len(verified['htp_replay_skipped_for_time'])} skipped for time):",
        "",
        "| replayed call | AR | tokens | past | HTP emulation | worst output SQNR |",
        "|---|---|---|---|---|---|",
    ]
    for c in verified["htp_replay_calls"]:
        lines.append(
            f"| {c['replay']} | {c['ar']} | {c['n_process']} | {c['n_past']} | {c['seconds']:.0f} s | "
            f"{c['worst_sqnr_db']:.1f} dB |"
        )
    lines.append("")
    real = verified.get("real_genie")
    if real:
        lines += _real_genie_markdown(real)
    return lines


def _real_genie_markdown(real: dict[str, Any]) -> list[str]:
    """The real Genie's cases: each query's time, status and answer, then every comparison made."""
    lines = [
        f"The real Genie (libGenie.so, x86 HTP emulation): loaded in {real['create_s']:.1f} s; peak RSS "
        f"{real['peak_rss_bytes'] / GIB:.2f} GiB.",
        "",
        "| case | query | status | answer |",
        "|---|---|---|---|",
    ]
    for case, t in real["query_s"].items():
        answer = real.get("answers", {}).get(case, "")
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        lines.append(
            f"| {case} | {t:.0f} s | {real['statuses'][case]} | {json.dumps(shown, ensure_ascii=False)} |"
        )
    lines += ["", "| compared | against | verdict | ids | why |", "|---|---|---|---|---|"]
    for c in real.get("comparisons") or []:
        why = c.get("why", "").replace("|", "/")
        lines.append(
            f"| {c['case']} | {c['against']} | {c['verdict']} | {c['agreed']} of {c['asked']} | {why} |"
        )
    lines += [f"| {case} | (not run) | | | {why} |" for case, why in (real.get("not_run") or {}).items()]
    return [*lines, ""]


def _plan_markdown(plan: dict[str, Any] | None) -> list[str]:
    """The plan's parts beside the measured."""
    if not plan:
        return []
    lines: list[str] = []
    lines += ["", "Plan (`g4v69 plan --json`) beside the measured:", ""]
    parts = plan.get("parts", [])
    precision = plan.get("config", {}).get("precision", "?")
    # The v69 limit applies per context binary: the largest estimated allocation of the part's binaries.
    allocation: dict[str, int] = {}
    for b in plan.get("binaries", []):
        allocation[b["part"]] = max(allocation.get(b["part"], 0), b["estimated_allocation"])
    lines.append(f"| part | layers | planned params | planned bytes ({precision}) | estimated allocation |")
    lines.append("|---|---|---|---|---|")
    for p in parts:
        alloc = allocation.get(p["name"])
        lines.append(
            f"| {p['name']} | {', '.join(p.get('holds', []))} | {p['params'] / 1e6:.0f} M | "
            f"{p['bytes'] / 1e9:.2f} GB | {f'{alloc / GIB:.2f} GiB' if alloc else '-'} |"
        )
    lines.append("")
    lines.append(
        f"Planned device memory {plan['device_bytes'] / GIB:.1f} GiB; decode ceiling "
        f"{plan['decode_tokens_per_s_ceiling']:.1f} tokens/s."
    )
    return lines


def passes_markdown(passes: list[dict[str, Any]] | None) -> list[str]:
    """The quantize stage's passes as a table: time, what each read, and its time per unit."""
    if not passes:
        return []
    lines = [
        "Quantize, pass by pass (`figures.passes` of its report):",
        "",
        "| pass | wall | tokens read | units | per unit |",
        "|---|---|---|---|---|",
    ]
    for p in passes:
        units = p.get("units")
        per = f"{p['wall_s'] / units:.2f} s/{p['unit']}" if units else ""
        count = f"{units} {p['unit']}s" if units else ""
        lines.append(
            f"| {p['name']} | {p['wall_s'] / 60:.1f} min | {p.get('tokens', '')} | {count} | {per} |"
        )
    return [*lines, ""]


def _fmt(row: dict[str, Any], key: str, unit: float, form: str) -> str:
    value = row.get(key)
    return "" if value is None else form.format(value / unit)


def write_bench_files(output: Path, kind: str, command: str, record: dict[str, Any], md: str) -> Path:
    """A bench-* run's record and table as OUTPUT/<date>-<kind>-<machine>.{json,md}; returns the path
    without its suffix."""
    import json

    m = _machine()
    stem = (
        output
        / f"{datetime.date.today().isoformat()}-{kind}-{m['cpus']}cpu-{round(m['memory_bytes'] / GIB)}gib"
    )
    output.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(
        json.dumps({"machine": m, "command": command, **record}, indent=2) + "\n"
    )
    stem.with_suffix(".md").write_text(md)
    return stem


def write_results(result: dict[str, Any], out_dir: Path, command: str, name: str = "") -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    m = result["machine"]
    stem = f"{result['date']}{f'-{name}' if name else ''}-{m['cpus']}cpu-{round(m['memory_bytes'] / GIB)}gib"
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    md = out_dir / f"{stem}.md"
    md.write_text(to_markdown(result, command))
    return path, md


# ---- the 4-bit weight schemes side by side: tiny-model quality, E2B-geometry rounding cost ----
# (label, config overrides): every scheme the quantize stage builds, on the tiny preset's layout.
QUALITY_SCHEMES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("w8a16 (int8 per channel)", {"precision": "w8a16"}),
    ("w4a16, clipping search, round to nearest", {"precision": "w4a16", "weight_rounding": "nearest"}),
    ("w4a16, clipping search + GPTQ", {"precision": "w4a16", "weight_rounding": "gptq"}),
    (
        "w4a16, clipping search + GPTQ + scale search",
        {"precision": "w4a16", "weight_rounding": "gptq-search"},
    ),
    (
        "w4a16-lpbq, block-scale search, round to nearest",
        {"precision": "w4a16-lpbq", "weight_rounding": "nearest"},
    ),
    ("w4a16-lpbq, block-scale search + GPTQ", {"precision": "w4a16-lpbq", "weight_rounding": "gptq"}),
    ("w4a16-mixed 50 % int8 (GPTQ + scale search)", {"precision": "w4a16-mixed", "int8_percent": "50"}),
    ("w4a16-mixed 75 % int8 (GPTQ)", {"precision": "w4a16-mixed", "weight_rounding": "gptq"}),
    ("w4a16-mixed 75 % int8 (GPTQ + scale search; the default)", {"precision": "w4a16-mixed"}),
    ("w4a16-mixed 75 % int8, 4-bit lm_head", {"precision": "w4a16-mixed", "lm_head_bits": 4}),
)


def tiny_quality(workdir: Path, schemes=QUALITY_SCHEMES) -> list[dict[str, Any]]:
    """Each scheme through download, export and quantize of the trained tiny model: its held-out
    quality (quantized vs float graphs) and what quantize recorded of its weights."""
    import shutil

    from stages.core.config import load_config
    from stages.download import run_download
    from stages.export import run_export
    from stages.planning.results import QuantizeResult, require_result
    from stages.quantize import run_quantize

    rows = []
    ckpt = workdir / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    for label, overrides in schemes:
        cfg = load_config("tiny", overrides)
        for stage in ("export", "quantize"):
            shutil.rmtree(output_dir(workdir, stage), ignore_errors=True)
        run_export(cfg, workdir, ckpt)
        run_quantize(cfg, workdir, ckpt)
        quantized = require_result(workdir, "quantize", QuantizeResult, RuntimeError)
        fig = quantized.report.figures
        q = quantized.quality[cfg.ple_policy]
        rows.append(
            {
                "scheme": label,
                "overrides": overrides,
                "top1_agreement": q["top1_agreement"],
                "kl_divergence": q["kl_divergence"],
                "perplexity_fp": q["perplexity_fp"],
                "perplexity_quantized": q["perplexity_quantized"],
                "tokens": q["tokens"],
                "int8_share": fig.get("weights", {}).get("int8_share"),
                "quantize_wall_s": quantized.report.wall_s,
            }
        )
    return rows


# The QAT rows of bench-quality: (label, QAT kind of the tiny fixture or None for the plain trained
# model, config overrides). Each QAT checkpoint is quantized keeping its grid and ignoring it (GPTQ
# as for any checkpoint), beside today's default precision on the model that was not trained for it.
QAT_ROWS: tuple[tuple[str, str | None, dict[str, Any]], ...] = (
    ("QAT per channel, grid kept (w4a16-mixed)", "channel", {"precision": "w4a16-mixed"}),
    ("QAT per channel, GPTQ (w4a16)", "channel", {"precision": "w4a16", "checkpoint_grid": "ignore"}),
    (
        "QAT per channel, GPTQ (w4a16-mixed)",
        "channel",
        {"precision": "w4a16-mixed", "checkpoint_grid": "ignore"},
    ),
    ("QAT groups of 32, grid kept (w4a16-lpbq)", "group32", {"precision": "w4a16-lpbq"}),
    (
        "QAT groups of 32, GPTQ (w4a16-lpbq)",
        "group32",
        {"precision": "w4a16-lpbq", "checkpoint_grid": "ignore"},
    ),
    # The same QAT weights as compressed-tensors writes them (its int4 is [-8, 7] under a positive
    # scale: Q4_0's +8 becomes +7 in the file, so the kept grid is the file's, clipped at writing).
    ("QAT per channel, compressed-tensors, grid kept (w4a16)", "ct-channel", {"precision": "w4a16"}),
    (
        "QAT groups of 32, compressed-tensors, grid kept (w4a16-lpbq)",
        "ct-group32",
        {"precision": "w4a16-lpbq"},
    ),
    (
        "QAT per channel, compressed-tensors, GPTQ (w4a16)",
        "ct-channel",
        {"precision": "w4a16", "checkpoint_grid": "ignore"},
    ),
    (
        "QAT groups of 32, compressed-tensors, GPTQ (w4a16-lpbq)",
        "ct-group32",
        {"precision": "w4a16-lpbq", "checkpoint_grid": "ignore"},
    ),
    ("not QAT, GPTQ (w4a16)", None, {"precision": "w4a16"}),
    ("not QAT, today's default (w4a16-mixed)", None, {"precision": "w4a16-mixed"}),
)
COMPRESSED_KIND = "ct-"  # a QAT_ROWS kind in compressed-tensors' format


def qat_quality(workdir: Path, rows=QAT_ROWS) -> list[dict[str, Any]]:
    """Each QAT_ROWS row through download, export and quantize of the tiny model: held-out quality of
    the quantized graphs against that checkpoint's own float graphs, how many weights kept their grid,
    and the int8 share. A QAT checkpoint is written by transformers' save_pretrained (bf16, the
    `-qat-q4_0-unquantized` layout at toy size) or, for a `ct-` kind, by compressed-tensors'
    ModelCompressor (`save_compressed_checkpoint`), and imported as a user imports a folder."""
    import shutil

    from stages.core.config import load_config
    from stages.download import run_download
    from stages.export import run_export
    from stages.planning.results import QuantizeResult, require_result
    from stages.quantize import run_quantize

    out = []
    for label, kind, overrides in rows:
        model = "tiny" if kind is None else f"tiny-qat-{kind}"
        ckpt = workdir / "checkpoints" / model
        if not ckpt.is_dir():
            if kind is None:
                run_download("tiny", "main", ckpt)
            elif kind.startswith(COMPRESSED_KIND):
                src = save_compressed_checkpoint(workdir / f"{model}-src", kind.removeprefix(COMPRESSED_KIND))
                run_download(model, "main", ckpt, from_dir=src)
            else:
                src = workdir / f"{model}-transformers"
                save_qat_checkpoint(src, kind)
                run_download(model, "main", ckpt, from_dir=src)
        cfg = load_config("tiny", {"model": model, **overrides})
        for stage in ("export", "quantize"):
            shutil.rmtree(output_dir(workdir, stage), ignore_errors=True)
        run_export(cfg, workdir, ckpt)
        run_quantize(cfg, workdir, ckpt)
        quantized = require_result(workdir, "quantize", QuantizeResult, RuntimeError)
        weights = quantized.report.figures.get("weights", {})
        grids = weights.get("checkpoint_grids", {})
        q = quantized.quality[cfg.ple_policy]
        out.append(
            {
                "row": label,
                "overrides": overrides,
                "top1_agreement": q["top1_agreement"],
                "kl_divergence": q["kl_divergence"],
                "perplexity_fp": q["perplexity_fp"],
                "perplexity_quantized": q["perplexity_quantized"],
                "grids_kept": grids.get("kept", 0),
                "grids_found": grids.get("found", 0),
                "weights_4bit": grids.get("of", 0),
                "int8_share": weights.get("int8_share"),
                "quantize_wall_s": quantized.report.wall_s,
            }
        )
    return out


def save_qat_checkpoint(dest: Path, kind: str) -> Path:
    """The QAT tiny fixture of `kind` as transformers writes it (Gemma4ForCausalLM.save_pretrained,
    bf16) with the tiny model's tokenizer files."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from stages.model.builtin_models import write_tokenizer_files
    from stages.model.geometry import TINY_TEXT_CONFIG
    from stages.model.tiny_model import load_fixture

    dest.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(dest, TINY_TEXT_CONFIG["max_position_embeddings"])
    model = Gemma4ForCausalLM(
        Gemma4TextConfig(**{k: v for k, v in TINY_TEXT_CONFIG.items() if k != "model_type"})
    )
    result = model.model.load_state_dict(load_fixture(kind), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(str(dest))
    return dest


# The compressed-tensors schemes of the QAT fixtures: (module pattern, bits, strategy, group size,
# bits of a static input-activation scale or None).
CompressedScheme = tuple[str, int, str, "int | None", "int | None"]
QAT_LINEARS = r"re:.*layers\.\d+\.(self_attn|mlp)\..*_proj$"
COMPRESSED_SCHEMES: dict[str, tuple[CompressedScheme, ...]] = {
    "channel": ((QAT_LINEARS, 4, "channel", None, None),),
    "group32": ((QAT_LINEARS, 4, "group", 32, None),),
}


def save_compressed_checkpoint(
    dest: Path, kind: str, schemes: tuple[CompressedScheme, ...] | None = None
) -> Path:
    """The QAT tiny fixture of `kind` in compressed-tensors' pack-quantized format, written by that
    library's own ModelCompressor (the `-ct` releases' layout at toy size). Each weight's scales are
    its QAT grid's where it sits on one of that shape, else symmetric max-abs ones as the library's
    observers make them; a static input scale is max-abs over the tiny corpus's first tokens.
    compressed-tensors' int4 is [-8, 7] under a positive scale, so Q4_0's +8 (its negative-scale
    groups) is written as +7 by the library. `schemes` default to COMPRESSED_SCHEMES[kind]."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from loguru import logger
    from transformers import Gemma4ForCausalLM

    from stages.quant.grid import find_grid

    # compressed-tensors logs (loguru) that 8-bit weights would infer int-quantized: packed is asked for.
    logger.disable("compressed_tensors")
    save_qat_checkpoint(dest, kind)
    model = Gemma4ForCausalLM.from_pretrained(str(dest), dtype=torch.float32)
    peaks = _input_peaks(model)
    groups = {}
    for i, (pattern, bits, strategy, size, input_bits) in enumerate(schemes or COMPRESSED_SCHEMES[kind]):
        weights = QuantizationArgs(
            num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=size
        )
        inputs = (
            QuantizationArgs(
                num_bits=input_bits, type="int", symmetric=True, strategy="tensor", dynamic=False
            )
            if input_bits
            else None
        )
        groups[f"group_{i}"] = QuantizationScheme(
            targets=[pattern], weights=weights, input_activations=inputs
        )
    apply_quantization_config(
        model, QuantizationConfig(config_groups=groups, quantization_status="calibration")
    )
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        scheme = module.quantization_scheme
        w = module.weight.detach().double()
        group = w.shape[1] if scheme.weights.group_size is None else scheme.weights.group_size
        grid = find_grid(w.numpy())
        if grid is not None and grid.group == group and grid.bits == scheme.weights.num_bits:
            scale = torch.from_numpy(grid.scale).abs()
        else:
            peak = w.reshape(w.shape[0], -1, group).abs().amax(dim=2)
            scale = torch.where(peak > 0, peak, 1.0) / ((2**scheme.weights.num_bits - 1) / 2)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if scheme.input_activations is not None:
            step = peaks[name] / ((2**scheme.input_activations.num_bits - 1) / 2)
            module.input_scale.data = torch.full_like(module.input_scale, step)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    for stale in dest.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(str(dest))
    compressor.update_config(str(dest))
    return dest


def _input_peaks(model, tokens: int = 256) -> dict[str, float]:
    """Each Linear's largest input magnitude over the first `tokens` of the tiny corpus."""
    import torch

    from stages.model.tiny_model import encode, read_corpus

    peaks: dict[str, float] = {}

    def hook(name):
        def record(_module, args):
            peaks[name] = max(peaks.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(torch.tensor([encode(read_corpus("calibration"))[:tokens]]))
    for h in handles:
        h.remove()
    return peaks


def _table_section(intro: str, header: list[str], rows: list[list[str]]) -> str:
    """A bench-quality section: a paragraph, then a markdown table."""
    lines = ["", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def qat_markdown(rows: list[dict[str, Any]]) -> str:
    return _table_section(
        "Quantization-aware-trained tiny checkpoints (`python -m stages.model.tiny_model --qat`, Q4_0's "
        "int4 grid per channel or per group of 32 inputs, bf16 as transformers writes them): each "
        "quantized keeping its grid and ignoring it, against its own float graphs on held-out text; the "
        "model not trained for 4 bits beside them.",
        [
            "checkpoint, quantization",
            "top-1",
            "KL",
            "perplexity FP -> quantized",
            "grids kept / 4-bit weights",
            "int8 share",
        ],
        [
            [
                r["row"],
                f"{r['top1_agreement']:.3f}",
                f"{r['kl_divergence']:.4f}",
                f"{r['perplexity_fp']:.3f} -> {r['perplexity_quantized']:.3f}",
                f"{r['grids_kept']} / {r['weights_4bit']}",
                "" if r["int8_share"] is None else f"{r['int8_share']:.2f}",
            ]
            for r in rows
        ],
    )


def e2b_qat_markdown(rows: list[dict[str, Any]]) -> str:
    return _table_section(
        "A QAT checkpoint's weights at E2B geometry (random weights put on Q4_0's grid first): finding "
        "and keeping the grid against GPTQ ignoring it, as `e2b_rounding_costs` times the rounding.",
        ["weights, quantization", "E2B rounding", "peak per weight", "Hessians"],
        [
            [
                r["scheme"],
                f"{r['rounding_s'] / 60:.1f} min",
                f"{r['peak_bytes'] / 2**20:.0f} MiB",
                f"{r['hessian_bytes'] / GIB:.1f} GiB",
            ]
            for r in rows
        ],
    )


def lut_quality(workdir: Path, bits: tuple[int, ...] = (16, 8, 4)) -> list[dict[str, Any]]:
    """What the per-layer LUT's bits cost on their own: the trained tiny model's float graphs fed
    the Genie LUTs' rows (embedding 16-bit, per-layer LUT at each width) against the same graphs fed
    the checkpoint's float embeddings, on quantize's held-out samples. (Quantize's own figures feed
    the LUTs to both sides, so they cannot see this.)"""
    import shutil

    from stages.core.config import load_config
    from stages.download import run_download
    from stages.export import run_export
    from stages.planning.results import ExportResult, StageReport
    from stages.quant.quality import compare_chains
    from stages.quant.runner import HostRunner
    from stages.quantize.stage import heldout_samples

    rows = []
    ckpt = workdir / "checkpoints" / "tiny"
    if not ckpt.is_dir():
        run_download("tiny", "main", ckpt)
    for b in bits:
        cfg = load_config("tiny", {"ple_lut_bits": b})
        shutil.rmtree(output_dir(workdir, "export"), ignore_errors=True)
        run_export(cfg, workdir, ckpt)
        export_dir = output_dir(workdir, "export")
        samples, decode_steps = heldout_samples(cfg, ckpt)
        exact = HostRunner.from_export(export_dir, luts=False)
        fed = HostRunner.from_export(export_dir, luts=True)
        lut = ExportResult(export_dir, StageReport.read(export_dir)).luts["per_layer_embedding"]
        rows.append(
            {
                "ple_lut_bits": b,
                "lut_bytes": (export_dir / lut.path).stat().st_size,
                **compare_chains(exact, fed, samples, decode_steps),
            }
        )
    return rows


def lut_markdown(rows: list[dict[str, Any]]) -> str:
    return _table_section(
        "Per-layer LUT bits alone (tiny trained model, float graphs): the graphs fed the Genie LUTs "
        "(embedding ufixed16, per-layer LUT at each width) against the same graphs fed the checkpoint's "
        "float embeddings, held-out text.",
        ["per-layer LUT", "top-1", "KL", "perplexity exact -> LUT", "tiny LUT file"],
        [
            [
                f"ufixed{r['ple_lut_bits']}",
                f"{r['top1_agreement']:.3f}",
                f"{r['kl_divergence']:.5f}",
                f"{r['perplexity_fp']:.3f} -> {r['perplexity_quantized']:.3f}",
                f"{r['lut_bytes'] / 1024:.0f} KiB",
            ]
            for r in rows
        ],
    )


# The QAT rows of the E2B rounding cost: weights on Q4_0's grid (int4, one scale per 32 inputs), as
# google/gemma-4-E2B-it-qat-q4_0-unquantized holds them, their grid kept or ignored.
QAT_E2B_SCHEMES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("QAT Q4_0 grid, kept (w4a16-lpbq: LPBQ-32)", {"precision": "w4a16-lpbq"}),
    ("QAT Q4_0 grid, ignored: GPTQ (w4a16-lpbq)", {"precision": "w4a16-lpbq", "checkpoint_grid": "ignore"}),
)


def q4_0_snapped(w: Any, group: int = 32) -> Any:
    """`w` (in, out) on Q4_0's grid along its inputs, as llama.cpp's Q4_0 rounds it (scale = the
    group's largest-magnitude value / -8, integers clipped to -8..7), stored as bf16 values."""
    import numpy as np
    import torch

    groups = w.T.reshape(-1, group).astype(np.float64)
    peak = groups[np.arange(len(groups)), np.abs(groups).argmax(axis=1)]
    d = np.where(peak != 0, peak / -8, 1.0)[:, None]
    snapped = (np.clip(np.rint(groups / d), -8, 7) * d).reshape(w.shape[1], w.shape[0]).T
    return torch.from_numpy(snapped.astype(np.float32)).to(torch.bfloat16).float().numpy()


def e2b_rounding_costs(
    schemes=QUALITY_SCHEMES, calibration_rows: int = 1024, on_grid: bool = False
) -> list[dict[str, Any]]:
    """Each scheme's weight rounding at E2B geometry: one layer of each kind (sliding/full attention,
    6,144/12,288-wide MLP) rounded as quantize rounds it, timed and traced (numpy's allocations), then
    scaled by how many layers of that kind E2B has. Random weights and inputs: rounding time does not
    depend on the values; `on_grid` puts them on Q4_0's grid first (a QAT checkpoint: finding and
    keeping the grid is timed with the rounding). The Hessians' memory is counted from the geometry."""
    import time
    import tracemalloc

    import numpy as np

    from stages.core.config import load_config
    from stages.model.geometry import LINEAR, e2b_geometry
    from stages.planning.fitting import hessian_bytes, hessian_shape
    from stages.quant.gptq import Hessian
    from stages.quantize.weights import WeightRounder

    geo = e2b_geometry()
    kinds: dict[tuple, list[int]] = {}
    for layer in geo.layers:
        kinds.setdefault((layer.attention, layer.intermediate_size, layer.owns_kv), []).append(layer.index)
    rng = np.random.default_rng(0)
    rows = []
    for label, overrides in schemes:
        cfg = load_config(overrides={**overrides, "model": "e2b-random"})
        scheme = cfg.decoder_scheme
        if scheme.bits != 4:
            rows.append(
                {"scheme": label, "rounding_s": 0.0, "search_s": 0.0, "peak_bytes": 0, "hessian_bytes": 0}
            )
            continue
        gptq = cfg.weight_rounding != "nearest"
        # The scale search rounds only the weights left at 4 bits: which ones is decided by E2B's
        # measured costs, so each kind's search time is counted at the 4-bit share of its parameters.
        search_share = (1 - scheme.int8_share) if cfg.weight_rounding == "gptq-search" else 0.0
        total_s, search_s, peak = 0.0, 0.0, 0
        for (_, _, _), layers in sorted(kinds.items()):
            tensors = [t for t in geo.layers[layers[0]].tensors if t.kind == LINEAR]
            hessians: dict[int, Hessian] = {}
            for t in tensors:
                width = t.shape[1]
                if gptq and width not in hessians:
                    x = rng.normal(size=(calibration_rows, width)).astype(np.float32)
                    shape = hessian_shape(width)
                    hessians[width] = Hessian(np.zeros(shape, np.float32))
                    hessians[width].add(x)
            tracemalloc.start()
            rounder = WeightRounder(cfg, {t.name: hessians[t.shape[1]] for t in tensors if gptq})
            for t in tensors:
                w = (rng.normal(size=(t.shape[1], t.shape[0])) * 0.02).astype(np.float32)
                if on_grid:
                    w = q4_0_snapped(w)
                tracemalloc.reset_peak()
                t0 = time.perf_counter()
                rounder.round_weight(t.name, w)  # as quantize does: the scheme, GPTQ, both errors
                total_s += (time.perf_counter() - t0) * len(layers)
                if search_share:
                    t0 = time.perf_counter()
                    rounder.round_weight(t.name, w, search=True)  # as search_scales does
                    search_s += (time.perf_counter() - t0) * len(layers) * search_share
                rounder.rounded.clear()
                peak = max(peak, tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        rows.append(
            {
                "scheme": label,
                "rounding_s": total_s,
                "search_s": search_s,
                "peak_bytes": peak,
                "hessian_bytes": hessian_bytes(geo, cfg),
            }
        )
    return rows


def quality_markdown(tiny: list[dict[str, Any]], e2b: list[dict[str, Any]], command: str) -> str:
    cost = {r["scheme"]: r for r in e2b}
    lines = [
        f"# 4-bit weight schemes side by side ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}`. Machine: {_machine()['cpus']} CPUs, "
        f"{_machine()['memory_bytes'] / GIB:.0f} GiB.",
        "",
        "Tiny trained model (SM8450, KV 8-bit, PLE float16, 8 x 128 calibration tokens), held-out text, "
        "quantized graphs against the float graphs. E2B geometry: the decoder weights' rounding in "
        "quantize (one layer of each kind rounded, scaled by E2B's layer counts; random values), its "
        "peak extra memory per weight and the Hessians it keeps; the scale search (gptq-search) at the "
        "4-bit share of each layer's parameters.",
        "",
        "| scheme | top-1 | KL | perplexity FP -> quantized | int8 share | E2B rounding | E2B scale "
        "search | E2B peak per weight | E2B Hessians |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tiny:
        c = cost.get(r["scheme"], {})
        share = "" if r["int8_share"] is None else f"{r['int8_share']:.2f}"
        lines.append(
            f"| {r['scheme']} | {r['top1_agreement']:.3f} | {r['kl_divergence']:.4f} | "
            f"{r['perplexity_fp']:.3f} -> {r['perplexity_quantized']:.3f} | {share} | "
            f"{c.get('rounding_s', 0) / 60:.1f} min | {c.get('search_s', 0) / 60:.1f} min | "
            f"{c.get('peak_bytes', 0) / 2**20:.0f} MiB | "
            f"{c.get('hessian_bytes', 0) / GIB:.1f} GiB |"
        )
    return "\n".join(lines) + "\n"
