"""Push a Genie bundle and the QAIRT runtime to an Android phone over adb, and run it there.

Everything goes into /data/local/tmp/<bundle name>: the files the bundle's manifest lists, plus the
QAIRT libraries, the HTP skel and stub for the manifest's dsp_arch and genie-t2t-run from the SDK in
QNN_SDK_ROOT. A push resumes: files whose sha256 on the phone already matches are skipped, and every
pushed file is hashed again on the phone afterwards, since adb reports success on damaged transfers.

run_on_device starts genie-t2t-run in that folder, streams the text between Genie's `[BEGIN]:` and
`[END]` markers as it arrives and reads the `[KPIS]:` block it prints at the end (format as in the
sample output of quic/ai-hub-apps tutorials/llm_on_genie/README.md).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from stages.core.report import sha256_file
from stages.core.soc import SOCS
from stages.runtimes import RuntimeFailure
from stages.runtimes.genie.files import GENIE_CONFIG, MANIFEST, QAIRT_RUNTIME_LIBS

REMOTE_ROOT = "/data/local/tmp"
GENIE_RUN = "genie-t2t-run"
# Loaded by Genie when the config names a backend extensions file; pushed when the SDK has it.
OPTIONAL_RUNTIME_LIBS = ("libQnnHtpNetRunExtensions.so",)
QUALCOMM_MANUFACTURERS = {"qualcomm", "qti"}
# ro.board.platform values of Qualcomm SoCs; Android before 12 has no ro.soc.manufacturer to ask.
QUALCOMM_PLATFORMS = set(
    "kona lahaina taro kalama pineapple sun canoe lito atoll bengal holi trinket yupik parrot"
    " cape ukee crow blair cliffs volcano niobe anorak msmnile msmsteppe monaco khaje".split()
)
QUALCOMM_PLATFORM_PREFIXES = ("msm", "sdm", "sm", "apq", "qcs", "qcm", "sdx", "trinket")
PUSH_PROGRESS_DELAY_S = 2.0
OUTPUT_TAIL_LINES = 25


class DeviceError(RuntimeFailure):
    """A push or run that cannot go on; the message says what failed and what to do about it."""


@dataclass
class Manifest:
    name: str
    qairt_version: str
    dsp_arch: str
    soc: str
    files: list[dict]
    path: Path
    genie_config: str = GENIE_CONFIG


@dataclass
class Device:
    serial: str
    props: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.props.get("ro.product.model", "")


@dataclass
class Transfer:
    """One file to put on the phone: where it comes from, where it goes, what it must hash to."""

    local: Path
    remote: str
    size: int
    sha256: str
    executable: bool = False


# ---- the manifest and the SDK ----


def read_manifest(bundle_dir: Path) -> Manifest:
    path = Path(bundle_dir) / MANIFEST
    if not path.is_file():
        raise DeviceError(f"{path} does not exist; run `make bundle` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DeviceError(f"{path} is not valid JSON ({e}); rebuild the bundle") from None
    missing = [k for k in ("name", "qairt_version", "dsp_arch", "soc", "files") if k not in data]
    if missing:
        raise DeviceError(f"{path} lacks {', '.join(missing)}; rebuild the bundle with this version")
    name = str(data["name"])
    # The name becomes a folder in a device shell command line; keep it to characters that need no quoting.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise DeviceError(f"{path}: bundle name {name!r} must be letters, digits, '.', '_' or '-'")
    if not re.fullmatch(r"v\d+", str(data["dsp_arch"])):
        raise DeviceError(f"{path}: dsp_arch {data['dsp_arch']!r} is not like 'v69'")
    files = data["files"]
    if not isinstance(files, list) or not files:
        raise DeviceError(f"{path}: 'files' must be a non-empty list of {{path, bytes, sha256}}")
    for entry in files:
        rel = entry.get("path") if isinstance(entry, dict) else None
        if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise DeviceError(f"{path}: file entry {entry!r} needs a 'path' relative to the bundle folder")
    return Manifest(
        name=name,
        qairt_version=str(data["qairt_version"]),
        dsp_arch=str(data["dsp_arch"]),
        soc=str(data["soc"]),
        files=files,
        path=path,
        genie_config=str(data.get("genie_config") or GENIE_CONFIG),
    )


def _version_tuple(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version.strip())
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def sdk_version(sdk_root: Path) -> str | None:
    """The QAIRT version from sdk.yaml, else from a version-like folder name (the SDK zip's layout)."""
    yaml = sdk_root / "sdk.yaml"
    if yaml.is_file():
        for line in yaml.read_text(errors="replace").splitlines():
            m = re.match(r"\s*version\s*:\s*['\"]?([0-9][0-9.]*)", line)
            if m:
                return m[1]
    for part in (sdk_root.resolve(), *sdk_root.resolve().parents):
        if re.fullmatch(r"v?\d+\.\d+\.\d+(\.\d+)?", part.name):
            return part.name.removeprefix("v")
    return None


def runtime_files(sdk_root: Path | None, manifest: Manifest) -> tuple[list[tuple[Path, str]], str]:
    """(local file, name in the remote folder) for each runtime file, and the SDK's version."""
    if sdk_root is None or not str(sdk_root):
        raise DeviceError(
            "QNN_SDK_ROOT is not set; point it at an unpacked QAIRT SDK "
            f"(version {manifest.qairt_version} or newer, the one the bundle was compiled with)"
        )
    sdk_root = Path(sdk_root)
    if not sdk_root.is_dir():
        raise DeviceError(f"QNN_SDK_ROOT={sdk_root} does not exist; point it at an unpacked QAIRT SDK")
    arch = manifest.dsp_arch.upper()
    libdir = sdk_root / "lib" / "aarch64-android"
    wanted = [libdir / lib for lib in (*QAIRT_RUNTIME_LIBS, f"libQnnHtp{arch}Stub.so")]
    wanted.append(sdk_root / "lib" / f"hexagon-{manifest.dsp_arch}" / "unsigned" / f"libQnnHtp{arch}Skel.so")
    wanted.append(sdk_root / "bin" / "aarch64-android" / GENIE_RUN)
    absent = [str(p.relative_to(sdk_root)) for p in wanted if not p.is_file()]
    if absent:
        raise DeviceError(
            f"QNN_SDK_ROOT={sdk_root} is not a QAIRT SDK with the Android runtime for {manifest.dsp_arch}: "
            f"missing {', '.join(absent)}; point QNN_SDK_ROOT at the folder that holds lib/ and bin/"
        )
    version = sdk_version(sdk_root)
    if version is None or _version_tuple(version) is None:
        raise DeviceError(
            f"cannot tell the QAIRT version of QNN_SDK_ROOT={sdk_root}: no sdk.yaml with a 'version:' line "
            f"and the folder is not named after a version; the bundle needs QAIRT {manifest.qairt_version} "
            "or newer"
        )
    need = _version_tuple(manifest.qairt_version)
    if need is None:
        raise DeviceError(f"{manifest.path}: qairt_version {manifest.qairt_version!r} is not like 2.51.0")
    if _version_tuple(version) < need:
        raise DeviceError(
            f"QNN_SDK_ROOT={sdk_root} is QAIRT {version}, older than the QAIRT {manifest.qairt_version} the "
            f"bundle was compiled with; its runtime cannot load these context binaries. Install QAIRT "
            f"{manifest.qairt_version} or newer and point QNN_SDK_ROOT at it"
        )
    wanted += [libdir / lib for lib in OPTIONAL_RUNTIME_LIBS if (libdir / lib).is_file()]
    return [(p, p.name) for p in wanted], version


# ---- adb ----


@dataclass
class Adb:
    exe: str
    serial: str | None = None

    @classmethod
    def find(cls, adb: str, serial: str | None) -> Adb:
        exe = shutil.which(adb)
        if exe is None:
            raise DeviceError(
                f"adb not found (looked for {adb!r}); install it (Debian/Ubuntu: `apt-get install adb`, "
                "or Android platform-tools) and put it on PATH, or run `make push` in the tools image"
            )
        return cls(exe, serial)

    def argv(self, *args: str) -> list[str]:
        return [self.exe, *(["-s", self.serial] if self.serial else []), *args]

    def run(self, *args: str, timeout: float | None = 120) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                self.argv(*args), capture_output=True, text=True, errors="replace", timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise DeviceError(
                f"`adb {' '.join(args)[:80]}` did not answer in {timeout:.0f} s; unplug and replug the "
                "phone, or restart the adb server (`adb kill-server`)"
            ) from None

    def shell(self, command: str, timeout: float | None = 120) -> subprocess.CompletedProcess[str]:
        # One argument: adb hands it to the device's sh -c as it is, so the quoting made here holds.
        r = self.run("shell", command, timeout=timeout)
        _raise_for_adb_error(r, self.serial)
        return r


def _raise_for_adb_error(r: subprocess.CompletedProcess[str], serial: str | None) -> None:
    """adb's own failures (as opposed to the device command's) come as `error: ...` on stderr."""
    if r.returncode == 0:
        return
    for line in r.stderr.splitlines():
        line = line.strip().removeprefix("adb: ")
        if line.startswith("error:"):
            raise DeviceError(_explain_adb_error(line, serial))


def _explain_adb_error(line: str, serial: str | None) -> str:
    low = line.lower()
    phone = f"the phone {serial}" if serial else "the phone"
    if "unauthorized" in low:
        return (
            f"{phone} has not authorized this computer ({line}); unlock it and accept the "
            "'Allow USB debugging?' prompt (tick 'Always allow'), then run again"
        )
    if "offline" in low:
        return f"{phone} is offline ({line}); unplug and replug it, or run `adb kill-server`"
    if "no devices" in low or "not found" in low:
        return (
            f"no phone is attached ({line}); connect it by USB with USB debugging enabled "
            "(Settings > Developer options) and check `adb devices`"
        )
    if "more than one" in low:
        return f"several phones are attached ({line}); pick one with ADB_SERIAL=<serial>"
    return f"adb failed: {line}"


def _devices(adb: Adb) -> list[tuple[str, str]]:
    r = subprocess.run([adb.exe, "devices"], capture_output=True, text=True, errors="replace", timeout=60)
    if r.returncode != 0:
        raise DeviceError(
            f"`adb devices` failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}"
        )
    found = []
    for line in r.stdout.splitlines():
        # Skip the header and the "* daemon started" chatter that a first call prints.
        if not line.strip() or line.startswith(("List of devices", "*")) or "\t" not in line:
            continue
        serial, state = line.split("\t", 1)
        found.append((serial.strip(), state.strip()))
    return found


def select_device(adb_exe: str, serial: str | None) -> Adb:
    adb = Adb.find(adb_exe, serial)
    # Real adb falls back to ANDROID_SERIAL without -s; honour it here so the choice below agrees.
    source = "ADB_SERIAL" if serial else "ANDROID_SERIAL"
    serial = serial or os.environ.get("ANDROID_SERIAL") or None
    devices = _devices(adb)
    listing = ", ".join(f"{s} ({st})" for s, st in devices)
    if serial:
        states = dict(devices)
        if serial not in states:
            raise DeviceError(
                f"{source}={serial} is not attached; attached: {listing or 'none'}. "
                f"Set {source} to one of those (see `adb devices`)"
            )
        chosen = (serial, states[serial])
    elif not devices:
        raise DeviceError(
            "no phone is attached (`adb devices` lists none); connect it by USB with USB debugging enabled "
            "(Settings > Developer options) and accept the authorization prompt"
        )
    elif len(devices) > 1:
        raise DeviceError(f"several phones are attached: {listing}; pick one with ADB_SERIAL=<serial>")
    else:
        chosen = devices[0]
    serial, state = chosen
    if state == "unauthorized":
        raise DeviceError(
            f"the phone {serial} is unauthorized: unlock it and accept the 'Allow USB debugging?' prompt "
            "(tick 'Always allow'); if no prompt shows, revoke USB debugging authorizations in Developer "
            "options and replug"
        )
    if state == "offline":
        raise DeviceError(f"the phone {serial} is offline; unplug and replug it, or run `adb kill-server`")
    if state.startswith("no permissions"):
        raise DeviceError(f"cannot open the phone {serial} over USB ({state}); add a udev rule for it")
    if state != "device":
        raise DeviceError(f"the phone {serial} is in state {state!r}; boot it into Android and run again")
    return Adb(adb.exe, serial)


PROPS = ("ro.product.cpu.abi", "ro.soc.manufacturer", "ro.board.platform", "ro.soc.model", "ro.product.model")


def _is_qualcomm_platform(platform: str) -> bool:
    p = platform.lower()
    return p in QUALCOMM_PLATFORMS or p.startswith(QUALCOMM_PLATFORM_PREFIXES)


def check_device(adb: Adb, manifest: Manifest) -> Device:
    """The phone must run 64-bit Android on a Qualcomm SoC; a different SoC only earns a warning."""
    assert adb.serial
    r = adb.shell("; ".join(f"getprop {p}" for p in PROPS))
    values = r.stdout.replace("\r", "").split("\n")
    props = {p: (values[i].strip() if i < len(values) else "") for i, p in enumerate(PROPS)}
    dev = Device(adb.serial, props)
    abi = props["ro.product.cpu.abi"]
    label = f"{adb.serial} ({dev.model or 'unknown model'})"
    if abi != "arm64-v8a":
        raise DeviceError(
            f"the phone {label} runs a {abi or 'unknown'} userspace (ro.product.cpu.abi); genie-t2t-run and "
            "the QAIRT libraries are built for 64-bit arm64-v8a only"
        )
    maker = props["ro.soc.manufacturer"]
    platform = props["ro.board.platform"]
    if maker and maker.lower() not in QUALCOMM_MANUFACTURERS:
        raise DeviceError(
            f"the phone {label} has a {maker} SoC ({props['ro.soc.model'] or platform}); the bundle needs a "
            f"Snapdragon with a Hexagon {manifest.dsp_arch} NPU ({manifest.soc})"
        )
    if not maker and not _is_qualcomm_platform(platform):
        raise DeviceError(
            f"the phone {label} does not look like a Snapdragon: ro.soc.manufacturer is empty and "
            f"ro.board.platform is {platform or 'empty'}; the bundle needs a {manifest.soc} "
            f"(Hexagon {manifest.dsp_arch})"
        )
    soc = props["ro.soc.model"]
    if soc and soc.upper() != manifest.soc.upper():
        known = SOCS.get(soc.upper())
        why = (
            f"its NPU is {known.dsp_arch}, the context binaries are for {manifest.dsp_arch}; Genie will "
            "probably refuse them"
            if known and known.dsp_arch != manifest.dsp_arch
            else f"it has the same {manifest.dsp_arch} NPU, so the binaries should load"
            if known
            else "unknown to the SoC table; the binaries may not load"
        )
        dev.warnings.append(f"the phone {label} is a {soc}, the bundle was built for {manifest.soc}: {why}")
    return dev


# ---- hashes, space, transfers ----


def remote_hashes(adb: Adb, paths: list[str]) -> dict[str, str]:
    """sha256 of each remote file that exists; absent ones are simply missing from the answer."""
    if not paths:
        return {}
    r = adb.shell("sha256sum " + " ".join(shlex.quote(p) for p in paths), timeout=None)
    # 127 is the device shell's "command not found".
    if r.returncode == 127:
        raise DeviceError(f"the phone {adb.serial} has no sha256sum (Android 8 or newer has one): {r.stderr}")
    found = {}
    for line in r.stdout.replace("\r", "").splitlines():
        m = re.match(r"([0-9a-fA-F]{64})\s+\*?(.+)$", line.strip())
        if m:
            found[m[2]] = m[1].lower()
    return found


def _df_available_bytes(text: str) -> int | None:
    """The available column of `df -k`-style output (toybox, busybox, or the old toolbox's sizes)."""
    lines = [ln for ln in text.replace("\r", "").splitlines() if ln.strip()]
    if len(lines) < 2:
        return None
    header = lines[0].replace("Mounted on", "Mounted_on").split()
    col = next((i for i, h in enumerate(header) if h.lower() in ("available", "avail", "free")), None)
    if col is None:
        return None
    unit = 1024
    m = next((re.match(r"(\d+)([kKmM]?)-blocks", h) for h in header if "-blocks" in h), None)
    if m:
        unit = int(m[1]) * {"": 1, "k": 1024, "m": 1 << 20}[m[2].lower()]
    # A long filesystem name may wrap onto its own line, so count the column from the end of the data.
    data = " ".join(lines[1:]).split()
    from_end = len(header) - col
    if len(data) < from_end:
        return None
    value = data[-from_end]
    m = re.fullmatch(r"([\d.]+)([KMGT]?)", value, re.IGNORECASE)
    if not m:
        return None
    if m[2]:
        return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper()))
    return int(float(m[1]) * unit)


