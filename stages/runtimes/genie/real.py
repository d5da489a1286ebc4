"""The real Genie on the host: QAIRT's own libGenie.so (x86, from onnxruntime-qnn) driven through its
C API over the x86 libQnnHtp.so, which executes the bundle's v69 ctx-bins in emulation. The same
library version (QAIRT 2.51) runs the bundle on the phone; verify trusts it first.

Each dialog runs in a child process (`python -m stages.runtimes.genie.real SPEC`): Genie may corrupt
the heap at exit, and a crash must not take the stage with it. The child answers with one JSON line;
Genie's own log (its logger callback, verbose) goes to a file kept beside the verify report.
The C calls and their signatures: docs/facts.md §3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages.runtimes.genie.files import GENIE_CONFIG

GENIE_LIBRARY = "libGenie.so"
# GenieLog levels: 1 error, 2 warn, 3 info, 4 verbose (every chunk, n_past and KV$ update).
LOG_VERBOSE = 4
# GenieDialog_SentenceCode_t: the whole answer in one callback stream (GENIE_DIALOG_SENTENCE_COMPLETE).
SENTENCE_COMPLETE = 0
# The greedy sampler Genie's BasicSampler takes (rules.sampler_is_greedy).
GREEDY = {"temp": 0.0, "top-k": 1, "top-p": 1.0}


# Lines the x86 libraries print on every run (libnative's configuration notice, the CPU affinity the
# config's cpu-mask asks for on a machine with fewer cores, Genie's load path).
NOISE = re.compile(r"LIBNATIVE|failed to set affinity mask|Using create From Binary")


class RealGenieError(RuntimeError):
    """The real Genie could not be run at all (no library, no answer from its child process)."""


@dataclass
class Query:
    text: str
    max_new_tokens: int | None = None  # None: no limit (Genie stops at EOS or a full context)
    reset_before: bool = False


@dataclass
class DialogRun:
    """What one dialog did: one entry per query, in order."""

    answers: list[str] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    query_s: list[float] = field(default_factory=list)
    create_status: int = 0
    create_s: float = 0.0
    peak_rss_bytes: int = 0
    log: Path | None = None
    stderr: list[str] = field(default_factory=list)  # what Genie printed itself (e.g. a refused input)

    def errors(self, limit: int = 2) -> str:
        """Genie's own error lines, from its log and what it printed, for a one-line failure."""
        lines = list(self.stderr)
        if self.log is not None and self.log.is_file():
            lines += [
                ln[4:] for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("[1] ")
            ]
        return " | ".join(lines[:limit])


def library_dir() -> Path:
    """The onnxruntime_qnn package folder: libGenie.so, libQnnHtp.so and their x86 companions."""
    try:
        import onnxruntime_qnn
    except ImportError:
        raise RealGenieError(
            "onnxruntime-qnn is not installed here: the real Genie runs where the compile image runs "
            "(make verify, or RUNNER=local after make venv)"
        ) from None
    folder = Path(onnxruntime_qnn.__file__).parent
    if not (folder / GENIE_LIBRARY).is_file():
        raise RealGenieError(f"{folder} has no {GENIE_LIBRARY}: onnxruntime-qnn 2.7.0 or later ships it")
    return folder


def _staged_bundle(
    bundle_dir: Path, sampler: dict[str, Any] | None, work: Path, dump_dir: Path | None = None
) -> Path:
    """A folder that is the bundle (its files linked, not copied) with genie_config.json's sampler
    replaced where asked: Genie reads every path relative to its working directory. With dump_dir,
    Genie writes every call's raw inputs and outputs there (its `debug` section: dump-tensors;
    <graph>/<call>_in_<tensor>) and a spec.<graph>.json of each graph's tensors."""
    staged = work / "bundle"
    staged.mkdir()
    for f in bundle_dir.iterdir():
        if f.name != GENIE_CONFIG:
            (staged / f.name).symlink_to(f.resolve())
    config = json.loads((bundle_dir / GENIE_CONFIG).read_text())
    if sampler is not None:
        config["dialog"]["sampler"].update(sampler)
    if dump_dir is not None:
        debug = {"path": str(dump_dir.resolve()), "dump-tensors": True, "dump-specs": True}
        config["dialog"]["debug"] = debug | {"dump-outputs": True}
    (staged / GENIE_CONFIG).write_text(json.dumps(config, indent=1))
    return staged


# How long one dialog may run before it is taken for hung (run_dialog's default).
DIALOG_TIMEOUT_S = 1800


