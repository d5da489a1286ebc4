"""Stage outputs: written to a temporary folder, renamed into place only when complete, each with a
`report.json` (inputs with sha256, options, tool versions, wall time, peak RSS).

A folder that has a report.json is complete; a folder without one is never produced by a stage,
so a later run cannot mistake a crashed run's leftovers for a result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.core.errors import UserFixable
from stages.core.pipeline import PIPELINE

if TYPE_CHECKING:
    from stages.core.config import PipelineConfig

REPORT_NAME = "report.json"
# A report seals itself: this field holds the sha256 of the rest of it (report_seal), so a report edited
# by hand is refused by the next stage that reads it. A later stage that read an upstream's report also
# records its sha256 among its inputs, and the stages after it check that record (check_inputs).
REPORT_SEAL = "report_sha256"
# Distributions whose versions a report records when installed; the ones a stage uses are a subset.
TOOL_DISTRIBUTIONS = (
    "g4v69",
    "click",
    "jinja2",
    "torch",
    "transformers",
    "executorch",
    "safetensors",
    "huggingface_hub",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "datasets",
    "numpy",
    "qai-hub",
    "tokenizers",
)
# Names of environment variables whose values must never reach a report.
SECRET_ENV = ("HF_TOKEN", "QAI_HUB_API_TOKEN")
# Each stage's output folder under WORKDIR (download: checkpoints/<name>/), from the stage table; the
# stage's name is also the Make target that redoes it.
STAGE_DIRS = {s.name: s.folder for s in PIPELINE}
# Where the per-stage stamps live (the Makefile's STAMP_DIR), relative to WORKDIR.
STAMP_DIR = ".g4v69"

# sha256 of files already hashed by this process, keyed by what changes when a file is rewritten:
# a stage checks its inputs against the upstream report and then records them in its own report,
# and reading a 10 GB checkpoint twice would double the cost of the check.
_hashed: dict[tuple[str, int, int, int], str] = {}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _hashed:
        return _hashed[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    _hashed[key] = h.hexdigest()
    return _hashed[key]


class IntegrityError(UserFixable, RuntimeError):
    """A stage's input differs from what the stage that made it recorded; the message names the file
    and the Make target that makes it again."""


class DiskSpaceError(UserFixable, RuntimeError):
    """Not enough free disk for a write the stage is about to make."""


def _stage_folder(path: Path) -> tuple[Path, str]:
    """The finished stage folder holding `path` and that stage's name (from its folder name)."""
    path = Path(path)
    for folder in [path, *path.parents]:
        if folder.parent.name == STAGE_DIRS["download"]:
            return folder, "download"
        for stage, name in STAGE_DIRS.items():
            if stage != "download" and folder.name == name:
                return folder, stage
    raise ValueError(f"{path} is in no stage's output folder")


def _stamps(workdir: Path, prefix: str) -> list[Path]:
    """The stamps `<prefix>-<config key>.json` (prefix: a stage, or download-<checkpoint>)."""
    found = (Path(workdir) / STAMP_DIR).glob(f"{prefix}-*.json")
    return [p for p in found if p.name.rsplit("-", 1)[0] == prefix]


def _invalidate(workdir: Path, stage: str, folder: Path) -> None:
    """Remove the stage's stamps, so that Make redoes that stage (and what follows) on the next run."""
    for stamp in _stamps(workdir, f"download-{folder.name}" if stage == "download" else stage):
        stamp.unlink(missing_ok=True)


