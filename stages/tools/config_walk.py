"""The pipeline config followed through a stage as a parameter (issue 34's measure): every stages/
function the config enters (called with a `PipelineConfig` among its arguments; the config's own
methods and comprehensions aside), in the order each is first called. Consecutive functions of one
module are one stay; a stay in a library module the walk has already left is a return. The stage's
own module, where the walk starts, drives it: its helpers are listed where they take the config, and
not counted as returns. A job worked out once and handed on keeps the walk short and one-way.

`python -m stages.tools.config_walk [--preset tiny]` runs download and export of the built-in tiny
model in a temporary folder under the profiler and prints the walk (about half a minute here).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from stages.core.config import PipelineConfig, load_config

STAGES = Path(__file__).resolve().parents[1]


@dataclass
class Walk:
    stays: list[tuple[str, list[str]]]  # (module, the functions entered there), in order

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.stays))

    @property
    def returns(self) -> list[str]:
        """The library modules the walk enters again after leaving them, once per return (the stage's
        own module, the first stay's, drives the walk and is not counted)."""
        root = self.stays[0][0] if self.stays else None
        seen: set[str] = set()
        back = []
        for module, _ in self.stays:
            if module in seen and module != root:
                back.append(module)
            seen.add(module)
        return back

    def text(self) -> str:
        lines = [
            f"{len(self.stays)} stays in {len(self.modules)} modules, "
            f"{len(self.returns)} returns to a library module already left"
            + (f" ({', '.join(self.returns)})" if self.returns else "")
        ]
        lines += [f"  {module}: {', '.join(names)}" for module, names in self.stays]
        return "\n".join(lines)


def walk(run: Callable[[], Any]) -> Walk:
    """The config's walk through stages/ while `run()` runs."""
    root = str(STAGES) + "/"
    first: dict[tuple[str, str], None] = {}

    def profile(frame, event, arg) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(root) or code.co_name.startswith("<"):
            return
        if any(isinstance(v, PipelineConfig) for k, v in frame.f_locals.items() if k != "self"):
            first.setdefault((code.co_filename[len(root) :], code.co_name), None)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    stays: list[tuple[str, list[str]]] = []
    for module, name in first:
        if stays and stays[-1][0] == module:
            stays[-1][1].append(name)
        else:
            stays.append((module, [name]))
    return Walk(stays)


def export_walk(preset: str = "tiny") -> Walk:
    """The config's walk through `run_export`, on a fresh download of the preset's built-in model."""
    from stages.core.pipeline import output_dir
    from stages.download import run_download
    from stages.export import run_export

    cfg = load_config(preset)
    with tempfile.TemporaryDirectory(prefix="config-walk-") as tmp:
        work = Path(tmp)
        checkpoint = output_dir(work, "download", cfg.checkpoint_name)
        run_download(cfg.model, cfg.model_revision, checkpoint)
        return walk(lambda: run_export(cfg, work, checkpoint))


@click.command()
@click.option("--preset", default="tiny", show_default=True, help="a preset whose model is built in")
def main(preset: str) -> None:
    """Print the pipeline config's walk through the export stage."""
    click.echo(export_walk(preset).text())


if __name__ == "__main__":
    main()
