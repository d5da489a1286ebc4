import re

import pytest

from stages.core.config import (
    FIELD_NAMES,
    PRESETS_DIR,
    STAGES,
    ConfigError,
    load_config,
    model_name_from_dir,
    plan_fields,
    stage_fields,
)


def test_default_preset_is_the_real_job():
    cfg = load_config()
    assert cfg.model == "google/gemma-4-E2B-it"
    # The layout the preset's layout rule picks (test_geometry_and_plan checks it is the rule's pick).
    assert cfg.soc == "SM8450" and cfg.precision == "w4a16-mixed"
    assert (cfg.max_context, cfg.prefill_ar, cfg.decode_ar, cfg.num_shards) == (2048, 32, 32, 4)
    assert (cfg.target_phone_ram_gb, cfg.ttft_prompt_tokens, cfg.max_ttft_s) == (8, 512, 1.0)
    assert cfg.min_decode_tokens_per_s == 20.0
    assert cfg.compiler == "local" and cfg.ple_policy == "float16"
    # The measured recipe (make bench-calibration), through the AR-128 calibration twin: ranges on 4
    # windows of 2048 tokens, Hessians on 8, the sensitivity on 128 tokens; 8 windows read.
    assert (cfg.calibration_dataset, cfg.calibration_samples, cfg.calibration_tokens) == (
        "wikitext-2-raw-v1",
        4,
        2048,
    )
    assert (cfg.hessian_samples, cfg.sensitivity_tokens, cfg.calibration_sequences) == (8, 128, 8)
    assert cfg.calibration_ar == 128
    assert cfg.kv_cache_bits == 8  # v69 has no 16x16 matmul
    assert cfg.checkpoint_name == "gemma-4-e2b-it"


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.toml")))
def test_every_shipped_preset_is_valid(preset):
    load_config(preset)


def test_overrides_are_coerced_from_strings():
    cfg = load_config(overrides={"soc": "sm8550", "max_context": "4096", "num_shards": "2"})
    assert (cfg.soc, cfg.max_context, cfg.num_shards) == ("SM8550", 4096, 2)
    assert cfg.kv_cache_bits == 16


def test_none_overrides_keep_the_preset_value():
    assert load_config(overrides={"soc": None}).soc == "SM8450"


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"soc": "SM9999"}, "soc", "SM8350, SM8450"),
        ({"prefill_ar": 2048}, "prefill_ar", "1..2047"),
        ({"decode_ar": 4096}, "decode_ar", "1..2047"),
        ({"num_shards": 0}, "num_shards", ">= 1"),
        ({"precision": "w16a16"}, "precision", "w8a16, w4a16"),
        ({"precision": "w3a7"}, "precision", "w8a16, w4a16, w4a16-mixed, w4a16-lpbq, w16a16"),
        ({"compiler": "cloud"}, "compiler", "local, aihub"),
        ({"kv_bits": "16"}, "kv_bits", "auto, 8"),
        ({"ple_policy": "int4"}, "ple_policy", "float16, int16, int8"),
        ({"ple_lut_bits": 2}, "ple_lut_bits", "4, 8, 16"),
        ({"max_context": "lots"}, "max_context", "integer"),
        ({"model": "not a repo"}, "model", "tiny, e2b-random"),
        ({"colour": "blue"}, "colour", "allowed fields"),
        ({"min_top1_agreement_w8": "1.5"}, "min_top1_agreement_w8", "0..1"),
        ({"max_kl_divergence_w4": "0"}, "max_kl_divergence_w4", "> 0"),
        ({"max_kl_divergence_w8": "lots"}, "max_kl_divergence_w8", "a number"),
        ({"verify_engine": "gpu"}, "verify_engine", "htp, replay, cpu"),
    ],
)
def test_invalid_values_name_the_field_and_allowed_values(overrides, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert e.value.field_name == field
    assert f"'{field}'" in str(e.value) and allowed in str(e.value)


def test_w4a16_needs_lpbq_so_not_on_v68():
    with pytest.raises(ConfigError, match="cannot run on SM8350"):
        load_config(overrides={"soc": "SM8350", "precision": "w4a16"})
    assert load_config(overrides={"precision": "w4a16"}).precision == "w4a16"


def test_a_precision_the_pipeline_cannot_build_is_refused_everywhere():
    # w16a16 would run on v73+ but the quantize stage has no 16-bit weight scheme: refused, not ignored.
    with pytest.raises(ConfigError, match="w16a16 is refused: the quantize stage has no 16-bit weight"):
        load_config(overrides={"soc": "SM8650", "precision": "w16a16"})


def test_lpbq_is_built_for_v69_and_not_v68():
    assert load_config(overrides={"precision": "w4a16-lpbq"}).precision == "w4a16-lpbq"
    with pytest.raises(ConfigError, match="cannot run on SM8350"):
        load_config(overrides={"soc": "SM8350", "precision": "w4a16-lpbq"})


def test_precision_and_ple_policy_re_export():
    # The part split balances weight bytes at the precision and the PLE policy.
    assert {"precision", "ple_policy"} <= set(stage_fields("export"))


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="allowed values: default, gemma3-270m, qat, tiny"):
        load_config("nonexistent")


