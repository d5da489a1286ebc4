"""The bundle and verify stages on the trained tiny model: golden configs for v69 and v73, Genie's
own validator, the consistency checks, reproducible manifests, and verify against transformers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from stages.cli import main
from stages.compile import run_compile
from stages.core.config import load_config
from stages.core.report import IntegrityError
from stages.model.chat import join_adjacent_string_literals, render_chat
from stages.quantize import run_quantize
from stages.runtimes.genie.bundle import (
    BundleError,
    consistency_errors,
    genie_validator_errors,
    lut_feeds,
    run_bundle,
)
from stages.runtimes.genie.verify import run_verify
from tests.conftest import REPO, copy_workdir, rewrite_report

pytestmark = pytest.mark.slow
GOLDEN = REPO / "tests" / "golden"
# Set G4V69_UPDATE_GOLDEN=1 to rewrite the golden files after a deliberate change (and review the diff).
UPDATE = os.environ.get("G4V69_UPDATE_GOLDEN") == "1"


def _bundle(work: Path, cfg) -> dict:
    run_compile(cfg, work)
    return run_bundle(cfg, work, work / "checkpoints" / "tiny")


@pytest.fixture(scope="module")
def sm8450(quantized_tiny, tmp_path_factory):
    work = copy_workdir(quantized_tiny, tmp_path_factory.mktemp("bundle") / "w")
    return work, _bundle(work, load_config("tiny"))


def _golden(name: str, data: dict) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(json.dumps(data, indent=2) + "\n")
    assert data == json.loads(path.read_text()), f"{name} changed; see tests/golden/ and G4V69_UPDATE_GOLDEN"


def test_sm8450_configs_match_the_golden_files(sm8450):
    work, report = sm8450
    bundle = work / "genie_bundle"
    _golden("sm8450_genie_config.json", json.loads((bundle / "genie_config.json").read_text()))
    _golden(
        "sm8450_htp_backend_ext_config.json", json.loads((bundle / "htp_backend_ext_config.json").read_text())
    )
    ext = json.loads((bundle / "htp_backend_ext_config.json").read_text())
    assert ext["devices"][0]["soc_model"] == 36 and ext["devices"][0]["dsp_arch"] == "v69"
    assert ext["context"]["weight_sharing_enabled"] is False
    assert report["figures"]["genie_validator"].startswith("libGenie.so")


def test_v73_configs_match_the_golden_files(quantized_tiny, tmp_path):
    work = copy_workdir(quantized_tiny, tmp_path / "w")
    cfg = load_config("tiny", {"soc": "SM8550"})
    run_quantize(cfg, work, work / "checkpoints" / "tiny")
    _bundle(work, cfg)
    genie = json.loads((work / "genie_bundle" / "genie_config.json").read_text())
    _golden("sm8550_genie_config.json", genie)
    _golden(
        "sm8550_htp_backend_ext_config.json",
        json.loads((work / "genie_bundle" / "htp_backend_ext_config.json").read_text()),
    )
    assert genie["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == ["part1_of_2.bin", "part2_of_2.bin"]


def test_bundle_holds_what_genie_needs_and_a_true_manifest(sm8450):
    work, _ = sm8450
    bundle = work / "genie_bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    names = {f["path"] for f in manifest["files"]}
    assert names == {
        "prefill_ar4_part1_of_2.bin",
        "decode_ar1_part1_of_2.bin",
        "prefill_ar4_part2_of_2.bin",
        "decode_ar1_part2_of_2.bin",
        "embedding_ufixed16.bin",
        "per_layer_embedding_ufixed8.bin",
        "tokenizer.json",
        "tokenizer_config.json",
        "genie_config.json",
        "htp_backend_ext_config.json",
    }
    assert manifest["qairt_version"].startswith("2.51.") and manifest["dsp_arch"] == "v69"
    assert manifest["checkpoint"]["model"] == "tiny" and manifest["checkpoint"]["files"]
    assert set(manifest["lock_sha256"]) >= {"export", "quant", "compile", "tools"}
    r = CliRunner().invoke(main, ["bundle", "--check", str(bundle / "manifest.json")])
    assert r.exit_code == 0 and "matches" in r.output


def test_chat_template_is_made_safe_for_genie_and_renders_the_same(sm8450):
    work, _ = sm8450
    ckpt = work / "checkpoints" / "tiny"
    shipped = json.loads((work / "genie_bundle" / "tokenizer_config.json").read_text())["chat_template"]
    original = (ckpt / "chat_template.jinja").read_text()
    assert "' '" in original and "' '" not in shipped  # the tiny template has adjacent literals on purpose
    assert shipped == join_adjacent_string_literals(original)
    fixed = work / "fixed"
    shutil.copytree(ckpt, fixed)
    (fixed / "chat_template.jinja").write_text(shipped)
    assert render_chat(fixed, "Hi", system="Be brief") == render_chat(ckpt, "Hi", system="Be brief")


def test_bundling_twice_gives_identical_manifests(sm8450, tmp_path):
    work, first = sm8450
    again = copy_workdir(work, tmp_path / "again")
    shutil.rmtree(again / "genie_bundle")
    shutil.rmtree(again / "compiled")
    second = _bundle(again, load_config("tiny"))
    assert (again / "genie_bundle" / "manifest.json").read_bytes() == (
        work / "genie_bundle" / "manifest.json"
    ).read_bytes()
    assert second["figures"]["manifest_sha256"] == first["figures"]["manifest_sha256"]


def test_inconsistent_configs_are_refused(sm8450, tmp_path):
    work, _ = sm8450
    bundle = work / "genie_bundle"
    genie = json.loads((bundle / "genie_config.json").read_text())
    compiled = json.loads((work / "compiled" / "report.json").read_text())
    io = {g["name"]: g["io"] for b in compiled["figures"]["binaries"] for g in b["graphs"]}
    files = {p.name: p for p in bundle.iterdir()}
    assert consistency_errors(genie, files, io, _geometry(work)) == []
    bad = json.loads(json.dumps(genie))
    bad["dialog"]["engine"]["model"]["binary"]["ctx-bins"].append("part9_of_2.bin")
    bad["dialog"]["engine"]["cache-groups"][0]["prefix"] = "global_"
    bad["dialog"]["context"]["n-vocab"] += 1  # a rule verify also applies (config_vs_graphs)
    big = tmp_path / "huge.bin"
    with open(big, "wb") as f:  # sparse: 4 GiB of nothing
        f.truncate(2**32)
    bad["dialog"]["perlayer-embedding"]["lut-path"] = "huge.bin"
    errors = consistency_errors(bad, {**files, "huge.bin": big}, io, _geometry(work))
    assert any("part9_of_2.bin is not in the bundle" in e for e in errors)
    assert any("prefix 'global_' matches no key cache input" in e for e in errors)
    assert any("(huge.bin) LUT is 4.00 GiB, over Genie's 4 GiB LUT limit" in e for e in errors)
    assert any("context.n-vocab is" in e for e in errors)


def _geometry(work: Path):
    from stages.model.checkpoint import Checkpoint

    return Checkpoint(work / "checkpoints" / "tiny").geometry


def _graph_io(work: Path) -> dict:
    compiled = json.loads((work / "compiled" / "report.json").read_text())
    return {g["name"]: g["io"] for b in compiled["figures"]["binaries"] for g in b["graphs"]}


def test_genie_byte_copies_both_luts_into_inputs_of_their_exact_encoding(sm8450):
    work, report = sm8450
    genie = json.loads((work / "genie_bundle" / "genie_config.json").read_text())["dialog"]
    io = _graph_io(work)
    for key, tensor in (("embedding", "inputs_embeds"), ("perlayer-embedding", "per_layer_inputs")):
        qp = genie[key]["quant-param"]
        for graph in ("prefill_ar4_part1_of_2", "decode_ar1_part1_of_2"):
            enc = io[graph]["inputs"][tensor]
            # Genie compares the JSON scale with the binary's float32 scale: equal to the bit.
            assert (qp["scale"], qp["offset"]) == (enc["scale"], enc["offset"])
            assert float(np.float32(qp["scale"])) == qp["scale"]
            assert enc["dtype"] == {"ufixed16": "uint16", "ufixed8": "uint8"}[genie[key]["datatype"]]
    feeds = report["figures"]["lut_feeds"]
    assert len(feeds) == 4 and {f["mode"] for f in feeds} == {"copy"}


def test_lut_inputs_genie_cannot_feed_are_refused_and_requantized_ones_allowed(sm8450):
    work, _ = sm8450
    bundle = work / "genie_bundle"
    genie = json.loads((bundle / "genie_config.json").read_text())
    files = {p.name: p for p in bundle.iterdir()}
    io = _graph_io(work)
    graphs = ("prefill_ar4_part1_of_2", "decode_ar1_part1_of_2")

    def with_input(tensor: str, **enc) -> dict:
        changed = json.loads(json.dumps(io))
        for g in graphs:
            changed[g]["inputs"][tensor] = {"shape": io[g]["inputs"][tensor]["shape"], **enc}
        return changed

    # A float per_layer_inputs (what the float16 PLE policy used to make) from the ufixed8 LUT.
    float_ple = with_input("per_layer_inputs", dtype="float32")
    errors = consistency_errors(genie, files, float_ple, _geometry(work))
    assert len(errors) == 2 and all(
        "Genie cannot feed graph input per_layer_inputs (float32)" in e for e in errors
    )
    assert "from the perlayer-embedding LUT (ufixed8 (scale " in errors[0]
    # inputs_embeds with another unsigned encoding: Genie requantizes each row (allowed, reported).
    other = with_input("inputs_embeds", dtype="uint16", scale=0.001, offset=-30000)
    assert consistency_errors(genie, files, other, _geometry(work)) == []
    assert {f["mode"] for f in lut_feeds(genie, other) if f["tensor"] == "inputs_embeds"} == {"requantize"}
    # ... but not into a signed one.
    signed = with_input("inputs_embeds", dtype="int16", scale=0.001, offset=0)
    errors = consistency_errors(genie, files, signed, _geometry(work))
    assert len(errors) == 2 and all(
        "graph input inputs_embeds (sfixed16 (scale 0.001, offset 0))" in e for e in errors
    )


def test_a_bundle_genie_could_not_load_or_feed_is_refused_whole(sm8450, tmp_path):
    """compiled/report.json edited as a stale or mixed compile would leave it: nothing is written."""
    work = copy_workdir(sm8450[0], tmp_path / "w")
    shutil.rmtree(work / "genie_bundle")
    report_path = work / "compiled" / "report.json"
    original = report_path.read_text()
    compiled = json.loads(original)
    for b in compiled["figures"]["binaries"]:
        for g in b["graphs"]:
            if "per_layer_inputs" in g["io"]["inputs"]:
                g["io"]["inputs"]["per_layer_inputs"] = {"dtype": "float32", "shape": [1, 1, 4, 8]}
    rewrite_report(work, report_path.parent, compiled)
    with pytest.raises(
        BundleError, match=r"cannot feed graph input per_layer_inputs \(float32\) from the perl"
    ):
        run_bundle(load_config("tiny"), work, work / "checkpoints" / "tiny")
    # A cross-part tensor whose encoding differs between the part writing it and the one reading it.
    compiled = json.loads(original)
    for b in compiled["figures"]["binaries"]:
        for g in b["graphs"]:
            if g["name"] == "decode_ar1_part2_of_2":
                g["io"]["inputs"]["xfer_hidden_states_layer4"]["offset"] += 1
    rewrite_report(work, report_path.parent, compiled)
    with pytest.raises(BundleError, match="xfer_hidden_states_layer4 has 2 encodings across the graphs"):
        run_bundle(load_config("tiny"), work, work / "checkpoints" / "tiny")
    assert not (work / "genie_bundle").exists()


def test_genie_rejects_an_unknown_key_and_says_which():
    genie = json.loads((GOLDEN / "sm8450_genie_config.json").read_text())
    assert genie_validator_errors(genie) == []
    genie["dialog"]["context"]["n-vocabulary"] = 3
    (error,) = genie_validator_errors(genie)
    assert "n-vocabulary" in error


def test_a_missing_compile_is_a_clear_error(quantized_tiny, tmp_path):
    work = copy_workdir(quantized_tiny, tmp_path / "w")
    with pytest.raises(BundleError, match="no finished compile.*run `make compile` first"):
        run_bundle(load_config("tiny"), work, work / "checkpoints" / "tiny")
    assert not (work / "genie_bundle").exists()


def test_verify_matches_transformers_on_an_in_domain_prompt(sm8450):
    work, _ = sm8450
    report = run_verify(
        load_config("tiny"), work, work / "checkpoints" / "tiny", "Return the first element of a list."
    )
    fig = report["figures"]
    assert fig["matching_prefix_tokens"] >= 16
    assert fig["top1_agreement"] >= 0.95
    assert fig["bundle_text"] and fig["bundle_text"][:16] == fig["transformers_text"][:16]


def test_verify_catches_a_tampered_bundle(sm8450, tmp_path):
    work = copy_workdir(sm8450[0], tmp_path / "w")
    lut = work / "genie_bundle" / "embedding_ufixed16.bin"
    data = bytearray(lut.read_bytes())
    data[100] ^= 0xFF
    lut.write_bytes(bytes(data))  # a copy, not a link: exported/ keeps its bytes
    with pytest.raises(IntegrityError, match="embedding_ufixed16.bin changed after bundle wrote it"):
        run_verify(load_config("tiny"), work, work / "checkpoints" / "tiny", "Hi")
    assert (work / "exported" / "luts" / "embedding_ufixed16.bin").read_bytes() != bytes(data)
    r = CliRunner().invoke(main, ["bundle", "--check", str(work / "genie_bundle" / "manifest.json")])
    assert r.exit_code == 2 and "sha256 differs" in r.output
