"""Reading config.json in every form transformers writes or Google publishes, the way transformers
5.23 reads it (Gemma4TextConfig is the oracle), and the stop tokens of a checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from stages.model.builtin_models import gemma4_config, write_tokenizer_files
from stages.model.checkpoint import CheckpointError, stop_token_ids
from stages.model.geometry import E2B_TEXT_CONFIG, FULL, TINY_TEXT_CONFIG, GeometryError, geometry_from_config


def _tiny(**changes) -> dict:
    """The tiny text config without global_head_dim, plus `changes` (None deletes a key)."""
    cfg = copy.deepcopy({k: v for k, v in TINY_TEXT_CONFIG.items() if k != "global_head_dim"})
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def _transformers_view(cfg: dict) -> list[tuple[int, int]]:
    """(head_dim, num_key_value_heads) per layer as transformers' own Gemma4TextConfig resolves them."""
    from transformers import Gemma4TextConfig

    text = Gemma4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    return [(c.head_dim, c.num_key_value_heads) for c in text.per_layer_config]


def _ours(cfg: dict) -> list[tuple[int, int]]:
    geo = geometry_from_config(cfg)
    return [(layer.head_dim, geo.num_kv_heads) for layer in geo.layers]


FORMS = {
    "published global_head_dim": _tiny(global_head_dim=32, num_global_key_value_heads=None),
    "saved per_layer_config": _tiny(per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 32}}),
    "zero-padded keys": _tiny(per_layer_config={"02": {"head_dim": 32}, "05": {"head_dim": 32}}),
    "integer keys": _tiny(per_layer_config={2: {"head_dim": 32}, 5: {"head_dim": 32}}),
    # Present but empty (a config whose full layers use head_dim): the global fields are not read.
    "empty per_layer_config": _tiny(per_layer_config={}, global_head_dim=64),
    "null per_layer_config": _tiny(per_layer_config=None, global_head_dim=64),
    "per_layer_config wins over global_head_dim": _tiny(
        per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 32}}, global_head_dim=64
    ),
    # transformers applies num_global_key_value_heads only with attention_k_eq_v.
    "num_global_key_value_heads without k_eq_v": _tiny(global_head_dim=32, num_global_key_value_heads=2),
    "per-layer KV heads on every layer": _tiny(
        num_key_value_heads=1,
        per_layer_config={
            str(i): {"num_key_value_heads": 2, **({"head_dim": 32} if i in (2, 5) else {})} for i in range(6)
        },
    ),
    "sliding head_dim overridden": _tiny(
        per_layer_config={str(i): {"head_dim": 8 if i not in (2, 5) else 32} for i in range(6)}
    ),
    # transformers turns a last sliding layer into a full one.
    "last layer sliding": _tiny(
        global_head_dim=32, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2
    ),
}
FORMS["last layer sliding"]["layer_types"][-1] = "sliding_attention"


@pytest.mark.slow  # imports transformers (seconds)
@pytest.mark.parametrize("form", FORMS, ids=str)
def test_every_form_reads_as_transformers_reads_it(form):
    assert _ours(FORMS[form]) == _transformers_view(FORMS[form])


@pytest.mark.slow  # imports transformers (seconds)
def test_what_transformers_saves_reads_back_to_the_same_geometry():
    from transformers import Gemma4Config, Gemma4TextConfig

    for text in (TINY_TEXT_CONFIG, E2B_TEXT_CONFIG):
        saved = Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
        assert "global_head_dim" not in saved and saved["per_layer_config"]
        nested = Gemma4Config(text_config=saved, vision_config=None, audio_config=None).to_dict()
        want = geometry_from_config(text)
        for config in (saved, nested):
            got = geometry_from_config(config)
            assert got.all_tensors() == want.all_tensors() and got.layers == want.layers
            assert got.config["global_head_dim"] == text["global_head_dim"]
    e2b = Gemma4TextConfig(**{k: v for k, v in E2B_TEXT_CONFIG.items() if k != "model_type"}).to_dict()
    assert e2b["per_layer_config"]["04"] == {"head_dim": 512}  # zero-padded keys, as the issue saw


@pytest.mark.slow  # imports transformers (seconds)
def test_the_normalised_config_rebuilds_the_same_transformers_model():
    """The reference model is built from geometry.config: it must mean what the original meant."""
    for cfg in FORMS.values():
        normalised = geometry_from_config(cfg).config
        assert "per_layer_config" not in normalised
        assert _transformers_view(normalised) == _transformers_view(cfg)


