"""Pushing a bundle and running Genie on a phone, against the adb test double (tests/doubles/adb):
resume after a cut transfer, damaged transfers, the device states adb reports, phones that cannot run
the bundle, a full disk, bad SDKs, and a run that streams the answer and reads Genie's KPIs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from stages.runtimes.genie.device import (
    DeviceError,
    _df_available_bytes,
    genie_command,
    parse_kpis,
    push_bundle,
    run_on_device,
    sdk_version,
)
from tests.conftest import DOUBLES

ADB = str(DOUBLES / "adb")
NAME = "gemma4-e2b-sm8450"
REMOTE = f"/data/local/tmp/{NAME}"
SERIAL = "R5CT10FAKE0"
RUNTIME = [
    "libGenie.so",
    "libQnnHtp.so",
    "libQnnSystem.so",
    "libQnnHtpV69Stub.so",
    "libQnnHtpV69Skel.so",
    "genie-t2t-run",
]


class FakeAdb:
    """Writes the double's scenario and reads back its state."""

    def __init__(self, root: Path):
        self.root = root
        self.state = root / "adb-state"
        self.scenario_file = root / "adb-scenario.json"

    def scenario(self, **settings) -> None:
        self.scenario_file.write_text(json.dumps(settings))

    def calls(self, command: str | None = None) -> list[list[str]]:
        path = self.state / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        argvs = [json.loads(line)["argv"] for line in lines]
        return [a for a in argvs if command is None or command in a]

    def remote(self, path: str, serial: str = SERIAL) -> Path:
        return self.state / serial / "fs" / path.lstrip("/")

    def genie_runs(self, serial: str = SERIAL) -> list[dict]:
        path = self.state / serial / "genie_runs.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def phone(serial: str = SERIAL, state: str = "device", free_kb: int = 10_000_000, **props) -> dict:
    return {"serial": serial, "state": state, "free_kb": free_kb, "props": props}


@pytest.fixture
def fake_adb(tmp_path, monkeypatch) -> FakeAdb:
    fake = FakeAdb(tmp_path)
    monkeypatch.setenv("FAKE_ADB_STATE", str(fake.state))
    monkeypatch.setenv("FAKE_ADB_SCENARIO", str(fake.scenario_file))
    monkeypatch.delenv("ANDROID_SERIAL", raising=False)
    # The double runs under `env python3`; this interpreter starts faster than a pyenv shim would.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    fake.scenario(devices=[phone()])
    return fake


def make_sdk(
    root: Path, version: str = "2.51.0.250930", yaml: bool = True, skip: tuple[str, ...] = ()
) -> Path:
    sdk = root / "qairt" / version
    files = {
        "lib/aarch64-android/libGenie.so": b"genie-lib",
        "lib/aarch64-android/libQnnHtp.so": b"htp",
        "lib/aarch64-android/libQnnSystem.so": b"system",
        "lib/aarch64-android/libQnnHtpV69Stub.so": b"stub69",
        "lib/aarch64-android/libQnnHtpV73Stub.so": b"stub73",
        "lib/hexagon-v69/unsigned/libQnnHtpV69Skel.so": b"skel69",
        "bin/aarch64-android/genie-t2t-run": b"\x7fELF genie",
    }
    for rel, data in files.items():
        if rel in skip:
            continue
        path = sdk / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (sdk / "bin/aarch64-android").mkdir(parents=True, exist_ok=True)
    if yaml:
        (sdk / "sdk.yaml").write_text(f"name: QAIRT\nversion: {version}\n")
    return sdk


@pytest.fixture
def sdk(tmp_path) -> Path:
    return make_sdk(tmp_path)