def _free_bytes(adb: Adb) -> int:
    r = adb.shell(f"df -k {REMOTE_ROOT}")
    free = _df_available_bytes(r.stdout)
    if free is None:
        raise DeviceError(
            f"cannot read the free space of {REMOTE_ROOT} on {adb.serial} from `df -k`: "
            f"{r.stdout!r} {r.stderr}"
        )
    return free


def _plan(
    bundle_dir: Path, manifest: Manifest, runtime: list[tuple[Path, str]], remote_dir: str
) -> list[Transfer]:
    transfers: list[Transfer] = []
    for entry in manifest.files:
        local = bundle_dir / entry["path"]
        if not local.is_file():
            raise DeviceError(f"{local} is listed in {manifest.path} but missing; rebuild the bundle")
        digest = sha256_file(local)
        if entry.get("sha256") and entry["sha256"].lower() != digest:
            raise DeviceError(
                f"{local} has changed since the bundle stage wrote {manifest.path} (sha256 {digest[:12]}…, "
                f"manifest says {entry['sha256'][:12]}…); rebuild the bundle"
            )
        transfers.append(
            Transfer(local, f"{remote_dir}/{Path(entry['path']).as_posix()}", local.stat().st_size, digest)
        )
    taken = {t.remote for t in transfers}
    for local, name in runtime:
        remote = f"{remote_dir}/{name}"
        # A bundle that already carries a runtime file keeps its own copy.
        if remote in taken:
            continue
        transfers.append(Transfer(local, remote, local.stat().st_size, sha256_file(local), name == GENIE_RUN))
    return transfers


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def push_bundle(bundle_dir: Path, sdk_root: Path | None, serial: str | None = None, adb: str = "adb") -> dict:
    """Put the bundle and the QAIRT runtime into /data/local/tmp/<name> on the phone, resuming a push
    that was cut short; returns figures about what was sent."""
    started = time.monotonic()
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    runtime, version = runtime_files(sdk_root, manifest)
    conn = select_device(adb, serial)
    device = check_device(conn, manifest)
    for w in device.warnings:
        print(f"warning: {w}", file=sys.stderr)
    remote_dir = f"{REMOTE_ROOT}/{manifest.name}"
    transfers = _plan(bundle_dir, manifest, runtime, remote_dir)
    todo = _still_to_push(conn, transfers, remote_dir, manifest.name)
    pushed_bytes = _push(conn, todo, manifest.name)
    if todo:
        _check_pushed(conn, transfers, todo)
    return {
        "device": device.serial,
        "model": device.model,
        "soc": device.props.get("ro.soc.model", ""),
        "remote_dir": remote_dir,
        "qairt_sdk": version,
        "files_pushed": len(todo),
        "files_skipped": len(transfers) - len(todo),
        "bytes_pushed": pushed_bytes,
        "bytes_total": sum(t.size for t in transfers),
        "seconds": round(time.monotonic() - started, 3),
        "warnings": device.warnings,
    }


