"""What every `g4v69` command shares: the context the group hands it and the one error a user can act
on. The group is stages/cli.py; a stage's command lives in the stage's module (the stage table names
it), so both import this."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from stages.core.config import PipelineConfig, stage_key, stamp_name
from stages.core.pipeline import output_dir
from stages.core.report import REPORT_NAME, write_stamp


class UserError(click.ClickException):
    """A problem the user can fix: printed as one line, exit status 2, nothing written."""

    exit_code = 2


@dataclass
class Context:
    config: PipelineConfig
    workdir: Path

    def checkpoint_dir(self) -> Path:
        return output_dir(self.workdir, "download", self.config.checkpoint_name)

    def download_done(self) -> None:
        """Stamp a download that has just finished (see the Makefile's stage rules): only on success,
        keyed by the config, so a run with another config neither removes nor reuses it. The other
        stages stamp themselves as they write their output (report.StageJob); a checkpoint folder
        is made without a config, for every config of its model."""
        out = self.checkpoint_dir()
        content = {"stage": "download", "config": stage_key(self.config, "download")}
        write_stamp(self.workdir, stamp_name(self.config, "download"), content, out / REPORT_NAME)