def run_dialog(
    bundle_dir: Path,
    queries: list[Query],
    log_path: Path,
    sampler: dict[str, Any] | None = None,
    timeout_s: float = DIALOG_TIMEOUT_S,
    dump_dir: Path | None = None,
) -> DialogRun:
    """The queries through one Genie dialog on the bundle, in a child process; `sampler` replaces
    genie_config.json's sampler fields (GREEDY for a comparison with transformers); `dump_dir` gets
    Genie's own dumps of each call's tensors (_staged_bundle)."""
    libs = library_dir()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="g4v69-genie-") as tmp:
        staged = _staged_bundle(bundle_dir.resolve(), sampler, Path(tmp), dump_dir)
        spec = Path(tmp) / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "bundle": str(staged),
                    "log": str(log_path.resolve()),
                    "queries": [asdict(q) for q in queries],
                }
            )
        )
        env = dict(os.environ, LD_LIBRARY_PATH=f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}")
        try:
            p = subprocess.run(
                [sys.executable, "-m", "stages.runtimes.genie.real", str(spec)],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
                cwd=Path(__file__).resolve().parents[3],
            )
        except subprocess.TimeoutExpired:
            raise RealGenieError(
                f"the real Genie gave no answer within {timeout_s:.0f} s (log: {log_path})"
            ) from None
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("{")), None)
    if line is None:
        tail = (p.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise RealGenieError(
            f"the real Genie's process ended without an answer (exit {p.returncode}: {tail}; log: {log_path})"
        )
    r = json.loads(line)
    return DialogRun(
        answers=r["answers"],
        statuses=r["statuses"],
        query_s=r["query_s"],
        create_status=r["create_status"],
        create_s=r["create_s"],
        peak_rss_bytes=r["peak_rss_bytes"],
        log=log_path,
        stderr=[ln for ln in p.stderr.splitlines() if ln.strip() and not NOISE.search(ln)],
    )


# ---- the child: Genie's C API through ctypes ----
def _child(spec_path: str) -> None:
    import ctypes
    import resource
    from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int32, c_uint32, c_uint64, c_void_p

    spec = json.loads(Path(spec_path).read_text())
    lib = ctypes.CDLL(str(library_dir() / GENIE_LIBRARY), mode=ctypes.RTLD_GLOBAL)
    libc = ctypes.CDLL("libc.so.6")
    libc.vsnprintf.argtypes = [c_char_p, ctypes.c_size_t, c_char_p, c_void_p]
    log = open(spec["log"], "w")  # flushed by finish(); os._exit skips the close
    log_cb_type = CFUNCTYPE(None, c_void_p, c_char_p, c_int32, c_uint64, c_void_p)

    def on_log(_handle, fmt, level, _ts, args):  # void(handle, fmt, level, timestamp, va_list)
        buf = ctypes.create_string_buffer(4096)
        libc.vsnprintf(buf, 4096, fmt, args)
        log.write(f"[{level}] {buf.value.decode(errors='replace').rstrip()}\n")

    log_cb = log_cb_type(on_log)
    logger = c_void_p()
    lib.GenieLog_create.argtypes = [c_void_p, log_cb_type, c_int32, POINTER(c_void_p)]
    lib.GenieLog_create(None, log_cb, LOG_VERBOSE, byref(logger))
    result: dict[str, Any] = {"answers": [], "statuses": [], "query_s": [], "create_status": 0}

    def finish() -> None:
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        log.flush()
        print(json.dumps(result), flush=True)
        os._exit(0)  # Genie's destructors may corrupt the heap: skip them

    os.chdir(spec["bundle"])
    config = c_void_p()
    lib.GenieDialogConfig_createFromJson.argtypes = [c_char_p, POINTER(c_void_p)]
    lib.GenieDialogConfig_bindLogger.argtypes = [c_void_p, c_void_p]
    lib.GenieDialog_create.argtypes = [c_void_p, POINTER(c_void_p)]
    t0 = time.perf_counter()
    status = lib.GenieDialogConfig_createFromJson(Path(GENIE_CONFIG).read_bytes(), byref(config))
    if status == 0:
        lib.GenieDialogConfig_bindLogger(config, logger)
        dialog = c_void_p()
        status = lib.GenieDialog_create(config, byref(dialog))
    result["create_status"], result["create_s"] = status, round(time.perf_counter() - t0, 3)
    if status != 0:
        finish()
    answer_cb_type = CFUNCTYPE(None, c_char_p, c_int32, c_void_p)
    lib.GenieDialog_query.argtypes = [c_void_p, c_char_p, c_int32, answer_cb_type, c_void_p]
    lib.GenieDialog_setMaxNumTokens.argtypes = [c_void_p, c_uint32]
    lib.GenieDialog_reset.argtypes = [c_void_p]
    for q in spec["queries"]:
        if q["reset_before"]:
            lib.GenieDialog_reset(dialog)
        if q["max_new_tokens"] is not None:
            lib.GenieDialog_setMaxNumTokens(dialog, q["max_new_tokens"])
        pieces: list[bytes] = []
        cb = answer_cb_type(lambda text, _code, _user, into=pieces: into.append(text) if text else None)
        t0 = time.perf_counter()
        status = lib.GenieDialog_query(dialog, q["text"].encode(), SENTENCE_COMPLETE, cb, None)
        result["query_s"].append(round(time.perf_counter() - t0, 3))
        result["statuses"].append(status)
        result["answers"].append(b"".join(pieces).decode(errors="replace"))
    finish()


if __name__ == "__main__":
    _child(sys.argv[1])