def make_bundle(root: Path, qairt_version: str = "2.51.0", soc: str = "SM8450") -> Path:
    bundle = root / "bundle"
    bundle.mkdir(parents=True, exist_ok=True)
    config = {
        "dialog": {
            "tokenizer": {"path": "tokenizer.json"},
            "engine": {"model": {"binary": {"ctx-bins": ["gemma_part1.bin", "gemma_part2.bin"]}}},
        }
    }
    contents = {
        "genie_config.json": json.dumps(config).encode(),
        "tokenizer.json": b'{"model": {}}',
        "gemma_part1.bin": bytes(range(256)) * 40,
        "gemma_part2.bin": b"\x01\x02" * 3000,
        "htp_backend_ext_config.json": b'{"devices": [{"dsp_arch": "v69"}]}',
    }
    entries = []
    for rel, data in contents.items():
        (bundle / rel).write_bytes(data)
        entries.append({"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (bundle / "notes-not-in-manifest.txt").write_text("stays on the host")
    manifest = {
        "name": NAME,
        "qairt_version": qairt_version,
        "dsp_arch": "v69",
        "soc": soc,
        "files": entries,
        "model": "google/gemma-4-E2B-it",
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


@pytest.fixture
def bundle(tmp_path) -> Path:
    return make_bundle(tmp_path)


def bundle_files(bundle: Path) -> list[str]:
    return [f["path"] for f in json.loads((bundle / "manifest.json").read_text())["files"]]


def assert_on_phone_intact(fake: FakeAdb, bundle: Path, sdk: Path, serial: str = SERIAL) -> None:
    for rel in bundle_files(bundle):
        assert fake.remote(f"{REMOTE}/{rel}", serial).read_bytes() == (bundle / rel).read_bytes(), rel
    for name in RUNTIME:
        local = next(sdk.rglob(name))
        assert fake.remote(f"{REMOTE}/{name}", serial).read_bytes() == local.read_bytes(), name


# ---- pushing ----


def test_push_sends_listed_files_and_runtime_with_matching_hashes(fake_adb, bundle, sdk):
    figures = push_bundle(bundle, sdk, adb=ADB)

    assert_on_phone_intact(fake_adb, bundle, sdk)
    assert not fake_adb.remote(f"{REMOTE}/notes-not-in-manifest.txt").exists()
    assert not fake_adb.remote(f"{REMOTE}/manifest.json").exists()
    assert not fake_adb.remote(f"{REMOTE}/libQnnHtpV73Stub.so").exists()
    assert fake_adb.remote(f"{REMOTE}/genie-t2t-run").stat().st_mode & 0o111
    n = len(bundle_files(bundle)) + len(RUNTIME)
    assert figures["files_pushed"] == n and figures["files_skipped"] == 0
    assert len(fake_adb.calls("push")) == n
    assert figures["bytes_pushed"] == figures["bytes_total"] > 12_000
    assert figures["device"] == SERIAL and figures["model"] == "SM-S901B"
    assert figures["remote_dir"] == REMOTE and figures["qairt_sdk"] == "2.51.0.250930"
    assert figures["warnings"] == []
    # The hashes were checked on the phone after the push.
    assert any(a[-1].startswith("sha256sum ") for a in fake_adb.calls("shell")[-3:])


def test_second_push_skips_everything(fake_adb, bundle, sdk):
    push_bundle(bundle, sdk, adb=ADB)
    before = len(fake_adb.calls("push"))
    figures = push_bundle(bundle, sdk, adb=ADB)
    assert len(fake_adb.calls("push")) == before
    assert figures["files_pushed"] == 0 and figures["bytes_pushed"] == 0
    assert figures["files_skipped"] == len(bundle_files(bundle)) + len(RUNTIME)


def test_interrupted_push_resumes_without_resending(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone()], fail_push_after=3)
    with pytest.raises(DeviceError, match=r"after 3 of 11 files.*Broken pipe.*run again") as e:
        push_bundle(bundle, sdk, adb=ADB)
    assert "gemma_part2.bin" in str(e.value)
    # The cut transfer left half a file behind; it must not count as pushed.
    half = fake_adb.remote(f"{REMOTE}/gemma_part2.bin")
    assert 0 < half.stat().st_size < (bundle / "gemma_part2.bin").stat().st_size
    assert len(fake_adb.calls("push")) == 4

    figures = push_bundle(bundle, sdk, adb=ADB)
    assert figures["files_skipped"] == 3 and figures["files_pushed"] == 8
    pushed_again = [a[a.index("push") + 1] for a in fake_adb.calls("push")[4:]]
    assert len(pushed_again) == 8
    assert not any(
        p.endswith(("genie_config.json", "tokenizer.json", "gemma_part1.bin")) for p in pushed_again
    )
    assert_on_phone_intact(fake_adb, bundle, sdk)


def test_damaged_transfer_is_caught_and_removed(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone()], corrupt="gemma_part1.bin")
    with pytest.raises(DeviceError, match=r"gemma_part1\.bin.*does not match.*sha256") as e:
        push_bundle(bundle, sdk, adb=ADB)
    assert "gemma_part2.bin" not in str(e.value)
    assert not fake_adb.remote(f"{REMOTE}/gemma_part1.bin").exists()
    fake_adb.scenario(devices=[phone()])
    figures = push_bundle(bundle, sdk, adb=ADB)
    assert figures["files_pushed"] == 1
    assert_on_phone_intact(fake_adb, bundle, sdk)


def test_adb_missing(fake_adb, bundle, sdk, tmp_path):
    with pytest.raises(DeviceError, match=r"adb not found.*apt-get install adb"):
        push_bundle(bundle, sdk, adb=str(tmp_path / "no-such-adb"))


def test_no_device(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[])
    with pytest.raises(DeviceError, match=r"no phone is attached.*USB debugging"):
        push_bundle(bundle, sdk, adb=ADB)
    assert fake_adb.calls("push") == []


def test_unauthorized_device(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone(state="unauthorized")])
    with pytest.raises(DeviceError, match=rf"{SERIAL} is unauthorized.*accept the 'Allow USB debugging\?'"):
        push_bundle(bundle, sdk, adb=ADB)


