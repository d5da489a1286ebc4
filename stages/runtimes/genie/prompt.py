"""The prompt as `make run` hands it to genie-t2t-run, for run and for verify's emulator alike. Light
imports only: push and run work in the tools image (no numpy, no onnx)."""

from __future__ import annotations

import json
from pathlib import Path

from stages.model.chat import render_chat
from stages.runtimes.genie.files import GENIE_CONFIG, TOKENIZER_CONFIG


def query_text(bundle_dir: Path, prompt: str) -> str:
    """The text `make run` hands genie-t2t-run for a one-turn prompt: the bundle's chat template
    rendered, less its leading BOS text where the config's bos-token is one Genie prepends itself
    (qualla dialog.cpp Dialog::query adds bos-token >= 0 before the text's ids), else it would be
    there twice. verify's emulator starts from the same text."""
    text = render_chat(bundle_dir, prompt)
    dialog = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    bos = json.loads((bundle_dir / TOKENIZER_CONFIG).read_text()).get("bos_token")
    if dialog["context"].get("bos-token", -1) >= 0 and isinstance(bos, str) and text.startswith(bos):
        text = text[len(bos) :]
    return text
