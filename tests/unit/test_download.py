"""The download stage: built-in checkpoints, validation, --from, and the Hub path against test doubles."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import TINY_GEMMA4_CONFIG, run

from stages import download as dl
from stages.core.report import read_report, sha256_file
from stages.model import builtin_models as bm
from stages.model import checkpoint as ck
from stages.model.geometry import E2B_TEXT_CONFIG, TINY_TEXT_CONFIG, geometry_from_config

REPO_ID = "google/gemma-4-E2B-it"
RESOLVED_SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_canary_download_4711"
EXPECTED_FILES = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The built-in tiny checkpoint, written once; tests that damage it work on a copy."""
    d = tmp_path_factory.mktemp("tiny")
    dl.write_builtin_checkpoint("tiny", d)
    return d


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path) -> Path:
    dest = tmp_path / "snapshot"
    shutil.copytree(tiny_dir, dest)
    return dest


def load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def save_tensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- built-in checkpoints ----


def test_tiny_is_byte_identical_across_runs(tiny_dir, tmp_path):
    again = tmp_path / "again"
    dl.write_builtin_checkpoint("tiny", again)
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == EXPECTED_FILES
    assert sorted(p.name for p in again.iterdir()) == names
    for name in names:
        assert sha256_file(tiny_dir / name) == sha256_file(again / name), name


def test_another_seed_gives_other_weights(tiny_dir, tmp_path):
    dl.write_builtin_checkpoint("tiny", tmp_path, seed=1)
    assert sha256_file(tmp_path / "model.safetensors") != sha256_file(tiny_dir / "model.safetensors")
    assert sha256_file(tmp_path / "tokenizer.json") == sha256_file(tiny_dir / "tokenizer.json")


