"""The tiny Gemma 4 through download and export, then the FP32 ONNX shard chain, driven by the host
runner exactly as the phone drives the binaries, against transformers' Gemma4ForCausalLM.

The prompt is longer than one prefill chunk (AR-4) and than the sliding window (8); decoding runs
63 AR-1 steps, past the window many times over, through KV-shared layers whose donors sit in other
parts when the model is split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.core.config import load_config
from stages.download import run_download
from stages.export import ExportError, run_export
from stages.model.checkpoint import Checkpoint
from stages.quant.runner import HostRunner

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 41  # three prefill chunks of 16, the last one padded
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("tiny-ckpt")
    out = work / "checkpoints" / "tiny"
    run_download("tiny", "main", out)
    return out


def _workdir_with(checkpoint: Path, tmp: Path) -> Path:
    work = tmp
    (work / "checkpoints").mkdir(parents=True)
    (work / "checkpoints" / "tiny").symlink_to(checkpoint)
    return work


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    import torch

    from stages.model.reference import transformers_model

    torch.manual_seed(0)
    return transformers_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def reference(hf_model):
    """A prompt and a random continuation, transformers' logits at each of their positions, and
    transformers' own greedy generation from the prompt."""
    import torch

    rng = np.random.default_rng(7)
    prompt = [2] + rng.integers(6, 262, PROMPT_TOKENS - 1).tolist()
    continuation = rng.integers(6, 262, NEW_TOKENS - 1).tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + continuation])).logits[0].numpy()
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
    return prompt, continuation, logits, out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"{n}-shards")
def export(request, tiny_checkpoint, tmp_path_factory):
    work = _workdir_with(tiny_checkpoint, tmp_path_factory.mktemp(f"export-{request.param}"))
    cfg = load_config("tiny", {"num_shards": request.param})
    report = run_export(cfg, work, work / "checkpoints" / "tiny")
    return work / "exported", report


def test_onnx_chain_logits_match_transformers(export, reference):
    """Prefill in AR-4 chunks, then 63 AR-1 decode steps fed a random continuation."""
    export_dir, _ = export
    prompt, continuation, hf_logits, _ = reference
    runner = HostRunner.from_export(export_dir)
    got = [runner.prefill(prompt)]
    got += [runner.step([tok]) for tok in continuation]
    got = np.concatenate(got)
    assert runner.graphs["decode"][0][0].ar == 1 and got.shape == hf_logits.shape
    span = float(hf_logits.max() - hf_logits.min())
    assert float(np.abs(got - hf_logits).max()) < 1e-4 * span
    # Top-1 at every position, on varied inputs (the random tiny model's own greedy path is monotonous).
    assert (got.argmax(-1) == hf_logits.argmax(-1)).all()
    assert len(set(hf_logits.argmax(-1).tolist())) > 10


def test_onnx_chain_greedy_tokens_match_generate(export, reference):
    export_dir, _ = export
    prompt, _, _, hf_tokens = reference
    gen = HostRunner.from_export(export_dir).generate(prompt, NEW_TOKENS)
    assert gen.tokens == hf_tokens and gen.stopped_by == "max_new_tokens"


def test_report_records_graphs_parts_and_luts(export):
    export_dir, report = export
    fig = report["figures"]
    n = report["options"]["num_shards"]
    assert len(fig["parts"]) == n and len(fig["graphs"]) == 2 * n
    assert sorted(g["onnx"] for g in fig["graphs"]) == sorted(p.name for p in export_dir.glob("*.onnx"))
    layers = [layer for p in fig["parts"] for layer in p["layers"]]
    assert layers == list(range(6))
    hashed = {o["path"] for o in report["outputs"]}
    assert {g["onnx"] for g in fig["graphs"]} <= hashed and "luts/embedding_ufixed16.bin" in hashed
    assert all(g["onnx_vs_torch_rel_error"] < 1e-4 for g in fig["graphs"])
    assert report["peak_rss_bytes"] > 0 and report["wall_s"] > 0


def test_onnx_graphs_follow_the_contract(export):
    import onnx

    export_dir, report = export
    for g in report["figures"]["graphs"]:
        model = onnx.load(str(export_dir / g["onnx"]))
        spec = g["spec"]
        assert model.opset_import[0].version >= 21
        io = [(v.name, [d.dim_value for d in v.type.tensor_type.shape.dim]) for v in model.graph.input]
        assert io == [(t["name"], t["shape"]) for t in spec["inputs"]]
        assert [v.name for v in model.graph.output] == [t["name"] for t in spec["outputs"]]
        ops = {n.op_type for n in model.graph.node}
        assert {"RMSNormalization", "Gelu"} <= ops  # fused, not x^2 / x^3 chains
        assert "Pow" not in ops and "Shape" not in ops  # static shapes only


