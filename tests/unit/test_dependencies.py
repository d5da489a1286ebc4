"""Dependencies point one way: from the CLI down through the stages to the shared core. Read from the
source (every import, module level or inside a function), so a shortcut import fails here, named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

STAGES = Path(__file__).resolve().parents[2] / "stages"


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


MODULES = {_module(p): p for p in STAGES.rglob("*.py")}

# (importer prefix, forbidden import prefix, why)
RULES = [
    ("stages.runtimes", "stages.doctor", "a runtime's facts live in the runtime; doctor reads them"),
    ("stages.runtimes", "stages.compile", "the emulator reads graph I/O through stages.encoding"),
    ("stages.runtimes", "stages.cli", "runtimes are driven by the CLI, never the other way"),
    ("stages.precision", "stages.config", "the precision table is stdlib-only and read by the config"),
    ("stages.soc", "stages.config", "the SoC table is read by the config, not the other way"),
] + [
    (m, "stages.runtimes.genie", "a runtime is reached through the registry (stages.runtimes.get_runtime)")
    for m in (
        "stages.cli",
        "stages.export",
        "stages.compile",
        "stages.quantize",
        "stages.plan",
        "stages.fitting",
        "stages.config",
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
    """stages/plan.py is `g4v69 plan`'s text; what the stages fit against is stages/fitting.py."""
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if name not in ("stages.cli", "stages.plan")
        and any(i.startswith("stages.plan") for i in imports_of(path))
    )
    assert offenders == [], "import stages.fitting instead: " + ", ".join(offenders)


def test_the_rule_reader_sees_imports_inside_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from stages.compile import prepare_io\n    import stages.doctor\n")
    assert imports_of(src) >= {"stages.compile", "stages.compile.prepare_io", "stages.doctor"}
