"""The Genie emulator on the trained tiny bundle: the bundle's own v69 binaries on the HTP emulation
against transformers, the CPU engine, and mutations of a good bundle that verify must catch (refused
naming the cause, or tokens that no longer match)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from stages.compile import run_compile
from stages.core.config import load_config
from stages.core.report import IntegrityError, write_report
from stages.model.contract import HIDDEN_PREFIX
from stages.planning.results import CompileResult, StageReport
from stages.runtimes.genie.bundle import check_manifest, run_bundle
from stages.runtimes.genie.emulator import EmulatorError, GenieEmulator
from stages.runtimes.genie.verify import VerifyError, run_verify
from tests.conftest import copy_workdir, rewrite_report

pytestmark = pytest.mark.slow
PROMPT = "Return the first element of a list."


@pytest.fixture(scope="module")
def verified(bundled) -> dict:
    """verify as `make demo` runs it: the HTP engine on the binaries."""
    return run_verify(load_config("tiny"), bundled, bundled / "checkpoints" / "tiny", PROMPT)["figures"]


def test_the_binaries_under_the_emulator_match_transformers(verified):
    assert verified["engine"]["name"] == "htp"
    assert verified["matching_prefix_tokens"] >= 31 and len(verified["transformers_tokens"]) == 32
    assert verified["top1_agreement"] >= 0.95
    assert verified["heldout"]["ran"] and verified["heldout"]["top1_agreement"] >= 0.95
    # Disagreements on held-out text are near-ties in transformers' own logits.
    assert all(t["transformers_logit_gap"] < 0.5 for t in verified["heldout"]["near_ties"])
    assert verified["bundle_vs_host_runner_logits"]["top1_agreement"] >= 0.95
    # Prefill in AR-4 chunks (the last one padded), then AR-1 decode steps.
    steps = verified["emulator_prefill_steps"]
    assert {s["ar"] for s in steps} == {4} and sum(s["n_process"] for s in steps) == verified["prompt_tokens"]
    behaviours = verified["genie_behaviours"]
    assert len(behaviours) >= 7 and all(b["source"] for b in behaviours)


def test_cpu_engine_follows_the_same_path(bundled, verified):
    from stages.runtimes.genie.prompt import query_text

    compiled = CompileResult(bundled / "compiled", StageReport.read(bundled / "compiled"))
    em = GenieEmulator(bundled / "genie_bundle", compiled, "cpu", bundled / "quantized")
    ids = em.query_ids(query_text(bundled / "genie_bundle", PROMPT))
    run = em.generate(
        ids, 32, greedy=True
    )  # the config samples (temp 1.0, top-k 64); verify compares greedily
    same = sum(a == b for a, b in zip(run.tokens, verified["transformers_tokens"], strict=False))
    assert same >= 31


# ---- mutations ----
def _resign(bundle: Path) -> None:
    """Record the edited files in the manifest, as a bundle built that way would."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for f in manifest["files"]:
        data = (bundle / f["path"]).read_bytes()
        f.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    report = json.loads((bundle / "report.json").read_text())  # the bundle stage's record of its outputs
    for f in report["outputs"]:
        data = (bundle / f["path"]).read_bytes()
        f.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    rewrite_report(bundle.parent, bundle, report)


def _edit_genie_config(work: Path, edit) -> None:
    path = work / "genie_bundle" / "genie_config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["dialog"])
    path.unlink()  # never write through a link into compiled/ or exported/
    path.write_text(json.dumps(cfg, indent=2))
    _resign(work / "genie_bundle")


def _edit_compiled_io(work: Path, edit) -> None:
    path = work / "compiled" / "report.json"
    report = json.loads(path.read_text())
    for b in report["figures"]["binaries"]:
        for g in b["graphs"]:
            edit(g["name"], g["io"])
    rewrite_report(work, path.parent, report)


def _verify(work: Path) -> dict:
    return run_verify(load_config("tiny"), work, work / "checkpoints" / "tiny", PROMPT, engine="cpu")


@pytest.fixture
def mutable(bundled, tmp_path) -> Path:
    return copy_workdir(bundled, tmp_path / "w")


def test_float_per_layer_inputs_from_a_ufixed8_lut_is_refused(mutable):
    def to_float(_, io):
        if "per_layer_inputs" in io["inputs"]:
            io["inputs"]["per_layer_inputs"] = {
                "dtype": "float32",
                "shape": io["inputs"]["per_layer_inputs"]["shape"],
            }

    _edit_compiled_io(mutable, to_float)
    with pytest.raises(
        VerifyError, match="per_layer_inputs: Genie cannot feed a float32 input from the ufixed8"
    ):
        _verify(mutable)