def test_luts_dequantize_within_half_a_step(export, tiny_checkpoint):
    from stages.quant.runner import CheckpointEmbedder

    export_dir, report = export
    lut = HostRunner.from_export(export_dir, luts=True).embed
    exact = CheckpointEmbedder(Checkpoint(tiny_checkpoint))
    ids = np.arange(262)
    (emb_q, ple_q), (emb, ple) = lut(ids), exact(ids)
    luts = report["figures"]["luts"]
    assert luts["embedding"]["bits"] == 16 and luts["per_layer_embedding"]["bits"] == 8
    assert np.abs(emb_q - emb).max() <= luts["embedding"]["scale"] * 0.5 + 1e-6
    assert np.abs(ple_q - ple).max() <= luts["per_layer_embedding"]["scale"] * 0.5 + 1e-6
    size = (export_dir / luts["per_layer_embedding"]["path"]).stat().st_size
    assert size == 262 * 6 * 8  # one byte per entry


def test_generate_with_luts_and_chat_template(export, tiny_checkpoint):
    from click.testing import CliRunner

    from stages.cli import main

    export_dir, _ = export
    work = export_dir.parent
    r = CliRunner().invoke(
        main,
        [
            "--workdir",
            str(work),
            "--preset",
            "tiny",
            "generate",
            "--prompt",
            "Hi",
            "--luts",
            "--json",
            "--max-new-tokens",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # <bos><|turn>user\nHi<turn|>\n<|turn>model\n in the byte-level tokenizer.
    assert out["prompt_tokens"] == 1 + 1 + len("user\nHi") + 1 + 1 + 1 + len("model\n")
    assert 1 <= out["generated_tokens"] <= 5


def _failing_export(work: Path, cfg_overrides: dict, match: str) -> None:
    with pytest.raises(ExportError, match=match):
        run_export(load_config("tiny", cfg_overrides), work, work / "checkpoints" / "tiny")
    assert not (work / "exported").exists()
    assert not [p for p in work.iterdir() if p.name.startswith(".exported")]


def test_more_shards_than_layers_fails_cleanly(tiny_checkpoint, tmp_path):
    work = _workdir_with(tiny_checkpoint, tmp_path)
    _failing_export(work, {"num_shards": 7}, "num_shards=7 exceeds the model's 6 decoder layers")


def test_context_too_small_for_the_window_fails_cleanly(tiny_checkpoint, tmp_path):
    work = _workdir_with(tiny_checkpoint, tmp_path)
    _failing_export(work, {"max_context": 20, "prefill_ar": 16}, "raise max_context to at least 24")


def test_missing_tensor_and_foreign_config_fail_cleanly(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.core.report import IntegrityError, describe_inputs, write_report
    from stages.model.checkpoint import CheckpointError

    work = tmp_path
    ckpt = work / "checkpoints" / "tiny"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.language_model.layers.3.mlp.up_proj.weight"]
    save_file(weights, ckpt / "model.safetensors")
    # Edited after download: the hash check names the file before anything reads it.
    with pytest.raises(IntegrityError, match=r"model\.safetensors has \d+ bytes, download wrote"):
        run_export(load_config("tiny"), work, ckpt)

    def rerecord() -> None:
        """Record the edited files as the download's own (a report that agrees with bad files)."""
        report = json.loads((ckpt / "report.json").read_text())
        files = [p for p in ckpt.iterdir() if p.name != "report.json"]
        report["outputs"] = describe_inputs(files, ckpt)
        write_report(ckpt, report)

    rerecord()
    _failing_export(work, {}, "layers.3.mlp.up_proj.weight")

    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(IntegrityError, match="config.json has"):
        run_export(load_config("tiny"), work, ckpt)
    rerecord()
    with pytest.raises(CheckpointError, match="config.json.*not a family this pipeline builds"):
        run_export(load_config("tiny"), work, ckpt)
    assert not (work / "exported").exists()


def test_export_without_download_says_what_to_do(tmp_path):
    _failing_export_dir = tmp_path / "checkpoints" / "tiny"
    _failing_export_dir.mkdir(parents=True)
    with pytest.raises(ExportError, match="run `make download` first"):
        run_export(load_config("tiny"), tmp_path, _failing_export_dir)


def test_weights_keep_their_checkpoint_names(export):
    import onnx

    export_dir, report = export
    for g in report["figures"]["graphs"]:
        model = onnx.load(str(export_dir / g["onnx"]), load_external_data=False)
        inits = {i.name for i in model.graph.initializer}
        matmul_weights = {
            n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
        }
        assert matmul_weights and all(w.endswith(".weight") for w in matmul_weights), matmul_weights
        if g["spec"]["part"] == g["spec"]["num_parts"]:
            assert "lm_head.weight" in matmul_weights
