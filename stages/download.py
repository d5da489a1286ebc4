"""The download stage: a Gemma 4 checkpoint in `checkpoints/<name>/`, checked before it counts as done.

Sources:
- built-in models (`tiny`, `e2b-random`): random bf16 weights made here from a seed, no network;
- a Hugging Face repo (`google/gemma-4-E2B-it`): fetched with huggingface_hub into a persistent staging
  folder (an interrupted download resumes), checked against the Hub's sizes and LFS sha256 values;
- `--from DIR`: a snapshot the user already has, hard-linked (or copied) in.

Every source ends in the same layout as the real -it snapshot (multimodal config.json, text weights
under `model.language_model.`, tokenizer files) and passes the same validation: config.json is Gemma 4,
every safetensors file opens, every text tensor of the geometry is there with its shape.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.checkpoint import GEMMA4_MODEL_TYPES, INDEX_NAME, TEXT_PREFIXES
from stages.config import is_repo_id
from stages.geometry import (
    E2B_TEXT_CONFIG,
    TINY_TEXT_CONFIG,
    GeometryError,
    Tensor,
    geometry_from_config,
    text_config_of,
)
from stages.report import redact, sha256_file, stage_output

# Built-in checkpoints use the -it (multimodal) layout; validation also accepts a text-only save.
TEXT_PREFIX = TEXT_PREFIXES[0]
# One non-text tensor in built-in checkpoints, so loaders prove they skip what is not the language model.
NON_TEXT_TENSOR = ("model.embed_vision.embedding_projection.weight", (4, 4))
# The files of a snapshot this pipeline uses (huggingface_hub allow_patterns; fnmatch rules).
ALLOW_PATTERNS = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
# Free disk wanted on top of the bytes still to download.
DISK_MARGIN = 0.10
HF_URL = "https://huggingface.co"

BUILTIN_TEXT_CONFIGS: dict[str, dict[str, Any]] = {"tiny": TINY_TEXT_CONFIG, "e2b-random": E2B_TEXT_CONFIG}

# The built-in tokenizer: 6 special tokens, then the 256 ByteLevel characters (id = 6 + byte value).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TURN_START_ID, TURN_END_ID = range(6)
BYTE_OFFSET = len(SPECIAL_TOKENS)

# Gemma 4's chat format (FACTS.md s.1). The adjacent string literals inside raise_exception(...) are
# deliberate: the real Gemma 4 template has them, Jinja2 accepts them, Genie's C++ engine (minja) does
# not, so the bundle stage must fix them; the tiny model keeps the problem so that fix is tested.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}\n"
    "{%- elif message['role'] in ['system', 'user', 'model'] -%}{%- set role = message['role'] -%}\n"
    "{%- else -%}{{- raise_exception('Conversation roles must be system, user or assistant; ' "
    "'got: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}\n"
    "{%- else -%}{%- set ns = namespace(text='') -%}\n"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}"
    "{%- set ns.text = ns.text + part['text'] -%}{%- endif -%}{%- endfor -%}\n"
    "{%- set content = ns.text -%}\n"
    "{%- endif -%}\n"
    "{{- '<|turn>' + role + '\\n' + content + '<turn|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}\n"
)

# Elements generated per chunk of a big tensor (fp32 scratch: 64 MiB), so the 2.35 B-element PLE
# table never exists in fp32.
CHUNK_ELEMENTS = 16 * 1024 * 1024
BF16_BYTES = 2


class DownloadError(Exception):
    """A problem the user can fix; the message is one line and names the file or setting at fault."""


# ---------------------------------------------------------------------------------------------------
# Built-in checkpoints
# ---------------------------------------------------------------------------------------------------


def gemma4_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal-layout config.json around a text config, as in the -it snapshot.

    vision_config and audio_config are null (Gemma4Config allows that), so transformers'
    Gemma4ForConditionalGeneration builds text-only instead of default-sized vision and audio towers.
    """
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "dtype": "bfloat16",
        "tie_word_embeddings": True,
        "text_config": {**text_config, "model_type": "gemma4_text", "dtype": "bfloat16"},
        "vision_config": None,
        "audio_config": None,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer() -> Any:
    """The built-in byte-level tokenizer (a `tokenizers.Tokenizer`): no training, so deterministic.

    Every UTF-8 string encodes to its bytes (id = 6 + byte) and decodes back; encode adds `<bos>`
    like Gemma's own tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = BYTE_OFFSET + b
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos>:1 $B:1", special_tokens=[("<bos>", BOS_ID)]
    )
    return tok


def write_tokenizer_files(dest: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json."""
    build_tokenizer().save(str(dest / "tokenizer.json"))
    tokenizer_config = {
        # Not GemmaTokenizer: in transformers 5 that class rebuilds a SentencePiece-style pipeline
        # (space -> "▁" normalizer) over the vocab and would ignore this file's ByteLevel one.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "padding_side": "left",
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    # An -it model ends its turn with <turn|>, so generation stops at eos or <turn|> (FACTS.md s.1).
    _write_json(
        dest / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, TURN_END_ID], "pad_token_id": PAD_ID},
    )


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _init_spec(name: str, shape: tuple[int, ...], text_config: dict[str, Any]) -> tuple[str, float, float]:
    """(distribution, a, b) for a tensor: ("normal", mean, std) or ("uniform", low, high).

    Chosen so a random model behaves like a trained one numerically: activations stay O(1) and the
    logits are spread (std ~4 before softcapping), and no weight is trivial (norm weights are not all 1,
    layer scalars not 1), so parity tests against transformers exercise every multiply.
    """
    if name.endswith("layer_scalar"):
        return ("uniform", 0.5, 1.5)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        # Gemma 4 attends with scaling 1.0 on RMS-normed q and k, so these weights set the logit
        # spread. Around head_dim**-0.25 each, q.k has the spread of a 1/sqrt(d)-scaled attention;
        # weights near 1 make random attention one-hot and a deep random model chaotic (rounding
        # errors double every layer), which no trained model is.
        scale = shape[0] ** -0.25
        return ("normal", scale, 0.3 * scale)
    if len(shape) == 1:
        return ("normal", 1.0, 0.3)
    if name.endswith("embed_tokens.weight"):
        # Embeddings are scaled by sqrt(hidden) on lookup and the tied lm_head dots a unit-RMS state
        # with them: std 4/sqrt(hidden) gives logits of std ~4 at any width (0.5 for tiny).
        return ("normal", 0.0, 4.0 / math.sqrt(text_config["hidden_size"]))
    if name.endswith("embed_tokens_per_layer.weight"):
        # Scaled by sqrt(ple_dim) on lookup: this gives per-layer inputs of unit scale.
        return ("normal", 0.0, 1.0 / math.sqrt(text_config["hidden_size_per_layer_input"]))
    return ("normal", 0.0, 1.0 / math.sqrt(shape[-1]))  # linear: N(0, 1/fan_in)


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor seeds: a tensor's values depend on (seed, name) only, not on order or sharding.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def random_tensor(name: str, shape: tuple[int, ...], text_config: dict[str, Any], seed: int) -> Any:
    """A bf16 tensor filled in row chunks, so no full fp32 copy of a big table ever exists."""
    import torch

    dist, a, b = _init_spec(name, shape, text_config)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = out.view(shape[0], -1)
    chunk = max(1, CHUNK_ELEMENTS // rows.shape[1])
    for r0 in range(0, rows.shape[0], chunk):
        r1 = min(r0 + chunk, rows.shape[0])
        size = (r1 - r0, rows.shape[1])
        if dist == "uniform":
            block = torch.rand(size, generator=gen).mul_(b - a).add_(a)
        else:
            block = torch.randn(size, generator=gen).mul_(b).add_(a)
        rows[r0:r1] = block
    return out


def _plan_shards(tensors: list[tuple[str, tuple[int, ...]]], max_shard_bytes: int) -> list[list[int]]:
    """Greedy, in order: a tensor bigger than the limit gets a file of its own."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(tensors):
        nbytes = math.prod(shape) * BF16_BYTES
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_random_checkpoint(
    text_config: dict[str, Any],
    dest: Path,
    seed: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    trained: dict[str, Any] | None = None,
) -> None:
    """Write a complete random-weight Gemma 4 checkpoint for `text_config` into the folder `dest`;
    tensors found in `trained` (names relative to the language model) are written instead of random.

    Same bytes on every run for the same arguments (fixed safetensors metadata, no timestamps).
    Tensors are made one file at a time, so memory holds at most one file's tensors.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    geo = geometry_from_config(text_config)
    tensors = [(TEXT_PREFIX + t.name, t.shape) for t in geo.all_tensors()] + [NON_TEXT_TENSOR]
    shards = _plan_shards(tensors, max_shard_bytes)
    names = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    total = sum(math.prod(shape) for _, shape in tensors) * BF16_BYTES
    # disable=None: a bar on a terminal, silence in logs and tests.
    with tqdm(total=total, unit="B", unit_scale=True, desc="random weights", disable=None) as bar:
        for file_name, members in zip(names, shards, strict=True):
            data = {}
            for i in members:
                name, shape = tensors[i]
                given = (trained or {}).get(name.removeprefix(TEXT_PREFIX))
                data[name] = given if given is not None else random_tensor(name, shape, geo.config, seed)
                weight_map[name] = file_name
                bar.update(math.prod(shape) * BF16_BYTES)
            save_file(data, str(dest / file_name), metadata={"format": "pt"})
            # safetensors creates files 0600; make them as readable as the JSON files beside them.
            os.chmod(dest / file_name, 0o644)
            del data
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(dest / INDEX_NAME, index)
    _write_json(dest / "config.json", gemma4_config(text_config))
    write_tokenizer_files(dest, text_config.get("max_position_embeddings", 1024))


def write_builtin_checkpoint(
    name: str, dest: Path, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write a built-in model (`tiny` or `e2b-random`) into `dest`.

    `tiny` is a few MB in one model.safetensors, with the weights trained by `stages.tiny_model`
    (the committed fixture) so that its text and its quantization figures mean something.
    `e2b-random` has the full E2B geometry (about 9 GB
    of bf16 in ~2 GB shards; the 4.7 GB per-layer embedding table alone in its file). It carries the
    built-in byte-level tokenizer, which only covers token ids < 262 of its 262144-entry vocabulary:
    it is for sizing and timing the pipeline, not for text.
    """
    if name not in BUILTIN_TEXT_CONFIGS:
        raise DownloadError(f"no built-in model {name!r}; built-in models: {', '.join(BUILTIN_TEXT_CONFIGS)}")
    trained = None
    if name == "tiny":
        from stages.tiny_model import load_fixture

        trained = load_fixture()
    write_random_checkpoint(BUILTIN_TEXT_CONFIGS[name], Path(dest), seed, max_shard_bytes, trained)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """A file as the Hub lists it: size, and sha256 when it is stored with LFS."""

    name: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class CheckpointSummary:
    files: int
    bytes: int
    text_tensors: int
    text_params: int
    extra_text_tensors: int
    other_tensors: int
    dtypes: tuple[str, ...]
    text_prefix: str = TEXT_PREFIX
    # Stored language-model tensors the model has no place for, dropped as transformers drops them:
    # K/V weights of KV-shared layers, and (unused_tensors) anything else, which transformers warns about.
    ignored_tensors: tuple[str, ...] = ()
    unused_tensors: tuple[str, ...] = ()

    def figures(self) -> dict[str, Any]:
        return {
            "ignored_tensors": list(self.ignored_tensors),
            "unused_tensors": list(self.unused_tensors),
            "text_prefix": self.text_prefix,
            "files": self.files,
            "bytes": self.bytes,
            "text_tensors": self.text_tensors,
            "text_params": self.text_params,
            "extra_text_tensors": self.extra_text_tensors,
            "other_tensors": self.other_tensors,
            "dtypes": list(self.dtypes),
        }


def _first(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DownloadError(f"{path} is not valid JSON ({str(e).splitlines()[0]})") from None


def check_config(path: Path) -> dict[str, Any]:
    """The parsed config.json, which must be a Gemma 4 config that the geometry understands."""
    config = _read_json(path)
    if not isinstance(config, dict):
        raise DownloadError(f"{path} is not a config object")
    model_type = config.get("model_type")
    text_type = text_config_of(config).get("model_type", model_type)
    if model_type not in GEMMA4_MODEL_TYPES or text_type not in GEMMA4_MODEL_TYPES:
        raise DownloadError(
            f"{path} is not a Gemma 4 config (model_type {model_type!r}); this pipeline handles "
            f"model_type {' or '.join(GEMMA4_MODEL_TYPES)}, e.g. google/gemma-4-E2B-it"
        )
    try:
        geometry_from_config(config)
    except (GeometryError, KeyError, TypeError, ValueError) as e:
        raise DownloadError(f"{path}: {e}") from None
    return config


def check_remote_files(folder: Path, remote: list[RemoteFile]) -> None:
    """Sizes and LFS sha256 values as the Hub lists them. A corrupt file is deleted (with its
    huggingface_hub resume metadata), so the next run fetches it again instead of trusting it."""
    for f in remote:
        path = folder / f.name
        if not path.is_file():
            raise DownloadError(f"{path} is missing after the download; run the download again")
        size = path.stat().st_size
        bad = None
        if f.size is not None and size != f.size:
            bad = f"is {size} bytes, the Hub lists {f.size}"
        elif f.sha256 and sha256_file(path) != f.sha256:
            bad = f"does not match the Hub's sha256 {f.sha256[:12]}..."
        if bad:
            path.unlink()
            for meta in (folder / ".cache" / "huggingface" / "download").glob(f"{f.name}.*"):
                meta.unlink()
            raise DownloadError(f"{path} {bad}; it was deleted: run the download again to fetch it anew")


def validate_checkpoint(
    folder: Path, files: list[str] | None = None, remote: list[RemoteFile] | None = None
) -> CheckpointSummary:
    """Check a checkpoint folder; raise DownloadError naming the first bad file or tensors.

    `files` limits the check to those names (a staging or user folder may hold other files);
    default: the names of `remote`, else every file in the folder.

    Checked: the required files exist and parse; config.json is Gemma 4; every safetensors file
    (and every file the index names) opens; every language-model tensor of the geometry is present
    under `model.language_model.` (or, for a text-only save, `model.`) with its shape. Non-text
    tensors (vision, audio) are skipped; extra text tensors are accepted and listed, as transformers
    accepts them: the K/V weights of KV-shared layers that the published E2B-it keeps (ignored_tensors,
    which transformers drops silently) and anything else (unused_tensors, which it drops with a
    warning). With `remote`, sizes and LFS sha256 values are compared too.
    """
    from safetensors import safe_open

    folder = Path(folder)
    if files is None:
        on_disk = sorted(p.name for p in folder.iterdir() if p.is_file())
        files = [f.name for f in remote] if remote else on_disk
    names = set(files)
    if remote:
        # First: a file damaged in transit is then deleted for a refetch whatever else fails.
        check_remote_files(folder, remote)
    missing = [n for n in REQUIRED_FILES if n not in names or not (folder / n).is_file()]
    if missing:
        raise DownloadError(f"{_first(missing)} missing from {folder}")
    config = check_config(folder / "config.json")
    geo = geometry_from_config(config)
    for name in ("tokenizer_config.json", "generation_config.json", INDEX_NAME):
        if name in names:
            _read_json(folder / name)
    _check_tokenizer(folder / "tokenizer.json")

    weights = [folder / n for n in sorted(names) if n.endswith(".safetensors")]
    if INDEX_NAME in names:
        named = set(_read_json(folder / INDEX_NAME).get("weight_map", {}).values())
        absent = sorted(n for n in named if n not in names or not (folder / n).is_file())
        if absent:
            raise DownloadError(f"{INDEX_NAME} names {_first(absent)}, missing from {folder}")
    if not weights:
        raise DownloadError(f"no *.safetensors weights in {folder}")

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shapes[key] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError, ValueError)
            raise DownloadError(
                f"{path} is not a readable safetensors file, truncated or corrupt ({str(e).splitlines()[0]})"
            ) from None

    prefix = next((p for p in TEXT_PREFIXES if p + geo.embedding.name in shapes), TEXT_PREFIX)
    found = {k[len(prefix) :]: v[0] for k, v in shapes.items() if k.startswith(prefix)}
    dtypes = {v[1] for k, v in shapes.items() if k.startswith(prefix)}
    expected: list[Tensor] = geo.all_tensors()
    absent_tensors = [prefix + t.name for t in expected if t.name not in found]
    if absent_tensors:
        raise DownloadError(
            f"{len(absent_tensors)} language-model tensors missing from the safetensors in {folder}: "
            f"{_first(absent_tensors)}"
        )
    wrong = [
        f"{prefix}{t.name} {list(found[t.name])} (config says {list(t.shape)})"
        for t in expected
        if found[t.name] != t.shape
    ]
    if wrong:
        raise DownloadError(f"{len(wrong)} tensors have the wrong shape for config.json: {_first(wrong, 3)}")
    extra = sorted(set(found) - {t.name for t in expected})
    return CheckpointSummary(
        ignored_tensors=tuple(prefix + n for n in extra if geo.is_shared_kv_leftover(n)),
        unused_tensors=tuple(prefix + n for n in extra if not geo.is_shared_kv_leftover(n)),
        files=len(names),
        bytes=sum((folder / n).stat().st_size for n in names),
        text_tensors=len(expected),
        text_params=sum(t.numel for t in expected),
        extra_text_tensors=len(found) - len(expected),
        other_tensors=len(shapes) - len(found),
        dtypes=tuple(sorted(dtypes)),
        text_prefix=prefix,
    )


def _check_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise DownloadError(f"{path} is not a loadable tokenizer ({str(e).splitlines()[0]})") from None


# ---------------------------------------------------------------------------------------------------
# --from DIR
# ---------------------------------------------------------------------------------------------------


def selected(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def snapshot_files(src: Path) -> list[str]:
    """The names of the checkpoint files at the top of a snapshot folder."""
    src = Path(src)
    if not src.is_dir():
        raise DownloadError(f"--from {src}: not a folder")
    names = sorted(p.name for p in src.iterdir() if selected(p.name) and p.resolve().is_file())
    if not names:
        raise DownloadError(f"--from {src}: no checkpoint files there (expected config.json, *.safetensors)")
    return names


def import_snapshot(src: Path, dest: Path) -> CheckpointSummary:
    """Validate the snapshot in `src`, then hard-link (or, across file systems, copy) it into `dest`.

    Validating in place makes errors name the user's own files. Links are followed first, so a
    Hugging Face cache snapshot (symlinks into blobs/) works too.
    """
    names = snapshot_files(src)
    summary = validate_checkpoint(src, names)
    for name in names:
        source = (src / name).resolve()
        try:
            os.link(source, dest / name)
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(source, dest / name)
    return summary


# ---------------------------------------------------------------------------------------------------
# Hugging Face Hub
# ---------------------------------------------------------------------------------------------------


@contextmanager
def hub_errors(repo: str, revision: str, token: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line DownloadErrors that say what to do."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_state = "HF_TOKEN is set" if token else "HF_TOKEN is not set"
    offline = "pass --from DIR (make download FROM=DIR) with a snapshot you already have"
    try:
        yield
    except GatedRepoError:
        raise DownloadError(
            f"{repo} is gated: accept its license at {HF_URL}/{repo} while logged in, then set HF_TOKEN "
            f"to a read token of that account ({token_state})"
        ) from None
    except RevisionNotFoundError:
        raise DownloadError(
            f"revision {revision!r} does not exist in {repo}; set --model-revision (MODEL_REVISION) to a "
            "branch, tag or commit sha of that repo"
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"repository {repo} was not found on the Hugging Face Hub (or it is private and {token_state}); "
            "check --model (MODEL)"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise DownloadError(
                "the Hugging Face Hub rejected HF_TOKEN (401 Unauthorized): make a new read token at "
                f"{HF_URL}/settings/tokens and set HF_TOKEN to it"
            ) from None
        raise DownloadError(
            redact(f"the Hugging Face Hub answered HTTP {status} for {repo}; try again later, or {offline}")
        ) from None
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError):
        raise DownloadError(
            f"cannot reach {HF_URL} (no network, or HF_HUB_OFFLINE is set); {offline}"
        ) from None


def hub_files(repo: str, revision: str, token: str | None) -> tuple[str, list[RemoteFile]]:
    """The commit sha `revision` resolves to and the selected files there, with sizes and sha256."""
    import huggingface_hub

    with hub_errors(repo, revision, token):
        info = huggingface_hub.HfApi().model_info(repo, revision=revision, files_metadata=True, token=token)
    remote = [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
        if selected(s.rfilename)
    ]
    names = {f.name for f in remote}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DownloadError(
            f"{repo} at {revision} has no config.json with *.safetensors weights; is it a transformers "
            "checkpoint of Gemma 4?"
        )
    if not info.sha:
        raise DownloadError(f"the Hub did not resolve revision {revision!r} of {repo} to a commit")
    return info.sha, sorted(remote, key=lambda f: f.name)


def check_disk(staging: Path, remote: list[RemoteFile]) -> int:
    """Bytes still to download; DownloadError when free disk is short of that plus a margin."""
    have = 0
    for f in remote:
        path = staging / f.name
        if path.is_file():
            have += min(path.stat().st_size, f.size or 0)
    need = sum(f.size or 0 for f in remote) - have
    free = shutil.disk_usage(staging.parent).free
    want = int(need * (1 + DISK_MARGIN))
    if free < want:
        gb = 1e9
        raise DownloadError(
            f"not enough disk space in {staging.parent}: {need / gb:.2f} GB still to download "
            f"(+{DISK_MARGIN:.0%} margin: {want / gb:.2f} GB), {free / gb:.2f} GB free; free space or "
            "set WORKDIR to a bigger disk"
        )
    return need


def fetch_from_hub(repo: str, revision: str, staging: Path, dest: Path) -> dict[str, Any]:
    """Download `repo` at `revision` through `staging` (kept between runs, so downloads resume),
    check it against the Hub's listing, move the files into `dest`, and return report figures."""
    import huggingface_hub

    token = os.environ.get("HF_TOKEN") or None
    sha, remote = hub_files(repo, revision, token)
    staging.mkdir(parents=True, exist_ok=True)
    to_fetch = check_disk(staging, remote)
    with hub_errors(repo, revision, token):
        # The resolved sha, not the branch name: the files then match the listing just checked.
        huggingface_hub.snapshot_download(
            repo_id=repo,
            revision=sha,
            allow_patterns=list(ALLOW_PATTERNS),
            token=token,
            local_dir=str(staging),
        )
    # Checked where it lies, so a bad file is named by its lasting path and the rest stays for a resume.
    summary = validate_checkpoint(staging, remote=remote)
    for f in remote:
        os.replace(staging / f.name, dest / f.name)
    shutil.rmtree(staging, ignore_errors=True)
    figures = {"repo": repo, "requested_revision": revision, "revision": sha, "downloaded_bytes": to_fetch}
    return {**figures, **summary.figures()}


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------


def run_download(
    model: str,
    model_revision: str,
    out_dir: Path,
    from_dir: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Make `out_dir` (checkpoints/<name>) from the model's source; return the report's figures.

    Written through stage_output: a temporary folder renamed into place only after validation, with a
    report.json; on any error nothing is left but the resumable Hub staging folder.
    """
    out_dir = Path(out_dir)
    if from_dir is not None:
        source = "from"
    elif model in BUILTIN_TEXT_CONFIGS:
        source = "builtin"
    elif is_repo_id(model):
        source = "hf"
    else:
        raise DownloadError(
            f"model {model!r} is a name for an imported folder, not a Hugging Face repo id (owner/name) or a "
            f"built-in model; import the folder with `make download FROM=DIR` (g4v69 download --from DIR)"
        )
    options = {"model": model, "model_revision": model_revision, "source": source}
    if from_dir is not None:
        options["from"] = str(from_dir)
    with stage_output("download", out_dir, [], options, root=out_dir.parent) as run:
        figures: dict[str, Any] = {"source": source}
        if source == "from":
            assert from_dir is not None
            figures["from"] = str(from_dir)
            figures.update(import_snapshot(from_dir, run.dir).figures())
        elif source == "builtin":
            write_builtin_checkpoint(model, run.dir, seed)
            figures["seed"] = seed
            figures.update(validate_checkpoint(run.dir).figures())
        else:
            staging = out_dir.with_name(f".{out_dir.name}.download")
            figures.update(fetch_from_hub(model, model_revision, staging, run.dir))
        run.figures.update(figures)
    return figures
