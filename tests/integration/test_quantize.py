"""The trained tiny model through download, export and quantize: the v69 rules, the PLE policies, no
float left behind, quality on held-out text, and the quantized chain still writing text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from stages.core.config import load_config
from stages.core.report import IntegrityError, read_report
from stages.download import run_download
from stages.export import run_export
from stages.model.contract import LutSpec
from stages.model.encoding import Encoding
from stages.quant.runner import HostRunner
from stages.quantize.analysis import QuantizeError, analyse
from stages.quantize.audit import audit
from stages.quantize.stage import run_quantize
from stages.quantize.weights import lut_input_encodings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("quant")
    run_download("tiny", "main", work / "checkpoints" / "tiny")
    run_export(load_config("tiny"), work, work / "checkpoints" / "tiny")
    return work


def _quantize(exported: Path, tmp: Path, compare: bool = False, **overrides) -> tuple[Path, dict]:
    work = tmp / "work"
    shutil.copytree(exported, work, symlinks=True)
    report = run_quantize(
        load_config("tiny", overrides), work, work / "checkpoints" / "tiny", compare_ple_policies=compare
    )
    return work, report


@pytest.fixture(scope="module")
def sm8450(exported, tmp_path_factory):
    return _quantize(exported, tmp_path_factory.mktemp("sm8450"), compare=True)


def test_quality_on_held_out_text_meets_the_bar(sm8450):
    _, report = sm8450
    q = report["figures"]["quality"]["float16"]
    assert q["tokens"] > 400
    assert q["top1_agreement"] >= 0.95
    assert q["perplexity_quantized"] <= 1.05 * q["perplexity_fp"]
    assert q["kl_divergence"] < 0.05
    for policy in ("int16", "int8"):
        assert report["figures"]["quality"][policy]["audit_problems"] == []
    assert (sm8450[0] / "quantized" / "quality.html").read_text().count("<svg") == 2


def test_kv_is_8_bit_with_one_encoding_per_cache_on_v69(sm8450):
    _, report = sm8450
    assert report["figures"]["kv_cache_bits"] == 8
    encodings: dict[str, set] = {}
    for g in report["figures"]["graphs"]:
        act = g["audit"]["activation_matmuls"]
        assert act and all(m["inputs"] == ["uint16", "uint8"] for m in act), act
        for key, found in g["audit"]["kv_encodings"].items():
            assert len(found) == 1
            encodings.setdefault(key, set()).add(tuple(found[0]))
    assert set(encodings) == {f"{w}_{i}" for w in ("key", "value") for i in (0, 1, 2)}
    assert all(len(v) == 1 for v in encodings.values())  # the same across prefill, decode and parts


def test_ple_paths_stay_float_and_nothing_else_does(sm8450):
    _, report = sm8450
    for g in report["figures"]["graphs"]:
        audit_ = g["audit"]
        assert audit_["problems"] == [] and audit_["float_leftovers"] == []
        inside = [t for t in audit_["ple_tensors"] if t["role"] != "boundary"]
        assert inside and all(t["type"] == "float32" for t in inside)
        assert {t["role"] for t in inside} == {"weight", "internal"}
        # Each layer's PLE path ends at its projection MatMul: the norm after it reads a quantized
        # input (fp16 there failed QAIRT's v69 finalization at AR-32 on the E2B graphs).
        assert not any("post_per_layer_input_norm" in t["tensor"] for t in audit_["ple_tensors"])


def test_the_norm_after_each_ple_projection_reads_a_quantized_input(sm8450):
    work, report = sm8450
    for g in report["figures"]["graphs"]:
        model = onnx.load(str(work / "quantized" / g["qdq_onnx"]), load_external_data=False)
        producer = {o: n for n in model.graph.node for o in n.output}
        norms = [
            n
            for n in model.graph.node
            if n.op_type == "RMSNormalization"
            and "post_per_layer_input_norm"
            in (producer[n.input[1]].input[0] if n.input[1] in producer else n.input[1])
        ]
        assert norms, g["name"]
        # Input and weight both: the v69 compiler fails a quantized norm with a float weight as well.
        assert all(producer[n.input[0]].op_type == "DequantizeLinear" for n in norms)
        assert all(
            n.input[1] in producer and producer[n.input[1]].op_type == "DequantizeLinear" for n in norms
        )


def test_the_audit_catches_a_policy_that_was_not_applied(sm8450):
    work, report = sm8450
    cfg = load_config("tiny", {"ple_policy": "int8"})
    export_dir = work / "exported"
    # The audit on the float16 graphs, judged by the int8 policy, must complain: it is not vacuous.
    g = report["figures"]["graphs"][0]
    model = onnx.load(str(work / "quantized" / g["qdq_onnx"]))
    analysis = analyse(onnx.load(str(export_dir / f"{g['name']}.onnx")))
    lut_inputs = lut_input_encodings(exported_luts(export_dir), {"per_layer_inputs"})
    assert audit(cfg, model, analysis, lut_inputs)["problems"]


def exported_luts(export_dir: Path) -> dict[str, LutSpec]:
    """The export's LUTs, typed as the stages read them."""
    from stages.planning.results import ExportResult, StageReport

    return ExportResult(export_dir, StageReport.read(export_dir)).luts


