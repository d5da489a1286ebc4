import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, run

RUFF = Path(sys.prefix) / "bin" / "ruff"


@pytest.mark.skipif(not RUFF.exists() and not shutil.which("ruff"), reason="ruff not installed")
def test_code_is_ruff_clean():
    ruff = str(RUFF) if RUFF.exists() else shutil.which("ruff")
    for args in (["check"], ["format", "--check"]):
        r = run([ruff, *args, "stages", "tests", "docker"], cwd=REPO)
        assert r.returncode == 0, r.stdout + r.stderr


def _string_constants(path: Path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_tensor_names_are_spelled_only_in_the_contract():
    """stages/model/contract.py owns every graph tensor name and name pattern; a name typed elsewhere
    is a second source that drifts (issue 16)."""
    import re

    from stages.model import contract
    from stages.model.geometry import FULL, SLIDING

    names = {
        contract.INPUTS_EMBEDS,
        contract.PER_LAYER_INPUTS,
        contract.PER_LAYER_EMBEDS,
        contract.LOGITS,
        *contract.MASK_NAME.values(),
        *(contract.rope_name(kind, f) for kind in (FULL, SLIDING) for f in ("cos", "sin")),
    }
    patterns = [
        re.compile(rf"^(?:{'|'.join(contract.CACHE_PREFIX.values())})_(?:key|value)_\d+_h\d+_(?:in|out)$"),
        re.compile(rf"^{contract.HIDDEN_PREFIX}\d*$"),
        re.compile(rf"^{contract.KVSHARE_PREFIX}(?:key|value)?_?\d*$"),
    ]
    found = []
    for path in sorted((REPO / "stages").rglob("*.py")):
        if path.name == "contract.py":
            continue
        for line, value in _string_constants(path):
            if value in names or any(p.match(value) for p in patterns):
                found.append(f"{path.relative_to(REPO)}:{line}: {value!r}")
    assert not found, "tensor names outside stages/model/contract.py:\n" + "\n".join(found)


def test_genie_lut_words_are_spelled_only_in_its_rules():
    """Genie's genie_config.json LUT sections are the runtime's words: spelled in
    stages/runtimes/genie/rules.py only (issue 34). Its LUT datatypes are QNN's names, which
    stages/model/encoding.py owns."""
    from stages.runtimes.genie import rules

    # "embedding" is also the export report's LUT key and a geometry name; the other is Genie's.
    words = {v for v in rules.LUT_SECTION.values() if v != "embedding"}
    found = [
        f"{path.relative_to(REPO)}:{line}: {value!r}"
        for path in sorted((REPO / "stages").rglob("*.py"))
        if path != Path(rules.__file__)
        for line, value in _string_constants(path)
        if value in words
    ]
    assert not found, "Genie LUT words outside stages/runtimes/genie/rules.py:\n" + "\n".join(found)


def _module(path: Path) -> str:
    """stages/runtimes/genie/bundle.py -> runtimes.genie.bundle; a package's __init__ -> the package."""
    parts = path.relative_to(REPO / "stages").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stage_imports(path: Path, modules: set[str]) -> set[str]:
    """The stages modules `path` imports, at the top or inside a function (both run eventually)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "stages":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stages."):
            found.add(node.module.removeprefix("stages."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("stages.") for a in node.names if a.name.startswith("stages.")}
    return (found & modules) - {_module(path)}


def test_the_import_graph_of_stages_has_no_cycles():
    """A cycle means two modules are one job split badly (compile <-> aihub, download <-> tiny_model
    were; issue 16); graphlib names the modules of a new one."""
    from graphlib import CycleError, TopologicalSorter

    paths = [p for p in sorted((REPO / "stages").rglob("*.py")) if _module(p)]  # not stages/__init__
    modules = {_module(p) for p in paths}
    assert "runtimes.genie.bundle" in modules  # subpackages are walked too
    graph = {_module(p): _stage_imports(p, modules) for p in paths}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle in stages/: {' -> '.join(e.args[1])}")
    assert set(order) == modules


def test_later_stages_read_the_job_and_typed_results():
    """Compile, bundle and verify read what export worked out (`QuantizeResult.job`) and the stage
    outputs through their typed results: no layout derived again from the config, no report dict
    indexed by hand."""
    import re

    root = Path(__file__).parents[2] / "stages"
    files = [
        root / "compile.py",
        root / "runtimes" / "genie" / "bundle.py",
        root / "runtimes" / "genie" / "verify.py",
    ]
    for path in files:
        text = path.read_text()
        for call in ("lay_out_binaries(", "graph_kinds(", "graph_specs(", "part_layers(", "Job.build("):
            assert call not in text, f"{path.name} derives the job again: {call}"
        indexed = re.findall(r"\b(?:compiled|exported|quantized|download)\.\w+(?:\.\w+)*\s*\[", text)
        assert not indexed, f"{path.name} indexes a stage output by hand: {indexed}"
        assert not re.search(r"\.report\.figures\b", text), f"{path.name} reads a report's figures untyped"
        # Keys of the earlier stages' records, read by hand; compile builds its own figures (figures,
        # fig, gf) and the bundle checks its own manifest's entries (f).
        keys = (
            "file|graphs|io|weight_shared|sha256|qdq_onnx|onnx|qairt_version|bits|estimated_allocation_bytes"
        )
        by_hand = [
            m.group(0)
            for m in re.finditer(rf'\b(\w+)\["(?:{keys})"\]', text)
            if m.group(1) not in ("figures", "fig", "gf", "f")
        ]
        assert not by_hand, f"{path.name} reads an earlier stage's record by hand: {by_hand}"
