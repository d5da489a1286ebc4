"""The stage table: every stage once, in pipeline order, with its output folder, the stages whose output
it reads (and checks against their reports' hashes), the image it runs in and what it makes.

The CLI, the reports, the bench, doctor and the Makefile read it (the Makefile through
`python -m stages.pipeline`, as it reads the config; a unit test checks its recipes against the
images here). Which config fields invalidate a stage is said once per field, in `stages/config.py`
(`stage_fields`). A new stage is a row here, a module with its `run_<stage>` and a CLI command; the
bundle and verify stages are the runtime's (`stages.runtimes`).

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


PIPELINE: tuple[Stage, ...] = (
    Stage(
        "download", "checkpoints", (), "export", "the checkpoint (or a built-in model) in checkpoints/<name>/"
    ),
    Stage(
        "export", "exported", ("download",), "export", "static-shape sharded ONNX graphs and the Genie LUTs"
    ),
    Stage("quantize", "quantized", ("download", "export"), "quant", "audited QDQ graphs at the precision"),
    Stage("compile", "compiled", ("quantize",), "compile", "QNN context binaries, one per graph"),
    # Genie's own config validator is onnxruntime-qnn's libGenie.so, in the compile image.
    Stage("bundle", "genie_bundle", ("download", "export", "compile"), "compile", "the Genie bundle"),
    Stage(
        "verify",
        "verify",
        ("download", "quantize", "bundle"),
        "export",
        "the bundle under the Genie emulator against transformers",
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in PIPELINE)
_BY_NAME = {s.name: s for s in PIPELINE}


def stage(name: str) -> Stage:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a stage; allowed values: {', '.join(STAGE_NAMES)}") from None


def output_dir(workdir: Path, name: str, checkpoint_name: str | None = None) -> Path:
    """Where a stage writes under workdir; download needs the checkpoint's folder name."""
    folder = Path(workdir) / stage(name).folder
    if name == "download":
        if not checkpoint_name:
            raise ValueError("the download stage's folder needs the checkpoint name")
        return folder / checkpoint_name
    return folder


def _main(argv: list[str]) -> int:
    """`python -m stages.pipeline folders`: the output folders, in stage order (for the Makefile)."""
    if argv == ["folders"]:
        print(" ".join(s.folder for s in PIPELINE))
        return 0
    print("usage: python -m stages.pipeline folders", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
