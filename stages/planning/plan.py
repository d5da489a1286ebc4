"""`g4v69 plan`: the priced plan of a config (stages/planning/fitting.py) as the text `make plan`
prints: parts, graphs, device memory, the SoC's limits, the roofline, the layouts side by side and
the layout rule."""

from __future__ import annotations

from stages.core.config import PipelineConfig
from stages.planning.fitting import (
    LAYOUT_RULE,
    PLE_LUT_4BIT_NOTE,
    LayoutPlan,
    LayoutRuleError,
    LimitCheck,
    Plan,
    _layout_name,
    _targets,
    fmt_gib,
    fmt_mib,
    fmt_size,
    recommended_layout,
    rule_layout,
)


def _m(n: int) -> str:
    return f"{n / 1e6:,.1f} M"


def _table(rows: list[list[str]], header: list[str], text_columns: int = 1) -> list[str]:
    """Plain-text table; the first `text_columns` columns align left, figures align right."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if c < text_columns else '>'}{w}}}" for c, w in enumerate(widths))
    lines = [fmt.format(*header), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows]
    return lines


def render_plan(
    plan: Plan, layouts: list[LayoutPlan] | None = None, cfg: PipelineConfig | None = None
) -> str:
    """The plan as text; with the layouts, the layout table, and with the config, the layout rule."""
    out = [
        f"Plan: {plan.model} on {plan.soc} ({plan.dsp_arch}), {plan.precision} "
        f"({plan.weight_scheme} decoder weights), KV {plan.kv_cache_bits}-bit",
        f"Context: graphs of {plan.max_context} positions; a conversation (prompts and replies) holds "
        f"{plan.usable_context} tokens, the past the widest graph kind keeps",
        "",
        "Parameters",
    ]
    out += _table([[k, _m(v)] for k, v in plan.params.items()], ["what", "params"])
    out += ["", "Parts (one context binary per graph)"]
    out += _table(
        [[p.name, ", ".join(p.holds), _m(p.params), fmt_mib(p.bytes)] for p in plan.parts],
        ["part", "holds", "params", "bytes"],
        text_columns=2,
    )
    out += ["", "Graphs (estimated allocation = weights + I/O + widest layer's intermediates + spill-fill)"]
    out += _table(
        [
            [
                g.name,
                g.role,
                str(g.ar),
                str(g.kv_inputs),
                fmt_mib(g.bytes),
                fmt_mib(g.allocation["io"]),
                fmt_mib(g.allocation["intermediates"] + g.allocation["spill_fill"]),
                fmt_mib(g.allocation["total"]),
            ]
            for g in plan.graphs
        ],
        ["graph", "role", "AR", "KV in", "weights", "I/O", "interm.+spill", "est. alloc"],
        text_columns=2,
    )
    out += ["", "Device memory"]
    rows = [[f"{k} LUT", fmt_mib(v)] for k, v in plan.luts.items()]
    rows += [
        ["KV cache (as laid out: windowed sliding caches where Genie allows)", fmt_mib(plan.kv_cache_bytes)],
        ["KV cache (every layer full length)", fmt_mib(plan.kv_cache_bytes_without_window)],
        ["pinned, weight-shared binaries", fmt_gib(plan.device_bytes_shared_weights)],
        ["pinned, separate prefill/decode binaries", fmt_gib(plan.device_bytes_separate_binaries)],
        [f"pinned on {plan.soc} (binaries + LUTs + KV)", fmt_gib(plan.device_bytes)],
        ["mapped by Genie (every ctx-bin's est. allocation)", fmt_gib(plan.mapped_bytes)],
    ]
    if plan.per_layer_lut_4bit_bytes:
        saved = plan.luts["per_layer_embedding"] - plan.per_layer_lut_4bit_bytes
        rows += [
            ["per_layer_embedding LUT with ple_lut_bits=4", fmt_mib(plan.per_layer_lut_4bit_bytes)],
            ["pinned with it", fmt_gib(plan.device_bytes - saved)],
        ]
    out += _table(rows, ["what", "bytes"])
    out += [f"  LUT residency: {plan.lut_residency}"]
    if plan.per_layer_lut_4bit_bytes:
        out += [f"  4-bit per-layer LUT: {PLE_LUT_4BIT_NOTE}"]
    out += ["", f"Limits of {plan.soc}"]
    out += render_limits(plan.limits)
    out += ["", "Roofline: one call of each graph kind through every part (ceilings, not measurements)"]
    out += render_roofline(plan)
    if layouts:
        out += ["", "Layouts side by side (same model, SoC and context; rates and TTFT are ceilings)"]
        out += render_layouts(layouts)
    if layouts and cfg:
        out += ["", "Layout rule (the preset's targets)"]
        out += render_rule(layouts, cfg)
    if plan.warnings:
        out += ["", "Warnings"] + [f"  ! {w}" for w in plan.warnings]
    return "\n".join(out)


def render_limits(limits: list[LimitCheck]) -> list[str]:
    rows = [
        [c.limit, fmt_size(c.needed_bytes), fmt_size(c.limit_bytes), "meets" if c.meets else "OVER"]
        for c in limits
    ]
    out = _table(rows, ["limit", "needs", "limit", "verdict"])
    out += ["  sources and what only a phone can settle:"]
    for c in limits:
        out.append(f"  - {c.limit}: {c.source}")
        if c.unverified:
            out.append(f"    unverified: {c.unverified}")
    return out


def _ttft(seconds: float, prompt: int, usable_context: int) -> str:
    """A prompt that fills the usable context leaves no room for the reply."""
    if prompt >= usable_context:
        return "> ctx"
    return f"{seconds:.2f} s"


def render_roofline(plan: Plan) -> list[str]:
    rows = [
        [
            f"{c.role} AR-{c.ar}" if c.role != "any" else f"  (at AR-{c.ar})",
            fmt_size(c.bytes),
            f"{c.ops / 1e9:,.1f} G",
            f"{c.memory_s * 1e3:.1f} ms",
            f"{c.compute_s * 1e3:.1f} ms" if c.compute_s is not None else "no figure",
            c.bound,
        ]
        for c in [*plan.calls, *plan.calls_by_ar]
    ]
    out = _table(rows, ["graph kind", "read", "ops", "memory time", "compute time", "bound"])
    ttft = ", ".join(f"{n} tokens {_ttft(v, n, plan.usable_context)}" for n, v in plan.ttft_s.items())
    out += [
        f"  decode: at most {plan.decode_tokens_per_s_ceiling} tokens/s; prefill: at most "
        f"{plan.prefill_tokens_per_s} tokens/s; time to first token at least: {ttft}",
        f"  - bandwidth {plan.bandwidth['gb_per_s']} GB/s ({plan.bandwidth['dram']}): "
        f"{plan.bandwidth['source']}",
    ]
    if plan.compute:
        out.append(
            f"  - HTP peak {plan.compute['int8_tops']} TOPS int8, {plan.compute['a16_tops']} TOPS with "
            f"16-bit activations ({plan.compute['source']})"
        )
    else:
        out.append(f"  - {plan.soc} has no HTP compute figure in the SoC table: times are memory-bound only")
    return out


def render_rule(layouts: list[LayoutPlan], cfg: PipelineConfig) -> list[str]:
    out = [f"  targets: {_targets(cfg)}", f"  rule: {LAYOUT_RULE}"]
    try:
        pick = rule_layout(layouts, cfg)
    except LayoutRuleError as e:
        return [*out, f"  ! {e}"]
    out.append(f"  picks: {pick.name} (Genie: {pick.genie})")
    if not pick.is_config:
        out.append(f"  this config's layout is another ({_layout_name(cfg)}); the preset says why")
    return out


def render_layouts(layouts: list[LayoutPlan]) -> list[str]:
    phones = sorted({ram for lay in layouts for ram in lay.fits})
    prompts = list(layouts[0].ttft_s)
    rows = []
    for lay in layouts:
        rows.append(
            [
                ("* " if lay.is_config else "  ") + lay.name,
                fmt_gib(lay.binaries_bytes),
                fmt_gib(lay.largest_allocation),
                fmt_gib(lay.mapped_bytes),
                fmt_gib(lay.pinned_bytes),
                f"{lay.decode_tokens_per_s_ceiling} ({lay.decode_bound[:3]})",
                f"{lay.prefill_tokens_per_s:,.0f}",
                str(lay.usable_context),
                *[_ttft(lay.ttft_s[n], n, lay.usable_context) for n in prompts],
                *["fits" if lay.fits[ram] else "no" for ram in phones],
            ]
        )
    header = ["layout (* = this config)", "binaries", "largest ctx", "mapped", "pinned", "decode tok/s"]
    header += [
        "prefill tok/s",
        "usable ctx",
        *[f"TTFT {n}" for n in prompts],
        *[f"{ram} GB" for ram in phones],
    ]
    out = _table(rows, header)
    for ram in phones:
        best = recommended_layout(layouts, ram)
        out.append(
            f"  most accurate layout that fits a phone with {ram} GB, whatever its speed: "
            f"{best.name if best else 'none'}" + (f" (Genie: {best.genie})" if best else "")
        )
    return out
