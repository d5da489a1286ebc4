import hashlib
import importlib.util
import sys

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "docker" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_every_lock_pins_every_package_with_hashes():
    locks = sorted((REPO / "docker").glob("*/requirements.lock"))
    assert {p.parent.name for p in locks} == {"local", "export", "quant", "quant-rocm", "compile", "tools"}
    for lock in locks:
        reqs = wheelhouse.parse_lock(lock)
        assert reqs and all(reqs.values())
    export = wheelhouse.parse_lock(REPO / "docker" / "export" / "requirements.lock")
    assert "torch==2.13.0+cpu" in export  # the CPU build, never the CUDA one


def test_locks_agree_on_versions():
    pins: dict[str, str] = {}
    for lock in (REPO / "docker").glob("*/requirements.lock"):
        for req in wheelhouse.parse_lock(lock):
            name, version = req.split("==")
            assert pins.setdefault(name, version) == version, f"{name} differs in {lock}"


def test_resolve_matches_files_by_hash(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "a-1.0-py3-none-any.whl").write_bytes(b"A")
    (pool / "b-2.0-py3-none-any.whl").write_bytes(b"not B")
    lock = tmp_path / "x" / "requirements.lock"
    lock.parent.mkdir()
    lock.write_text(
        f"a==1.0 \\\n    --hash=sha256:{sha(b'A')}\n"
        f"b==2.0 \\\n    --hash=sha256:{sha(b'B')} \\\n    --hash=sha256:{'0' * 64}\n"
    )
    files, missing = wheelhouse.resolve(lock, pool)
    assert files == ["a-1.0-py3-none-any.whl"] and missing == ["b==2.0"]


def test_lock_without_hashes_is_refused(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("a==1.0\n")
    with pytest.raises(SystemExit, match="without hashes"):
        wheelhouse.parse_lock(lock)


def test_context_without_complete_wheelhouse_says_what_to_run(tmp_path):
    lock = REPO / "docker" / "tools" / "requirements.lock"
    with pytest.raises(SystemExit, match="make wheelhouse"):
        wheelhouse.context(tmp_path / "empty", lock, tmp_path / "ctx")


def test_platform_args_cover_older_manylinux_tags():
    args = wheelhouse.PLATFORM_ARGS
    assert "manylinux_2_36_x86_64" in args and "manylinux2014_x86_64" in args
    assert sys.version_info >= (3, 11)
