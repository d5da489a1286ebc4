"""Dependencies point one way: from the CLI down through the stages to the shared core. Read from the
source (every import, module level or inside a function, type-only ones too), so a shortcut import
fails here, named.

The folders of stages/ are its layers (docs/architecture.md, "Folders and layers"), lowest first:

    core      stages/core/         imports nothing else of stages/
    model     stages/model/        core
    planning  stages/planning/     core, model; and the runtime registry (stages/runtimes/__init__.py:
                                   the Runtime protocol and get_runtime, which loads a runtime by name)
    quant     stages/quant/        core, model, planning
    stage     stages/<stage>.py    the layers below; never another stage (aihub.py is compile's backend)
              stages/quantize/
    runtime   stages/runtimes/<name>/   the layers below the stages; never a stage
    tools     stages/tools/        any of the above
    cli       stages/cli.py        any of the above
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

STAGES = Path(__file__).resolve().parents[2] / "stages"

LAYERS = ("core", "model", "planning", "quant", "stage", "tools", "cli")
# The stage modules (and the runtimes, which sit on the same floor): which stage each belongs to.
STAGE_MODULES = {
    "stages.download": "download",
    "stages.export": "export",
    "stages.quantize": "quantize",
    "stages.compile": "compile",
    "stages.aihub": "compile",
}


def _module(path: Path) -> str:
    rel = path.relative_to(STAGES.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every stages.* module `path` imports, wherever the import statement sits."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("stages")}


def place(module: str) -> tuple[str, str]:
    """(layer, group) of a stages module; the group tells apart modules that share the stage floor
    (each stage, each runtime) and must not import one another. Raises for a module in no layer."""
    parts = module.split(".")
    if module in ("stages", "stages.__main__", "stages.cli"):
        return ("core", "core") if module == "stages" else ("cli", "cli")
    if parts[1] in ("core", "model", "planning", "quant", "tools"):
        return parts[1], parts[1]
    if module == "stages.runtimes":
        return "planning", "planning"
    if parts[1] == "runtimes":
        return "stage", f"runtime {parts[2]}"
    owner = STAGE_MODULES.get(".".join(parts[:2]))
    if owner:
        return "stage", f"stage {owner}"
    raise LookupError(f"{module} is in no layer: put it in a layer's folder (see this test's docstring)")


def allowed(importer: str, imported: str) -> bool:
    (low, low_group), (high, high_group) = place(imported), place(importer)
    if LAYERS.index(low) != LAYERS.index(high):
        return LAYERS.index(low) < LAYERS.index(high)
    # Same floor: the libraries share theirs; a stage or a runtime keeps to its own modules.
    return high != "stage" or low_group == high_group


MODULES = {_module(p): p for p in STAGES.rglob("*.py")}

# (importer prefix, forbidden import prefix, why)
RULES = [
    ("stages.runtimes", "stages.tools.doctor", "a runtime's facts live in the runtime; doctor reads them"),
    ("stages.runtimes", "stages.compile", "the emulator reads graph I/O through stages.model.encoding"),
    ("stages.runtimes", "stages.cli", "runtimes are driven by the CLI, never the other way"),
    (
        "stages.core.precision",
        "stages.core.config",
        "the precision table is stdlib-only and read by the config",
    ),
    ("stages.core.soc", "stages.core.config", "the SoC table is read by the config, not the other way"),
] + [
    (m, "stages.runtimes.genie", "a runtime is reached through the registry (stages.runtimes.get_runtime)")
    for m in (
        "stages.cli",
        "stages.export",
        "stages.compile",
        "stages.quantize",
        "stages.planning.plan",
        "stages.planning.fitting",
        "stages.core.config",
    )
]


@pytest.mark.parametrize(("importer", "forbidden", "why"), RULES)
def test_no_import_against_the_direction(importer: str, forbidden: str, why: str) -> None:
    offenders = sorted(
        f"{name} imports {imp}"
        for name, path in MODULES.items()
        if name.startswith(importer)
        for imp in imports_of(path)
        if imp.startswith(forbidden)
    )
    assert offenders == [], f"{why}: " + "; ".join(offenders)


def test_only_the_cli_imports_the_plan_report():
    """stages/planning/plan.py is `g4v69 plan`'s text; what the stages fit against is
    stages/planning/fitting.py."""
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if name not in ("stages.cli", "stages.planning.plan")
        and any(i.startswith("stages.planning.plan") for i in imports_of(path))
    )
    assert offenders == [], "import stages.planning.fitting instead: " + ", ".join(offenders)


def test_every_module_sits_in_a_layer() -> None:
    unplaced = []
    for name in MODULES:
        try:
            place(name)
        except LookupError as e:
            unplaced.append(str(e))
    assert unplaced == []
    # The folders are the layers: nothing but the stages, the CLI and the package's own files at the top.
    top = sorted(
        n
        for n, path in MODULES.items()
        if path.parent == STAGES and path.name != "__init__.py" and place(n)[0] not in ("stage", "cli")
    )
    assert top == [], top


def test_imports_follow_the_layers() -> None:
    offenders = sorted(
        f"{name} ({place(name)[1]}) imports {module} ({place(module)[1]})"
        for name, path in MODULES.items()
        for imp in imports_of(path)
        # `from stages.x import name` lists stages.x.name too: judge the module it names.
        for module in [imp if imp in MODULES else imp.rsplit(".", 1)[0]]
        if module in MODULES and not allowed(name, module)
    )
    assert offenders == [], "imports against the layers:\n" + "\n".join(offenders)


def test_the_layer_rule_refuses_what_it_should() -> None:
    assert allowed("stages.quant.gptq", "stages.planning.fitting")
    assert allowed("stages.planning.fitting", "stages.runtimes")
    assert allowed("stages.compile", "stages.aihub")
    assert allowed("stages.tools.doctor", "stages.runtimes.genie.files")
    assert not allowed("stages.core.config", "stages.model.geometry")
    assert not allowed("stages.model.contract", "stages.planning.job")
    assert not allowed("stages.export", "stages.download")
    assert not allowed("stages.runtimes.genie.verify", "stages.compile")
    assert not allowed("stages.compile", "stages.runtimes.genie.bundle")
    assert not allowed("stages.quant.runner", "stages.quantize.stage")
    with pytest.raises(LookupError, match="in no layer"):
        place("stages.loose")


def test_the_rule_reader_sees_imports_inside_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from stages.compile import prepare_io\n    import stages.tools.doctor\n")
    assert imports_of(src) >= {"stages.compile", "stages.compile.prepare_io", "stages.tools.doctor"}