def test_lut_fed_inputs_are_read_with_their_luts_exact_encoding(sm8450):
    """Genie copies LUT rows into inputs_embeds and per_layer_inputs only if the graph reads them with the
    LUT's own encoding (it has no path from a fixed-point LUT into a float input); the float16 policy's
    per-layer input included."""
    work, report = sm8450
    luts = read_report(work / "exported")["figures"]["luts"]
    seen = set()
    for g in report["figures"]["graphs"]:
        for tensor, found in g["audit"]["lut_inputs"].items():
            key = {"inputs_embeds": "embedding", "per_layer_inputs": "per_layer_embedding"}[tensor]
            assert found["input"] == found["lut"] == Encoding.of_lut(LutSpec(**luts[key])).to_dict()
            seen.add((g["name"].split("_")[0], tensor))
    assert seen == {(r, t) for r in ("prefill", "decode") for t in ("inputs_embeds", "per_layer_inputs")}
    assert luts["per_layer_embedding"]["bits"] == 8


def test_the_audit_catches_a_float_per_layer_input(sm8450):
    """The same graph with per_layer_inputs read as float (what the float16 policy made before) fails."""
    work, report = sm8450
    g = next(g for g in report["figures"]["graphs"] if "per_layer_inputs" in g["audit"]["lut_inputs"])
    model = onnx.load(str(work / "quantized" / g["qdq_onnx"]))
    nodes = model.graph.node
    (q,) = [n for n in nodes if "per_layer_inputs" in n.input]
    (dq,) = [n for n in nodes if q.output[0] in n.input]
    for n in nodes:
        n.input[:] = ["per_layer_inputs" if i == dq.output[0] else i for i in n.input]
    nodes.remove(q)
    nodes.remove(dq)
    export_dir = work / "exported"
    analysis = analyse(onnx.load(str(export_dir / f"{g['name']}.onnx")))
    lut_inputs = lut_input_encodings(exported_luts(export_dir), {"per_layer_inputs"})
    problems = audit(load_config("tiny"), model, analysis, lut_inputs)["problems"]
    assert any(p.startswith("per_layer_inputs is read as float32, its LUT is ufixed8") for p in problems)


def test_sm8650_may_keep_16_bit_kv(exported, tmp_path):
    _, report = _quantize(exported, tmp_path, soc="SM8650")
    assert report["figures"]["kv_cache_bits"] == 16
    for g in report["figures"]["graphs"]:
        assert all(m["inputs"][1] == "uint16" for m in g["audit"]["activation_matmuls"])


def test_quantized_chain_still_writes_text(sm8450):
    from stages.model.chat import ChatTokenizer

    work, _ = sm8450
    runner = HostRunner.from_export(work / "exported", luts=True, graph_dir=work / "quantized")
    tok = ChatTokenizer(work / "checkpoints" / "tiny")
    gen = runner.generate(tok.encode("Return the number of"), 24)
    text = tok.decode(gen.tokens)
    assert len(gen.tokens) == 24 and sum(c.isalpha() for c in text) > 10, text