def test_preset_file_must_set_every_field(tmp_path):
    p = tmp_path / "partial.toml"
    p.write_text('model = "tiny"\n')
    with pytest.raises(ConfigError, match="missing from preset"):
        load_config(p)


def test_preset_file_with_unknown_key_fails(tmp_path):
    p = tmp_path / "extra.toml"
    p.write_text((PRESETS_DIR / "tiny.toml").read_text() + "shards = 3\n")
    with pytest.raises(ConfigError, match="'shards': unknown field"):
        load_config(p)


def test_broken_toml_names_the_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("model = \n")
    with pytest.raises(ConfigError, match="broken.toml is not valid TOML"):
        load_config(p)


def test_every_field_belongs_to_exactly_one_stage():
    owned = [f for s in STAGES for f in stage_fields(s)]
    assert sorted(owned + plan_fields()) == sorted(FIELD_NAMES)
    assert not set(owned) & set(plan_fields())
    assert "soc" in stage_fields("quantize") and "compiler" in stage_fields("compile")


def test_a_folder_name_is_a_model_for_from_imports():
    assert load_config(overrides={"model": "My-Finetune_2.1"}).checkpoint_name == "my-finetune_2.1"
    with pytest.raises(ConfigError, match="nor a folder name for a FROM=DIR import"):
        load_config(overrides={"model": "a b"})


def test_the_model_is_named_after_the_from_folder(tmp_path):
    assert model_name_from_dir(tmp_path / "mm") == "mm"
    assert model_name_from_dir(f"{tmp_path}/mm/") == "mm"
    snapshot = tmp_path / "hub" / "models--google--gemma-4-E2B-it" / "snapshots" / "0123abc"
    assert model_name_from_dir(snapshot) == "google/gemma-4-E2B-it"
    with pytest.raises(ConfigError, match="'my model' is not a plain folder name.*set MODEL"):
        model_name_from_dir(tmp_path / "my model")


def test_the_makefile_helper_prints_the_model_and_its_folder(tmp_path):
    import subprocess
    import sys

    def helper(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "stages.core.config", *args], capture_output=True, text=True
        )

    assert helper("--from", str(tmp_path / "Mm")).stdout.split()[:2] == ["model=Mm", "checkpoint=mm"]
    assert helper("--model", "google/gemma-4-E2B-it", "--from", str(tmp_path / "Mm")).stdout.split()[:2] == [
        "model=google/gemma-4-E2B-it",
        "checkpoint=gemma-4-e2b-it",
    ]
    assert helper("--preset", "tiny").stdout.split()[:2] == ["model=tiny", "checkpoint=tiny"]
    bad = helper("--from", str(tmp_path / "a b"))
    assert bad.returncode == 1 and "set MODEL" in bad.stderr


def test_calibration_twin_bounds():
    from stages.model.graphs import calibration_kind

    cfg = load_config()
    assert calibration_kind(cfg).ar == 128 and calibration_kind(cfg).role == "calibration"
    # A prefill kind as wide as the twin calibrates itself: no twin, nothing refused.
    assert calibration_kind(cfg.with_overrides(prefill_ar=128)) is None
    assert calibration_kind(cfg.with_overrides(calibration_ar=0)) is None
    with pytest.raises(ConfigError, match="calibration_ar"):
        cfg.with_overrides(calibration_ar=2048)
    with pytest.raises(ConfigError, match="calibration_tokens"):
        cfg.with_overrides(calibration_tokens=64)