def _still_to_push(conn: Adb, transfers: list[Transfer], remote_dir: str, name: str) -> list[Transfer]:
    """The transfers whose file is not on the phone yet with its sha256 (a push cut short resumes):
    stale copies removed first so that df counts their space, and refused when it does not fit."""
    dirs = sorted({t.remote.rsplit("/", 1)[0] for t in transfers})
    r = conn.shell("mkdir -p " + " ".join(shlex.quote(d) for d in dirs))
    if r.returncode != 0:
        raise DeviceError(
            f"cannot create {remote_dir} on {conn.serial}: {r.stderr.strip() or r.stdout.strip()}"
        )
    on_device = remote_hashes(conn, [t.remote for t in transfers])
    todo = [t for t in transfers if on_device.get(t.remote) != t.sha256]
    stale = [t.remote for t in todo if t.remote in on_device]
    if stale:
        conn.shell("rm -f " + " ".join(shlex.quote(p) for p in stale))
    need = sum(t.size for t in todo)
    free = _free_bytes(conn) if todo else 0
    if need > free:
        others = conn.shell(f"ls {REMOTE_ROOT}").stdout.split()
        others = [o for o in others if o != name]
        hint = f"; other folders there: {', '.join(others[:8])}" if others else ""
        raise DeviceError(
            f"not enough space on {conn.serial}: {_human(need)} ({need} bytes) still to push into "
            f"{remote_dir}, {_human(free)} ({free} bytes) free; free some space (e.g. `adb shell rm -r "
            f"{REMOTE_ROOT}/<old folder>`){hint} and run again"
        )
    return todo