def test_a_corrupt_or_incomplete_export_fails_cleanly(exported, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(exported, work, symlinks=True)
    graph = next((work / "exported").glob("decode_*part2*.onnx"))
    size = graph.stat().st_size
    graph.write_bytes(graph.read_bytes()[:1000])
    with pytest.raises(IntegrityError, match=f"has 1000 bytes, export wrote {size}; run `make export` again"):
        run_quantize(load_config("tiny"), work, work / "checkpoints" / "tiny")
    graph.unlink()
    with pytest.raises(QuantizeError, match="missing; run `make export` again"):
        run_quantize(load_config("tiny"), work, work / "checkpoints" / "tiny")
    assert not (work / "quantized").exists()
    assert not [p for p in work.iterdir() if p.name.startswith(".quantized")]


def test_quality_below_the_floor_fails_and_keeps_nothing(exported, tmp_path):
    """Floors above what w8a16 measures on the tiny model (0.984 / 0.0007): quantize measures, refuses
    in one line naming both figures, their floors and the fields, and leaves no quantized/ behind."""
    work = tmp_path / "work"
    shutil.copytree(exported, work, symlinks=True)
    cfg = load_config("tiny", {"min_top1_agreement_w8": "0.999", "max_kl_divergence_w8": "0.0001"})
    with pytest.raises(QuantizeError) as e:
        run_quantize(cfg, work, work / "checkpoints" / "tiny")
    line = str(e.value)
    assert "\n" not in line
    assert "below the quality floor for 8-bit weights on 508 held-out tokens" in line
    assert "top-1 agreement with the float graphs 0.98" in line
    assert "floor 0.999 (min_top1_agreement_w8)" in line
    assert "ceiling 0.0001 (max_kl_divergence_w8)" in line
    assert "G4V69_MIN_TOP1_AGREEMENT_W8" in line and "run `make quantize` again" in line
    assert not (work / "quantized").exists()
    assert not [p for p in work.iterdir() if p.name.startswith(".quantized")]


def test_calibration_files_in_jsonl_and_a_bad_one(exported, tmp_path):
    from stages.model.tiny_model import read_corpus
    from stages.quant.calibration import CalibrationError, read_text_files

    jsonl = tmp_path / "cal.jsonl"
    text = read_corpus("calibration")
    jsonl.write_text("\n".join(json.dumps({"text": text[i : i + 2000]}) for i in range(0, 20000, 2000)))
    assert "".join(read_text_files([jsonl])) == text[:20000]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(CalibrationError, match="bad.jsonl:1 is not a JSON object with a 'text' field"):
        read_text_files([bad])


def test_parquet_calibration_and_the_entropy_method(exported, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.model.tiny_model import read_corpus

    text = read_corpus("calibration")
    parquet = tmp_path / "cal.parquet"
    pq.write_table(pa.table({"text": [text[i : i + 4000] for i in range(0, 40000, 4000)]}), parquet)
    work = tmp_path / "work"
    shutil.copytree(exported, work, symlinks=True)
    # Entropy on 2 samples measures about 0.89 / 0.057 here, below the tiny preset's w8 floor (0.95 /
    # 0.01): this checks the method's plumbing, so the floors are set to what it gets.
    floors = {"min_top1_agreement_w8": 0.85, "max_kl_divergence_w8": 0.1}
    report = run_quantize(
        load_config("tiny", {"calibration_samples": 2, **floors}),
        work,
        work / "checkpoints" / "tiny",
        [parquet],
        method="entropy",
        stride=4,
    )
    cal = report["figures"]["calibration"]
    assert cal["files"] == [str(parquet)] and cal["method"] == "entropy" and cal["stride"] == 4
    for g in report["figures"]["graphs"]:
        calls = 2 * 128 // load_config("tiny").prefill_ar if g["name"].startswith("prefill") else 2 * 64
        assert g["calibration_calls"] == calls and g["calibration_stride"] == 4
    # Entropy clips outliers: a bit below MinMax on this model, still close to the float chain.
    assert report["figures"]["quality"]["float16"]["top1_agreement"] > 0.85


@pytest.mark.parametrize("method, stride", [("minmax", None), ("entropy", 4)])
def test_two_step_quantize_equals_onnxruntimes_one_call(exported, tmp_path, method, stride):
    """The stage calibrates, drops the calibrator and the float chain, then quantizes from the saved
    ranges (that is what keeps a full-size part under 16 GB); the graph must be the one onnxruntime's
    single quantize() call makes from the same feeds."""
    from onnxruntime.quantization import quantize

    from stages.model.chat import ChatTokenizer
    from stages.quant.calibration import load_texts, token_samples
    from stages.quantize.calibrate import (
        calibrate,
        calibrated_ranges,
        graph_quant_config,
        quantize_with_ranges,
    )

    cfg = load_config("tiny")
    tok = ChatTokenizer(exported / "checkpoints" / "tiny")
    samples = token_samples(load_texts(cfg, "calibration"), tok.encode, 2, 2, 128)
    lut = exported_luts(exported / "exported")
    results = []
    for two_step in (False, True):
        runner = HostRunner.from_export(exported / "exported", luts=True)
        ranges = calibrated_ranges(runner, samples)
        spec, src = runner.graphs["decode"][1]  # a part with KV overrides and a boundary tensor
        setup = graph_quant_config(
            cfg, runner, spec, src, ranges, lut, samples, 16, method=method, stride=stride
        )
        dest = tmp_path / f"{two_step}" / "graph.qdq.onnx"
        dest.parent.mkdir()
        if two_step:
            calibrate(src, setup.qcfg, tmp_path / "ranges.json", tmp_path)
            quantize_with_ranges(src, dest, setup.qcfg, tmp_path / "ranges.json")
        else:
            quantize(str(src), str(dest), setup.qcfg)
        assert setup.reader.count == 2 * 16
        results.append(sorted((p.name, p.read_bytes()) for p in dest.parent.iterdir()))
    assert results[0] == results[1]


@pytest.mark.parametrize("method, stride", [("minmax", None), ("entropy", 4)])
def test_one_chain_pass_calibrates_every_graph_as_graph_by_graph(exported, tmp_path, method, stride):
    """The stage calibrates all graphs of a kind in one pass of the float chain (issue 15: 4 part calls
    per token instead of 10 plus a pass for the KV ranges, for 4 parts). Every graph's ranges must be
    those of calibrating it alone, where the chain runs parts 1..k for it: same calls, same order."""
    import json

    from stages.model.chat import ChatTokenizer
    from stages.quant.calibration import load_texts, token_samples
    from stages.quantize.calibrate import (
        RangeCollector,
        calibrate,
        calibrate_kind,
        calibrated_ranges,
        graph_quant_config,
    )

    cfg = load_config("tiny")
    tok = ChatTokenizer(exported / "checkpoints" / "tiny")
    samples = token_samples(load_texts(cfg, "calibration"), tok.encode, 2, 2, 128)
    luts = exported_luts(exported / "exported")
    runner = HostRunner.from_export(exported / "exported", luts=True)
    reference_ranges = calibrated_ranges(runner, samples)
    collector = RangeCollector()
    for role in ("prefill", "decode"):
        shared = calibrate_kind(
            cfg,
            runner,
            role,
            samples,
            16,
            tmp_path / role,
            method=method,
            stride=stride,
            collector=collector if role == "prefill" else None,
        )
        assert set(shared) == {spec.name for spec, _ in runner.graphs[role]}
        for spec, src in runner.graphs[role]:
            setup = graph_quant_config(
                cfg, runner, spec, src, reference_ranges, luts, samples, 16, method=method, stride=stride
            )
            alone = tmp_path / f"alone-{spec.name}"
            alone.mkdir()
            calibrate(src, setup.qcfg, alone / "ranges.json", alone)
            ranges_file, calls, used_stride = shared[spec.name]
            assert calls == setup.reader.count and used_stride == setup.stride
            import shutil

            shutil.copy(ranges_file, f"/tmp/sh-{spec.name}.json")
            shutil.copy(alone / "ranges.json", f"/tmp/al-{spec.name}.json")
            assert json.loads(ranges_file.read_text()) == json.loads((alone / "ranges.json").read_text())
    assert collector.ranges() == reference_ranges


def test_folded_weights_keep_the_evaluation_figures(sm8450):
    """The quality evaluation folds every weight's DequantizeLinear once at load (issue 15: an hour
    of E2B evaluation was onnxruntime dequantizing int8 weights on every decode call).

    What must hold is in the name: the figures quantize reports (held-out top-1, KL, perplexity) are
    the same either way. The logits cannot be bit-equal, and their difference is not a constant: the
    two sessions run one QDQ graph by different kernels (onnxruntime's default path fuses Q/DQ pairs
    into integer QLinear* kernels; the folded one runs float MatMuls on the DQ's own floats), so an
    activation that lands on a rounding boundary goes to different neighbouring steps, and threaded
    reductions make which ones vary run to run (seen: 2 % to 20 % of rows touched, up to 2.4e-4 of
    the logits' range). A real regression (a weight folded with a lost scale or zero point, a wrong
    tensor) moves every row and the figures by orders of magnitude more."""
    import numpy as np

    from stages.quant.quality import chain_logits, compare_chains
    from stages.quantize.stage import heldout_samples

    work, _ = sm8450
    cfg = load_config("tiny")
    samples, decode_steps = heldout_samples(cfg, work / "checkpoints" / "tiny")
    fp = HostRunner.from_export(work / "exported", luts=True)
    runners = {
        fold: HostRunner.from_export(
            work / "exported", luts=True, graph_dir=work / "quantized", fold_weights=fold
        )
        for fold in (False, True)
    }
    figures = {fold: compare_chains(fp, r, samples, decode_steps) for fold, r in runners.items()}
    plain, folded = figures[False], figures[True]
    tokens = plain["tokens"]
    assert folded["tokens"] == tokens > 400
    assert abs(plain["top1_agreement"] - folded["top1_agreement"]) <= 2 / tokens  # two near-ties at most
    assert abs(plain["kl_divergence"] - folded["kl_divergence"]) <= 0.05 * plain["kl_divergence"] + 1e-4
    assert (
        abs(plain["perplexity_quantized"] - folded["perplexity_quantized"])
        <= 2e-3 * plain["perplexity_quantized"]
    )
    # Row by row: a greedy choice may differ only where its margin is within what rounding moved.
    for a, b in zip(
        *(chain_logits(runners[f], samples[:2], decode_steps) for f in (False, True)), strict=True
    ):
        assert a.shape == b.shape
        moved = np.abs(a - b).max(-1)
        top2 = np.sort(a, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * moved
        assert (a.argmax(-1) == b.argmax(-1))[clear].all()
        # a few activation steps, not a different computation (4x the largest difference seen)
        assert moved.max() <= 1e-3 * (a.max() - a.min())


def test_calibration_reads_external_data_graphs_from_its_copies(exported, tmp_path):
    """E2B parts keep their weights in an external-data file, and onnx refuses external data behind a
    symbolic link (or with several hard links): the quantize stage's scratch links once crashed the
    E2B bench at its first calibrator. The tiny graphs are single files, so this re-saves one the E2B
    way and calibrates it from the stage's scratch copy."""
    import onnx
    import pytest as _pytest

    from stages.model.graphs import copy_graph
    from stages.quantize.calibrate import new_calibrator, qnn_config

    src_model = onnx.load(str(next((exported / "exported").glob("prefill_*part1*.onnx"))))
    big = tmp_path / "exported" / "graph.onnx"
    big.parent.mkdir()
    onnx.save(src_model, str(big), save_as_external_data=True, location="graph.onnx.data", size_threshold=0)
    assert (big.parent / "graph.onnx.data").stat().st_size > 0
    copied = copy_graph(big, tmp_path / "scratch")
    assert sorted(p.name for p in copied.parent.iterdir()) == ["graph.onnx", "graph.onnx.data"]
    calibrator = new_calibrator(copied, qnn_config(copied, None), copied.parent)
    assert calibrator.infer_session is not None
    # The symbolic-link form is what onnx refuses.
    sym = tmp_path / "sym"
    sym.mkdir()
    for f in big.parent.iterdir():
        (sym / f.name).symlink_to(f)
    with _pytest.raises(Exception, match="symbolic link"):
        new_calibrator(sym / big.name, qnn_config(sym / big.name, None), sym)
