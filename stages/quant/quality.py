"""How good the quantized graphs are: the metrics the quantize stage reports (float vs quantized chains
on held-out text, per-graph output SQNR) and quantized/quality.html, the same figures as a page a
person reads, with the plots drawn as inline SVG (no plotting library in the quant image)."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from stages.model.contract import GraphSpec

# Held-out samples of the evaluation, and the tokens of the first one the per-graph SQNR runs over.
EVAL_SAMPLES = 4
SQNR_TOKENS = 128

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
{_weights_section(figures.get("weights") or {})}
<h2>Per-layer error (SQNR of each owner layer's new K/V entries, prefill graphs)</h2>
{_bars("KV cache outputs", per_layer, "dB")}
<h2>Per-part outputs (SQNR)</h2>
{_bars("part outputs", per_output, "dB")}
</body></html>
"""
    path.write_text(doc, encoding="utf-8")


def _weights_section(weights: dict[str, Any]) -> str:
    """The 4-bit weights: how they were rounded, which a mixed precision kept at int8, and each one's
    output SQNR at 4 bits (what the choice ranks), worst first."""
    if not weights.get("weights"):
        return ""
    chosen = set(weights.get("int8_weights", []))
    sqnr = {
        f"{name}{' (int8)' if name in chosen else ''}": -10 * np.log10(max(w["nsr_int4"], 1e-12))
        for name, w in sorted(weights["weights"].items(), key=lambda kv: -kv[1]["nsr_int4"])
    }
    return (
        f"<h2>4-bit weights: {html.escape(str(weights.get('rounding')))} rounding, "
        f"{len(chosen)} kept at int8 ({100 * weights.get('int8_share', 0):.0f} % of decoder parameters)</h2>"
        "<p>Each weight's MatMul output SQNR at 4 bits on the calibration inputs "
        "(||XW||&sup2; / ||X(W-Wq)||&sup2;, dB), lowest first; a mixed precision keeps the weights that "
        "lose the most per extra byte at int8.</p>" + _bars("4-bit output SQNR", sqnr, "dB")
    )


# ---- metrics ----
def chain_logits(runner, samples: list[list[int]], decode_steps: int) -> list[np.ndarray]:
    """Teacher-forced logits for every position but the last of each sample: its beginning through
    the prefill graphs, the rest as decode steps. All prefills run first and their cache states are
    kept, so prefill and decode graphs (each a full copy of the weights) are never loaded together."""
    from stages.core.progress import tqdm
    from stages.quant.calibration import decode_split

    use_decode = "decode" in runner.graphs
    splits = [decode_split(s, decode_steps if use_decode else 0) for s in samples]
    progress = tqdm(
        total=len(samples) + sum(max(len(tail) - 1, 0) for _, tail in splits),
        desc="evaluate",
        unit="call",
        leave=False,
    )
    heads = []
    for head, tail in splits:
        runner.reset()
        heads.append((runner.prefill(head), runner.snapshot(), tail))
        progress.update()
    runner.release("prefill")
    out = []
    for sample, (logits, state, tail) in zip(samples, heads, strict=True):
        runner.restore(state)
        rows = [logits]
        for tok in tail[:-1]:
            rows.append(runner.step([tok]))
            progress.update()
        out.append(np.concatenate(rows)[: len(sample) - 1])
    runner.release("decode")
    progress.close()
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def below_floor(cfg, figures: dict[str, Any]) -> str | None:
    """The one-line refusal when the held-out figures (compare_chains) miss the config's quality floor
    for its precision (PipelineConfig.quality_floor), or None when they clear it."""
    floor = cfg.quality_floor
    short = floor.shortfalls(figures["top1_agreement"], figures["kl_divergence"])
    if not short:
        return None
    return (
        f"the {cfg.precision} graphs fall below the quality floor for {floor.weights} weights on "
        f"{figures['tokens']} held-out tokens: "
        + "; ".join(f"{text} ({name})" for name, text in short.items())
        + ". Nothing was kept: a quantization this far from the float graphs is broken (look at the "
        "calibration text, the precision and ple_policy); if it is what this model really gets, relax "
        f"{' and '.join(short)} (in the preset, as {', '.join('--' + f.replace('_', '-') for f in short)} "
        f"or {', '.join('G4V69_' + f.upper() for f in short)}) and run `make quantize` again"
    )


def compare_chains(fp_runner, q_runner, samples: list[list[int]], decode_steps: int) -> dict[str, float]:
    agree, kl, nll_fp, nll_q, count = 0, 0.0, 0.0, 0.0, 0
    fp_logits = chain_logits(fp_runner, samples, decode_steps)
    q_logits = chain_logits(q_runner, samples, decode_steps)
    for sample, fp, q in zip(samples, fp_logits, q_logits, strict=True):
        lp_fp, lp_q = _log_softmax(fp), _log_softmax(q)
        targets = np.array(sample[1:])
        idx = np.arange(len(targets))
        agree += int((lp_fp.argmax(-1) == lp_q.argmax(-1)).sum())
        kl += float((np.exp(lp_fp) * (lp_fp - lp_q)).sum())
        nll_fp -= float(lp_fp[idx, targets].sum())
        nll_q -= float(lp_q[idx, targets].sum())
        count += len(targets)
    return {
        "tokens": count,
        "top1_agreement": round(agree / count, 4),
        "kl_divergence": round(kl / count, 5),
        "perplexity_fp": round(math.exp(nll_fp / count), 4),
        "perplexity_quantized": round(math.exp(nll_q / count), 4),
    }


def output_sqnr(fp_runner, q_paths: dict[str, Path], samples: list[list[int]]) -> dict[str, dict[str, float]]:
    """Per graph and output, the SQNR (dB) of the quantized graph fed the float chain's inputs.

    One graph at a time: the float chain runs up to that graph's part and only that quantized graph
    is loaded beside it."""
    import onnxruntime as ort

    from stages.quant.runner import session_options

    out: dict[str, dict[str, float]] = {}
    for spec, _ in fp_runner.graphs["prefill"]:
        session = ort.InferenceSession(
            str(q_paths[spec.name]), session_options(fold_weights=True), providers=["CPUExecutionProvider"]
        )
        signal: dict[str, float] = defaultdict(float)
        noise: dict[str, float] = defaultdict(float)

        def observe(
            seen: GraphSpec,
            feeds: dict,
            outputs: dict,
            _n: int,
            spec=spec,
            session=session,
            signal=signal,
            noise=noise,
        ) -> None:
            if seen.name != spec.name:
                return
            got = session.run(list(outputs), feeds)
            for (name, ref), q in zip(outputs.items(), got, strict=True):
                signal[name] += float(np.square(ref, dtype=np.float64).sum())
                noise[name] += float(np.square(ref - q, dtype=np.float64).sum())

        fp_runner.observer = observe
        try:
            for sample in samples:
                fp_runner.reset()
                for i in range(0, len(sample), fp_runner.prefill_ar):
                    fp_runner.step(sample[i : i + fp_runner.prefill_ar], role="prefill", parts=spec.part)
        finally:
            fp_runner.observer = None
        del session
        out[spec.name] = {
            name: round(10 * math.log10(s / noise[name]), 2) if noise[name] > 0 else 99.0
            for name, s in signal.items()
        }
    fp_runner.release("prefill")
    return out