def _push(conn: Adb, todo: list[Transfer], name: str) -> int:
    """adb push of each transfer, with a progress bar by bytes; the bytes pushed."""
    from stages.core.progress import tqdm

    pushed_bytes = 0
    with tqdm(
        total=sum(t.size for t in todo),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"push {name}",
        delay=PUSH_PROGRESS_DELAY_S,
        file=sys.stderr,
        disable=not todo,
    ) as bar:
        for n, t in enumerate(todo):
            # refresh=False: a forced refresh would show the bar before its delay is up.
            bar.set_postfix_str(Path(t.remote).name, refresh=False)
            r = conn.run("push", str(t.local), t.remote, timeout=None)
            if r.returncode != 0:
                _raise_for_adb_error_if_gone(r, conn)
                raise DeviceError(
                    f"pushing {t.local.name} to {conn.serial} failed after {n} of {len(todo)} files: "
                    f"{(r.stderr.strip() or r.stdout.strip())[-400:]}; run again to resume (files already "
                    "on the phone are kept); if it keeps failing, try another USB cable or port"
                )
            pushed_bytes += t.size
            bar.update(t.size)
    return pushed_bytes


def _check_pushed(conn: Adb, transfers: list[Transfer], todo: list[Transfer]) -> None:
    """The runtime's executables made executable, and every pushed file's sha256 checked on the
    phone; a damaged copy is removed and named."""
    executables = [t.remote for t in transfers if t.executable]
    if executables:
        conn.shell("chmod 755 " + " ".join(shlex.quote(p) for p in executables))
    after = remote_hashes(conn, [t.remote for t in todo])
    bad = [t for t in todo if after.get(t.remote) != t.sha256]
    if bad:
        conn.shell("rm -f " + " ".join(shlex.quote(t.remote) for t in bad))
        names = ", ".join(f"{t.local.name} ({t.remote})" for t in bad)
        raise DeviceError(
            f"{names}: the copy on {conn.serial} does not match the local file's sha256 after the push "
            "(damaged transfer); it was removed; run again, and try another USB cable if it recurs"
        )


