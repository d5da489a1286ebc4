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
    """stages/contract.py owns every graph tensor name, name pattern and Genie LUT section name; a
    name typed elsewhere is a second source that drifts (issue 16)."""
    import re

    from stages import contract
    from stages.geometry import FULL, SLIDING

    names = {
        contract.INPUTS_EMBEDS,
        contract.PER_LAYER_INPUTS,
        contract.PER_LAYER_EMBEDS,
        contract.LOGITS,
        *contract.MASK_NAME.values(),
        *(contract.rope_name(kind, f) for kind in (FULL, SLIDING) for f in ("cos", "sin")),
        # "embedding" is also the export report's LUT key and a geometry name; the other is Genie's.
        *(v for v in contract.GENIE_LUT_SECTION.values() if v != "embedding"),
    }
    patterns = [
        re.compile(rf"^(?:{'|'.join(contract.CACHE_PREFIX.values())})_(?:key|value)_\d+_h\d+_(?:in|out)$"),
        re.compile(rf"^{contract.HIDDEN_PREFIX}\d*$"),
        re.compile(rf"^{contract.KVSHARE_PREFIX}(?:key|value)?_?\d*$"),
    ]
    found = []
    for path in sorted((REPO / "stages").glob("*.py")):
        if path.name == "contract.py":
            continue
        for line, value in _string_constants(path):
            if value in names or any(p.match(value) for p in patterns):
                found.append(f"{path.name}:{line}: {value!r}")
    assert not found, "tensor names outside stages/contract.py:\n" + "\n".join(found)
