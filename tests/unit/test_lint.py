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
