"""The E2B figures must agree with docs/facts.md §1 (counted there on the meta device)."""

import itertools
import json
import re

import pytest
from conftest import TINY_GEMMA4_CONFIG

from stages.core.config import load_config
from stages.core.precision import INT4_CHANNEL, INT4_LPBQ64
from stages.model.geometry import FULL, SLIDING, e2b_geometry, geometry_from_config
from stages.model.graphs import PartitionError, partition_layers
from stages.planning.fitting import (
    GIB,
    LayoutRuleError,
    kv_cache_bytes,
    make_layouts,
    over_context_limit,
    plan_config,
    prompt_seconds,
    recommended_layout,
    rule_layout,
)

MIB = 1 << 20


@pytest.fixture(scope="module")
def geo():
    return e2b_geometry()


def original(**overrides):
    """The original plan's job (w8a16, AR-128 prefill + AR-1 decode): the figures docs/facts.md §1
    and §4b give."""
    return load_config(overrides={"precision": "w8a16", "prefill_ar": 128, "decode_ar": 1, **overrides})


def test_the_qat_preset_is_the_layout_its_rule_picks_for_a_qat_source(geo):
    """A known QAT source whose groups LPBQ keeps ranks LPBQ above int4 per channel; at the preset's
    30 tokens/s target the rule picks it all at 4 bits. The same targets on the plain checkpoint pick
    LPBQ too, by the real-weight table alone (Gemma 3 270M: KL 0.110 against int4 per channel's 0.200)."""
    from stages.planning.fitting import quality_rank

    cfg = load_config("qat")
    pick = rule_layout(make_layouts(geo, cfg), cfg)
    assert pick.is_config and pick.name == "w4a16-lpbq, one graph kind AR-16"
    assert pick.decode_tokens_per_s_ceiling >= cfg.min_decode_tokens_per_s
    assert quality_rank(cfg) == cfg.precision_info.quality_rank - 1
    assert quality_rank(cfg) < quality_rank(load_config("qat", {"precision": "w4a16"})) - 1
    assert quality_rank(load_config("qat", {"checkpoint_grid": "ignore"})) == cfg.precision_info.quality_rank
    plain = load_config("qat", {"model": "google/gemma-4-E2B-it"})
    assert quality_rank(plain) == plain.precision_info.quality_rank
    assert rule_layout(make_layouts(geo, plain), plain).precision == "w4a16-lpbq"


def test_the_default_preset_is_the_layout_its_rule_picks(geo):
    cfg = load_config()
    layouts = make_layouts(geo, cfg)
    pick = rule_layout(layouts, cfg)
    assert pick.is_config and pick.name == "w4a16-mixed, one graph kind AR-32"
    # The most accurate layout that fits, whatever its speed, is the same precision at AR-1: one prompt
    # token per call, over the preset's time-to-first-token target.
    slowest = recommended_layout(layouts, 8)
    assert slowest.name == "w4a16-mixed, one graph kind AR-1"
    assert slowest.ttft_s[cfg.ttft_prompt_tokens] > cfg.max_ttft_s >= pick.ttft_s[cfg.ttft_prompt_tokens]
    # AR-32 decoding is still bandwidth-bound: within 2 % of AR-1's rate.
    assert pick.decode_bound == "memory"
    assert pick.decode_tokens_per_s_ceiling >= 0.98 * slowest.decode_tokens_per_s_ceiling
    plan = plan_config(geo, cfg)
    assert plan.fits(8)
    # The mixed share is the largest quarter step that fits: one more quarter is over the budget.
    assert cfg.mixed_percent == 75
    assert not plan_config(geo, load_config(overrides={"int8_percent": "100"})).fits(8)


def approx(value, expected, rel=0.005):
    return value == pytest.approx(expected, rel=rel)


