"""Prompts: the checkpoint's tokenizer, its chat template and its stop tokens.

A base model (Gemma 3 270M, say) has no chat template: its prompt is the raw text after BOS
(RAW_TEMPLATE), which the bundle then carries as its template, so `make run`, verify and the host
runner all send the same ids.

The template is rendered with Jinja2 the way transformers' apply_chat_template does (trim_blocks,
lstrip_blocks, raise_exception), so the host runner sees the exact token ids Genie's template gives.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from stages.core.errors import UserFixable

# A base model's prompt: BOS, then the text as it is (a system text, if given, first).
RAW_TEMPLATE = "{{- bos_token -}}{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"


class ChatError(UserFixable, ValueError):
    pass


def stored_chat_template(checkpoint_dir: Path) -> str | None:
    """The checkpoint's own chat template (chat_template.jinja or tokenizer_config.json), or None."""
    jinja = checkpoint_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = checkpoint_dir / "tokenizer_config.json"
    template = json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None
    return template if isinstance(template, str) else None


def chat_template(checkpoint_dir: Path) -> str:
    """The template prompts are rendered with: the checkpoint's, or RAW_TEMPLATE for a base model."""
    return stored_chat_template(checkpoint_dir) or RAW_TEMPLATE


def render_chat(
    checkpoint_dir: Path, prompt: str, system: str | None = None, template: str | None = None
) -> str:
    """The text of a one-turn conversation, ending where the model's answer starts (`template`: the
    checkpoint's by default)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    tok_cfg_path = checkpoint_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
    return env.from_string(template or chat_template(checkpoint_dir)).render(
        messages=messages, add_generation_prompt=True, **special
    )


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # transformers may store AddedToken dicts
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def added_token_id(checkpoint_dir: Path, token: str) -> int | None:
    """The id of a special token, read from tokenizer.json without the tokenizers library (the
    compile image, where the bundle is made, does not carry it)."""
    data = json.loads((checkpoint_dir / "tokenizer.json").read_text())
    for added in data.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    return vocab.get(token) if isinstance(vocab, dict) else None


class ChatTokenizer:
    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer

        path = checkpoint_dir / "tokenizer.json"
        if not path.is_file():
            raise ChatError(f"{path} is missing; the checkpoint has no tokenizer")
        self.dir = checkpoint_dir
        self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        # The rendered template already holds <bos>; the tokenizer must not add another.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_ids(self, prompt: str, system: str | None = None) -> list[int]:
        return self.encode(render_chat(self.dir, prompt, system))

    def raw_ids(self, text: str) -> list[int]:
        """Text sent as it is, without the chat template, as Genie queries it: BOS, then the text."""
        return self.encode(render_chat(self.dir, text, template=RAW_TEMPLATE))

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


# A Jinja string literal, single- or double-quoted, with backslash escapes.
_STRING = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
_ADJACENT = re.compile(rf"(?:{_STRING})(?:\s*(?:{_STRING}))+")
_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)


def join_adjacent_string_literals(template: str) -> str:
    """The same template with `'a' 'b'` inside tags written as `'ab'`.

    Jinja2 concatenates adjacent string literals; minja, the C++ engine Genie renders chat templates
    with, rejects them, and Gemma's template has some. Text outside `{{ }}` / `{% %}` is left alone.
    """

    def merge(m: re.Match) -> str:
        parts = re.findall(_STRING, m.group(0))
        text = "".join(ast.literal_eval(p) for p in parts)
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"

    return _TAG.sub(lambda tag: _ADJACENT.sub(merge, tag.group(0)), template)