def test_an_embedding_lut_encoding_unlike_the_input_gives_other_tokens(verified, mutable):
    def shift(genie):
        genie["embedding"]["quant-param"]["offset"] += 3000

    _edit_genie_config(mutable, shift)
    assert (mutable / "verify" / "report.json").is_file()  # the good bundle's passing report
    # The real Genie reads the LUT with the config's encoding, as the phone would: other tokens.
    with pytest.raises(VerifyError, match="the real Genie's greedy ids for the 'chat' prompt differ"):
        _verify(mutable)
    assert not (mutable / "verify" / "report.json").exists()  # no stale pass left behind


def test_a_cross_part_tensor_with_two_encodings_is_refused(mutable):
    def rescale(name, io):
        for t, enc in io["inputs"].items():
            if t.startswith(HIDDEN_PREFIX) and "part2" in name:
                enc["scale"] *= 2

    _edit_compiled_io(mutable, rescale)
    with pytest.raises(
        VerifyError, match=r"xfer_hidden_states_layer\d+ leaves one split as .* Genie hands over the raw"
    ):
        _verify(mutable)


@pytest.mark.parametrize(
    "field,value,cause",
    [
        (
            "rope-theta",
            10.0,
            r"positional-encoding \(global\) rope-theta is 10.0, the graphs and the model say 1000000.0",
        ),
        (
            "partial-rotary-factor",
            1.0,
            r"\(global\) partial-rotary-factor is 1.0, the graphs and the model say 0.25",
        ),
    ],
    ids=["rope-theta", "partial-rotary"],
)
def test_a_wrong_rope_is_refused(mutable, field, value, cause):
    def edit(genie):
        rope = genie["engine"]["model"]["positional-encoding"][0]
        (rope["rope-scaling"] if field == "partial-rotary-factor" else rope)[field] = value

    _edit_genie_config(mutable, edit)
    with pytest.raises(VerifyError, match=cause):
        _verify(mutable)


def test_the_emulator_builds_its_rope_tables_from_the_config(bundled, mutable, verified):
    """A wrong rope-theta in genie_config.json reaches the binaries' inputs, as it would on the phone."""
    from stages.model.chat import ChatTokenizer

    _edit_genie_config(
        mutable, lambda g: g["engine"]["model"]["positional-encoding"][0].update({"rope-theta": 10.0})
    )
    compiled = CompileResult(bundled / "compiled", StageReport.read(bundled / "compiled"))
    ids = ChatTokenizer(bundled / "genie_bundle").chat_ids(PROMPT)
    path = verified["transformers_tokens"][:-1]
    good = GenieEmulator(bundled / "genie_bundle", compiled, "cpu", bundled / "quantized").logits_along(
        ids, path
    )
    bad = GenieEmulator(mutable / "genie_bundle", compiled, "cpu", mutable / "quantized").logits_along(
        ids, path
    )
    assert float(abs(bad - good).mean()) > 0.1 * float(good.std())


@pytest.mark.parametrize(
    "edit,cause",
    [
        (
            lambda g: g["engine"]["cache-groups"][1]["longcontext"]["sliding-window"].update(
                {"window-size": 6}
            ),
            "sliding window-size is 6, the graphs and the model say 8",
        ),
        (
            lambda g: g["engine"]["cache-groups"][0].update({"kv-dim": 16}),
            "'past_' kv-dim is 16, the graphs and the model say 32",
        ),
        (
            lambda g: g["engine"]["cache-groups"][1].update({"prefix": "sw_"}),
            "'sw_' matches no key cache input",
        ),
    ],
    ids=["window", "kv-dim", "prefix"],
)
def test_cache_group_mistakes_are_refused(mutable, edit, cause):
    _edit_genie_config(mutable, edit)
    with pytest.raises(VerifyError, match=cause):
        _verify(mutable)


def test_the_emulator_alone_refuses_cache_group_mistakes(mutable):
    """Without verify's config checks, the emulator still names kv-dim and prefix mistakes."""
    compiled = CompileResult(mutable / "compiled", StageReport.read(mutable / "compiled"))
    for edit, cause in [
        (lambda g: g["engine"]["cache-groups"][0].update({"kv-dim": 16}), "kv-dim 16 in genie_config.json"),
        (
            lambda g: g["engine"]["cache-groups"][1].update({"prefix": "sw_"}),
            "'sw_' matches no KV cache input",
        ),
    ]:
        work = copy_workdir(mutable, mutable.parent / f"m{len(cause)}")
        _edit_genie_config(work, edit)
        with pytest.raises(EmulatorError, match=cause):
            GenieEmulator(work / "genie_bundle", compiled, "cpu", work / "quantized")