def test_e2b_layer_pattern_and_kv_sharing(geo):
    assert geo.num_layers == 35
    assert [layer.index for layer in geo.layers if layer.attention == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert [layer.index for layer in geo.layers if layer.owns_kv] == list(range(15))
    for layer in geo.layers[15:]:
        assert layer.kv_donor == (14 if layer.attention == FULL else 13)
        assert not any("k_proj" in t.name or "v_proj" in t.name for t in layer.tensors)
    assert {layer.intermediate_size for layer in geo.layers[:15]} == {6144}
    assert {layer.intermediate_size for layer in geo.layers[15:]} == {12288}
    assert {layer.head_dim for layer in geo.layers if layer.attention == SLIDING} == {256}
    assert {layer.head_dim for layer in geo.layers if layer.attention == FULL} == {512}


def test_e2b_parameter_counts_match_facts(geo):
    assert approx(geo.total_params, 4.63e9)
    assert geo.embedding.numel == 262144 * 1536  # 403 M
    assert approx(geo.ple_table.numel, 2.35e9)
    assert approx(sum(t.numel for t in geo.ple_projection), 13.8e6)
    decoder = [layer.numel for layer in geo.layers]
    assert approx(sum(decoder), 1.86e9)
    assert approx(sum(decoder[:15]), 564e6)
    assert approx(sum(decoder[15:]), 1.30e9)


def test_ple_table_bytes_match_facts(geo):
    cfg16 = original(**{"ple_lut_bits": 16})
    cfg8 = original()
    assert approx(plan_config(geo, cfg16).luts["per_layer_embedding"], 4.70e9)
    assert approx(plan_config(geo, cfg8).luts["per_layer_embedding"], 2.35e9)
    four = plan_config(geo, original(**{"ple_lut_bits": 4}))
    assert four.luts["per_layer_embedding"] * 2 == plan_config(geo, cfg8).luts["per_layer_embedding"]
    # the 4-bit alternative is priced beside a wider LUT, not beside itself
    assert plan_config(geo, cfg8).per_layer_lut_4bit_bytes == four.luts["per_layer_embedding"]
    assert four.per_layer_lut_4bit_bytes == 0


def test_kv_cache_bytes_match_facts(geo):
    cfg16 = original(**{"soc": "SM8550", "kv_bits": "16"})
    assert kv_cache_bytes(geo, cfg16, windowed=False) == 36 * MIB
    assert kv_cache_bytes(geo, cfg16, windowed=True) == 18 * MIB
    # v69 keeps an 8-bit cache: half of it.
    assert plan_config(geo, original()).kv_cache_bytes == 9 * MIB


def test_decoder_at_int8_and_roofline_match_facts(geo):
    plan = plan_config(geo, original())
    layers_only = sum(p.bytes for p in plan.parts) - 402_653_184  # minus the int8 lm_head
    assert approx(layers_only, 1.86e9 + 27.6e6 + 13.8e6, rel=0.02)  # PLE paths stay float16
    assert approx(plan.decode_bytes_per_token, 2.3e9, rel=0.03)
    assert 21 <= plan.decode_tokens_per_s_ceiling <= 23  # docs/facts.md §4b: ~22 tok/s ceiling


def test_v69_plan_has_separate_binaries_and_warns(geo):
    plan = plan_config(geo, original())
    assert len(plan.graphs) == 8
    assert [g.name for g in plan.graphs[:2]] == ["prefill_ar128_part1_of_4", "prefill_ar128_part2_of_4"]
    assert plan.device_bytes == plan.device_bytes_separate_binaries
    assert plan.device_bytes_separate_binaries - plan.device_bytes_shared_weights == sum(
        p.bytes for p in plan.parts
    )
    assert any("no weight sharing" in w for w in plan.warnings)
    assert not any("LUT" in w for w in plan.warnings)


def test_v73_plan_shares_weights_and_meets_its_limits(geo):
    plan = plan_config(geo, original(**{"soc": "SM8550"}))
    assert plan.device_bytes == plan.device_bytes_shared_weights
    # No warning about binaries: only the (estimated) 8 GB phone budget, by 0.12 GiB.
    assert [w for w in plan.warnings if "8 GB phone" not in w] == []
    assert plan.fits(12) and not plan.fits(8)


def test_limits_warn(geo):
    lut = plan_config(geo, original(**{"ple_lut_bits": 16}))
    assert any("over Genie's 4 GiB LUT limit" in w for w in lut.warnings)
    big = plan_config(geo, original(**{"num_shards": 1}))
    assert any("per-context allocation limit" in w for w in big.warnings)


def test_one_graph_per_part_when_prefill_equals_decode(geo):
    plan = plan_config(geo, original(**{"prefill_ar": 1}))
    assert len(plan.graphs) == 4 and plan.device_bytes_separate_binaries == plan.device_bytes_shared_weights


def test_parts_cover_every_layer_once_with_lm_head_last(geo):
    plan = plan_config(geo, original())
    assert list(itertools.chain.from_iterable(p.layers for p in plan.parts)) == list(range(35))
    assert "lm_head" in plan.parts[-1].holds and "PLE projection" in plan.parts[0].holds
    assert plan.params["in_graphs"] == sum(p.params for p in plan.parts)
    # Balanced: no part more than 15 % above the mean.
    mean = sum(p.bytes for p in plan.parts) / 4
    assert max(p.bytes for p in plan.parts) < 1.15 * mean


def test_partition_is_optimal_against_brute_force():
    sizes = [5, 1, 9, 3, 3, 8, 2, 7]
    for k in range(1, 5):
        got = partition_layers(sizes, k, first_extra=4, last_extra=6)
        best = min(
            max(
                sum(sizes[a:b]) + (4 if a == 0 else 0) + (6 if b == len(sizes) else 0)
                for a, b in zip((0, *cuts), (*cuts, len(sizes)), strict=True)
            )
            for cuts in itertools.combinations(range(1, len(sizes)), k - 1)
        )
        cost = max(
            sum(sizes[r.start : r.stop]) + (4 if r.start == 0 else 0) + (6 if r.stop == len(sizes) else 0)
            for r in got
        )
        assert cost == best and len(got) == k


def test_with_anchors_every_part_holds_one_and_the_cut_is_the_best_such():
    """Genie needs a full-attention layer in every part (window-cache layout): among the cuts that give
    each part one, the minimax one; where no cut can, the plain minimax."""
    sizes = [5, 1, 9, 3, 3, 8, 2, 7]
    anchors = [False, False, True, False, False, True, False, True]
    for k in range(1, 4):
        got = partition_layers(sizes, k, anchors=anchors)
        assert all(any(anchors[i] for i in r) for r in got)
        best = min(
            max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes)), strict=True))
            for cuts in itertools.combinations(range(1, len(sizes)), k - 1)
            if all(any(anchors[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes)), strict=True))
        )
        assert max(sum(sizes[r.start : r.stop]) for r in got) == best
    assert partition_layers(sizes, 4, anchors=anchors) == partition_layers(sizes, 4)