def test_bare_and_nested_text_configs_agree():
    cfg = FORMS["saved per_layer_config"]
    nested = geometry_from_config(gemma4_config(cfg))
    assert nested.all_tensors() == geometry_from_config(cfg).all_tensors()


@pytest.mark.parametrize(
    "cfg, message",
    [
        (_tiny(), "neither 'per_layer_config' nor 'global_head_dim'"),
        (_tiny(global_head_dim=None, head_dim=None, per_layer_config={}), "lacks 'head_dim'"),
        (_tiny(global_head_dim=32, hidden_size=None), "lacks 'hidden_size'"),
        (_tiny(per_layer_config={"full": {"head_dim": 32}}), "key 'full' is not a layer index"),
        (_tiny(per_layer_config={"6": {"head_dim": 32}}), r"key '6' is not a layer index in 0\.\.5"),
        (
            _tiny(per_layer_config={"2": {"intermediate_size": 32}}),
            "sets intermediate_size; Gemma 4 reads only",
        ),
        (_tiny(per_layer_config={"2": 32}), r"per_layer_config\['2'\] is 32, not an object"),
        (
            _tiny(per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 64}}),
            "full_attention layers different head_dim values .layer 2: 32, layer 5: 64",
        ),
        (_tiny(global_head_dim=32, per_layer_config={"2": {"num_key_value_heads": 2}}), "one KV head count"),
        (_tiny(global_head_dim=32, attention_k_eq_v=True), "attention_k_eq_v is true"),
        (_tiny(global_head_dim=32, enable_moe_block=True), "MoE"),
        (_tiny(global_head_dim=32, tie_word_embeddings=False), "tie_word_embeddings is false"),
        (_tiny(global_head_dim=32, num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
        ({"model_type": "gemma4", "text_config": None}, "text_config is None, not an object"),
    ],
)
def test_a_value_no_form_gives_is_an_error_naming_the_field(cfg, message):
    with pytest.raises(GeometryError, match=message):
        geometry_from_config(cfg)


@pytest.mark.slow  # imports transformers (seconds)
def test_transformers_refuses_what_is_refused_here():
    """Spot checks that the refusals above are transformers' own, not stricter."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    for bad in ({"full": {"head_dim": 32}}, {"6": {"head_dim": 32}}):
        with pytest.raises(ValueError):
            Gemma4TextConfig(**_tiny(per_layer_config=bad))
    mixed = Gemma4TextConfig(**_tiny(per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 64}}))
    with pytest.raises(ValueError, match="not homogeneous"):
        Gemma4ForCausalLM(mixed)


# ---- stop tokens ----


def _checkpoint(tmp_path: Path, generation: dict | None, text_eos=1) -> Path:
    write_tokenizer_files(tmp_path, 128)  # <turn|> is id 5; writes a generation_config.json too
    (tmp_path / "config.json").write_text(
        json.dumps(gemma4_config({**TINY_TEXT_CONFIG, "eos_token_id": text_eos}))
    )
    if generation is None:
        (tmp_path / "generation_config.json").unlink()
    else:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


@pytest.mark.parametrize(
    "generation, text_eos, expected",
    [
        ({"eos_token_id": [1, 106, 50]}, 1, [1, 5, 50, 106]),  # the published E2B-it's list
        ({"eos_token_id": 1}, [1, 3], [1, 3, 5]),
        (None, 1, [1, 5]),
        ({}, None, [5]),
    ],
)
def test_stop_tokens_are_the_union_of_generation_config_text_config_and_turn_end(
    tmp_path, generation, text_eos, expected
):
    assert stop_token_ids(_checkpoint(tmp_path, generation, text_eos)) == expected


def test_a_bare_text_config_gives_its_eos_too(tmp_path):
    ckpt = _checkpoint(tmp_path, None)
    (ckpt / "config.json").write_text(json.dumps({**TINY_TEXT_CONFIG, "eos_token_id": 7}))
    assert stop_token_ids(ckpt) == [5, 7]


@pytest.mark.parametrize("bad", ["not json", json.dumps({"eos_token_id": "<eos>"})])
def test_a_broken_generation_config_is_named(tmp_path, bad):
    ckpt = _checkpoint(tmp_path, {})
    (ckpt / "generation_config.json").write_text(bad)
    with pytest.raises(CheckpointError, match="generation_config.json"):
        stop_token_ids(ckpt)


def test_a_last_sliding_layer_becomes_full_as_in_transformers():
    geo = geometry_from_config(FORMS["last layer sliding"])
    assert geo.layers[-1].attention == FULL and geo.layers[-1].head_dim == 32
