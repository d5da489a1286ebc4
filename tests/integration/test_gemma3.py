"""A toy Gemma 3 checkpoint written by transformers itself (Gemma3ForCausalLM.save_pretrained, a base
model: no chat template) through every stage: download (imported), export (parity with transformers'
own Gemma 3), quantize, compile, and bundle, which refuses it: QAIRT 2.51's Genie masks a
sliding-window cache wrongly in a dialog without a per-layer-embedding LUT (rules.sliding_mask_problems).
A bundle built past that check is the smallest reproduction of both Genie defects of that path, each
checked against the real Genie, so that a Genie that fixes them makes these tests say so.

The toy has what separates Gemma 3 from Gemma 4 in the graphs: RMSNorm weights stored minus one,
query_pre_attn_scalar unlike head_dim (the score scale), no value norm, no layer scalar, plain RoPE
on both kinds of layer with two bases, a window (8) shorter than the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.core.config import load_config
from stages.download import run_download
from stages.export import run_export
from stages.quant.runner import HostRunner

pytestmark = pytest.mark.slow

MODEL = "toy-gemma3"
TOY_GEMMA3 = {
    "vocab_size": 262,  # the built-in byte-level tokenizer's
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def write_toy_gemma3(dest: Path) -> Path:
    """The toy as transformers saves it, with random (non-trivial) weights, norms included, and the
    built-in tokenizer without its chat template (a base model)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from stages.model.builtin_models import write_tokenizer_files

    torch.manual_seed(3)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TOY_GEMMA3)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights stored minus one start at zero; spread them so the offset matters.
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 4.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(str(dest))
    write_tokenizer_files(dest, 1024)
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((dest / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dest


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A work folder with the toy downloaded (imported) as checkpoints/toy-gemma3."""
    work = tmp_path_factory.mktemp("gemma3")
    src = write_toy_gemma3(work / "saved")
    run_download(MODEL, "main", work / "checkpoints" / MODEL, from_dir=src)
    return work


def _cfg(**overrides):
    return load_config("tiny", {"model": MODEL, **overrides})


def test_geometry_names_every_tensor_transformers_has(toy):
    """The geometry's tensors are transformers' own parameter names and shapes, one for one."""
    from safetensors import safe_open

    from stages.model.checkpoint import Checkpoint

    ckpt = Checkpoint(toy / "checkpoints" / MODEL)
    geo = ckpt.geometry
    assert geo.family.name == "Gemma 3" and ckpt.prefix == "model."
    with safe_open(str(toy / "saved" / "model.safetensors"), "np") as f:
        stored = {k.removeprefix("model."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == {t.name: t.shape for t in geo.all_tensors()}
    assert geo.config["global_head_dim"] == 16 and geo.config["num_kv_shared_layers"] == 0


@pytest.fixture(scope="module")
def exported(toy) -> Path:
    run_export(_cfg(), toy, toy / "checkpoints" / MODEL)
    return toy / "exported"


def test_export_matches_transformers_gemma3(toy, exported):
    """Prefill in AR-4 chunks past the window, then AR-1 steps: the ONNX chain's logits are
    transformers' Gemma3ForCausalLM's at every position."""
    import torch

    from stages.model.reference import transformers_model

    hf = transformers_model(toy / "checkpoints" / MODEL)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    rng = np.random.default_rng(5)
    prompt = [2] + rng.integers(6, 262, 20).tolist()
    continuation = rng.integers(6, 262, 24).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + continuation])).logits[0].numpy()
    runner = HostRunner.from_export(exported)
    got = np.concatenate([runner.prefill(prompt)] + [runner.step([t]) for t in continuation])
    span = float(want.max() - want.min())
    assert float(np.abs(got - want).max()) < 1e-4 * span
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def compiled(toy, exported) -> Path:
    from stages.compile import run_compile
    from stages.quantize import run_quantize

    cfg = _cfg()
    run_quantize(cfg, toy, toy / "checkpoints" / MODEL)
    run_compile(cfg, toy)
    return toy


def test_the_bundle_stage_refuses_a_sliding_window_cache_genie_would_mask_wrongly(compiled, tmp_path):
    """Every stage up to the binaries runs; the bundle stage names the Genie defect and writes nothing."""
    import shutil

    from stages.runtimes.genie.bundle import BundleError, run_bundle

    work = tmp_path / "w"
    shutil.copytree(compiled, work)
    with pytest.raises(BundleError, match="masks the sliding-window cache group 'swa_'.*garbage"):
        run_bundle(_cfg(), work, work / "checkpoints" / MODEL)
    assert not (work / "genie_bundle").exists()


@pytest.fixture(scope="module")
def bundle(compiled) -> Path:
    """The bundle the stage refuses, built past that one check: the reproductions below run it."""
    from stages.runtimes.genie import bundle as stage

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage, "sliding_mask_problems", lambda dialog: [])
        stage.run_bundle(_cfg(), compiled, compiled / "checkpoints" / MODEL)
    return compiled / "genie_bundle"


def test_genie_masks_the_sliding_window_cache_by_token_index_without_a_per_layer_lut(bundle, tmp_path):
    """The smallest reproduction of rules.sliding_mask_problems: Genie's own dump of the first call's
    `swa_attention_mask` marks row r visible at cache columns 0..r (where the empty cache slots are),
    while the graph computes the prompt's own keys at columns W..W + r (W: the window's past slots),
    where the emulator, and Genie on a dialog with a per-layer LUT, put them. The full-attention mask
    of the same call is right."""
    from stages.planning.results import CompileResult, read_result
    from stages.runtimes.genie.emulator import GenieEmulator
    from stages.runtimes.genie.prompt import query_text
    from stages.runtimes.genie.real import GREEDY, Query, run_dialog

    work = bundle.parent
    emulator = GenieEmulator(bundle, read_result(work, "compile", CompileResult), "cpu", work / "quantized")
    text = query_text(bundle, "Hi")
    emulator.record = lambda step: step["index"] == 0
    emulator.prefill(emulator.query_ids(text))
    (graph, feeds, _), *_ = emulator.recorded[0].runs
    n = emulator.recorded[0].step["n_process"]
    dumps = tmp_path / "dumps"
    run = run_dialog(bundle, [Query(text, 1)], tmp_path / "genie.log", GREEDY, dump_dir=dumps)
    assert run.statuses == [0]
    folder = dumps / "text_primary" / graph.qnn_name
    masks = {}
    for name in ("swa_attention_mask", "attention_mask"):
        want = feeds[name]
        masks[name] = (np.fromfile(folder / f"000_in_{name}", dtype=want.dtype).reshape(want.shape), want)
    genie, ours = masks["attention_mask"]
    assert (genie[0, 0, :n] == ours[0, 0, :n]).all()
    genie, ours = masks["swa_attention_mask"]
    window = ours.shape[-1] - graph.ar
    for r in range(n):
        assert np.flatnonzero(ours[0, 0, r]).tolist() == list(range(window, window + r + 1))
        assert np.flatnonzero(genie[0, 0, r]).tolist() == list(range(r + 1)), f"row {r}: Genie fixed it?"


def test_genie_cannot_reset_a_dialog_without_a_per_layer_lut_after_the_window_wrapped(bundle, tmp_path):
    """The smallest reproduction of the reset failure on rules.swamask_path (QAIRT 2.51's
    libGenie.so): a prompt past the 8-token window, a few tokens, a reset, then any query fails;
    without the reset, or before the window wrapped, the same queries run. When a later Genie fixes
    it, this test says so."""
    from stages.runtimes.genie.real import GREEDY, Query, RealGenieError, run_dialog

    prompt = "Return the first element of a list."  # 36 tokens with BOS
    wrapped = [Query(prompt, 8, reset_before=True), Query(prompt, 3, reset_before=True)]
    # The failure is a negative status or, as often, the child process dying (exit -11): both count.
    try:
        run = run_dialog(bundle, wrapped, tmp_path / "reset.log", sampler=GREEDY)
        assert run.statuses[0] == 0 and run.statuses[1] < 0, run.statuses
    except RealGenieError as err:
        assert "ended without an answer" in str(err), err
    assert "SWAMASK" in (tmp_path / "reset.log").read_text(errors="replace")
    kept = run_dialog(bundle, [Query(prompt, 8), Query("Thanks.", 3)], tmp_path / "kept.log", sampler=GREEDY)
    short = [Query("Hi there", 3, reset_before=True), Query("Hi there", 3, reset_before=True)]
    early = run_dialog(bundle, short, tmp_path / "early.log", sampler=GREEDY)
    assert kept.statuses == [0, 0] and early.statuses == [0, 0]