def test_e2b_parts_each_hold_a_full_attention_layer_at_every_precision():
    """E2B at w4a16 once cut layers 0-3 (all sliding) into part 1, which the real Genie refused to load;
    the default's cut is unchanged."""
    from stages.planning.job import part_layers

    geo = e2b_geometry()
    for precision in ("w4a16", "w4a16-mixed", "w8a16", "w4a16-lpbq"):
        parts = part_layers(geo, original(precision=precision))
        assert all(any(geo.layers[i].attention == FULL for i in r) for r in parts), precision
    # the default job (w4a16-mixed): the cut of every bench run so far
    assert part_layers(geo, load_config()) == [range(0, 15), range(15, 24), range(24, 33), range(33, 35)]


def test_more_shards_than_layers_is_an_error():
    with pytest.raises(PartitionError, match="allowed values: 1..3"):
        partition_layers([1, 2, 3], 4)


def test_multimodal_config_with_text_config_is_read():
    geo = geometry_from_config(TINY_GEMMA4_CONFIG)
    assert [layer.kv_donor for layer in geo.layers] == [0, 1, 0, 1]
    assert [layer.intermediate_size for layer in geo.layers] == [128, 128, 256, 256]
    assert geo.ple_table.shape == (256, 32)


def _limit(plan, prefix):
    return next(c for c in plan.limits if c.limit.startswith(prefix))