# ---- the reports the stages hand on ----
def test_each_stage_records_the_reports_it_reads(bundled, verified):
    def inputs(folder: str) -> set[str]:
        return {f["path"] for f in json.loads((bundled / folder / "report.json").read_text())["inputs"]}

    assert "exported/report.json" in inputs("quantized")
    assert "quantized/report.json" in inputs("compiled")
    assert {"compiled/report.json", "exported/report.json"} <= inputs("genie_bundle")
    assert "genie_bundle/report.json" in inputs("verify")


def _lower_measured_top1(work: Path) -> dict:
    """quantized/report.json with its measured top-1 lowered (verify's floor once followed it)."""
    report = json.loads((work / "quantized" / "report.json").read_text())
    report["figures"]["quality"]["float16"]["top1_agreement"] = 0.1
    return report


def test_an_edited_quantize_report_is_refused_by_name(mutable):
    """Edited by hand: compile (which reads it), bundle and verify (which check compile's record of it)
    refuse it by name and name `make quantize`."""
    path = mutable / "quantized" / "report.json"
    path.write_text(json.dumps(_lower_measured_top1(mutable), indent=2))
    cfg, ckpt = load_config("tiny"), mutable / "checkpoints" / "tiny"
    stages = (
        lambda: run_compile(cfg, mutable),
        lambda: run_bundle(cfg, mutable, ckpt),
        lambda: _verify(mutable),
    )
    for stage in stages:
        with pytest.raises(IntegrityError) as e:
            stage()
        assert str(e.value) == (
            f"{path} changed after quantize wrote it (its report_sha256 does not match its content); "
            "run `make quantize` again"
        )
    # Sealed, as a quantize run again would leave it: not the report compile read, which compile
    # recorded, so bundle and verify send to `make compile`.
    write_report(path.parent, _lower_measured_top1(mutable))
    for stage in (lambda: run_bundle(cfg, mutable, ckpt), lambda: _verify(mutable)):
        with pytest.raises(IntegrityError, match="quantized/report.json is not the one compile read"):
            stage()
    assert (mutable / "genie_bundle" / "report.json").is_file()  # nothing was replaced


def test_verify_floor_does_not_follow_the_quantize_report(mutable):
    """A work folder whose every record agrees with a quantize report claiming top-1 0.1: verify's
    floor against transformers stays the preset's (min_top1_agreement_w8 0.95 less 0.05)."""
    rewrite_report(mutable, mutable / "quantized", _lower_measured_top1(mutable))
    fig = _verify(mutable)["figures"]
    assert fig["thresholds"]["min_top1_agreement_with_transformers"] == 0.9
    assert fig["thresholds"]["with_transformers_from"] == "min_top1_agreement_w8 0.95 less 0.05"


# ---- every genie_config.json field verify used to take as given, edited and re-signed ----
def _swap_first_two(items: list) -> list:
    return [items[1], items[0], *items[2:]]


def _edit_chat_template(work: Path) -> None:
    path = work / "genie_bundle" / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("model", "assistant")
    path.unlink()
    path.write_text(json.dumps(cfg, indent=2))
    _resign(work / "genie_bundle")


@pytest.mark.parametrize(
    "edit,cause",
    [
        (
            lambda g: g["engine"]["model"]["binary"].update(
                {"ctx-bins": _swap_first_two(g["engine"]["model"]["binary"]["ctx-bins"])}
            ),
            r"engine\.model\.binary\.ctx-bins is \['decode_ar1_part1_of_2.bin', 'prefill_ar4_part1_of_2.bin'",
        ),
        (
            lambda g: g["engine"]["backend"]["QnnHtp"].update({"kv-dim": 32}),
            "engine.backend.QnnHtp.kv-dim is 32, the graphs and the model say 16",
        ),
        (
            lambda g: g["context"].update({"bos-token": 3}),
            "context.bos-token is 3, the checkpoint tiny says 2",
        ),
        (
            lambda g: g["context"].update({"pad-token": 5}),
            "context.pad-token is 5, the checkpoint tiny says 0",
        ),
        (lambda g: g["context"].update({"eos-token": [1]}), r"context\.eos-token is \[1\]"),
        (lambda g: g["sampler"].update({"temp": 0.5}), "sampler.temp is 0.5, the checkpoint tiny says 1.0"),
        (
            lambda g: g["sampler"].update({"top-k": 300}),
            "sampler.top-k is 300; Genie takes 0 .all. to n-vocab",
        ),
        (
            lambda g: g["sampler"].update({"top-p": 0.5}),
            "sampler.top-p is 0.5, the checkpoint tiny says 0.95",
        ),
        (lambda g: g["sampler"].update({"seed": 7}), "sampler.seed is 7, the checkpoint tiny says 42"),
        (
            lambda g: g["tokenizer"].update({"path": "tokenizer_config.json"}),
            "tokenizer.path is 'tokenizer_config.json', the bundle .its tokenizer file. says",
        ),
        (None, "its tokenizer_config.json chat_template renders the prompt unlike the checkpoint's"),
    ],
    ids=[
        "ctx-bins-order",
        "qnnhtp-kv-dim",
        "bos",
        "pad",
        "eos",
        "sampler-temp",
        "sampler-top-k",
        "sampler-top-p",
        "sampler-seed",
        "tokenizer-path",
        "chat-template",
    ],
)
def test_a_re_signed_config_edit_is_refused_naming_the_field(mutable, edit, cause):
    """The manifest agrees with every edited file (re-signed), so only the field's meaning can
    catch it: verify fails with a line naming the field, before it runs anything."""
    if edit is None:
        _edit_chat_template(mutable)
    else:
        _edit_genie_config(mutable, edit)
    assert not check_manifest(mutable / "genie_bundle")
    with pytest.raises(VerifyError, match=cause):
        _verify(mutable)


