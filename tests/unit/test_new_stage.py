"""Adding a stage touches the stage table and the stage's own module only: a throwaway stage is added to
a copy of the package (one row in stages/core/pipeline.py, one new module), and the CLI runs it through the
stage driver (inputs checked, report and stamp written) and the Makefile makes its rule, with no other
file edited."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from conftest import REPO, run

ROW = """    Stage(
        "summary",
        "summary",
        ("download",),
        "tools",
        "a one-line summary of the checkpoint into summary/",
        "stages.summary:command",
    ),
"""

MODULE = '''"""A throwaway stage: the checkpoint's layer count, written through the stage driver."""

from __future__ import annotations

import json

import click

from stages.core.command import Context
from stages.core.pipeline import output_dir
from stages.core.report import StageJob, read_report


def run_summary(cfg, workdir, checkpoint_dir):
    job = StageJob("summary", cfg, workdir)
    job.check([checkpoint_dir])
    config = checkpoint_dir / "config.json"
    with job.output([config]) as run:
        layers = json.loads(config.read_text())["text_config"]["num_hidden_layers"]
        (run.dir / "summary.txt").write_text(f"{cfg.model}: {layers} layers\\n")
        run.figures["layers"] = layers
    return read_report(job.out_dir)


@click.command(name="summary")
@click.pass_obj
def command(obj: Context) -> None:
    """A one-line summary of the checkpoint."""
    report = run_summary(obj.config, obj.workdir, obj.checkpoint_dir())
    click.echo(f"{output_dir(obj.workdir, 'summary')}: {report['figures']['layers']} layers")
'''


def _copy_with_a_new_stage(dest: Path) -> Path:
    shutil.copytree(REPO / "stages", dest / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "Makefile", dest / "Makefile")
    for script in ("docker/base/build-base.sh", "docker/image-tag.sh"):
        (dest / script).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / script, dest / script)
    table = dest / "stages" / "core" / "pipeline.py"
    text = table.read_text()
    end = text.index(")\nSTAGE_NAMES")
    table.write_text(text[:end] + ROW + text[end:])
    (dest / "stages" / "summary.py").write_text(MODULE)
    return dest


def test_a_stage_is_a_table_row_and_a_module(tmp_path: Path) -> None:
    tree = _copy_with_a_new_stage(tmp_path / "tree")
    work = tmp_path / "work"
    env = {"PYTHONPATH": str(tree)}

    def g4v69(*args: str):
        # Run from the copy: `python -m` puts the working folder first on the path.
        cmd = [sys.executable, "-m", "stages", "--preset", "tiny", "--workdir", str(work), *args]
        return run(cmd, env=env, cwd=tree)

    listed = g4v69("--help")
    assert listed.returncode == 0 and "summary" in listed.stdout, listed.stderr
    # Its upstream is checked first: without a download it says so and writes nothing.
    early = g4v69("summary")
    assert early.returncode == 2 and "run `make download` first" in early.stderr
    assert not (work / "summary").exists()

    assert g4v69("download").returncode == 0
    # The Makefile's rule: after download's report, in the table's image, with the stage's command.
    make = run(
        ["make", "--no-print-directory", "-n", "summary", "PRESET=tiny", f"WORKDIR={work}", "RUNNER=docker"],
        env=env,
        cwd=tree,
    )
    assert make.returncode == 0, make.stderr
    recipes = [line for line in make.stdout.splitlines() if line.rstrip().endswith(" summary")]
    # (the copy has no image sources to tag; the rule still asks for the table's image first)
    assert len(recipes) == 1 and "build-image.sh tools " in make.stdout, make.stdout

    done = g4v69("summary")
    assert done.returncode == 0, done.stderr
    report = json.loads((work / "summary" / "report.json").read_text())
    assert report["figures"]["layers"] > 0 and report["options"]["model"] == "tiny"
    # The driver wrote the stamp Make looks for: the stage is now up to date for this config.
    venv = Path(sys.prefix)
    local = ["RUNNER=local", f"VENV={venv}", "-o", f"{venv}/.installed"]
    uptodate = run(["make", "-q", "summary", "PRESET=tiny", f"WORKDIR={work}", *local], env=env, cwd=tree)
    assert uptodate.returncode == 0, uptodate.stdout + uptodate.stderr
    helped = run(["make", "--no-print-directory", "help"], env=env, cwd=tree)
    assert "summary      a one-line summary of the checkpoint into summary/" in helped.stdout

    def sources(root: Path) -> dict[str, bytes]:
        return {
            str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.suffix in (".py", ".toml")
        }

    ours, theirs = sources(REPO / "stages"), sources(tree / "stages")
    edited = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
    assert edited == ["core/pipeline.py", "summary.py"], edited