def test_a_2_1_gib_v69_context_is_refused_and_the_fix_named(geo):
    plan = plan_config(geo, original(**{"num_shards": 1}))
    worst = max(b.estimated_allocation for b in plan.binaries)
    assert 2.1 * GIB < worst < 2.3 * GIB  # the whole w8a16 decoder in one context
    check = _limit(plan, "per-context allocation limit")
    assert not check.meets and check.limit_bytes == 2_097_152 * 1024
    assert "num_shards >= 2" in over_context_limit(geo, original(**{"num_shards": 1}))
    # The same context is within v73's 3.5 GiB.
    assert over_context_limit(geo, original(**{"num_shards": 1, "soc": "SM8550"})) == ""


def test_estimated_allocation_is_weights_plus_activations(geo):
    plan = plan_config(geo, original())
    for g in plan.graphs:
        a = g.allocation
        assert a["weights"] == g.bytes and a["io"] > 0 and a["intermediates"] > 0
        assert a["total"] == a["weights"] + a["io"] + a["intermediates"] + a["spill_fill"]
    prefill, decode = plan.graphs[3], plan.graphs[7]  # the lm_head parts: AR-128 logits dominate I/O
    assert prefill.allocation["io"] > 128 * 262144 * 2 > decode.allocation["io"]
    assert plan.mapped_bytes == sum(b.estimated_allocation for b in plan.binaries)


def test_the_default_v69_layout_is_over_the_8gb_phone_and_one_process_domain(geo):
    plan = plan_config(geo, original())
    assert not _limit(plan, "single-process-domain").meets  # 4.5 GiB of contexts > 4 GiB
    assert not _limit(plan, "RAM a bundle may pin (8 GB").meets
    assert _limit(plan, "RAM a bundle may pin (12 GB").meets
    assert approx(plan.device_bytes / GIB, 7.27, rel=0.01)


def test_4bit_weights_halve_the_decoder_and_say_what_is_unverified(geo):
    w8 = plan_config(geo, original(**{"prefill_ar": 1}))
    w4 = plan_config(geo, original(**{"prefill_ar": 1, "precision": "w4a16"}))
    decoder = 1.86e9
    assert approx(sum(p.bytes for p in w8.parts) - sum(p.bytes for p in w4.parts), decoder / 2, rel=0.02)
    # LPBQ adds one 4-bit scale per 64 weights.
    assert INT4_LPBQ64.stored_bytes(64 * 1536) - INT4_CHANNEL.stored_bytes(64 * 1536) == 1536 // 2
    lpbq = plan_config(geo, original(**{"prefill_ar": 1, "precision": "w4a16-lpbq"}))
    scales = sum(p.bytes for p in lpbq.parts) - sum(p.bytes for p in w4.parts)
    assert approx(scales, decoder / 64 / 2, rel=0.02)
    assert w4.fits(8) and not w8.fits(8)
    phone = _limit(w4, "RAM a bundle may pin (8 GB")
    assert "unpacks them at load" in phone.unverified
    assert "unpacks" not in _limit(w8, "RAM a bundle may pin (8 GB").unverified