def _raise_for_adb_error_if_gone(r: subprocess.CompletedProcess[str], conn: Adb) -> None:
    """A push that failed because the phone went away says so, rather than blaming the file."""
    text = (r.stderr + r.stdout).lower()
    if any(s in text for s in ("unauthorized", "offline", "no devices", "device '")):
        raise DeviceError(_explain_adb_error((r.stderr or r.stdout).strip().splitlines()[-1], conn.serial))


# ---- running Genie ----

BEGIN, END, PROMPT_ECHO = "[BEGIN]:", "[END]", "[PROMPT]:"

_KPI_PATTERNS = {
    "init_us": r"Init\s+Time\s*:\s*([\d.]+)\s*us",
    "prompt_us": r"Prompt\s+Processing\s+Time\s*:\s*([\d.]+)\s*us",
    "prompt_tokens_per_s": r"Prompt\s+Processing\s+Rate\s*:\s*([\d.]+)\s*toks?\s*/\s*sec",
    "decode_us": r"Token\s+Generation\s+Time\s*:\s*([\d.]+)\s*us",
    "decode_tokens_per_s": r"Token\s+Generation\s+Rate\s*:\s*([\d.]+)\s*toks?\s*/\s*sec",
}


def parse_kpis(text: str) -> dict[str, float | None]:
    """The figures of Genie's `[KPIS]:` block; None for each one it did not print."""
    start = text.rfind("[KPIS]")
    block = text[start:] if start >= 0 else ""
    found: dict[str, float | None] = {}
    for key, pattern in _KPI_PATTERNS.items():
        m = re.search(pattern, block, re.IGNORECASE)
        found[key] = float(m[1]) if m else None
    return found


