"""The E2B figures must agree with shared/design/FACTS.md section 1 (counted there on the meta device)."""

import itertools

import pytest
from conftest import TINY_GEMMA4_CONFIG

from stages.config import load_config
from stages.geometry import FULL, SLIDING, e2b_geometry, geometry_from_config
from stages.graphs import PartitionError, partition_layers
from stages.plan import kv_cache_bytes, make_plan

MIB = 1 << 20


@pytest.fixture(scope="module")
def geo():
    return e2b_geometry()


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
    cfg16 = load_config(overrides={"ple_lut_bits": 16})
    cfg8 = load_config()
    assert approx(make_plan(geo, cfg16).luts["per_layer_embedding"], 4.70e9)
    assert approx(make_plan(geo, cfg8).luts["per_layer_embedding"], 2.35e9)


def test_kv_cache_bytes_match_facts(geo):
    cfg16 = load_config(overrides={"soc": "SM8550", "kv_bits": "16"})
    assert kv_cache_bytes(geo, cfg16, windowed=False) == 36 * MIB
    assert kv_cache_bytes(geo, cfg16, windowed=True) == 18 * MIB
    # v69 keeps an 8-bit cache: half of it.
    assert make_plan(geo, load_config()).kv_cache_bytes == 9 * MIB


def test_decoder_at_int8_and_roofline_match_facts(geo):
    plan = make_plan(geo, load_config())
    layers_only = sum(p.bytes for p in plan.parts) - 402_653_184  # minus the int8 lm_head
    assert approx(layers_only, 1.86e9 + 27.6e6 + 13.8e6, rel=0.02)  # PLE paths stay float16
    assert approx(plan.decode_bytes_per_token, 2.3e9, rel=0.03)
    assert 21 <= plan.decode_tokens_per_s_ceiling <= 23  # FACTS: ~22 tok/s ceiling


def test_v69_plan_has_separate_binaries_and_warns(geo):
    plan = make_plan(geo, load_config())
    assert len(plan.graphs) == 8
    assert [g.name for g in plan.graphs[:2]] == ["prefill_ar128_part1_of_4", "prefill_ar128_part2_of_4"]
    assert plan.device_bytes == plan.device_bytes_separate_binaries
    assert plan.device_bytes_separate_binaries - plan.device_bytes_shared_weights == sum(
        p.bytes for p in plan.parts
    )
    assert any("no weight sharing" in w for w in plan.warnings)
    assert not any("LUT" in w for w in plan.warnings)


def test_v73_plan_shares_weights_without_warning(geo):
    plan = make_plan(geo, load_config(overrides={"soc": "SM8550"}))
    assert plan.device_bytes == plan.device_bytes_shared_weights
    assert plan.warnings == []


def test_limits_warn(geo):
    lut = make_plan(geo, load_config(overrides={"ple_lut_bits": 16}))
    assert any("over Genie's 4 GiB LUT limit" in w for w in lut.warnings)
    big = make_plan(geo, load_config(overrides={"soc": "SM8650", "precision": "w16a16", "num_shards": 1}))
    assert any("per-context limit" in w for w in big.warnings)


def test_one_graph_per_part_when_prefill_equals_decode(geo):
    plan = make_plan(geo, load_config(overrides={"prefill_ar": 1}))
    assert len(plan.graphs) == 4 and plan.device_bytes_separate_binaries == plan.device_bytes_shared_weights


def test_parts_cover_every_layer_once_with_lm_head_last(geo):
    plan = make_plan(geo, load_config())
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


def test_more_shards_than_layers_is_an_error():
    with pytest.raises(PartitionError, match="allowed values: 1..3"):
        partition_layers([1, 2, 3], 4)


def test_multimodal_config_with_text_config_is_read():
    geo = geometry_from_config(TINY_GEMMA4_CONFIG)
    assert [layer.kv_donor for layer in geo.layers] == [0, 1, 0, 1]
    assert [layer.intermediate_size for layer in geo.layers] == [128, 128, 256, 256]
    assert geo.ple_table.shape == (256, 32)