def test_the_emulator_alone_uses_the_fields_as_genie_does(mutable):
    """Without verify's checks against the checkpoint and compile, the emulator still refuses what
    Genie could not run, and prepends the config's bos-token to the query as Genie does."""
    compiled = CompileResult(mutable / "compiled", StageReport.read(mutable / "compiled"))
    for edit, cause in [
        (
            lambda g: g["tokenizer"].update({"path": "missing.json"}),
            "tokenizer.path 'missing.json' names no file",
        ),
        (lambda g: g["tokenizer"].update({"path": "../tokenizer.json"}), "names no file of the bundle"),
        (
            lambda g: g["engine"]["backend"]["QnnHtp"].update({"kv-dim": 3}),
            "QnnHtp kv-dim 3 in genie_config.json",
        ),
        (lambda g: g["sampler"].update({"top-p": 1.5}), "sampler.top-p is 1.5; Genie's schema needs"),
        (
            lambda g: g["engine"]["model"]["binary"]["ctx-bins"].append("decode_ar1_part1_of_2.bin"),
            "ctx-bins lists decode_ar1_part1_of_2.bin more than once",
        ),
    ]:
        work = copy_workdir(mutable, mutable.parent / f"m{len(cause)}")
        _edit_genie_config(work, edit)
        with pytest.raises(EmulatorError, match=cause):
            GenieEmulator(work / "genie_bundle", compiled, "cpu", work / "quantized")
    work = copy_workdir(mutable, mutable.parent / "bos")
    _edit_genie_config(work, lambda g: g["context"].update({"bos-token": 7}))
    em = GenieEmulator(work / "genie_bundle", compiled, "cpu", work / "quantized")
    assert (
        em.query_ids("hello")[0] == 7
        and em.query_ids("hello")[1:] == em.tokenizer.encode("hello", add_special_tokens=False).ids
    )


def test_the_emulator_samples_as_the_config_asks(bundled, verified):
    """Genie's greedy rule (temp <= 0 or top-k == 1) and, otherwise, draws from the config's top-k."""
    from stages.runtimes.genie.prompt import query_text

    compiled = CompileResult(bundled / "compiled", StageReport.read(bundled / "compiled"))
    em = GenieEmulator(bundled / "genie_bundle", compiled, "cpu", bundled / "quantized")
    ids = em.query_ids(query_text(bundled / "genie_bundle", PROMPT))
    assert em.generate(ids, 8, greedy=True).tokens == verified["bundle_tokens"][:8]
    em.sampler = {**em.sampler, "top-k": 1}
    assert em.generate(ids, 8).tokens == verified["bundle_tokens"][:8]  # top-k 1 is greedy
    em.sampler = {**em.sampler, "top-k": 3, "temp": 5.0, "top-p": 1.0}
    raw = em.prefill(ids)
    top3 = set(np.argsort(-raw.astype(np.int64))[:3].tolist())
    em.reset()
    drawn = {em.pick(raw, greedy=False) for _ in range(40)}
    assert drawn <= top3 and len(drawn) > 1


def test_verify_records_its_sampler_and_validator(verified):
    assert verified["sampler"]["config"]["top-k"] == 64 and not verified["sampler"]["greedy_in_genie"]
    assert verified["sampler"]["compared"].startswith("greedy")
    assert verified["genie_validator"].startswith("libGenie.so")