def test_tiny_has_the_real_snapshot_layout(tiny_dir):
    import torch
    from safetensors import safe_open

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "gemma4"
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "gemma4_text"
    assert config["text_config"]["vocab_size"] == TINY_TEXT_CONFIG["vocab_size"] == 262

    geo = geometry_from_config(config)
    expected = {bm.TEXT_PREFIX + t.name: t.shape for t in geo.all_tensors()}
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    assert keys == set(expected) | {bm.NON_TEXT_TENSOR[0]}
    assert not any("lm_head" in k for k in keys)  # tied to embed_tokens

    tensors = load_tensors(tiny_dir / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(tuple(tensors[k].shape) == shape for k, shape in expected.items())
    scalars = torch.cat([v.float() for k, v in tensors.items() if k.endswith("layer_scalar")])
    assert len(scalars) == 6 and scalars.min() >= 0.5 and scalars.max() <= 1.5 and scalars.std() > 0.1
    norm = tensors[bm.TEXT_PREFIX + "norm.weight"].float()
    assert 0.8 < norm.mean() < 1.2 and norm.std() > 0.15
    q = tensors[bm.TEXT_PREFIX + "layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std() - 1 / math.sqrt(q.shape[1])) < 0.02


@pytest.mark.slow
def test_tiny_runs_in_transformers_through_both_loaders(tiny_dir):
    """The text model from the state dict (prefix model.language_model. -> model.), and the real
    multimodal loader from the folder: both give the same finite, spread-out logits."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text_config = json.loads((tiny_dir / "config.json").read_text())["text_config"]
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text_config)).eval()
    state = {
        "model." + k[len(bm.TEXT_PREFIX) :]: v.float()
        for k, v in load_tensors(tiny_dir / "model.safetensors").items()
        if k.startswith(bm.TEXT_PREFIX)
    }
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([[2, 4, 123, 121, 107, 120, 16, 110, 111, 5, 16, 4, 115, 117, 106]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 262)
    assert torch.isfinite(logits).all() and logits.std() > 1.0

    full = Gemma4ForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(full(ids).logits, logits)


def test_tokenizer_is_byte_level_with_the_special_ids(tiny_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 262
    for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]):
        assert tok.token_to_id(token) == i
    text = "Héllo wörld, 日本語 ✓ <tab>\there\n"
    ids = tok.encode(text).ids
    assert ids == [bm.BOS_ID] + [bm.BYTE_OFFSET + b for b in text.encode()]
    assert tok.decode(ids, skip_special_tokens=True) == text
    turn = tok.encode("<|turn>user\nhi<turn|>", add_special_tokens=False).ids
    assert turn[0] == bm.TURN_START_ID and turn[-1] == bm.TURN_END_ID and len(turn) == 2 + 7


def test_autotokenizer_loads_offline_and_renders_the_gemma4_chat(tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Capital of France?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n"
        "<|turn>user\nCapital of France?<turn|>\n<|turn>model\n"
    )
    plain = tok.apply_chat_template(messages[1:2], tokenize=False)
    assert plain == "<bos><|turn>user\nHi<turn|>\n"
    ids = tok.apply_chat_template(messages[1:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [bm.BOS_ID, bm.TURN_START_ID] and ids.count(bm.BOS_ID) == 1
    with pytest.raises(Exception, match="roles must be system, user or assistant; got: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_template_files_agree_and_keep_the_adjacent_literals(tiny_dir):
    template = (tiny_dir / "chat_template.jinja").read_text()
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    # The quirk of the real Gemma 4 template that the bundle stage must fix for minja.
    assert re.search(r"raise_exception\('[^']*' '", template)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0}


def test_sharded_checkpoint_has_an_index_and_the_same_tensors(tmp_path):
    text_config = TINY_GEMMA4_CONFIG["text_config"]
    one, many = tmp_path / "one", tmp_path / "many"
    bm.write_random_checkpoint(text_config, one, seed=3, max_shard_bytes=10**9)
    bm.write_random_checkpoint(text_config, many, seed=3, max_shard_bytes=40_000)
    shards = sorted(p.name for p in many.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (one / ck.INDEX_NAME).exists()
    index = json.loads((many / ck.INDEX_NAME).read_text())
    single = load_tensors(one / "model.safetensors")
    assert set(index["weight_map"]) == set(single)
    total = 0
    for name in shards:
        part = load_tensors(many / name)
        assert all(index["weight_map"][k] == name for k in part)
        for k, v in part.items():
            assert v.equal(single[k]), k  # per-tensor seeds: sharding does not change values
            total += v.numel() * 2
        # Only a tensor bigger than the limit gets a file over it, alone.
        assert sum(v.numel() * 2 for v in part.values()) <= 40_000 or len(part) == 1
    assert index["metadata"]["total_size"] == total
    summary = ck.validate_checkpoint(many)
    assert summary.text_params == geometry_from_config(text_config).total_params
    assert summary.files == n + 6 and summary.other_tensors == 1  # + index, config, 4 tokenizer files


def test_big_tensors_are_made_in_row_chunks(monkeypatch):
    import torch

    full = bm.random_tensor("layers.0.mlp.up_proj.weight", (300, 64), TINY_TEXT_CONFIG, seed=0)
    monkeypatch.setattr(bm, "CHUNK_ELEMENTS", 1000)
    chunked = bm.random_tensor("layers.0.mlp.up_proj.weight", (300, 64), TINY_TEXT_CONFIG, seed=0)
    assert chunked.dtype == torch.bfloat16 and chunked.shape == (300, 64)
    assert abs(chunked.float().std() - 1 / 8) < 0.01 and abs(full.float().std() - 1 / 8) < 0.01
    again = bm.random_tensor("layers.0.mlp.up_proj.weight", (300, 64), TINY_TEXT_CONFIG, seed=0)
    assert again.equal(chunked)


def test_e2b_random_shard_plan_stays_under_the_limit_except_the_ple_table():
    geo = geometry_from_config(E2B_TEXT_CONFIG)
    tensors = [(t.name, t.shape) for t in geo.all_tensors()]
    limit = bm.DEFAULT_MAX_SHARD_BYTES
    shards = bm._plan_shards(tensors, limit)
    sizes = [sum(math.prod(tensors[i][1]) * 2 for i in s) for s in shards]
    big = [tensors[s[0]][0] for s, size in zip(shards, sizes, strict=True) if size > limit]
    assert big == ["embed_tokens_per_layer.weight"] and 4 <= len(shards) <= 8
    assert sum(sizes) == geo.total_params * 2 and 9e9 < sum(sizes) < 9.5e9


def test_unknown_builtin_is_refused(tmp_path):
    with pytest.raises(dl.DownloadError, match="built-in models: tiny, e2b-random"):
        dl.write_builtin_checkpoint("huge", tmp_path)


# ---- validation ----


def test_validation_summary_of_tiny(tiny_dir):
    s = ck.validate_checkpoint(tiny_dir)
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    assert (s.files, s.text_tensors, s.text_params) == (6, len(geo.all_tensors()), geo.total_params)
    assert s.other_tensors == 1 and s.extra_text_tensors == 0 and s.dtypes == ("BF16",)
    assert s.text_prefix == bm.TEXT_PREFIX


def test_missing_tensor_is_named(tiny_copy):
    tensors = load_tensors(tiny_copy / "model.safetensors")
    del tensors[bm.TEXT_PREFIX + "layers.2.self_attn.k_proj.weight"]
    save_tensors(tensors, tiny_copy / "model.safetensors")
    expected = r"1 language-model tensors missing .*layers\.2\.self_attn\.k_proj"
    with pytest.raises(ck.CheckpointError, match=expected):
        ck.validate_checkpoint(tiny_copy)


def test_wrong_shape_is_named_with_both_shapes(tiny_copy):
    import torch

    tensors = load_tensors(tiny_copy / "model.safetensors")
    tensors[bm.TEXT_PREFIX + "norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    save_tensors(tensors, tiny_copy / "model.safetensors")
    expected = r"model\.language_model\.norm\.weight \[32\] \(config says \[64\]\)"
    with pytest.raises(ck.CheckpointError, match=expected):
        ck.validate_checkpoint(tiny_copy)


def test_a_text_only_save_under_model_is_accepted(tiny_copy):
    tensors = load_tensors(tiny_copy / "model.safetensors")
    text_only = {
        "model." + k[len(bm.TEXT_PREFIX) :]: v for k, v in tensors.items() if k.startswith(bm.TEXT_PREFIX)
    }
    save_tensors(text_only, tiny_copy / "model.safetensors")
    summary = ck.validate_checkpoint(tiny_copy)
    assert summary.text_prefix == "model." and summary.other_tensors == 0 and summary.extra_text_tensors == 0


def test_extra_text_tensors_are_accepted_and_listed(tiny_copy):
    """The published E2B-it keeps K/V weights of KV-shared layers, which transformers drops silently;
    a tensor Gemma 4 has no place for at all it drops with a warning. Both are accepted and listed."""
    import torch

    tensors = load_tensors(tiny_copy / "model.safetensors")
    tensors[bm.TEXT_PREFIX + "layers.5.self_attn.k_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    tensors[bm.TEXT_PREFIX + "layers.1.self_attn.extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    save_tensors(tensors, tiny_copy / "model.safetensors")
    summary = ck.validate_checkpoint(tiny_copy)
    assert summary.extra_text_tensors == 2
    assert summary.ignored_tensors == (bm.TEXT_PREFIX + "layers.5.self_attn.k_proj.weight",)
    assert summary.unused_tensors == (bm.TEXT_PREFIX + "layers.1.self_attn.extra.weight",)


NOT_GEMMA = "is not a Gemma 4 or Gemma 3 config"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}, NOT_GEMMA),
        ({"model_type": "gemma4", "text_config": {"model_type": "gemma3_text"}}, NOT_GEMMA),
        ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}, "lacks 'hidden_size'"),
    ],
)
def test_a_config_that_is_not_gemma4_is_refused_naming_the_file(tiny_copy, config, message):
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ck.CheckpointError, match=message) as e:
        ck.validate_checkpoint(tiny_copy)
    assert str(tiny_copy / "config.json") in str(e.value)


def test_broken_json_and_missing_files_are_named(tiny_copy):
    (tiny_copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="tokenizer_config.json is not valid JSON"):
        ck.validate_checkpoint(tiny_copy)
    (tiny_copy / "tokenizer.json").unlink()
    with pytest.raises(ck.CheckpointError, match="tokenizer.json missing from"):
        ck.validate_checkpoint(tiny_copy)


def test_index_naming_an_absent_shard_is_refused(tiny_copy):
    weight_map = {"x": "model.safetensors", "y": "model-00002-of-00002.safetensors"}
    index = {"metadata": {}, "weight_map": weight_map}
    (tiny_copy / ck.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ck.CheckpointError, match="names model-00002-of-00002.safetensors, missing"):
        ck.validate_checkpoint(tiny_copy)


# ---- the CLI: built-in and --from ----


def test_cli_download_tiny_writes_a_complete_folder(g4v69, tmp_path):
    work = tmp_path / "w"
    r = g4v69("--workdir", str(work), "--model", "tiny", "download")
    assert r.exit_code == 0, r.output
    out = work / "checkpoints" / "tiny"
    assert sorted(p.name for p in out.iterdir()) == sorted([*EXPECTED_FILES, "report.json"])
    assert [p.name for p in (work / "checkpoints").iterdir()] == ["tiny"]  # no temp folder left
    report = read_report(out)
    assert report["stage"] == "download" and report["options"]["model"] == "tiny"
    fig = report["figures"]
    assert fig["source"] == "builtin" and fig["seed"] == 0 and fig["files"] == 6
    assert fig["text_params"] == geometry_from_config(TINY_TEXT_CONFIG).total_params
    assert {o["path"] for o in report["outputs"]} == set(EXPECTED_FILES)


def test_cli_from_imports_a_snapshot_by_hard_links(g4v69, tiny_copy, tmp_path):
    (tiny_copy / "README.md").write_text("not part of a checkpoint")
    work = tmp_path / "w"
    r = g4v69("--workdir", str(work), "--model", REPO_ID, "download", "--from", str(tiny_copy))
    assert r.exit_code == 0, r.output
    out = work / "checkpoints" / "gemma-4-e2b-it"
    assert sorted(p.name for p in out.iterdir()) == sorted([*EXPECTED_FILES, "report.json"])
    assert (out / "model.safetensors").stat().st_ino == (tiny_copy / "model.safetensors").stat().st_ino
    fig = read_report(out)["figures"]
    assert fig["source"] == "from" and fig["from"] == str(tiny_copy)


def test_cli_from_a_truncated_file_fails_naming_it_and_leaves_nothing(g4v69, tiny_copy, tmp_path):
    weights = tiny_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    work = tmp_path / "w"
    r = g4v69("--workdir", str(work), "--model", "tiny", "download", "--from", str(tiny_copy))
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1
    assert f"{weights} is not a readable safetensors file" in r.output
    assert list((work / "checkpoints").iterdir()) == []  # neither tiny/ nor a .partial folder


def test_a_folder_name_model_without_from_says_to_import_it(g4v69, tmp_path):
    work = tmp_path / "w"
    r = g4v69("--workdir", str(work), "--model", "mm", "download")
    assert r.exit_code == 2 and "import the folder with `make download FROM=DIR`" in r.output
    assert not (work / "checkpoints" / "mm").exists()


def test_cli_from_a_wrong_model_fails(g4v69, tiny_copy, tmp_path):
    (tiny_copy / "config.json").write_text(json.dumps({"model_type": "qwen3", "text_config": {}}))
    r = g4v69("--workdir", str(tmp_path / "w"), "--model", "tiny", "download", "--from", str(tiny_copy))
    assert r.exit_code == 2 and "is not a Gemma 4 or Gemma 3 config (model_type 'qwen3')" in r.output


def test_a_failed_rerun_keeps_the_previous_checkpoint(g4v69, tiny_copy, tmp_path):
    work = tmp_path / "w"
    assert g4v69("--workdir", str(work), "--model", "tiny", "download").exit_code == 0
    (tiny_copy / "tokenizer.json").write_text("[]")
    r = g4v69("--workdir", str(work), "--model", "tiny", "download", "--from", str(tiny_copy))
    assert r.exit_code == 2 and "tokenizer.json is not a loadable tokenizer" in r.output
    assert read_report(work / "checkpoints" / "tiny")["figures"]["source"] == "builtin"


# ---- through Make ----

VENV = Path(sys.prefix)
in_venv = pytest.mark.skipif(
    not (VENV / ".installed").exists(), reason="needs the project venv (`make venv`); run via `make test`"
)


def make(*args: str):
    return run(
        [
            "make",
            "--no-print-directory",
            "-o",
            f"{VENV}/.installed",
            "download",
            "RUNNER=local",
            f"VENV={VENV}",
            *args,
        ]
    )


@in_venv
def test_make_download_reruns_only_when_its_config_changes(tmp_path):
    args = [f"WORKDIR={tmp_path}", "PRESET=tiny"]
    assert make(*args).returncode == 0
    report = tmp_path / "checkpoints" / "tiny" / "report.json"
    first = report.stat().st_mtime_ns
    again = make(*args)
    assert again.returncode == 0 and report.stat().st_mtime_ns == first
    changed = make(*args, "MODEL_REVISION=0123abc")
    assert changed.returncode == 0, changed.stderr
    assert read_report(report.parent)["options"]["model_revision"] == "0123abc"


@in_venv
def test_make_download_from_imports_a_snapshot(tmp_path, tiny_dir):
    r = make(f"WORKDIR={tmp_path}", f"MODEL={REPO_ID}", f"FROM={tiny_dir}")
    assert r.returncode == 0, r.stderr
    assert read_report(tmp_path / "checkpoints" / "gemma-4-e2b-it")["figures"]["source"] == "from"


@in_venv
def test_make_download_from_names_the_checkpoint_after_the_folder_or_model(tmp_path, tiny_dir):
    snapshot = tmp_path / "My-Finetune"
    shutil.copytree(tiny_dir, snapshot)
    work = tmp_path / "w"
    r = make(f"WORKDIR={work}", f"FROM={snapshot}")
    assert r.returncode == 0, r.stderr
    assert read_report(work / "checkpoints" / "my-finetune")["options"]["model"] == "My-Finetune"
    r = make(f"WORKDIR={work}", "MODEL=mm", f"FROM={snapshot}")
    assert r.returncode == 0, r.stderr
    assert read_report(work / "checkpoints" / "mm")["figures"]["source"] == "from"


# ---- the Hub path, against doubles of huggingface_hub ----


def hub_error(status: int, code: str | None = None, message: str | None = None) -> Exception:
    """The exception huggingface_hub itself raises for such an answer of the Hub."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    headers = {k: v for k, v in (("X-Error-Code", code), ("X-Error-Message", message)) if v}
    url = f"https://huggingface.co/api/models/{REPO_ID}/revision/main"
    response = httpx2.Response(status, headers=headers, request=httpx2.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as e:
        return e
    raise AssertionError(f"no error for HTTP {status}")


class FakeHub:
    """model_info and snapshot_download over a local snapshot, as the Hub would serve it."""

    def __init__(self, source: Path):
        self.source = source
        self.info_error: Exception | None = None
        self.download_error: Exception | None = None
        self.corrupt: str | None = None
        self.downloads: list[dict] = []

    def model_info(self, repo_id, *, revision=None, files_metadata=False, token=None, **kwargs):
        from huggingface_hub.hf_api import ModelInfo

        assert files_metadata
        if self.info_error:
            raise self.info_error
        siblings = [{"rfilename": "README.md", "size": 10, "blobId": "0" * 40}]
        for p in sorted(self.source.iterdir()):
            entry = {"rfilename": p.name, "size": p.stat().st_size, "blobId": "1" * 40}
            if p.suffix == ".safetensors":
                entry["lfs"] = {"size": p.stat().st_size, "sha256": sha256_file(p), "pointerSize": 134}
            siblings.append(entry)
        return ModelInfo(id=repo_id, sha=RESOLVED_SHA, siblings=siblings)

    def snapshot_download(self, repo_id, *, revision, allow_patterns, token, local_dir, **kwargs):
        import fnmatch

        self.downloads.append({"repo_id": repo_id, "revision": revision, "token": token})
        if self.download_error:
            raise self.download_error
        local = Path(local_dir)
        meta = local / ".cache" / "huggingface" / "download"
        meta.mkdir(parents=True, exist_ok=True)
        for p in self.source.iterdir():
            if any(fnmatch.fnmatch(p.name, pat) for pat in allow_patterns):
                shutil.copyfile(p, local / p.name)
                (meta / f"{p.name}.metadata").write_text(f"{revision}\n")
        if self.corrupt:
            data = bytearray((local / self.corrupt).read_bytes())
            data[-1] ^= 0xFF  # same size, other bytes: only the sha256 can tell
            (local / self.corrupt).write_bytes(bytes(data))
        return str(local)


@pytest.fixture
def hub(tiny_dir, monkeypatch):
    import huggingface_hub

    fake = FakeHub(tiny_dir)
    # model_info is looked up on the class: HfApi().model_info(...) as the stage calls it.
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda api, *a, **k: fake.model_info(*a, **k))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return fake


def hub_download(g4v69, work: Path, *extra: str):
    return g4v69("--workdir", str(work), "--model", REPO_ID, *extra, "download")


def test_hub_download_records_the_resolved_revision(g4v69, hub, tmp_path):
    work = tmp_path / "w"
    r = hub_download(g4v69, work)
    assert r.exit_code == 0, r.output
    assert hub.downloads == [{"repo_id": REPO_ID, "revision": RESOLVED_SHA, "token": TOKEN}]
    out = work / "checkpoints" / "gemma-4-e2b-it"
    assert sorted(p.name for p in out.iterdir()) == sorted([*EXPECTED_FILES, "report.json"])
    assert [p.name for p in (work / "checkpoints").iterdir()] == ["gemma-4-e2b-it"]  # staging removed
    report_text = (out / "report.json").read_text()
    assert TOKEN not in report_text and TOKEN not in r.output
    fig = json.loads(report_text)["figures"]
    assert fig["source"] == "hf" and fig["revision"] == RESOLVED_SHA and fig["requested_revision"] == "main"
    assert fig["repo"] == REPO_ID and fig["files"] == 6 and fig["downloaded_bytes"] > 0


@pytest.mark.parametrize(
    "error, message",
    [
        (
            lambda: hub_error(403, "GatedRepo"),
            f"{REPO_ID} is gated: accept its license at https://huggingface.co/{REPO_ID} while logged in, "
            "then set HF_TOKEN",
        ),
        (lambda: hub_error(404, "RevisionNotFound"), "revision 'v9' does not exist in google/gemma-4-E2B-it"),
        (lambda: hub_error(404, "RepoNotFound"), f"repository {REPO_ID} was not found"),
        (
            lambda: hub_error(401, None, "Invalid credentials in Authorization header"),
            "the Hugging Face Hub rejected HF_TOKEN (401 Unauthorized)",
        ),
        (lambda: hub_error(500), "answered HTTP 500"),
        (lambda: __import__("httpx2").ConnectError("[Errno -2] Name or service not known"), "--from DIR"),
    ],
)
@pytest.mark.parametrize("stage", ["model_info", "snapshot_download"])
def test_hub_errors_are_one_actionable_line(g4v69, hub, tmp_path, error, message, stage):
    if stage == "model_info":
        hub.info_error = error()
    else:
        hub.download_error = error()
    work = tmp_path / "w"
    r = hub_download(g4v69, work, "--model-revision", "v9")
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1 and message in r.output
    assert TOKEN not in r.output
    assert not (work / "checkpoints" / "gemma-4-e2b-it").exists()


def test_offline_snapshot_download_suggests_from(g4v69, hub, tmp_path):
    from huggingface_hub.errors import LocalEntryNotFoundError

    hub.download_error = LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
    r = hub_download(g4v69, tmp_path / "w")
    assert r.exit_code == 2 and "cannot reach https://huggingface.co" in r.output and "FROM=DIR" in r.output


def test_not_enough_disk_refuses_before_downloading(g4v69, hub, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    r = hub_download(g4v69, tmp_path / "w")
    assert r.exit_code == 2 and "not enough disk space" in r.output and "GB free" in r.output
    assert hub.downloads == []


def test_files_already_in_staging_count_as_downloaded(g4v69, hub, tiny_dir, tmp_path, monkeypatch):
    staging = tmp_path / "w" / "checkpoints" / ".gemma-4-e2b-it.download"
    staging.mkdir(parents=True)
    shutil.copyfile(tiny_dir / "model.safetensors", staging / "model.safetensors")
    rest = sum(p.stat().st_size for p in tiny_dir.iterdir() if p.name != "model.safetensors")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(10**12, 0, int(rest * 1.1) + 10))
    r = hub_download(g4v69, tmp_path / "w")
    assert r.exit_code == 0, r.output
    report = read_report(tmp_path / "w" / "checkpoints" / "gemma-4-e2b-it")
    assert report["figures"]["downloaded_bytes"] == rest


def test_a_corrupt_download_is_deleted_and_the_rest_kept_for_a_resume(g4v69, hub, tmp_path):
    hub.corrupt = "model.safetensors"
    work = tmp_path / "w"
    r = hub_download(g4v69, work)
    assert r.exit_code == 2 and "model.safetensors does not match the Hub's sha256" in r.output
    staging = work / "checkpoints" / ".gemma-4-e2b-it.download"
    assert not (staging / "model.safetensors").exists() and (staging / "config.json").is_file()
    assert not (staging / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").exists()
    assert not (work / "checkpoints" / "gemma-4-e2b-it").exists()
    hub.corrupt = None
    assert hub_download(g4v69, work).exit_code == 0
    assert not staging.exists()


def test_a_repo_without_weights_is_refused(g4v69, hub, tmp_path):
    source = tmp_path / "no-weights"
    source.mkdir()
    (source / "config.json").write_text("{}")
    hub.source = source
    r = hub_download(g4v69, tmp_path / "w")
    assert r.exit_code == 2 and "has no config.json with *.safetensors weights" in r.output
