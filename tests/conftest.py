from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A small multimodal-style Gemma 4 config.json: sliding + full layers, KV sharing, double-wide MLP, PLE.
TINY_GEMMA4_CONFIG = {
    "model_type": "gemma4",
    "text_config": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "vocab_size": 256,
        "intermediate_size": 128,
        "sliding_window": 8,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
}


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO, timeout: int = 600):
    """Run a command and return the CompletedProcess with text stdout/stderr."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def g4v69(tmp_path):
    """Run the CLI in-process via click's runner, in an empty working folder."""
    from click.testing import CliRunner

    from stages.cli import main

    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None):
        with runner.isolated_filesystem(temp_dir=tmp_path):
            result = runner.invoke(main, list(args), env=env, catch_exceptions=False)
            result.files = sorted(str(p) for p in Path(".").rglob("*"))
        return result

    return invoke