def test_offline_device(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone(state="offline")])
    with pytest.raises(DeviceError, match=rf"{SERIAL} is offline.*replug"):
        push_bundle(bundle, sdk, adb=ADB)


def test_several_devices_need_a_serial(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone("AAA111"), phone("BBB222")])
    with pytest.raises(
        DeviceError, match=r"several phones.*AAA111 \(device\), BBB222 \(device\).*ADB_SERIAL"
    ):
        push_bundle(bundle, sdk, adb=ADB)


def test_serial_picks_one_device(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone("AAA111"), phone("BBB222", **{"ro.product.model": "Xiaomi 12"})])
    figures = push_bundle(bundle, sdk, serial="BBB222", adb=ADB)
    assert figures["device"] == "BBB222" and figures["model"] == "Xiaomi 12"
    assert_on_phone_intact(fake_adb, bundle, sdk, serial="BBB222")
    assert not fake_adb.remote(REMOTE, "AAA111").exists()
    device_calls = [a for a in fake_adb.calls() if a[0] != "devices"]
    assert device_calls and all(a[:2] == ["-s", "BBB222"] for a in device_calls)


def test_serial_not_attached(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone("AAA111")])
    with pytest.raises(DeviceError, match=r"ADB_SERIAL=ZZZ999 is not attached; attached: AAA111 \(device\)"):
        push_bundle(bundle, sdk, serial="ZZZ999", adb=ADB)


def test_32_bit_device_refused(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone(**{"ro.product.cpu.abi": "armeabi-v7a"})])
    with pytest.raises(DeviceError, match=r"armeabi-v7a.*64-bit arm64-v8a"):
        push_bundle(bundle, sdk, adb=ADB)
    assert fake_adb.calls("push") == []


@pytest.mark.parametrize(
    "props, message",
    [
        (
            {"ro.soc.manufacturer": "Samsung", "ro.soc.model": "s5e9925", "ro.board.platform": "s5e9925"},
            r"has a Samsung SoC \(s5e9925\).*Snapdragon",
        ),
        ({"ro.soc.manufacturer": None, "ro.board.platform": "mt6893"}, r"ro.board.platform is mt6893"),
    ],
    ids=["exynos", "old-android-mediatek"],
)
def test_non_snapdragon_refused(fake_adb, bundle, sdk, props, message):
    fake_adb.scenario(devices=[phone(**props)])
    with pytest.raises(DeviceError, match=message):
        push_bundle(bundle, sdk, adb=ADB)
    assert fake_adb.calls("push") == []


def test_old_android_snapdragon_recognised_by_platform(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone(**{"ro.soc.manufacturer": None, "ro.soc.model": None})])
    figures = push_bundle(bundle, sdk, adb=ADB)
    assert figures["files_pushed"] == 11 and figures["warnings"] == []


def test_other_soc_is_a_warning(fake_adb, bundle, sdk, capsys):
    fake_adb.scenario(devices=[phone(**{"ro.soc.model": "SM8475"})])
    figures = push_bundle(bundle, sdk, adb=ADB)
    assert figures["files_pushed"] == 11
    assert len(figures["warnings"]) == 1 and "SM8475" in figures["warnings"][0]
    assert "same v69 NPU" in figures["warnings"][0]
    assert "warning:" in capsys.readouterr().err


def test_disk_full_refused_with_numbers(fake_adb, bundle, sdk):
    fake_adb.scenario(devices=[phone(free_kb=5)])
    with pytest.raises(
        DeviceError, match=r"not enough space.*\((\d+) bytes\) still to push.*\(5120 bytes\) free"
    ):
        push_bundle(bundle, sdk, adb=ADB)
    assert fake_adb.calls("push") == []


