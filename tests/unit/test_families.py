"""Model families: recognized from config.json, normalised to one form, and the facts each stage reads
from them (stages/model/families.py)."""

from __future__ import annotations

import json

import pytest

from stages.core.config import BUILTIN_MODELS
from stages.model.builtin_models import BUILTIN_TEXT_CONFIGS
from stages.model.chat import RAW_TEMPLATE, chat_template, render_chat
from stages.model.checkpoint import stop_token_ids
from stages.model.families import FAMILIES, FULL, SLIDING, family_of
from stages.model.geometry import (
    GeometryError,
    builtin_geometry,
    e2b_geometry,
    geometry_from_config,
)
from stages.model.gguf import PACKAGED_GGUFS

# google/gemma-3-270m's config.json as Google published it (transformers 4.x field names).
PUBLISHED_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "_sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
}


def test_builtin_model_names_are_one_list():
    assert set(BUILTIN_MODELS) == set(BUILTIN_TEXT_CONFIGS) | set(PACKAGED_GGUFS)


def test_gemma3_270m_geometry_is_270m_parameters_without_gemma4_parts():
    geo = builtin_geometry("gemma-3-270m-q4_k_m")
    assert geo.family.name == "Gemma 3" and geo.num_layers == 18
    assert geo.total_params == 268_098_176  # 270M: 168 M of them the tied 262,144 x 640 embedding
    assert [layer.attention for layer in geo.layers].count(FULL) == 3
    assert geo.ple_table is None and geo.ple_dim == 0 and all(layer.owns_kv for layer in geo.layers)
    names = {t.name for t in geo.all_tensors()}
    assert not any("layer_scalar" in n or "per_layer" in n for n in names)
    assert geo.config["global_head_dim"] == geo.config["head_dim"] == 256


def test_gemma3_1b_is_known_before_its_download_and_fits_the_default_layout():
    """google/gemma-3-1b-it priced by the plan with no checkpoint: 999,885,952 parameters (keras-hub's
    count for gemma3_1b), 26 layers of which 4 global, and the default job's layout rule places it."""
    from stages.core.config import load_config
    from stages.planning.fitting import plan_config

    geo = builtin_geometry("google/gemma-3-1b-it")
    assert geo.total_params == 999_885_952 and geo.num_layers == 26
    assert [layer.attention for layer in geo.layers].count(FULL) == 4
    plan = plan_config(geo, load_config("default", {"model": "google/gemma-3-1b-it"}))
    assert plan.parts and plan.device_bytes > 0


def test_published_and_transformers5_configs_give_one_geometry():
    """Google's transformers-4 config (rope_theta, rope_local_base_freq) and transformers 5's
    rope_parameters are the same model."""
    published = geometry_from_config(PUBLISHED_270M)
    ours = builtin_geometry("gemma-3-270m-q4_k_m")
    assert published.all_tensors() == ours.all_tensors()
    assert published.config["rope_parameters"] == {
        FULL: {"rope_type": "default", "rope_theta": 1000000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    }


def test_gemma3_keeps_its_last_layer_type_gemma4_forces_full():
    types = ["sliding_attention"] * 4
    g3 = geometry_from_config({**PUBLISHED_270M, "num_hidden_layers": 4, "layer_types": types})
    assert [layer.attention for layer in g3.layers] == types
    assert e2b_geometry().layers[-1].attention == FULL


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "RoPE is of type 'linear'"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "llama"}, "model_type 'llama' is not a model family"),
    ],
)
def test_what_is_not_built_is_refused_by_name(change, message):
    with pytest.raises(GeometryError, match=message):
        geometry_from_config({**PUBLISHED_270M, **change})


def test_family_comes_from_the_config_not_the_name():
    assert family_of({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}).name == "Gemma 3"
    assert family_of({"model_type": "gemma4_text"}).name == "Gemma 4"
    with pytest.raises(ValueError, match="disagree"):
        family_of({"model_type": "gemma4", "text_config": {"model_type": "gemma3_text"}})
    assert len({t for f in FAMILIES for t in f.model_types}) == sum(len(f.model_types) for f in FAMILIES)


def test_attention_scale_and_norms_follow_transformers():
    g3 = next(f for f in FAMILIES if f.name == "Gemma 3")
    g4 = next(f for f in FAMILIES if f.name == "Gemma 4")
    assert g3.attention_scale({"query_pre_attn_scalar": 256, "head_dim": 256}) == 1 / 16
    assert g4.attention_scale({}) == 1.0
    assert (g3.norm_offset, g3.value_norm, g3.layer_scalar) == (1.0, False, False)
    assert (g4.norm_offset, g4.value_norm, g4.layer_scalar) == (0.0, True, True)


def test_a_base_model_prompt_is_its_raw_text_and_its_stop_tokens_the_familys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_270M | {"eos_token_id": 1}))
    tokenizer = {
        "added_tokens": [{"id": 106, "content": "<end_of_turn>"}, {"id": 5, "content": "<turn|>"}],
        "model": {"vocab": {}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    assert chat_template(tmp_path) == RAW_TEMPLATE
    assert render_chat(tmp_path, "The capital of France is") == "<bos>The capital of France is"
    assert stop_token_ids(tmp_path) == [1, 106]


def test_a_raw_prompt_starts_with_bos_as_genie_queries_it(tmp_path):
    """`g4v69 generate --raw` skips the chat template, not BOS: Genie puts bos-token before any text
    (docs/facts.md §3), and a Gemma without BOS answers garbage (Gemma 3 270M did)."""
    from stages.model.builtin_models import write_tokenizer_files
    from stages.model.chat import ChatTokenizer

    write_tokenizer_files(tmp_path, 1024)
    tok = ChatTokenizer(tmp_path)
    bos = tok.token_id(json.loads((tmp_path / "tokenizer_config.json").read_text())["bos_token"])
    assert bos is not None
    assert tok.raw_ids("Hi there") == [bos] + tok.encode("Hi there")
    assert tok.chat_ids("Hi there") != tok.raw_ids("Hi there")
