"""The graph I/O contract for the real job (E2B, SM8450, AR-128/AR-1, 2048 context, 4 parts)."""

from __future__ import annotations

import pytest

from stages.core.config import load_config
from stages.model.contract import ContractError
from stages.model.geometry import (
    GEMMA3_270M_TEXT_CONFIG,
    TINY_TEXT_CONFIG,
    e2b_geometry,
    geometry_from_config,
)
from stages.planning.fitting import plan_config
from stages.planning.job import Job

HOST_INPUTS = {
    "inputs_embeds",
    "per_layer_inputs",
    "attention_mask",
    "swa_attention_mask",
    "position_ids_cos",
    "position_ids_sin",
    "swa_position_ids_cos",
    "swa_position_ids_sin",
}


def _original():
    """The original plan's layout: AR-128 prefill and AR-1 decode graphs."""
    return load_config(overrides={"precision": "w8a16", "prefill_ar": 128, "decode_ar": 1})


@pytest.fixture(scope="module")
def e2b_specs():
    cfg = _original()
    geo = e2b_geometry()
    return list(Job.build(geo, cfg).shipped_specs)


def _shapes(spec):
    return {t.name: t.shape for t in spec.inputs} | {t.name: t.shape for t in spec.outputs}


def test_e2b_graphs_have_genie_names_and_shapes(e2b_specs):
    assert [s.name for s in e2b_specs] == [
        f"{role}_ar{ar}_part{p}_of_4" for role, ar in (("prefill", 128), ("decode", 1)) for p in range(1, 5)
    ]
    first = _shapes(e2b_specs[0])
    assert first["inputs_embeds"] == (1, 128, 1536)
    assert first["per_layer_inputs"] == (1, 128, 35, 256)
    assert first["attention_mask"] == (1, 1, 128, 2048)
    assert first["swa_attention_mask"] == (1, 1, 128, 512 + 128)
    assert first["position_ids_cos"] == (1, 1, 128, 256)  # proportional layout: 512 / 2
    assert first["swa_position_ids_cos"] == (1, 1, 128, 128)
    assert first["swa_key_0_h0_in"] == (1, 1, 256, 512)
    assert first["swa_value_0_h0_in"] == (1, 1, 512, 256)
    assert first["past_key_4_h0_in"] == (1, 1, 512, 1920)
    assert first["past_value_4_h0_out"] == (1, 1, 128, 512)
    decode_last = _shapes(e2b_specs[-1])
    assert decode_last["logits"] == (1, 1, 262144)


def test_e2b_caches_only_for_the_15_owner_layers(e2b_specs):
    for role in ("prefill", "decode"):
        names = {t.name for s in e2b_specs if s.role == role for t in s.inputs}
        cache_layers = {
            int(n.split("_")[2]) for n in names if n.endswith("_in") and n.split("_")[1] in ("key",)
        }
        assert cache_layers == set(range(15))
        full = {int(n.split("_")[2]) for n in names if n.startswith("past_key_")}
        assert full == {4, 9, 14}


def test_every_input_comes_from_the_host_or_an_earlier_part(e2b_specs):
    for role in ("prefill", "decode"):
        produced: set[str] = set()
        for spec in (s for s in e2b_specs if s.role == role):
            for t in spec.inputs:
                is_cache = t.name.endswith("_in") and t.name.startswith(("past_", "swa_"))
                assert t.name in HOST_INPUTS or is_cache or t.name in produced, (spec.name, t.name)
            produced |= {t.name for t in spec.outputs}
        assert "logits" in produced


def test_cross_part_tensors_avoid_cache_group_prefixes(e2b_specs):
    for spec in e2b_specs:
        for t in spec.outputs:
            if t.name.startswith(("past_", "swa_")):
                assert t.name.endswith("_out")


def test_plan_and_contract_split_the_same_layers(e2b_specs):
    cfg = _original()
    plan = plan_config(e2b_geometry(), cfg)
    assert [p.layers for p in plan.parts] == [list(s.layers) for s in e2b_specs[:4]]


def test_context_must_leave_room_for_the_window():
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    cfg = load_config("tiny", {"max_context": 20, "prefill_ar": 16})
    with pytest.raises(ContractError, match="at least 24"):
        Job.build(geo, cfg)
    # The plan still prices it (a layout table prices variants no export builds).
    assert Job.build(geo, cfg, specs=False).specs == ()


def test_a_model_without_per_layer_inputs_keeps_its_sliding_layers_in_the_full_cache_group():
    """Gemma 3 270M at the preset's layout: no `swa_` tensor (Genie 2.51 masks that group wrongly
    without a perlayer-embedding LUT, docs/facts.md §3 (l)); every cache spans the context, one mask."""
    geo = geometry_from_config(GEMMA3_270M_TEXT_CONFIG)
    cfg = load_config("gemma3-270m")
    specs = Job.build(geo, cfg).shipped_specs
    names = {t.name for spec in specs for t in spec.inputs + spec.outputs}
    assert not any(n.startswith("swa_") and "position_ids" not in n for n in names)
    for spec in specs:
        shapes = _shapes(spec)
        assert shapes["attention_mask"] == (1, 1, spec.ar, cfg.max_context)
        for i in spec.layers:
            assert shapes[f"past_key_{i}_h0_in"] == (1, 1, 256, cfg.max_context - spec.ar)
    wide = load_config("gemma3-270m", {"prefill_ar": 1024, "decode_ar": 1024})
    with pytest.raises(ContractError, match="wider than the sliding window"):
        Job.build(geo, wide)


@pytest.mark.parametrize("ar", [1, 4, 8])
def test_the_in_graph_window_is_transformers_sliding_window(ar):
    """sliding_mask_from_full against the window's definition (a key at most window - 1 positions
    back), at every fill of the cache: the row's position is its count of visible columns."""
    import numpy as np
    import torch

    from stages.model.contract import ATTENTION_MASK_MIN, sliding_mask_from_full

    window, context = 8, 40
    slots = context - ar
    for n_past in range(slots + 1):
        rows, new = n_past + np.arange(ar), np.arange(ar)
        columns = np.concatenate([np.arange(slots), n_past + new])
        visible = np.concatenate(
            [np.broadcast_to(np.arange(slots) < n_past, (ar, slots)), new[None, :] <= new[:, None]], axis=1
        )
        full = torch.tensor(np.where(visible, 0.0, ATTENTION_MASK_MIN).astype(np.float32)[None, None])
        got = sliding_mask_from_full(full, window).numpy()[0, 0]
        assert set(np.unique(got)) <= {0.0, ATTENTION_MASK_MIN}
        want = visible & (rows[:, None] - columns[None, :] < window)
        assert ((got == 0) == want).all(), n_past


def test_sampling_greedy_top_k_top_p_and_seeded_temperature():
    import numpy as np

    from stages.quant.runner import Sampling

    logits = np.array([0.0, 3.0, 2.9, -1.0, 2.8])
    assert Sampling().picker()(logits) == 1
    assert Sampling(temperature=5.0, top_k=1).picker()(logits) == 1
    assert Sampling(temperature=5.0, top_p=0.01).picker()(logits) == 1
    draws = [Sampling(temperature=1.0, seed=3).picker() for _ in range(2)]
    a = [draws[0](logits) for _ in range(50)]
    assert a == [draws[1](logits) for _ in range(50)]  # same seed, same draws
    assert set(a) >= {1, 2, 4} and set(a) <= {0, 1, 2, 3, 4}
    top2 = Sampling(temperature=10.0, top_k=2, seed=1).picker()
    assert {top2(logits) for _ in range(100)} == {1, 2}