# ---- no silent skips ----
def test_verify_fails_without_held_out_text_and_can_be_switched_off(mutable, monkeypatch):
    import stages.quant.calibration as calibration

    def offline(*_args, **_kwargs):
        raise calibration.CalibrationError("cannot load WikiText-2 (offline)")

    monkeypatch.setattr(calibration, "load_texts", offline)
    with pytest.raises(
        VerifyError, match=r"held-out check cannot run: cannot load WikiText-2.*VERIFY_HELDOUT=off"
    ):
        _verify(mutable)
    fig = run_verify(
        load_config("tiny"),
        mutable,
        mutable / "checkpoints" / "tiny",
        PROMPT,
        engine="cpu",
        heldout_check=False,
    )["figures"]
    assert fig["heldout"] == {
        "ran": False,
        "switched_off_by": "VERIFY_HELDOUT=off (g4v69 verify --no-heldout)",
    }


# ---- replay: the binaries on the HTP emulation, fed what the CPU engine was fed ----
def test_replay_runs_every_binary_and_compares_every_output(bundled):
    from stages.runtimes.genie.replay import DECODE, FIRST, MIN_SQNR_DB, WRAP

    fig = run_verify(load_config("tiny"), bundled, bundled / "checkpoints" / "tiny", PROMPT, engine="replay")[
        "figures"
    ]
    assert fig["engine"]["name"] == "replay" and fig["matching_prefix_tokens"] >= 31
    replayed = fig["htp_replay"]
    compiled = StageReport.read(bundled / "compiled").figures["binaries"]
    assert sorted(replayed["binaries_executed"]) == sorted(b["file"] for b in compiled)
    labels = [c["replay"] for c in replayed["calls"]]
    # Both graph kinds (AR-4 prefill, AR-1 decode), the first sliding-window wrap, two decode steps.
    assert labels.count(FIRST) == 2 and labels.count(WRAP) == 1 and labels.count(DECODE) == 2
    assert not replayed["skipped_for_time"]
    wrap = next(c for c in replayed["calls"] if c["replay"] == WRAP)
    assert wrap["wraps"] == ["swa_"]
    for call in replayed["calls"]:
        assert call["outputs"] >= 10  # every output of every part: logits and the KV entries
        assert call["worst"]["sqnr_db"] > MIN_SQNR_DB + 5  # measured: 31.7 dB or better
        assert call["logits_output"]["top1"] == 1.0


def test_replay_catches_binaries_that_differ_from_their_compiler_inputs(bundled, mutable):
    """A compiler input whose MLP weight scales were multiplied by 4 after compiling: the replay names
    the call and the binary whose output moved."""
    import onnx

    from stages.runtimes.genie.prompt import query_text
    from stages.runtimes.genie.replay import ReplayPlan, replay

    for path in (mutable / "quantized").glob("*part1_of_2.qdq.onnx"):
        model = onnx.load(str(path))
        for init in model.graph.initializer:
            if init.name == "layers.0.mlp.down_proj.weight_scale":
                values = onnx.numpy_helper.to_array(init) * 4
                init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
        path.unlink()
        onnx.save(model, str(path))
    compiled = CompileResult(bundled / "compiled", StageReport.read(bundled / "compiled"))
    em = GenieEmulator(bundled / "genie_bundle", compiled, "cpu", mutable / "quantized")
    em.record = ReplayPlan()
    em.generate(em.query_ids(query_text(bundled / "genie_bundle", PROMPT)), 4, greedy=True)
    result = replay(bundled / "genie_bundle", em, em.recorded, budget_s=600)
    assert result.problems
    assert any("part1_of_2.bin output" in p and "dB from its compiler input's" in p for p in result.problems)
    assert not any("part2_of_2" in p for p in result.problems)  # each part is fed the CPU engine's inputs


def test_generate_on_the_quantized_graphs_answers_as_the_bundle_does(bundled, verified):
    """`g4v69 generate --graphs quantized`: the bundle's quantized graphs fed as Genie feeds them, the
    same greedy tokens as verify's emulator on the binaries, with each step's top-2 margin; sampling
    options it cannot honour are refused."""
    from click.testing import CliRunner

    from stages.cli import main

    args = ["--preset", "tiny", "--workdir", str(bundled), "generate", "--prompt", PROMPT]
    args += ["--graphs", "quantized"]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["graphs"] == "quantized" and out["tokens"] == verified["bundle_tokens"][:8]
    assert len(out["top2_margins"]) == 8 and min(out["top2_margins"]) >= 0
    refused = CliRunner().invoke(main, [*args, "--temperature", "0.7"])
    assert refused.exit_code != 0 and "answers greedily" in refused.output