def check_inputs(workdir: Path, paths: list[Path], config: PipelineConfig | None = None) -> None:
    """Check the files a stage is about to read against the sha256 values the stages that made them
    recorded in their report.json (a folder: every file its report lists; a file: that one; a
    report.json: only the report), and, given the stage's `config`, each upstream stage's own config
    fields against what it ran with.

    Each upstream's report.json is checked too: against its own seal (REPORT_SEAL), and every report of
    a stage before it that it read (recorded among its inputs) against the sha256 it recorded. So the
    quantize stage's report, which compile reads and records, is checked against compile's record by
    bundle and verify.

    A file that differs stops the stage with one line naming it and the stage to run again; that
    stage's stamps are removed so that `make <stage>` really redoes it. A config field that differs
    stops it too: the stage would otherwise read graphs made for one value while acting on another.
    """
    checked: set[Path] = set()
    for path in paths:
        path = Path(path)
        folder, stage = _stage_folder(path)
        report = _finished_report(folder, stage)
        if folder not in checked:
            checked.add(folder)
            _check_report(workdir, folder, stage, report)
            if config is not None:
                _check_options(workdir, config, folder, stage, report)
        if path == folder / REPORT_NAME:
            continue
        recorded = {f["path"]: f for f in report.get("outputs", [])}
        wanted = sorted(recorded) if path == folder else [str(path.relative_to(folder))]
        for rel in wanted:
            file = folder / rel
            entry = recorded.get(rel)
            problem = None
            if entry is None:
                problem = f"is not among the outputs {stage} recorded"
            elif not file.is_file():
                problem = "is missing"
            elif file.stat().st_size != entry["bytes"]:
                problem = f"has {file.stat().st_size} bytes, {stage} wrote {entry['bytes']}"
            elif sha256_file(file) != entry["sha256"]:
                problem = f"changed after {stage} wrote it (its sha256 differs from {REPORT_NAME})"
            if problem:
                _invalidate(workdir, stage, folder)
                raise IntegrityError(f"{file} {problem}; run `make {stage}` again")


def _finished_report(folder: Path, stage: str) -> dict[str, Any]:
    report = read_report(folder)
    if report is None:
        raise IntegrityError(
            f"{folder} holds no finished {stage} stage (no {REPORT_NAME}); run `make {stage}` first"
        )
    return report


def report_seal(report: dict[str, Any]) -> str:
    """The sha256 a report carries in REPORT_SEAL: of its JSON without that field, keys sorted."""
    body = {k: v for k, v in report.items() if k != REPORT_SEAL}
    return hashlib.sha256(json.dumps(body, indent=2, sort_keys=True).encode()).hexdigest()


def write_report(folder: Path, report: dict[str, Any]) -> None:
    """Write folder/report.json, sealed."""
    write_json_atomic(Path(folder) / REPORT_NAME, {**report, REPORT_SEAL: report_seal(report)})


def _check_seal(workdir: Path, folder: Path, stage: str, report: dict[str, Any]) -> None:
    if report.get(REPORT_SEAL) == report_seal(report):
        return
    _invalidate(workdir, stage, folder)
    why = (
        f"changed after {stage} wrote it (its {REPORT_SEAL} does not match its content)"
        if REPORT_SEAL in report
        else f"has no {REPORT_SEAL} (written before reports were sealed, or edited)"
    )
    raise IntegrityError(f"{folder / REPORT_NAME} {why}; run `make {stage}` again")


def _check_report(workdir: Path, folder: Path, stage: str, report: dict[str, Any]) -> None:
    """The report against its seal, and the upstream reports it recorded among its inputs against the
    sha256 recorded: a different but intact one means the upstream stage ran again after this one
    read it, so this one is stale. An upstream folder since removed is left to the stages that read
    it (bundle needs no quantized/)."""
    _check_seal(workdir, folder, stage, report)
    for entry in report.get("inputs", []):
        upstream = Path(workdir) / entry["path"]
        if upstream.name != REPORT_NAME:
            continue
        try:
            up_folder, up_stage = _stage_folder(upstream)
        except ValueError:
            continue
        up_report = read_report(up_folder)
        if up_report is None:
            continue
        _check_seal(workdir, up_folder, up_stage, up_report)
        if sha256_file(upstream) != entry["sha256"]:
            _invalidate(workdir, stage, folder)
            raise IntegrityError(
                f"{upstream} is not the one {stage} read (its sha256 differs from the record in "
                f"{folder / REPORT_NAME}): {up_stage} ran again since; run `make {stage}` again"
            )


def _check_options(
    workdir: Path, config: PipelineConfig, folder: Path, stage: str, report: dict[str, Any]
) -> None:
    from stages.core.config import FIELD_NAMES

    ran = report.get("options", {})
    # Every config field the upstream recorded: its own and those it depends on (compile records soc).
    # The download's name the folder itself (checkpoints/<model>), and a revision may be resolved.
    fields = [] if stage == "download" else [f for f in FIELD_NAMES if f in ran]
    differ = [f for f in fields if ran[f] != getattr(config, f)]
    if differ:
        _invalidate(workdir, stage, folder)
        said = ", ".join(f"{f}={getattr(config, f)!r} (it ran with {ran[f]!r})" for f in differ)
        raise IntegrityError(
            f"{folder} was made for another config: {said}; run `make {stage}` again with this config, "
            "or set those fields back"
        )