def test_quality_floors_are_quantize_fields_picked_by_weight_bits():
    assert {
        "min_top1_agreement_w8",
        "max_kl_divergence_w8",
        "min_top1_agreement_w4",
        "max_kl_divergence_w4",
    } <= set(stage_fields("quantize"))
    cfg = load_config("tiny", {"max_kl_divergence_w4": "0.2"})  # a string, as from the environment
    assert cfg.max_kl_divergence_w4 == 0.2
    assert cfg.quality_floor.top1_field == "min_top1_agreement_w8"  # tiny builds w8a16
    w4 = cfg.with_overrides(precision="w4a16").quality_floor
    assert (w4.min_top1, w4.max_kl, w4.kl_field) == (0.75, 0.2, "max_kl_divergence_w4")


# Held-out figures (top-1 agreement, KL divergence) measured by the quantize stage on the trained tiny
# model: each precision the project builds or has measured, and one decoder weight's scales corrupted
# (times 4, or zeroed) after quantization. The tiny preset's comment gives the same numbers.
TINY_MEASURED = {
    "w8a16": ("w8a16", 0.9843, 0.00069),
    "w4a16": ("w4a16", 0.8307, 0.07597),
    "w4a16, max-abs scales": ("w4a16", 0.825, 0.111),
    "w4a16-lpbq": ("w4a16", 0.827, 0.098),
}
TINY_BROKEN = {
    "w8a16, MLP down projection scales x4": ("w8a16", 0.8839, 0.05743),
    "w8a16, K projection scales x4": ("w8a16", 0.7992, 0.15824),
    "w8a16, MLP down projection zeroed": ("w8a16", 0.5512, 0.75269),
    "w4a16, K projection scales x4": ("w4a16", 0.7402, 0.22498),
    "w4a16, MLP down projection zeroed": ("w4a16", 0.5276, 0.79877),
}


@pytest.mark.parametrize("case", sorted(TINY_MEASURED))
def test_the_tiny_floors_admit_every_measured_precision(case):
    from stages.quant.quality import below_floor

    precision, top1, kl = TINY_MEASURED[case]
    cfg = load_config("tiny", {"precision": precision})
    assert below_floor(cfg, {"top1_agreement": top1, "kl_divergence": kl, "tokens": 508}) is None


@pytest.mark.parametrize("case", sorted(TINY_BROKEN))
def test_the_tiny_floors_stop_a_broken_quantization(case):
    from stages.quant.quality import below_floor

    precision, top1, kl = TINY_BROKEN[case]
    cfg = load_config("tiny", {"precision": precision})
    line = below_floor(cfg, {"top1_agreement": top1, "kl_divergence": kl, "tokens": 508})
    assert line is not None and "\n" not in line
    assert f"max_kl_divergence_{precision[:2]}" in line  # KL is the sharper of the two figures


def test_the_default_floors_stop_a_collapse():
    from stages.quant.quality import below_floor

    for precision in ("w8a16", "w4a16"):
        cfg = load_config("default", {"precision": precision})
        assert below_floor(cfg, {"top1_agreement": 0.5276, "kl_divergence": 0.79877, "tokens": 508})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ttft_prompt_tokens": 0}, "'ttft_prompt_tokens': 0 is too small"),
        ({"max_ttft_s": 0}, "'max_ttft_s': 0.0 is out of range"),
        ({"min_decode_tokens_per_s": -1}, "'min_decode_tokens_per_s': -1.0 is out of range"),
        ({"target_phone_ram_gb": 0}, "'target_phone_ram_gb': 0 is too small"),
    ],
)
def test_layout_targets_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_the_calibration_recipe_is_per_pass():
    """Each pass takes its own share of one read of the calibration text: the sequences read are those
    of the pass that takes the most, and a pass cannot ask for more text than is read."""
    cfg = load_config("tiny")
    assert cfg.with_overrides(calibration_samples=2, hessian_samples=16).calibration_sequences == 16
    assert cfg.with_overrides(calibration_samples=32, hessian_samples=4).calibration_sequences == 32
    with pytest.raises(ConfigError, match="hessian_samples"):
        cfg.with_overrides(hessian_samples=0)
    with pytest.raises(ConfigError, match="sensitivity_tokens.*more than the calibration text"):
        cfg.with_overrides(calibration_samples=1, hessian_samples=1, sensitivity_tokens=129)
