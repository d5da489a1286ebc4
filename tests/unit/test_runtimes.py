"""The runtime seam: every registered runtime implements the interface the CLI drives it through."""

from __future__ import annotations

import importlib
import inspect

import pytest

from stages.runtimes import RUNTIMES, Runtime, get_runtime


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_each_runtime_implements_the_interface(name):
    runtime = get_runtime(name)
    assert isinstance(runtime, Runtime) and runtime.name == name
    # Its package lives under stages/runtimes/<name>/, where a newcomer looks for it.
    assert importlib.import_module(RUNTIMES[name]).__name__ == f"stages.runtimes.{name}"
    methods = ("layout_problems", "describe_layout", "usable_context", "lut_problems", "package", "check")
    for method in (*methods, "push", "run"):
        want = list(inspect.signature(getattr(Runtime, method)).parameters)[1:]
        assert list(inspect.signature(getattr(runtime, method)).parameters) == want, method


def test_an_unknown_runtime_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"runtime 'tflite' is not known; allowed values: genie"):
        get_runtime("tflite")


def test_genie_errors_are_runtime_failures_and_push_and_run_stay_light():
    import subprocess
    import sys

    from stages.runtimes import RuntimeFailure
    from stages.runtimes.genie.bundle import BundleError
    from stages.runtimes.genie.device import DeviceError
    from stages.runtimes.genie.verify import VerifyError

    assert all(issubclass(e, RuntimeFailure) for e in (BundleError, VerifyError, DeviceError))
    # The tools image (adb, no numpy or onnx) runs push and run: their imports must not need them.
    code = (
        "import sys; from stages.runtimes import get_runtime; import stages.runtimes.genie.device, "
        "stages.model.chat; "
        "print(sorted(m for m in ('numpy', 'onnx', 'onnxruntime', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_genie_errors_reach_the_user_as_one_line(tmp_path):
    from click.testing import CliRunner

    from stages.cli import main

    # No compile output: Genie's packaging says which stage to run, without a traceback.
    r = CliRunner().invoke(main, ["--preset", "tiny", "--workdir", str(tmp_path), "bundle"])
    assert r.exit_code != 0 and "Traceback" not in r.output and "make compile" in r.output


def test_genie_refuses_a_step_as_wide_as_the_sliding_window_before_export(tmp_path):
    """Genie 2.51 never writes a sliding-window cache group when a graph is as wide as its window
    (measured with the real libGenie.so): refused by `make plan` and at the start of export instead of
    by verify after everything was built."""
    from click.testing import CliRunner

    from stages.cli import main
    from stages.core.config import load_config
    from stages.download import run_download
    from stages.export import ExportError, run_export
    from stages.model.geometry import builtin_geometry
    from stages.runtimes.genie.rules import window_not_written

    genie, tiny = get_runtime("genie"), builtin_geometry("tiny")
    assert genie.layout_problems(load_config("tiny"), tiny) == []  # AR-4 in a window of 8
    wide = load_config("tiny", {"prefill_ar": 8})
    reason = window_not_written("swa", 8, 8)
    assert genie.layout_problems(wide, tiny) == [reason]
    assert genie.layout_problems(load_config(), builtin_geometry("e2b-random")) == []  # AR-32, window 512
    assert (
        genie.layout_problems(load_config(overrides={"prefill_ar": 128}), builtin_geometry("e2b-random"))
        == []
    )
    r = CliRunner().invoke(main, ["--preset", "tiny", "--prefill-ar", "8", "plan"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == f"Error: {reason}"
    ckpt = tmp_path / "checkpoints" / "tiny"
    run_download("tiny", "main", ckpt)
    with pytest.raises(ExportError) as e:
        run_export(wide, tmp_path, ckpt)
    assert str(e.value) == reason
    assert not (tmp_path / "exported").exists()


def test_the_plan_takes_its_layout_wording_from_the_runtime():
    """How each layout runs is the runtime's to say (Runtime.describe_layout), not the planner's."""
    from pathlib import Path

    from stages.core.config import load_config
    from stages.model.geometry import builtin_geometry
    from stages.planning.fitting import layout_configs

    genie = get_runtime("genie")
    assert "AR-4 chunks" in genie.describe_layout(4, 1) and "own AR-1 call" in genie.describe_layout(1, 1)
    cfg = load_config("tiny")
    for variant, how in layout_configs(builtin_geometry("tiny"), cfg):
        assert how == genie.describe_layout(variant.prefill_ar, variant.decode_ar)
    planner = (Path(__file__).parents[2] / "stages" / "planning" / "fitting.py").read_text()
    assert "prepareInferenceStrategy: it picks" not in planner and "chunks (last one padded)" not in planner


def test_the_plan_states_the_context_each_layout_can_use():
    """A graph of AR t at context C holds C - t past entries, and Genie must never be asked for more:
    the usable context (genie_config.json's context.size) is the widest graph kind's past, for the
    config's layout and for every layout of the table (measured: tests/integration/test_real_genie.py)."""
    from stages.core.config import load_config
    from stages.model.geometry import builtin_geometry
    from stages.planning.fitting import make_layouts, plan_config
    from stages.planning.plan import render_plan

    genie, tiny = get_runtime("genie"), builtin_geometry("tiny")
    assert [genie.usable_context(tiny, 128, ars) for ars in ([4, 1], [4], [1])] == [124, 124, 127]
    cfg = load_config("tiny")
    plan = plan_config(tiny, cfg)
    assert plan.usable_context == 124
    assert all(lay.usable_context == 128 - lay.prefill_ar for lay in make_layouts(tiny, cfg))
    e2b, default = builtin_geometry("e2b-random"), load_config()
    plan = plan_config(e2b, default)  # one graph kind at AR-32, context 2048
    assert plan.usable_context == 2048 - 32
    assert "holds 2016 tokens" in render_plan(plan)
