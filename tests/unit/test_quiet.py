"""Known library noise is dropped, and nothing else: the logging filters the CLI installs, and the
stdout filter the compile workers run under (native printf included)."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from stages.core.quiet import quiet_libraries

PYTREE_MSG = (
    "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
    "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
)


def _enum_from(module: str) -> type:
    cls = enum.Enum("KernelPreference", "AUTO")
    cls.__module__ = module
    return cls


def _record(name: str, level: int, msg: str, args: tuple = (), pathname: str = "x.py") -> logging.LogRecord:
    return logging.LogRecord(name, level, pathname, 1, msg, args, None)


class _Seen(logging.Handler):
    """Records that passed a logger's level and filters (torch's loggers do not propagate to root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _seen_on(logger: logging.Logger) -> Iterator[_Seen]:
    seen = _Seen()
    logger.addHandler(seen)
    try:
        yield seen
    finally:
        logger.removeHandler(seen)


def test_known_library_log_lines_are_dropped_and_others_kept():
    quiet_libraries()
    quiet_libraries()  # idempotent: one filter per logger
    assert len(logging.getLogger("torch.utils._pytree").filters) == 1
    cases = {
        ("torchao", logging.WARNING, "Failed to load /x/torchao/_C_mxfp8.so: Could not load", ()): False,
        ("torchao", logging.ERROR, "something torchao considers an error", ()): True,
        ("torch.utils._pytree", logging.WARNING, PYTREE_MSG, (_enum_from("torchao.quantization"),)): False,
        ("torch.utils._pytree", logging.WARNING, PYTREE_MSG, (_enum_from("ours"),)): True,
        ("torch.utils._pytree", logging.WARNING, "another pytree warning", ()): True,
    }
    for (name, level, msg, args), shown in cases.items():
        logger = logging.getLogger(name)
        with _seen_on(logger) as seen:
            logger.log(level, msg, *args)
        assert bool(seen.records) == shown, (name, msg)
    root = logging.getLogger()
    ort_quantize = "/venv/lib/python3.11/site-packages/onnxruntime/quantization/quantize.py"
    for path, shown in ((ort_quantize, False), ("/elsewhere/quantize.py", True)):
        advice = _record("root", logging.WARNING, "Please consider to run pre-processing", pathname=path)
        with _seen_on(root) as seen:
            root.handle(advice)
        assert bool(seen.records) == shown, path


WORKER = r"""
import ctypes, sys
from stages.core.quiet import call_without_native_noise

def work(n):
    libc = ctypes.CDLL(None)
    libc.printf(b" # LIBNATIVE: No alternate configuration present in libnative_tls.conf or from X\n")
    libc.printf(b"native line kept\n")
    print("python line kept")
    sys.stderr.write("stderr untouched\n")
    return n * 2

print("result", call_without_native_noise(work, 21))
"""


def test_native_stdout_filter_drops_only_the_known_line():
    # stdout is a pipe here, so C stdio buffers it fully: the filter must flush before restoring fd 1.
    r = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60, check=True)
    assert "LIBNATIVE" not in r.stdout
    assert r.stdout.splitlines() == ["native line kept", "python line kept", "result 42"]
    assert r.stderr == "stderr untouched\n"


QUIET_IMPORT = """
import sys
if sys.argv[1] == "quiet":
    from stages.core.quiet import quiet_libraries
    quiet_libraries()
from transformers import Gemma4ForCausalLM
"""


@pytest.mark.slow
def test_transformers_imports_torchao_and_the_cli_setup_silences_it():
    """The premise (transformers imports torchao, which logs on import) and the fix, end to end."""
    pytest.importorskip("torchao")
    noise = ("Failed to load", "register_constant()")
    loud, quiet = (
        subprocess.run(
            [sys.executable, "-c", QUIET_IMPORT, mode], capture_output=True, text=True, timeout=300
        )
        for mode in ("loud", "quiet")
    )
    assert loud.returncode == quiet.returncode == 0, quiet.stderr[-2000:]
    assert all(n in loud.stderr for n in noise), loud.stderr[-2000:]
    assert not any(n in quiet.stdout + quiet.stderr for n in noise), quiet.stderr[-2000:]
