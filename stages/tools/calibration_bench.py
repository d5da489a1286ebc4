"""The calibration recipe, measured (`make bench-calibration`): for each quantize pass that reads the
calibration text (the activation ranges, GPTQ's Hessians, the mixed precision's measured sensitivity;
the scale search reads the Hessians), the held-out quality of the trained tiny model against what that
pass takes, the other passes held at the preset's recipe; beside it, what the pass costs at E2B geometry
at each size, from the time per call or per weight that the newest E2B bench run measured.

Quality is measured on more held-out text than the quantize stage's own figure (EVAL_SEQUENCES windows,
about 8k tokens on the tiny model): the differences between recipes are small, and 508 tokens move top-1
by +-0.01 with the choice alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Held-out windows for the quality figures.
EVAL_SEQUENCES = 64


@dataclass(frozen=True)
class Sweep:
    field: str  # the config field the pass takes its share by
    timed: str  # the pass of figures.passes whose time grows with it
    values: tuple[int, ...]  # on the tiny model (128-token sequences)
    e2b_values: tuple[int, ...]  # on the default preset (2048-token sequences)


SWEEPS: tuple[Sweep, ...] = (
    Sweep("calibration_samples", "ranges_prefill", (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 20)),
    Sweep("hessian_samples", "hessians", (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 20)),
    Sweep("sensitivity_tokens", "sensitivity", (32, 64, 128, 256, 512, 1024), (128, 256, 512, 1024)),
)
# The tiny model's layout for the sweeps: the default preset's precision (every pass runs) on the tiny
# preset's graphs.
TINY_OVERRIDES: dict[str, Any] = {"precision": "w4a16-mixed"}


def tiny_recipe(workdir: Path, sweeps: tuple[Sweep, ...] = SWEEPS) -> list[dict[str, Any]]:
    """Every sweep value through the quantize stage of the trained tiny model (exported once): held-out
    quality of the quantized graphs against the float graphs, and each pass's time."""
    import shutil

    from stages.core.config import load_config
    from stages.core.pipeline import output_dir
    from stages.download import run_download
    from stages.export import run_export
    from stages.planning.results import QuantizeResult, require_result
    from stages.quant.quality import compare_chains
    from stages.quant.runner import HostRunner
    from stages.quantize import run_quantize
    from stages.quantize.stage import heldout_samples

    base = load_config("tiny", TINY_OVERRIDES)
    ckpt = workdir / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    run_export(base, workdir, ckpt)
    export_dir = output_dir(workdir, "export")
    samples, decode_steps = heldout_samples(base, ckpt, count=EVAL_SEQUENCES)
    rows = []
    for sweep in sweeps:
        for value in sweep.values:
            cfg = base.with_overrides(**{sweep.field: value})
            shutil.rmtree(output_dir(workdir, "quantize"), ignore_errors=True)
            run_quantize(cfg, workdir, ckpt)
            quantized = require_result(workdir, "quantize", QuantizeResult, RuntimeError)
            fp = HostRunner.from_export(export_dir, luts=True)
            q = HostRunner.from_export(export_dir, luts=True, graph_dir=quantized.folder, fold_weights=True)
            quality = compare_chains(fp, q, samples, decode_steps)
            timed = [p for p in quantized.report.figures["passes"] if p["name"] == sweep.timed]
            rows.append(
                {
                    "field": sweep.field,
                    "value": value,
                    "preset_value": getattr(base, sweep.field),
                    "pass_tokens": sum(p.get("tokens", 0) for p in timed),
                    "pass_s": round(sum(p["wall_s"] for p in timed), 2),
                    "top1_agreement": quality["top1_agreement"],
                    "kl_divergence": quality["kl_divergence"],
                    "heldout_tokens": quality["tokens"],
                    "quantize_wall_s": quantized.report.wall_s,
                }
            )
    return rows


def newest_e2b_passes(bench_dir: Path) -> tuple[str, dict[str, Any], list[dict[str, Any]]] | None:
    """The newest committed bench run at E2B geometry whose quantize report timed its passes: its file
    name, config and passes."""
    found = None
    for path in sorted(bench_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if data.get("quantize_passes") and "e2b" in data.get("config", {}).get("model", "").lower():
            found = (path.name, data["config"], data["quantize_passes"])
    return found


def e2b_costs(config: dict[str, Any], passes: list[dict[str, Any]], sweeps=SWEEPS) -> list[dict[str, Any]]:
    """Each sweep's E2B values priced from a run's passes: a pass's time per chain call (ranges,
    Hessians) or per weight and call (sensitivity) times the calls the value makes. Every call of a
    pass runs the same graphs on the same shapes, so its time is linear in the calls."""
    by_name = {p["name"]: p for p in passes}
    ar = max(config["calibration_ar"], config["prefill_ar"])
    per_sequence = -(-min(config["calibration_tokens"], config["max_context"]) // ar)
    rows = []
    for sweep in sweeps:
        p = by_name.get(sweep.timed)
        if not p or not p.get("units"):
            continue
        if sweep.field == "sensitivity_tokens":
            measured_calls = -(-p["tokens"] // ar)
            per_call = p["wall_s"] / (p["units"] * measured_calls)
            cost = [(v, p["units"] * -(-v // ar) * per_call) for v in sweep.e2b_values]
        else:
            per_call = p["wall_s"] / p["units"]
            cost = [(v, v * per_sequence * per_call) for v in sweep.e2b_values]
        for value, seconds in cost:
            rows.append(
                {
                    "field": sweep.field,
                    "value": value,
                    "tokens": value if sweep.field == "sensitivity_tokens" else value * per_sequence * ar,
                    "seconds": round(seconds, 1),
                    "preset_value": config.get(sweep.field),
                }
            )
    return rows


def recipe_markdown(
    tiny: list[dict[str, Any]], e2b: list[dict[str, Any]], e2b_source: str | None, command: str
) -> str:
    from stages.tools.bench import _table_section

    def value(r: dict[str, Any]) -> str:
        return f"{r['value']}{' (preset)' if r['value'] == r['preset_value'] else ''}"

    md = "# The calibration recipe, pass by pass\n\n" + f"Command: `{command}`\n"
    md += _table_section(
        "Each quantize pass that reads the calibration text, swept alone while the others keep the "
        "preset's share. Tiny model: the trained tiny model at w4a16-mixed (every pass runs), 128-token "
        f"sequences, quality of its quantized graphs against its float graphs on {EVAL_SEQUENCES} held-out "
        "windows; time of the pass itself on this machine. (preset): the tiny preset's share.",
        ["field", "value", "tokens the pass read", "held-out top-1", "KL", "pass time"],
        [
            [
                r["field"],
                value(r),
                str(r["pass_tokens"]),
                f"{r['top1_agreement']:.3f}",
                f"{r['kl_divergence']:.5f}",
                f"{r['pass_s']:.1f} s",
            ]
            for r in tiny
        ],
    )
    if not e2b:
        return md + "\nE2B geometry: no committed bench run timed its quantize passes yet.\n"
    return md + _table_section(
        f"E2B geometry: the pass's time per chain call (per weight and call for the sensitivity) "
        f"measured by {e2b_source}, times the calls each value makes (2048-token sequences through "
        "the AR-128 calibration twin). (preset): the default preset's share.",
        ["field", "value", "tokens", "estimated time"],
        [[r["field"], value(r), str(r["tokens"]), f"{r['seconds'] / 60:.1f} min"] for r in e2b],
    )
