"""Keeping known library noise out of the stages' output, so a normal run prints only our progress and
results. Each entry names what prints the line and why it says nothing to a user of this project;
anything else a library logs still shows.

- torchao (installed as a dependency of executorch) is imported by transformers' quantizer registry
  whenever transformers loads a model (transformers/quantizers/quantizer_torchao.py, because
  `is_torchao_available()`). On import it tries its CUDA kernels (`_C_mxfp8`, `_C_cutlass_90a`) and
  logs "Failed to load ..." on our CPU-only torch, then registers two Enums as pytree constants,
  which torch 2.13 logs as deprecated (torch/utils/_pytree.py). Neither is used here.
- onnxruntime's quantize_static logs (root logger) advice to run its shape-inference pre-processing;
  our graphs have static shapes and fused ops already.
- libQnnHtp.so (onnxruntime-qnn) prints "# LIBNATIVE: No alternate configuration present in
  libnative_tls.conf ..." to stdout from native code in every compile process. Setting its
  LIBNATIVE_CONFIG variable only trades it for "config file detected" lines, so the known line is
  filtered out of that process's stdout instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NATIVE_NOISE = (b"# LIBNATIVE: No alternate configuration present in libnative_tls.conf",)


def _not_torchao_enum(record: logging.LogRecord) -> bool:
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return not (
        "register_constant() on Enum subclasses is deprecated" in str(record.msg)
        and getattr(cls, "__module__", "").startswith("torchao.")
    )


def _not_onnxruntime_preprocess_advice(record: logging.LogRecord) -> bool:
    quantize_py = os.path.join("onnxruntime", "quantization", "quantize.py")
    return not (record.pathname.endswith(quantize_py) and str(record.msg).startswith("Please consider"))


# Logger name -> a filter (a callable: false drops the record).
_FILTERS = {"torch.utils._pytree": _not_torchao_enum, "": _not_onnxruntime_preprocess_advice}


def quiet_libraries() -> None:
    """Called once where the CLI starts, before any stage imports torch, transformers or onnxruntime."""
    # Nothing here uses torchao; its warnings are about its optional kernels at import. Errors still show.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    for name, flt in _FILTERS.items():
        logger = logging.getLogger(name)
        if flt not in logger.filters:
            logger.addFilter(flt)


@contextmanager
def native_stdout_without(known: tuple[bytes, ...] = NATIVE_NOISE) -> Iterator[None]:
    """Collect what this process writes to file descriptor 1 (native code included) and pass it on
    afterwards without the lines that contain one of `known`. Standard error is left alone, so a crash
    still reports as usual."""
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as buffer:
        os.dup2(buffer.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            libc.fflush(None)  # C stdio buffers, before fd 1 points back
            os.dup2(saved, 1)
            os.close(saved)
            buffer.seek(0)
            kept = b"".join(line for line in buffer if not any(k in line for k in known))
            if kept:
                sys.stdout.buffer.write(kept)
                sys.stdout.flush()


def call_without_native_noise(func: Callable[..., Any], *args: Any) -> Any:
    """func(*args) under `native_stdout_without`: a picklable wrapper for process-pool workers."""
    with native_stdout_without():
        return func(*args)
