import json

import pytest
from conftest import TINY_GEMMA4_CONFIG

from stages import __version__
from stages.cli import main

STAGE_COMMANDS = ["download", "export", "quantize", "compile", "bundle", "verify", "push", "run"]
# Each later stage run in an empty folder: the earlier stage it needs, named in the error.
MISSING_INPUT = {
    "export": "download",
    "quantize": "export",
    "compile": "quantize",
    "bundle": "compile",
    "verify": "bundle",
    "push": "bundle",
    "run": "bundle",
}


def test_version(g4v69):
    r = g4v69("--version")
    assert r.exit_code == 0 and __version__ in r.output


def test_every_stage_has_a_command():
    """The stages' commands come from the stage table; each resolves to a click command of its name."""
    import click

    ctx = click.Context(main)
    assert set(STAGE_COMMANDS) <= set(main.list_commands(ctx))
    for name in STAGE_COMMANDS:
        command = main.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name, name


@pytest.mark.parametrize("stage", sorted(MISSING_INPUT))
def test_a_stage_without_its_input_says_which_stage_to_run_and_writes_nothing(g4v69, stage):
    args = ["--preset", "tiny", stage] + (["--prompt", "Hi"] if stage == "run" else [])
    r = g4v69(*args)
    assert r.exit_code == 2, r.output
    assert f"make {MISSING_INPUT[stage]}" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert r.files == []


def test_plan_json_is_machine_readable(g4v69):
    r = g4v69("plan", "--json")
    assert r.exit_code == 0
    data = json.loads(r.output)
    assert data["config"]["soc"] == "SM8450" and data["dsp_arch"] == "v69"
    # The default: one graph kind per part, so 4 graphs (and 4 binaries) for 4 parts.
    assert len(data["parts"]) == 4 and len(data["graphs"]) == 4 and len(data["binaries"]) == 4
    assert data["decode_tokens_per_s_ceiling"] > 0 and data["prefill_tokens_per_s"] > 0
    assert data["layout_rule"]["picks"] == "w4a16-mixed, one graph kind AR-32"
    assert data["compute"]["estimate"] is True and "26 TOPS" in data["compute"]["source"]


def test_plan_table_is_readable(g4v69):
    r = g4v69("--num-shards", "2", "--precision", "w8a16", "--prefill-ar", "128", "plan")
    assert r.exit_code == 0
    assert "part2_of_2" in r.output and "Roofline" in r.output and "Warnings" in r.output
    assert "Layouts side by side" in r.output and "TTFT 512" in r.output and "Layout rule" in r.output


def test_plan_refuses_targets_no_layout_meets_and_says_how_close_they_come(g4v69):
    r = g4v69("--max-ttft-s", "0.001", "plan")
    assert r.exit_code != 0
    assert "the layout rule: no layout meets the targets" in r.output and "raise max_ttft_s" in r.output
    assert "Traceback" not in r.output


def test_plan_output_file(g4v69):
    r = g4v69("plan", "--output", "out/plan.json")
    assert r.exit_code == 0 and "out/plan.json" in r.files


@pytest.mark.parametrize(
    "args, message",
    [
        (["--soc", "SM1234"], "config field 'soc'"),
        (["--prefill-ar", "3000"], "config field 'prefill_ar'"),
        (["--num-shards", "0"], "config field 'num_shards'"),
        (["--precision", "w16a16"], "config field 'precision'"),
        (["--preset", "nope"], "config field 'preset'"),
    ],
)
def test_bad_config_fails_clearly_and_writes_nothing(g4v69, args, message):
    r = g4v69(*args, "plan", "--output", "plan.json")
    assert r.exit_code == 2
    assert message in r.output and "allowed" in r.output
    assert r.files == []


def test_env_vars_override_too(g4v69):
    r = g4v69("config", "--get", "soc", env={"G4V69_SOC": "SM8650"})
    assert r.output.strip() == "SM8650"


def test_plan_without_geometry_asks_for_download(g4v69):
    r = g4v69("--model", "someone/other-gemma", "plan")
    assert r.exit_code == 2 and "make download MODEL=someone/other-gemma" in r.output


def test_plan_knows_the_builtin_tiny_geometry(g4v69):
    r = g4v69("--preset", "tiny", "plan", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["params"]["embedding"] == 262 * 64


def test_plan_reads_a_checkpoint_config(g4v69, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_GEMMA4_CONFIG))
    r = g4v69("--preset", "tiny", "plan", "--json", "--checkpoint-config", str(cfg))
    assert r.exit_code == 0
    assert json.loads(r.output)["params"]["embedding"] == 256 * 64


@pytest.mark.parametrize("field, value", [("precision", "w8a16"), ("ple_policy", "int8")])
def test_precision_and_ple_policy_change_the_export_stamp(field, value):
    # The part split balances weight bytes at both, so Make must redo the export when either changes.
    from stages.core.config import load_config, stamp_name

    assert stamp_name(load_config("default", {field: value}), "export") != stamp_name(
        load_config("default"), "export"
    )


def test_plan_prices_the_layouts_and_their_limits(g4v69):
    original = g4v69("--precision", "w8a16", "--prefill-ar", "128", "plan")
    assert original.exit_code == 0 and "OVER" in original.output  # 7.27 GiB on an 8 GB phone
    r = g4v69("plan")
    assert r.exit_code == 0
    assert "per-context allocation limit" in r.output and "OVER" not in r.output
    fits = "most accurate layout that fits a phone with 8 GB, whatever its speed: "
    assert fits + "w4a16-mixed, one graph kind AR-1" in r.output
    assert "picks: w4a16-mixed, one graph kind AR-32" in r.output
    data = json.loads(g4v69("plan", "--json").output)
    assert {lay["precision"] for lay in data["layouts"]} == {"w8a16", "w4a16", "w4a16-mixed", "w4a16-lpbq"}
    assert all(c["source"] for c in data["limits"])


def test_doctor_never_prints_a_token(g4v69):
    r = g4v69("doctor", env={"HF_TOKEN": "hf_canary_doctor_123"})
    assert r.exit_code == 0 and "HF_TOKEN" in r.output
    assert "hf_canary_doctor_123" not in r.output


# The error classes whose messages are meant for the user, module by module (the CLI maps them once).
USER_ERRORS = {
    "stages.core.config": ["ConfigError"],
    "stages.core.report": ["IntegrityError", "DiskSpaceError"],
    "stages.model.chat": ["ChatError"],
    "stages.quant.runner": ["RunnerError"],
    "stages.model.checkpoint": ["CheckpointError"],
    "stages.runtimes": ["RuntimeFailure"],
    "stages.model.geometry": ["GeometryError"],
    "stages.model.graphs": ["PartitionError"],
    "stages.compile": ["CompileError"],
    "stages.download": ["DownloadError"],
    "stages.export": ["ExportError"],
    "stages.quantize.analysis": ["QuantizeError"],
    "stages.quant.calibration": ["CalibrationError"],
}


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, names in USER_ERRORS.items() for n in names])
def test_a_user_error_raised_anywhere_is_one_line_and_exit_status_2(module, name, monkeypatch, g4v69):
    """No command maps errors itself: any UserFixable that reaches the CLI becomes one line."""
    import importlib

    from stages.core.errors import UserFixable

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, UserFixable)

    args = ("what failed, where, what to do",)
    error = cls("soc", *args) if cls.__name__ == "ConfigError" else cls(*args)

    def fail(*_a, **_k):
        raise error

    monkeypatch.setattr("stages.cli.resolve_geometry", fail)
    r = g4v69("--preset", "tiny", "plan")
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"Error: {error}"
