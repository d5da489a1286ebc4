"""Built-in checkpoints: a Gemma 4 snapshot made here from a seed (random bf16 weights, a byte-level
tokenizer, Gemma 4's chat template), in the same layout as the real -it snapshot.

`stages.download` writes them (`tiny` with the trained fixture of `stages.model.tiny_model`); the tiny
model's training starts from the same seeded init, so the two stay one definition.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from stages.model.checkpoint import INDEX_NAME, TEXT_PREFIXES
from stages.model.geometry import E2B_TEXT_CONFIG, TINY_TEXT_CONFIG, geometry_from_config

# Built-in checkpoints use the -it (multimodal) layout; validation also accepts a text-only save.
TEXT_PREFIX = TEXT_PREFIXES[0]
# One non-text tensor in built-in checkpoints, so loaders prove they skip what is not the language model.
NON_TEXT_TENSOR = ("model.embed_vision.embedding_projection.weight", (4, 4))
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000

BUILTIN_TEXT_CONFIGS: dict[str, dict[str, Any]] = {"tiny": TINY_TEXT_CONFIG, "e2b-random": E2B_TEXT_CONFIG}

# The built-in tokenizer: 6 special tokens, then the 256 ByteLevel characters (id = 6 + byte value).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TURN_START_ID, TURN_END_ID = range(6)
BYTE_OFFSET = len(SPECIAL_TOKENS)

# Gemma 4's chat format (docs/facts.md §1). The adjacent string literals inside raise_exception(...) are
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
    # An -it model ends its turn with <turn|>, so generation stops at eos or <turn|> (docs/facts.md §1).
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

    from stages.core.progress import tqdm

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
