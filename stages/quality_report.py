"""quantized/quality.html: the quantize stage's figures as a page a person reads, with the plots
drawn as inline SVG (no plotting library in the quant image)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

QUALITY_COLUMNS = ("top1_agreement", "kl_divergence", "perplexity_fp", "perplexity_quantized", "tokens")


def _bars(title: str, values: dict[str, float], unit: str) -> str:
    """A horizontal bar chart: one bar per name, longest value = full width."""
    if not values:
        return ""
    width, row, label_w = 760, 18, 300
    top = max(max(values.values()), 1e-9)
    parts = [
        f'<svg width="{width}" height="{row * len(values) + 30}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="0" y="14" font-size="13" font-weight="bold">{html.escape(title)}</text>',
    ]
    for i, (name, v) in enumerate(values.items()):
        y = 24 + i * row
        w = max(1, int((width - label_w - 60) * max(v, 0) / top))
        parts.append(f'<text x="0" y="{y + 12}" font-size="11">{html.escape(name)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w}" height="{row - 5}" fill="#4a7bd0"/>')
        parts.append(f'<text x="{label_w + w + 4}" y="{y + 12}" font-size="11">{v:.1f} {unit}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _calibration(c: dict[str, Any]) -> str:
    source = ", ".join(c["files"]) if c["files"] else c["dataset"]
    if c["dataset"] == "files" and not c["files"]:
        source = "the built-in corpus"
    text = (
        f"{c['samples']} samples of {c['tokens_per_sample']} tokens from {source}, "
        f"{c['decode_steps_per_sample']} decode steps each, {c['method']}"
    )
    return html.escape(text + (f" (stride {c['stride']})" if c.get("stride") else ""))


def _min_sqnr(q: dict[str, Any]) -> str:
    """The worst per-output SQNR of a quality entry (its weakest layer or part output)."""
    values = [db for outputs in q.get("sqnr_db", {}).values() for db in outputs.values()]
    return f"{min(values):.1f}" if values else ""


def write_quality_html(path: Path, figures: dict[str, Any]) -> None:
    quality = figures["quality"]
    rows = "".join(
        "<tr><td>"
        + html.escape(policy)
        + "</td>"
        + "".join(f"<td>{q.get(c, '')}</td>" for c in QUALITY_COLUMNS)
        + "</tr>"
        for policy, q in quality.items()
    )
    by_precision = figures.get("quality_by_precision", {})
    precision_rows = "".join(
        "<tr><td>"
        + html.escape(name)
        + "</td>"
        + "".join(f"<td>{q.get(c, '')}</td>" for c in QUALITY_COLUMNS)
        + f"<td>{_min_sqnr(q)}</td></tr>"
        for name, q in by_precision.items()
    )
    chosen = quality[figures["ple_policy"]]
    per_layer = {}
    per_output = {}
    for graph, outputs in chosen.get("sqnr_db", {}).items():
        for name, db in outputs.items():
            if name.endswith("_out"):
                per_layer[f"{name} ({graph.split('_part')[1]})"] = db
            else:
                per_output[f"{graph}: {name}"] = db
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>Quantization quality</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}}td,th{{padding:2px 8px;text-align:right}}
td:first-child{{text-align:left}}</style></head><body>
<h1>Quantization quality: {html.escape(figures["soc"])}, KV {figures["kv_cache_bits"]}-bit,
PLE {html.escape(figures["ple_policy"])}</h1>
<p>Float and quantized shard chains through the host runner on held-out text
({figures["evaluation"]["samples"]} samples of {figures["evaluation"]["tokens_per_sample"]} tokens; prefill,
then teacher-forced decode steps). Calibration: {_calibration(figures["calibration"])}.</p>
<table><tr><th>PLE policy</th>{"".join(f"<th>{c}</th>" for c in QUALITY_COLUMNS)}</tr>{rows}</table>
<h2>Precisions (weight schemes; PLE {html.escape(figures["ple_policy"])})</h2>
<table><tr><th>precision</th>{"".join(f"<th>{c}</th>" for c in QUALITY_COLUMNS)}<th>min SQNR (dB)</th></tr>
{precision_rows}</table>
<h2>Per-layer error (SQNR of each owner layer's new K/V entries, prefill graphs)</h2>
{_bars("KV cache outputs", per_layer, "dB")}
<h2>Per-part outputs (SQNR)</h2>
{_bars("part outputs", per_output, "dB")}
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
