"""A toy Gemma 3 checkpoint written by transformers itself (Gemma3ForCausalLM.save_pretrained, a base
model: no chat template) through every stage: download (imported), export (parity with transformers'
own Gemma 3), quantize, compile, bundle and verify under the real Genie.

QAIRT 2.51's Genie runs a sliding-window cache group wrongly in a dialog without a per-layer-embedding
LUT (docs/facts.md §3 (l)), so a Gemma 3 graph keeps its sliding layers in the full-attention cache
group and applies the window itself (stages.model.contract.window_cache). The Genie-facing layout
Gemma 4 uses (a window-sized `swa_` group), built here past the bundle stage's refusal, is the
smallest reproduction of both Genie defects of that path, so that a Genie that fixes them makes these
tests say so.

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


def _build(work: Path, stages: tuple[str, ...] = ("quantize", "compile", "bundle")) -> Path:
    from stages.compile import run_compile
    from stages.quantize import run_quantize
    from stages.runtimes.genie.bundle import run_bundle

    cfg, ckpt = _cfg(), work / "checkpoints" / MODEL
    run = {
        "export": lambda: run_export(cfg, work, ckpt),
        "quantize": lambda: run_quantize(cfg, work, ckpt),
        "compile": lambda: run_compile(cfg, work),
        "bundle": lambda: run_bundle(cfg, work, ckpt),
    }
    for stage in stages:
        run[stage]()
    return work / "genie_bundle"


@pytest.fixture(scope="module")
def bundle(toy, exported) -> Path:
    return _build(toy)


def test_the_sliding_layers_share_the_full_cache_group(bundle):
    """One cache group, `past_`, with no sliding-window longcontext: every cache spans the context and
    no graph reads a `swa_` cache or mask (the window is in the graph), so Genie's SWAMASK defects
    cannot touch it; the bundle stage's rule finds nothing."""
    from stages.runtimes.genie.files import GENIE_CONFIG
    from stages.runtimes.genie.rules import sliding_mask_problems, swamask_path

    dialog = json.loads((bundle / GENIE_CONFIG).read_text())["dialog"]
    groups = dialog["engine"]["cache-groups"]
    assert [(g["prefix"], g["attention-mask-tensor-name"], "longcontext" in g) for g in groups] == [
        ("past_", "attention_mask", False)
    ]
    assert swamask_path(dialog) and sliding_mask_problems(dialog) == []
    from stages.planning.results import CompileResult, read_result

    io = read_result(bundle.parent, "compile", CompileResult).graph_io
    inputs = {name for graph in io.values() for name in graph["inputs"]}
    assert "swa_attention_mask" not in inputs and not any(n.startswith("swa_key") for n in inputs)
    assert {f"past_key_{i}_h0_in" for i in range(6)} <= inputs


def test_verify_holds_the_real_genie_to_the_host_and_transformers(bundle):
    """make verify on the toy: every real-Genie case runs (a prompt past the 8-token window, the
    token limit, a second query, the own sampler to a full context) and passes its comparison."""
    from stages.runtimes.genie.verify import run_verify

    work = bundle.parent
    real = run_verify(_cfg(), work, work / "checkpoints" / MODEL, "Return the first element of a list.")[
        "figures"
    ]["real_genie"]
    assert real["ran"] and real["not_run"] == {}
    verdicts = {(c["case"], c["against"]): c["verdict"] for c in real["comparisons"]}
    assert set(verdicts.values()) == {"passed"} and len(verdicts) >= 5, verdicts