def test_layouts_price_both_precisions_and_both_graph_kinds(geo):
    layouts = make_layouts(geo, original())
    names = [lay.name for lay in layouts]
    assert "w8a16, prefill AR-128 + decode AR-1" in names and "w4a16, one graph kind AR-1" in names
    assert {lay.precision for lay in layouts} == {"w8a16", "w4a16", "w4a16-mixed", "w4a16-lpbq"}
    assert sum(lay.is_config for lay in layouts) == 1
    separate = next(lay for lay in layouts if lay.name == "w8a16, prefill AR-128 + decode AR-1")
    one = next(lay for lay in layouts if lay.name == "w8a16, one graph kind AR-1")
    assert separate.binaries_bytes == 2 * one.binaries_bytes  # v69 stores the weights twice
    best = recommended_layout(layouts, 8)
    # 4-bit weights with the most sensitive three quarters at int8, in one graph kind at AR-1.
    assert best is not None and best.fits[8] and best.name == "w4a16-mixed, one graph kind AR-1"
    # LPBQ ranks above int4 per channel on real weights (the 270M table) though its binaries are
    # larger (block scales): without the mixed precision the planner takes LPBQ.
    w4 = next(lay for lay in layouts if lay.name == "w4a16, one graph kind AR-1")
    lpbq = next(lay for lay in layouts if lay.name == "w4a16-lpbq, one graph kind AR-1")
    assert lpbq.fits[8] and lpbq.quality_rank < w4.quality_rank
    assert lpbq.binaries_bytes > w4.binaries_bytes
    assert recommended_layout([lay for lay in layouts if "mixed" not in lay.name], 8).name == lpbq.name
    # Nothing more accurate fits: every w8a16 layout is over the 8 GB phone.
    assert all(not lay.fits[8] for lay in layouts if lay.precision == "w8a16")
    assert recommended_layout(layouts, 12).precision == "w8a16"


def test_roofline_of_one_call_against_hand_counted_figures(geo):
    cfg = load_config(overrides={"prefill_ar": 1, "decode_ar": 1})
    plan = plan_config(geo, cfg)
    (call,) = plan.calls
    # Attention of E2B at AR-1 over a 2,048 context, 8 query heads: Q.K^T and probs.V, 2 ops per MAC;
    # 7 full layers read 2,047 past + 1 new slots of 512-wide heads, 28 sliding ones 512 + 1 of 256.
    attention = 2 * 2 * 8 * (7 * 2048 * 512 + 28 * 513 * 256)
    assert attention == 352_550_912
    assert call.ops == 2 * plan.params["in_graphs"] + attention
    # Bytes: every graph's weights and I/O (no spill-fill at AR-1) and one row of each LUT: 1,536
    # 16-bit embedding entries and 35 x 256 8-bit per-layer entries.
    io = sum(g.allocation["io"] for g in plan.graphs)
    assert sum(g.allocation["spill_fill"] for g in plan.graphs) == 0
    assert call.bytes == sum(p.bytes for p in plan.parts) + io + 1536 * 2 + 35 * 256
    # v69: 51.2 GB/s; 16-bit activations at the estimated 13 TOPS.
    assert call.memory_s == pytest.approx(call.bytes / 51.2e9)
    assert call.compute_s == pytest.approx(call.ops / 13e12)
    assert call.bound == "memory" and call.seconds == call.memory_s
    assert plan.decode_tokens_per_s_ceiling == round(1 / call.memory_s, 1)
    # Every prompt token is its own call.
    assert plan.ttft_s[512] == pytest.approx(512 * call.seconds)


def test_prompt_seconds_follows_genies_choice_of_graph(geo):
    from stages.planning.fitting import CallCost

    decode = CallCost("decode", 1, 0, 0, memory_s=0.040, compute_s=0.001)
    prefill = CallCost("prefill", 32, 0, 0, memory_s=0.041, compute_s=0.050)
    assert prefill.bound == "compute" and prefill.seconds == 0.050
    calls = [prefill, decode]
    assert prompt_seconds(calls, 1) == 0.040  # the smallest AR >= 1 token
    assert prompt_seconds(calls, 20) == 0.050  # one padded AR-32 call
    assert prompt_seconds(calls, 512) == pytest.approx(16 * 0.050)
    assert prompt_seconds(calls, 100) == pytest.approx(4 * 0.050)  # 3 full chunks and a padded one
    assert prompt_seconds([decode], 100) == pytest.approx(100 * 0.040)


