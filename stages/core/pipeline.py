"""The stage table: every stage once, in pipeline order, with its output folder, the stages whose output
it reads (and checks against their reports' hashes), the image it runs in and what it makes.

The CLI, the reports, the bench, doctor and the Makefile read it: the Makefile makes each stage's
rule from its row (`python -m stages.core.pipeline rows`, as it reads the config) and the CLI finds its
command there, so a stage's folder, inputs, image and command are said here only. Which config fields
invalidate a stage is said once per field, in `stages/core/config.py` (`stage_fields`). A new stage is a
row here and a module with its `run_<stage>` and its `command` (tests/unit/test_new_stage.py adds
one); the bundle and verify stages are the runtime's (`stages.runtimes`).

Stdlib only: the Makefile reads it before any image exists.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stage:
    name: str
    folder: str  # under WORKDIR; download's output is one checkpoint folder inside it
    upstream: tuple[str, ...]  # stages whose output it reads
    image: str  # docker/<image>/: what runs it under RUNNER=docker
    makes: str
    # Its `g4v69 <name>` command, "module:attribute" (imported when it runs): in the stage's own module,
    # or in the CLI's for the runtime's stages, which reach the runtime through its registry.
    command: str
    # The output is one folder per checkpoint inside `folder` (download keeps every checkpoint it got).
    per_checkpoint: bool = False
    # A stamp per config says it finished (Make skips it then); a check without one runs whenever asked.
    stamped: bool = True


PIPELINE: tuple[Stage, ...] = (
    Stage(
        "download",
        "checkpoints",
        (),
        "export",
        "fetch the checkpoint (or make a built-in model) into checkpoints/<name>/",
        "stages.download:command",
        per_checkpoint=True,
    ),
    Stage(
        "export",
        "exported",
        ("download",),
        "export",
        "static-shape sharded ONNX graphs + LUTs into exported/",
        "stages.export:command",
    ),
    Stage(
        "quantize",
        "quantized",
        ("download", "export"),
        "quant",
        "audited QDQ graphs at PRECISION (QUANT_ARGS, QUANT_IMAGE) into quantized/",
        "stages.quantize.stage:command",
    ),
    Stage(
        "compile",
        "compiled",
        ("quantize",),
        "compile",
        "QNN context binaries into compiled/ (COMPILER)",
        "stages.compile:command",
    ),
    # Genie's own config validator is onnxruntime-qnn's libGenie.so, in the compile image.
    Stage(
        "bundle",
        "genie_bundle",
        ("download", "export", "compile"),
        "compile",
        "the Genie bundle into genie_bundle/",
        "stages.cli:bundle",
    ),
    Stage(
        "verify",
        "verify",
        ("download", "quantize", "bundle"),
        "export",
        "check the bundle under the real Genie and an emulator against transformers into verify/ (VERIFY_*)",
        "stages.cli:verify",
        stamped=False,
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in PIPELINE)

# The runtime table: name -> the package under stages/runtimes/ whose RUNTIME implements
# stages.runtimes.Runtime (imported on first use). The config field `runtime` picks a row; the bundle
# and verify stages and `make push` / `make run` are that runtime's.
RUNTIMES: dict[str, str] = {"genie": "stages.runtimes.genie"}
_BY_NAME = {s.name: s for s in PIPELINE}


def stage(name: str) -> Stage:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a stage; allowed values: {', '.join(STAGE_NAMES)}") from None


def output_dir(workdir: Path, name: str, checkpoint_name: str | None = None) -> Path:
    """Where a stage writes under workdir; download needs the checkpoint's folder name."""
    s = stage(name)
    folder = Path(workdir) / s.folder
    if s.per_checkpoint:
        if not checkpoint_name:
            raise ValueError(f"the {name} stage's folder needs the checkpoint name")
        return folder / checkpoint_name
    return folder


def make_rows() -> str:
    """One word per stage, in order, for the Makefile's stage rules:
    name:folder:upstream,stages:image:per_checkpoint:stamped ('-' for no upstream, yes/no flags)."""

    def row(s: Stage) -> str:
        flags = ["yes" if s.per_checkpoint else "no", "yes" if s.stamped else "no"]
        return ":".join([s.name, s.folder, ",".join(s.upstream) or "-", s.image, *flags])

    return " ".join(row(s) for s in PIPELINE)


def make_help() -> str:
    """The stage targets' lines of `make help`."""
    return "\n".join(f"  {s.name:<12} {s.makes}" for s in PIPELINE)


def _main(argv: list[str]) -> int:
    """`python -m stages.core.pipeline rows|help`: the stage table for the Makefile's rules and its help."""
    if argv == ["rows"]:
        print(make_rows())
        return 0
    if argv == ["help"]:
        print(make_help())
        return 0
    print("usage: python -m stages.core.pipeline rows|help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