def test_verify_real_genie_full_runs_every_case_on_the_cpu_engine(bundle):
    """VERIFY_REAL_GENIE=full, the bench's choice for the sizes whose verify runs the short query
    alone: every case runs and is compared, with the emulator on the ctx-bins' compiler inputs, at
    the slow sizes' token count (the own sampler from a prompt near a full context there, which it
    meets). The short query's ids
    are read from Genie's own dumps and equal its text's."""
    from stages.model.chat import ChatTokenizer
    from stages.runtimes.genie.verify import SLOW_QUERY_TOKENS, run_verify

    work = bundle.parent
    checkpoint = work / "checkpoints" / MODEL
    short = run_verify(_cfg(), work, checkpoint, "Hi", engine="cpu")["figures"]["real_genie"]
    assert set(short["not_run"]) == {"long", "crossing", "token limit", "second query", "own sampler"}
    assert short["dumps_unread"] == {} and len(short["ids_from_dumps"]["chat"]) == SLOW_QUERY_TOKENS
    tok = ChatTokenizer(work / "genie_bundle")
    assert tok.decode(short["ids_from_dumps"]["chat"]) == short["answers"]["chat"]
    assert {(c["case"], c["verdict"], c["asked"]) for c in short["comparisons"]} >= {
        ("chat", "passed", SLOW_QUERY_TOKENS)
    }
    real = run_verify(_cfg(), work, checkpoint, "Hi", engine="cpu", real_genie_all_cases=True)["figures"][
        "real_genie"
    ]
    cases = {"chat", "long", "crossing", "token limit", "own sampler"}
    assert real["not_run"] == {} and set(real["statuses"]) >= cases
    assert {c["case"] for c in real["comparisons"]} >= cases
    assert {c["verdict"] for c in real["comparisons"]} == {"passed"}
    genie = json.loads((work / "genie_bundle" / "genie_config.json").read_text())
    context = genie["dialog"]["context"]["size"]
    assert context - 2 * SLOW_QUERY_TOKENS <= real["own_sampler_prompt_tokens"] <= context - SLOW_QUERY_TOKENS
    own = next(c for c in real["comparisons"] if c["case"] == "own sampler")
    assert real["statuses"]["own sampler"] > 0 and "ended by a full context" in own["why"], own


def test_the_real_genie_feeds_every_call_as_the_emulator_across_the_window(bundle, tmp_path):
    """Attention barely moves a random toy's tokens, so the masks are held directly: every input of
    every call (the full mask the window is taken from, the caches past the window) equals Genie's
    own dumps."""
    from genie_dumps import compare_feeds_with_dumps

    from stages.planning.results import CompileResult, read_result
    from stages.runtimes.genie.emulator import GenieEmulator
    from stages.runtimes.genie.prompt import query_text
    from stages.runtimes.genie.real import GREEDY, Query, run_dialog

    work = bundle.parent
    emulator = GenieEmulator(bundle, read_result(work, "compile", CompileResult), "htp", work / "quantized")
    text = query_text(bundle, "Return the first element of a list.")
    emulator.record = lambda step: True
    emulated = emulator.generate(emulator.query_ids(text), 8, greedy=True)
    assert len(emulated.prompt_ids) > 2 * TOY_GEMMA3["sliding_window"]
    dumps = tmp_path / "dumps"
    run = run_dialog(bundle, [Query(text, 8)], tmp_path / "genie.log", GREEDY, dump_dir=dumps)
    assert run.statuses == [0]
    assert compare_feeds_with_dumps(emulator, dumps) >= 10 * len(emulator.recorded)


def test_a_dialog_resets_after_the_window_wrapped(bundle, tmp_path):
    """What failed on the `swa_` layout (below) runs on this one: a prompt past the window, a reset,
    the same prompt again, answered as the first time."""
    from stages.runtimes.genie.real import GREEDY, Query, run_dialog

    prompt = "Return the first element of a list."
    run = run_dialog(
        bundle,
        [Query(prompt, 8, reset_before=True), Query(prompt, 8, reset_before=True)],
        tmp_path / "reset.log",
        sampler=GREEDY,
    )
    assert run.statuses == [0, 0] and run.answers[0] == run.answers[1]


# ---- the `swa_` layout, which QAIRT 2.51's Genie runs wrongly without a per-layer LUT ----
@pytest.fixture(scope="module")
def window_work(toy, tmp_path_factory) -> Path:
    """The toy exported, quantized and compiled with Gemma 4's window-sized `swa_` caches."""
    import shutil

    from stages.model import contract

    work = tmp_path_factory.mktemp("gemma3-swa")
    shutil.copytree(toy / "checkpoints", work / "checkpoints")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contract, "window_cache", lambda geo: True)
        _build(work, ("export", "quantize", "compile"))
    return work