def test_a_soc_without_a_compute_figure_is_priced_on_memory_alone(geo):
    plan = plan_config(geo, load_config(overrides={"soc": "SM8550", "prefill_ar": 128}))
    assert plan.compute == {}
    assert all(c.compute_s is None and c.bound == "memory" for c in plan.calls)


def test_large_ars_turn_decode_compute_bound(geo):
    plan = plan_config(geo, load_config())
    by_ar = {c.ar: c for c in plan.calls_by_ar}
    assert list(by_ar) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert by_ar[32].bound == "memory" and by_ar[128].bound == "compute"
    assert by_ar[128].ops > 127 * by_ar[1].ops  # the lm_head and attention grow with AR too


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_ttft_s": 0.01}, "raise max_ttft_s, lower min_decode_tokens_per_s or target a larger phone"),
        ({"min_decode_tokens_per_s": 500}, "no layout meets the targets"),
        (
            {"target_phone_ram_gb": 6},
            "target_phone_ram_gb 6 is not a phone class of SM8450; allowed values: 8, 12",
        ),
        (
            {"ttft_prompt_tokens": 2048},
            "ttft_prompt_tokens 2048 leaves no room for a reply in max_context 2048",
        ),
        # v68 runs no 4-bit weights, and w8a16 is over the 8 GB phone's budget.
        ({"soc": "SM8350", "precision": "w8a16"}, "no layout fits the 8 GB phone's memory budget"),
    ],
)
def test_targets_no_layout_meets_are_refused_with_what_to_change(geo, overrides, message):
    cfg = load_config(overrides=overrides)
    with pytest.raises(LayoutRuleError, match=re.escape(message)):
        rule_layout(make_layouts(geo, cfg), cfg)


def test_the_rule_prefers_the_least_decode_compute_then_the_smallest_prefill_ar(geo):
    # With a loose first-token target the same precision at AR-1 meets everything and wins.
    cfg = load_config(overrides={"max_ttft_s": 60})
    assert rule_layout(make_layouts(geo, cfg), cfg).name == "w4a16-mixed, one graph kind AR-1"
    # On a 12 GB phone w8a16 fits: the most accurate precision first, separate graphs (AR-1 decode)
    # before one kind at a larger AR, the smallest prefill AR that meets the target.
    cfg = load_config(overrides={"target_phone_ram_gb": 12})
    assert rule_layout(make_layouts(geo, cfg), cfg).name == "w8a16, one graph kind AR-32"


def test_layouts_are_only_those_genie_accepts():
    from conftest import TINY_GEMMA4_CONFIG as tiny_config

    geo = geometry_from_config(tiny_config)
    cfg = load_config("tiny")
    ars = {lay.prefill_ar for lay in make_layouts(geo, cfg)}
    assert max(ars) <= geo.sliding_window  # a wider prefill overflows the sliding-window group


def test_resolve_geometry_prefers_the_config_given_then_the_download_then_the_builtin(tmp_path):
    from stages.model.geometry import builtin_geometry, e2b_geometry, resolve_geometry

    downloaded = tmp_path / "checkpoints" / "gemma-4-e2b-it"
    assert resolve_geometry("google/gemma-4-E2B-it", downloaded) == builtin_geometry("google/gemma-4-E2B-it")
    assert resolve_geometry("someone/unknown-model", downloaded) is None
    downloaded.mkdir(parents=True)
    tiny = json.loads(json.dumps(TINY_GEMMA4_CONFIG))
    (downloaded / "config.json").write_text(json.dumps(tiny))
    from_download = resolve_geometry("someone/unknown-model", downloaded)
    assert from_download is not None and from_download != e2b_geometry()
    given = tmp_path / "other.json"
    given.write_text(json.dumps(tiny))
    assert resolve_geometry("google/gemma-4-E2B-it", None, given) == from_download