def test_missing_sdk(fake_adb, bundle, tmp_path):
    with pytest.raises(DeviceError, match=r"QNN_SDK_ROOT is not set.*2\.51\.0 or newer"):
        push_bundle(bundle, None, adb=ADB)
    with pytest.raises(DeviceError, match=r"does not exist"):
        push_bundle(bundle, tmp_path / "nowhere", adb=ADB)


def test_wrong_sdk_layout_lists_missing_files(fake_adb, bundle, tmp_path):
    sdk = make_sdk(
        tmp_path,
        skip=("lib/hexagon-v69/unsigned/libQnnHtpV69Skel.so", "bin/aarch64-android/genie-t2t-run"),
    )
    with pytest.raises(DeviceError) as e:
        push_bundle(bundle, sdk, adb=ADB)
    msg = str(e.value)
    assert (
        "lib/hexagon-v69/unsigned/libQnnHtpV69Skel.so" in msg and "bin/aarch64-android/genie-t2t-run" in msg
    )
    assert "libGenie.so" not in msg


def test_sdk_older_than_bundle_refused(fake_adb, tmp_path):
    bundle = make_bundle(tmp_path, qairt_version="2.51.0")
    sdk = make_sdk(tmp_path, version="2.45.0.250321")
    with pytest.raises(DeviceError, match=r"QAIRT 2\.45\.0\.250321, older than the QAIRT 2\.51\.0"):
        push_bundle(bundle, sdk, adb=ADB)


def test_sdk_version_from_folder_name_and_numeric_compare(fake_adb, tmp_path):
    sdk = make_sdk(tmp_path, version="2.100.0.251010", yaml=False)
    assert sdk_version(sdk) == "2.100.0.251010"
    # 2.100 is newer than 2.51 (numbers, not strings).
    figures = push_bundle(make_bundle(tmp_path), sdk, adb=ADB)
    assert figures["qairt_sdk"] == "2.100.0.251010"


def test_bundle_file_changed_since_manifest(fake_adb, bundle, sdk):
    (bundle / "tokenizer.json").write_text("edited")
    with pytest.raises(DeviceError, match=r"tokenizer\.json has changed.*rebuild the bundle"):
        push_bundle(bundle, sdk, adb=ADB)


def test_df_parsing():
    toybox = (
        "Filesystem        1K-blocks     Used Available Use% Mounted on\n"
        "/dev/block/dm-48 115249236 23456780  91792456  21% /data\n"
    )
    assert _df_available_bytes(toybox) == 91792456 * 1024
    wrapped = (
        "Filesystem           1K-blocks      Used Available Use% Mounted on\n"
        "/dev/block/bootdevice/by-name/userdata\n"
        "                       5000000   1000000   4000000  20% /data\n"
    )
    assert _df_available_bytes(wrapped) == 4000000 * 1024
    toolbox = (
        "Filesystem               Size     Used     Free   Blksize\n"
        "/data                   12.1G     8.0G     4.1G   4096\n"
    )
    assert _df_available_bytes(toolbox) == int(4.1 * 1024**3)
    assert _df_available_bytes("df: /data/local/tmp: Permission denied\n") is None


# ---- running ----


@pytest.fixture(scope="session")
def pushed_phone_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pushed-phone") / "fs"


@pytest.fixture
def pushed(fake_adb, bundle, sdk, pushed_phone_cache) -> Path:
    """The bundle, already on the phone: pushed once per session, then the phone's files are copied."""
    if not pushed_phone_cache.exists():
        push_bundle(bundle, sdk, adb=ADB)
        shutil.copytree(fake_adb.state / SERIAL / "fs", pushed_phone_cache)
    else:
        shutil.copytree(pushed_phone_cache, fake_adb.state / SERIAL / "fs")
    return bundle


