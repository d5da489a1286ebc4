"""Export refuses jobs it cannot build before it reads a single weight."""

from __future__ import annotations

import json

import pytest

from stages.core.config import load_config
from stages.core.report import write_report
from stages.export import ExportError, run_export
from stages.model.builtin_models import gemma4_config
from stages.model.geometry import E2B_TEXT_CONFIG


def test_a_part_over_the_context_limit_is_refused(tmp_path):
    ckpt = tmp_path / "checkpoints" / "gemma-4-e2b-it"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(gemma4_config(E2B_TEXT_CONFIG)))
    write_report(ckpt, {})  # a finished download of this config alone
    cfg = load_config("default", {"num_shards": 1, "precision": "w8a16"})
    with pytest.raises(ExportError, match="over SM8450's per-context limit of 2097152 KB .*num_shards >= 2"):
        run_export(cfg, tmp_path, ckpt)
    assert not (tmp_path / "exported").exists()