def test_the_bundle_stage_refuses_a_sliding_window_cache_genie_would_mask_wrongly(window_work, tmp_path):
    """Given graphs with a `swa_` cache and no per-layer LUT, the bundle stage names the Genie defect
    and writes nothing."""
    import shutil

    from stages.runtimes.genie.bundle import BundleError

    work = tmp_path / "w"
    shutil.copytree(window_work, work)
    with pytest.raises(BundleError, match="masks the sliding-window cache group 'swa_'.*garbage"):
        _build(work, ("bundle",))
    assert not (work / "genie_bundle").exists()


@pytest.fixture(scope="module")
def window_bundle(window_work) -> Path:
    """The bundle the stage refuses, built past that one check: the reproductions below run it."""
    from stages.model import contract
    from stages.runtimes.genie import bundle as stage

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contract, "window_cache", lambda geo: True)
        patch.setattr(stage, "sliding_mask_problems", lambda dialog: [])
        return _build(window_work, ("bundle",))


def test_genie_masks_the_sliding_window_cache_by_token_index_without_a_per_layer_lut(window_bundle, tmp_path):
    """The smallest reproduction of rules.sliding_mask_problems: Genie's own dump of the first call's
    `swa_attention_mask` marks row r visible at cache columns 0..r (where the empty cache slots are),
    while the graph computes the prompt's own keys at columns W..W + r (W: the window's past slots),
    where the emulator, and Genie on a dialog with a per-layer LUT, put them. The full-attention mask
    of the same call is right."""
    from stages.planning.results import CompileResult, read_result
    from stages.runtimes.genie.emulator import GenieEmulator
    from stages.runtimes.genie.prompt import query_text
    from stages.runtimes.genie.real import GREEDY, Query, run_dialog

    work = window_bundle.parent
    bundle = window_bundle
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


def test_genie_cannot_reset_without_a_per_layer_lut_after_the_window_wrapped(window_bundle, tmp_path):
    """The smallest reproduction of the reset failure on rules.swamask_path (QAIRT 2.51's
    libGenie.so): a prompt past the 8-token window, a few tokens, a reset, then any query fails;
    without the reset, or before the window wrapped, the same queries run. When a later Genie fixes
    it, this test says so. The failure is intermittent (2026-12-07: most runs fail, one in several
    ran both queries), so it gets three tries and is skipped, saying so, when none fails."""
    from stages.runtimes.genie.real import GREEDY, Query, RealGenieError, run_dialog

    bundle = window_bundle
    prompt = "Return the first element of a list."  # 36 tokens with BOS
    wrapped = [Query(prompt, 8, reset_before=True), Query(prompt, 3, reset_before=True)]
    failed = None
    for attempt in range(3):
        log = tmp_path / f"reset{attempt}.log"
        # The failure is a negative status or, as often, the child process dying (exit -11).
        try:
            run = run_dialog(bundle, wrapped, log, sampler=GREEDY)
            assert run.statuses[0] == 0, run.statuses
            if run.statuses[1] < 0:
                failed = log
        except RealGenieError as err:
            assert "ended without an answer" in str(err), err
            failed = log
        if failed:
            break
    if failed is None:
        pytest.skip("Genie's reset defect did not show in 3 tries (intermittent, docs/facts.md §3 (l))")
    assert "SWAMASK" in failed.read_text(errors="replace")
    kept = run_dialog(bundle, [Query(prompt, 8), Query("Thanks.", 3)], tmp_path / "kept.log", sampler=GREEDY)
    short = [Query("Hi there", 3, reset_before=True), Query("Hi there", 3, reset_before=True)]
    early = run_dialog(bundle, short, tmp_path / "early.log", sampler=GREEDY)
    assert kept.statuses == [0, 0] and early.statuses == [0, 0]