def free_bytes(folder: Path) -> int:
    """Free disk space for unprivileged writes under folder (its nearest existing ancestor)."""
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def require_free(folder: Path, need: int, what: str) -> None:
    """DiskSpaceError unless `folder`'s disk has `need` bytes free (plus 5% and 64 MiB of slack)."""
    if need <= 0:
        return
    free = free_bytes(folder)
    want = int(need * 1.05) + (64 << 20)
    if free < want:
        raise DiskSpaceError(
            f"not enough disk space in {folder}: {what} needs about {want / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free; free space or set WORKDIR to a bigger disk"
        )


def copy_file(src: Path, dest: Path) -> None:
    """Copy src to dest as a reflink where the file system shares blocks copy-on-write (btrfs, XFS),
    else byte by byte: never a hard link, so editing one cannot change the other."""
    ficlone = 0x40049409  # linux/fs.h FICLONE
    with open(src, "rb") as s, open(dest, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), ficlone, s.fileno())
            return
        except OSError:
            pass
    shutil.copyfile(src, dest)


def describe_inputs(paths: list[Path], root: Path) -> list[dict[str, Any]]:
    """Every file under the given paths, relative to root, with size and sha256, in sorted order."""
    files: list[Path] = []
    for p in paths:
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            rel = str(f.resolve().relative_to(root.resolve()))
        except ValueError:
            rel = str(f)
        out.append({"path": rel, "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return out


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in TOOL_DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def peak_rss_bytes() -> int:
    """Peak resident set of this process and its finished children (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024
    return max(own, children) * scale


def proc_field_bytes(proc_file: str, key: str) -> int | None:
    """A `Key:  N kB` line of a Linux /proc file (meminfo, self/status) in bytes; None elsewhere."""
    try:
        for line in Path(proc_file).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_peak_rss_bytes() -> int:
    """This process's own peak resident set. On Linux from VmHWM, because ru_maxrss of a process
    started by fork + exec (multiprocessing's spawn) starts at its parent's RSS at the fork, which
    made every compile worker report the compile stage's own peak."""
    hwm = proc_field_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def redact(value: Any) -> Any:
    """Replace any secret's value wherever it appears in a report-bound structure."""
    secrets = [os.environ[k] for k in SECRET_ENV if os.environ.get(k)]
    if not secrets:
        return value
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, "<redacted>")
    return value


@dataclass
class StageRun:
    stage: str
    dir: Path  # the temporary folder the stage writes into
    figures: dict[str, Any] = field(default_factory=dict)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _lock(folder: Path) -> int:
    """An exclusive flock on the folder, held by this process until it closes the fd (or dies).

    A lock, not the pid in the name, tells a live run's folder from a dead one's: stages in
    containers all see small pids (often 1) from their own pid namespace.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_stale_partials(parent: Path, name: str = "*") -> list[Path]:
    """Remove `.<name>.partial-<pid>` folders no live process holds (killed runs) and `.<name>.old-<pid>`
    ones (a run killed while swapping its output in); return what was removed."""
    removed = []
    for folder in sorted(Path(parent).glob(f".{name}.partial-*")):
        try:
            fd = _lock(folder)
        except BlockingIOError:
            continue  # a live run is writing it
        except OSError:
            if folder.is_dir():
                raise
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(folder)
    for folder in sorted(Path(parent).glob(f".{name}.old-*")):
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


@contextmanager
def stage_output(
    stage: str,
    out_dir: Path,
    inputs: list[Path],
    options: dict[str, Any],
    root: Path,
    need_bytes: int = 0,
    since: tuple[float, float] | None = None,
) -> Iterator[StageRun]:
    """Run a stage into a temporary sibling of out_dir; on success write report.json (sealed) and swap
    it in. Its wall and CPU time count from here, or from `since` (time.time(), time.process_time()
    when the stage began: a stage that checks before it writes, like verify).

    Leftovers of killed runs of this stage are removed first; `need_bytes` (the output's expected
    size) must be free on the disk. On any exception the temporary folder is removed and an
    existing out_dir is left untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir.parent, out_dir.name)
    require_free(out_dir.parent, need_bytes, f"the {stage} stage's output")
    # The partial folder holds the output being written and a scratch folder beside it; its lock
    # tells a live run's partial folder from a killed one's.
    partial = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    lock = _lock(partial)
    tmp, scratch = partial / out_dir.name, partial / "scratch"
    tmp.mkdir()
    scratch.mkdir()
    started, cpu0 = since or (time.time(), time.process_time())
    run = StageRun(stage=stage, dir=tmp)
    # Libraries' own temporary files (onnxruntime's quantizer keeps whole model copies there) go to
    # the scratch folder, so that a killed run leaves nothing elsewhere.
    saved_tmp = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(scratch)
    try:
        try:
            described = describe_inputs(inputs, root)
            try:
                yield run
            finally:
                tempfile.tempdir = saved_tmp[0]
                if saved_tmp[1] is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = saved_tmp[1]
            report = {
                "stage": stage,
                "inputs": described,
                "options": options,
                "outputs": describe_inputs([tmp], tmp),
                "tool_versions": tool_versions(),
                "wall_s": round(time.time() - started, 3),
                "cpu_s": round(time.process_time() - cpu0, 3),
                "peak_rss_bytes": peak_rss_bytes(),
                "figures": run.figures,
            }
            write_report(tmp, redact(report))
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            if out_dir.exists():
                os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    finally:
        os.close(lock)


@dataclass
class StageJob:
    """The one way a config-driven stage runs (every stage but download, whose checkpoint folder serves
    every config of its model): `check` its upstream outputs against the hashes and config their stages
    recorded (first, before reading them), then write its `output` through stage_output with the config
    fields it depends on (config.stage_key) as its options, and, once the output is in place, its stamp
    for Make (a stage the table marks unstamped, a check, gets none)."""

    name: str
    cfg: PipelineConfig
    workdir: Path

    @property
    def out_dir(self) -> Path:
        from stages.core.pipeline import output_dir

        return output_dir(self.workdir, self.name, self.cfg.checkpoint_name)

    def check(self, paths: list[Path]) -> None:
        check_inputs(self.workdir, paths, self.cfg)

    @contextmanager
    def output(
        self, inputs: list[Path], need_bytes: int = 0, since: tuple[float, float] | None = None
    ) -> Iterator[StageRun]:
        from stages.core.config import stage_key, stamp_name
        from stages.core.pipeline import stage

        key = stage_key(self.cfg, self.name)
        out = self.out_dir
        with stage_output(
            self.name, out, inputs, key, root=self.workdir, need_bytes=need_bytes, since=since
        ) as run:
            yield run
        if stage(self.name).stamped:
            content = {"stage": self.name, "config": key}
            write_stamp(self.workdir, stamp_name(self.cfg, self.name), content, out / REPORT_NAME)


def write_stamp(workdir: Path, name: str, content: dict[str, Any], report: Path) -> None:
    """Record that a stage finished for one config: WORKDIR/.g4v69/<name>, dated like the stage's
    report (so Make sees the report as up to date), replacing the stage's stamps of other configs
    (whose output this run has just replaced). `name` is `<stage>-<config key>.json`, or for
    download `download-<checkpoint>-<config key>.json` (checkpoints of other models stay)."""
    stamps = Path(workdir) / STAMP_DIR
    stamps.mkdir(parents=True, exist_ok=True)
    for other in _stamps(workdir, name.rsplit("-", 1)[0]):
        if other.name != name:
            other.unlink(missing_ok=True)
    path = stamps / name
    write_json_atomic(path, content)
    mtime = Path(report).stat().st_mtime_ns
    os.utime(path, ns=(mtime, mtime))


def read_report(out_dir: Path) -> dict[str, Any] | None:
    """The report of a complete stage output, or None if the folder is absent or incomplete."""
    path = Path(out_dir) / REPORT_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


if __name__ == "__main__":
    # `python3 -m stages.core.report clean DIR...` removes stale partial folders under each DIR: `make clean`
    # runs it on the host (this module is stdlib-only), where no stage image may exist.
    if sys.argv[1:2] != ["clean"]:
        sys.exit("usage: python3 -m stages.core.report clean DIR...")
    for parent in sys.argv[2:]:
        if Path(parent).is_dir():
            for gone in remove_stale_partials(Path(parent)):
                print(f"removed {gone}")
