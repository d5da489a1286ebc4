#!/usr/bin/env python3
"""Fills the wheelhouse from the hash-locked requirements and assembles offline image build contexts.

    wheelhouse.py fill WHEELHOUSE LOCK [LOCK ...] [-- PIP_DOWNLOAD_ARGS]
    wheelhouse.py context WHEELHOUSE LOCK DEST

One pool of files (wheels, and the odd sdist) serves every lock; a lock is "complete" once each of
its requirements has a pool file whose sha256 the lock lists, recorded in complete/<name>-<hash>.txt.
A complete lock is never downloaded again, so a rerun on the same machine needs no network. Only
the standard library is used: this runs on the host before any image exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The stage images' platform (Debian bookworm: glibc 2.36, CPython 3.11, x86_64). pip does not
# expand a manylinux tag to the older ones it implies, so every accepted tag is listed.
_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64", "any",
]  # fmt: skip
PLATFORM_ARGS = [a for p in _PLATFORMS for a in ("--platform", p)] + [
    "--python-version", "3.11", "--implementation", "cp",
    "--abi", "cp311", "--abi", "abi3", "--abi", "none",
]  # fmt: skip
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def parse_lock(lock: Path) -> dict[str, set[str]]:
    """name==version -> the sha256 hashes the lock accepts for it."""
    reqs: dict[str, set[str]] = {}
    current = None
    for line in lock.read_text().splitlines():
        if m := _REQ.match(line):
            current = f"{m.group(1)}=={m.group(2)}"
            reqs[current] = set()
        if current:
            reqs[current].update(_HASH.findall(line))
    missing = [r for r, h in reqs.items() if not h]
    if missing:
        sys.exit(f"error: {lock} has requirements without hashes: {', '.join(missing)}; run `make lock`")
    return reqs


def lock_key(lock: Path) -> str:
    return f"{lock.parent.name}-{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}"


def pool_hashes(pool: Path) -> dict[str, str]:
    """sha256 of every pool file, cached by (size, mtime) in pool/.sha256.json."""
    cache_file = pool / ".sha256.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    out, fresh = {}, {}
    for f in sorted(pool.iterdir()):
        if f.name.startswith(".") or not f.is_file():
            continue
        st = f.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}"
        entry = cache.get(f.name)
        if entry and entry[0] == key:
            digest = entry[1]
        else:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
            digest = h.hexdigest()
        out[digest] = f.name
        fresh[f.name] = [key, digest]
    tmp = cache_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(fresh, indent=0, sort_keys=True))
    os.replace(tmp, cache_file)
    return out


def resolve(lock: Path, pool: Path) -> tuple[list[str], list[str]]:
    """Pool file for each requirement, and the requirements that have none yet."""
    by_hash = pool_hashes(pool)
    files, missing = [], []
    for req, hashes in parse_lock(lock).items():
        found = sorted(by_hash[h] for h in hashes if h in by_hash)
        if found:
            files.append(found[0])
        else:
            missing.append(req)
    return files, missing


def complete_record(wheelhouse: Path, lock: Path) -> Path:
    return wheelhouse / "complete" / f"{lock_key(lock)}.txt"


def fill(wheelhouse: Path, locks: list[Path], pip_args: list[str]) -> None:
    pool = wheelhouse / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    (wheelhouse / "complete").mkdir(exist_ok=True)
    for lock in locks:
        record = complete_record(wheelhouse, lock)
        if record.exists() and all((pool / n).exists() for n in record.read_text().split()):
            print(f"wheelhouse: {lock} complete ({record.name}), nothing to download")
            continue
        _, missing = resolve(lock, pool)
        if missing:
            print(f"wheelhouse: downloading {len(missing)} files for {lock}", flush=True)
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                "--quiet", "--disable-pip-version-check", "-d", str(pool),
                *PLATFORM_ARGS, *pip_args, "-r", str(lock),
            ]  # fmt: skip
            r = subprocess.run(cmd)
            if r.returncode != 0:
                sys.exit(f"error: pip download for {lock} failed (exit {r.returncode}); see above")
        files, missing = resolve(lock, pool)
        if missing:
            sys.exit(
                f"error: after download, no file in {pool} matches the locked hashes of: "
                f"{', '.join(missing)}; check the index (torch needs its CPU build) or run `make lock`"
            )
        tmp = record.with_suffix(".tmp")
        tmp.write_text("\n".join(files) + "\n")
        os.replace(tmp, record)
        print(f"wheelhouse: {lock} complete, {len(files)} files")


def context(wheelhouse: Path, lock: Path, dest: Path) -> None:
    """Put exactly the lock's files into DEST/wheels (hard links where possible)."""
    record = complete_record(wheelhouse, lock)
    if not record.exists():
        sys.exit(f"error: the wheelhouse has no complete set for {lock}; run `make wheelhouse` first")
    wheels = dest / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    for name in record.read_text().split():
        src = wheelhouse / "pool" / name
        try:
            os.link(src, wheels / name)
        except OSError:
            shutil.copy2(src, wheels / name)


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "fill":
        rest = argv[2:]
        cut = rest.index("--") if "--" in rest else len(rest)
        locks, pip_args = rest[:cut], rest[cut + 1 :]
        fill(Path(argv[1]), [Path(p) for p in locks], pip_args)
    elif len(argv) == 4 and argv[0] == "context":
        context(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