class Recorder(io.StringIO):
    """Keeps when each piece of the answer arrived."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def write(self, s: str) -> int:
        self.times.append(time.monotonic())
        return super().write(s)


def test_run_streams_answer_and_reads_kpis(fake_adb, pushed):
    bundle = pushed
    answer = "The capital of France is Paris. It lies on the Seine."
    fake_adb.scenario(
        devices=[phone()],
        genie={
            "answer": answer,
            "token_delay_s": 0.03,
            "init_us": 1285307,
            "prompt_us": 203862,
            "prompt_rate": 58.862,
            "gen_us": 1416584,
            "gen_rate": 33.179,
        },
    )
    out = Recorder()
    figures = run_on_device(
        bundle, "<start_of_turn>user\nCapital of France?<end_of_turn>\n", adb=ADB, out=out
    )
    done = time.monotonic()

    assert out.getvalue() == answer == figures["text"]
    # Streamed: many writes, the first well before the run ended.
    assert len(out.times) > 5 and done - out.times[0] > 0.2
    assert figures["prompt_tokens_per_s"] == pytest.approx(58.862)
    assert figures["decode_tokens_per_s"] == pytest.approx(33.179)
    assert figures["init_s"] == pytest.approx(1.285307)
    assert figures["prompt_tokens"] == 12 and figures["generated_tokens"] == 47
    run = fake_adb.genie_runs()[-1]
    assert run["cwd"] == REMOTE and run["exit_code"] == 0
    assert run["env"] == {"LD_LIBRARY_PATH": ".", "ADSP_LIBRARY_PATH": "."}


def test_prompt_with_quotes_and_newlines_arrives_intact(fake_adb, pushed):
    bundle = pushed
    prompt = (
        '<start_of_turn>user\nIt\'s a "test": $HOME ${PATH} \\n; echo hi && rm -rf / | cat\n'
        "[BEGIN]: not the answer [END]\n<end_of_turn>\n<start_of_turn>model\n"
    )
    out = io.StringIO()
    figures = run_on_device(bundle, prompt, adb=ADB, out=out)
    assert fake_adb.genie_runs()[-1]["prompt"] == prompt
    assert figures["text"] == "Paris is the capital of France." == out.getvalue()


def test_run_before_push(fake_adb, bundle):
    with pytest.raises(
        DeviceError, match=r"lacks genie-t2t-run or genie_config\.json; push the bundle first"
    ):
        run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())


def test_run_fails_when_a_context_binary_is_missing(fake_adb, pushed):
    bundle = pushed
    fake_adb.remote(f"{REMOTE}/gemma_part2.bin").unlink()
    with pytest.raises(DeviceError, match=r"(?s)exited with status 1.*Could not open file: gemma_part2\.bin"):
        run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())


def test_run_fails_without_the_skel(fake_adb, pushed):
    bundle = pushed
    fake_adb.remote(f"{REMOTE}/libQnnHtpV69Skel.so").unlink()
    with pytest.raises(DeviceError, match=r"(?s)exited with status 1.*Failed to create device"):
        run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())


def test_run_without_begin_is_an_error(fake_adb, pushed):
    bundle = pushed
    fake_adb.scenario(devices=[phone()], genie={"begin": False})
    with pytest.raises(DeviceError, match=r"(?s)printed no \[BEGIN\]:.*\[PROMPT\]: hi"):
        run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())


def test_run_nonzero_exit_is_an_error(fake_adb, pushed):
    bundle = pushed
    fake_adb.scenario(devices=[phone()], genie={"exit_code": 3})
    with pytest.raises(DeviceError, match=r"(?s)exited with status 3.*Token Generation Rate"):
        run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())


def test_run_without_kpis_still_returns_the_text(fake_adb, pushed, capsys):
    bundle = pushed
    fake_adb.scenario(devices=[phone()], genie={"kpis": False, "answer": "ok"})
    figures = run_on_device(bundle, "hi", adb=ADB, out=io.StringIO())
    assert figures["text"] == "ok"
    assert figures["prompt_tokens_per_s"] is None and figures["decode_tokens_per_s"] is None
    assert "no [KPIS]" in capsys.readouterr().err


def test_kpi_parsing_tolerates_spacing():
    text = (
        "[KPIS]:\nInit Time:6549034 us\n"
        "Prompt Processing Time: 196067 us, Prompt Processing Rate : 86.707710 toks/sec\n"
        "Token Generation Time :740568us,  Token Generation Rate:12.152884 toks/sec\n"
    )
    k = parse_kpis(text)
    assert k == {
        "init_us": 6549034.0,
        "prompt_us": 196067.0,
        "prompt_tokens_per_s": 86.70771,
        "decode_us": 740568.0,
        "decode_tokens_per_s": 12.152884,
    }


def test_genie_command_quotes_for_the_device_shell():
    cmd = genie_command(REMOTE, "a'b\nc")
    assert cmd == (
        f"cd {REMOTE} && LD_LIBRARY_PATH=. ADSP_LIBRARY_PATH=. ./genie-t2t-run -c genie_config.json "
        "-p 'a'\"'\"'b\nc'"
    )