def _longest_marker_prefix(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker (held back until more comes)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _AnswerStream:
    """Feeds Genie's output through, writing only the answer to `out` as it arrives."""

    def __init__(self, prompt: str, out: IO[str]):
        self.prompt, self.out = prompt, out
        self.before = ""  # everything up to [BEGIN]:
        self.pending = ""  # answer text not yet written (may end in part of [END])
        self.answer: list[str] = []
        self.after: list[str] = []
        self.state = "before"
        self.drop_space = False

    def _begin_search_from(self) -> int | None:
        """Where [BEGIN]: may be looked for: past Genie's echo of the prompt, which may contain it."""
        echo = self.before.find(PROMPT_ECHO)
        if echo < 0:
            return 0
        body = echo + len(PROMPT_ECHO)
        body += 1 if self.before[body : body + 1] == " " else 0
        if len(self.before) < body + len(self.prompt):
            return None
        return body + len(self.prompt) if self.before.startswith(self.prompt, body) else body

    def feed(self, chunk: str) -> None:
        if self.state == "before":
            self.before += chunk
            start = self._begin_search_from()
            at = -1 if start is None else self.before.find(BEGIN, start)
            if at < 0:
                return
            chunk = self.before[at + len(BEGIN) :]
            self.before = self.before[:at]
            self.state, self.drop_space = "answer", True
        if self.state == "answer":
            if self.drop_space and chunk:
                chunk = chunk[1:] if chunk[0] == " " else chunk
                self.drop_space = False
            self.pending += chunk
            at = self.pending.find(END)
            if at >= 0:
                self._write(self.pending[:at])
                self.after.append(self.pending[at + len(END) :])
                self.pending, self.state = "", "after"
                return
            keep = _longest_marker_prefix(self.pending, END)
            self._write(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return
        self.after.append(chunk)

    def _write(self, text: str) -> None:
        if text:
            self.answer.append(text)
            self.out.write(text)
            if hasattr(self.out, "flush"):
                self.out.flush()

    def close(self) -> None:
        if self.state == "answer" and self.pending:
            self._write(self.pending)
            self.pending = ""

    @property
    def everything(self) -> str:
        return (
            self.before
            + (BEGIN + "".join(self.answer) + END if self.state != "before" else "")
            + "".join(self.after)
        )


def genie_command(remote_dir: str, prompt_text: str, config: str = GENIE_CONFIG) -> str:
    return (
        f"cd {shlex.quote(remote_dir)} && LD_LIBRARY_PATH=. ADSP_LIBRARY_PATH=. ./{GENIE_RUN} "
        f"-c {shlex.quote(config)} -p {shlex.quote(prompt_text)}"
    )


def _tail(text: str, lines: int = OUTPUT_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_on_device(
    bundle_dir: Path, prompt_text: str, serial: str | None = None, adb: str = "adb", out: IO[str] = sys.stdout
) -> dict:
    """Run genie-t2t-run on the phone with an already chat-templated prompt, stream the answer to `out`
    and return Genie's own figures (tokens/s for the prompt and for decoding, init time) and the text."""
    manifest = read_manifest(Path(bundle_dir))
    conn = select_device(adb, serial)
    device = check_device(conn, manifest)
    for w in device.warnings:
        print(f"warning: {w}", file=sys.stderr)
    remote_dir = f"{REMOTE_ROOT}/{manifest.name}"
    exe, config = (shlex.quote(f"{remote_dir}/{n}") for n in (GENIE_RUN, manifest.genie_config))
    # Echo rather than the exit status: adb before Android 7 does not pass the status back.
    probe = conn.shell(f"test -x {exe} && test -f {config} && echo ready")
    if "ready" not in probe.stdout:
        raise DeviceError(
            f"{remote_dir} on {conn.serial} lacks {GENIE_RUN} or {manifest.genie_config}; push the bundle "
            "first (`g4v69 push`)"
        )

    started = time.monotonic()
    stream = _AnswerStream(prompt_text, out)
    proc = subprocess.Popen(
        conn.argv("shell", genie_command(remote_dir, prompt_text, manifest.genie_config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        # os.read returns whatever has arrived, so tokens reach `out` as Genie prints them.
        while block := os.read(proc.stdout.fileno(), 4096):
            stream.feed(decoder.decode(block))
        stream.feed(decoder.decode(b"", final=True))
        stream.close()
        code = proc.wait()
    finally:
        # Interrupted (Ctrl-C, a failing `out`): do not leave adb behind holding the phone.
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - started
    output = stream.everything
    if code != 0 or stream.state == "before":
        _raise_for_adb_error(subprocess.CompletedProcess([], code, "", output), conn.serial)
        why = f"exited with status {code}" if code != 0 else f"printed no {BEGIN}"
        raise DeviceError(
            f"{GENIE_RUN} on {conn.serial} {why}; the last lines it printed:\n{_tail(output)}\n"
            f"(a missing library or context binary means the push is incomplete: run `g4v69 push` again)"
        )
    kpis = parse_kpis(output)
    if kpis["prompt_tokens_per_s"] is None and kpis["decode_tokens_per_s"] is None:
        print(f"warning: {GENIE_RUN} printed no [KPIS] block; no token rates to report", file=sys.stderr)

    def seconds(us: float | None) -> float | None:
        return None if us is None else round(us / 1e6, 6)

    def tokens(us: float | None, rate: float | None) -> int | None:
        return None if us is None or rate is None else round(us / 1e6 * rate)

    return {
        "device": conn.serial,
        "model": device.model,
        "remote_dir": remote_dir,
        "text": "".join(stream.answer),
        "prompt_tokens_per_s": kpis["prompt_tokens_per_s"],
        "decode_tokens_per_s": kpis["decode_tokens_per_s"],
        "init_s": seconds(kpis["init_us"]),
        "prompt_s": seconds(kpis["prompt_us"]),
        "decode_s": seconds(kpis["decode_us"]),
        # Genie prints rates and times, not counts; their product is the count it measured.
        "prompt_tokens": tokens(kpis["prompt_us"], kpis["prompt_tokens_per_s"]),
        "generated_tokens": tokens(kpis["decode_us"], kpis["decode_tokens_per_s"]),
        "wall_s": round(wall, 3),
        "warnings": device.warnings,
    }
