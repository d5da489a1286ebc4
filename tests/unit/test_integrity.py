"""Integrity and faults in the shared core: input hashes against upstream reports, per-config stamps,
stale partial folders, disk space, and the CLI's one-line errors for full or read-only disks."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil

import pytest

from stages.core import report as rp
from stages.core.config import load_config, stage_key, stamp_name
from stages.core.config import main as config_main
from stages.core.report import (
    DiskSpaceError,
    IntegrityError,
    check_inputs,
    copy_file,
    read_report,
    remove_stale_partials,
    stage_output,
    write_stamp,
)
from tests.conftest import folder_locked_by_another_process


def _make_stage(workdir, stage, files):
    """A finished stage folder under workdir with the given files, through stage_output."""
    out = workdir / rp.STAGE_DIRS[stage] / ("tiny" if stage == "download" else "")
    with stage_output(stage, out, [], {}, root=workdir) as run:
        for name, data in files.items():
            (run.dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run.dir / name).write_bytes(data)
    return out


def _flip(path, offset=0):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ---- hashes against the upstream report ----
def test_a_flipped_byte_names_the_file_and_the_stage_and_removes_its_stamps(tmp_path):
    out = _make_stage(tmp_path, "export", {"a.onnx": b"x" * 100, "luts/e.bin": b"y" * 10})
    (tmp_path / ".g4v69").mkdir()
    for name in ("export-aaa.json", "export-bbb.json", "quantize-ccc.json"):
        (tmp_path / ".g4v69" / name).write_text("{}")
    check_inputs(tmp_path, [out])  # untouched: passes
    _flip(out / "luts" / "e.bin", 3)
    with pytest.raises(IntegrityError) as e:
        check_inputs(tmp_path, [out])
    line = str(e.value)
    assert "\n" not in line and str(out / "luts" / "e.bin") in line and "run `make export` again" in line
    # Make redoes export (its stamps are gone) and then what follows; other stages' stamps stay.
    assert sorted(p.name for p in (tmp_path / ".g4v69").iterdir()) == ["quantize-ccc.json"]


def test_an_upstream_made_for_another_config_is_refused_by_name(tmp_path):
    cfg = load_config("tiny")
    out = tmp_path / rp.STAGE_DIRS["export"]
    ran = {"model": "tiny", **{f: getattr(cfg, f) for f in ("prefill_ar", "precision", "calibration_ar")}}
    with stage_output("export", out, [], ran, root=tmp_path) as run:
        (run.dir / "a.onnx").write_bytes(b"x")
    check_inputs(tmp_path, [out], cfg)  # the config it was made for
    # A later stage's own fields are not the export's business.
    check_inputs(tmp_path, [out], cfg.with_overrides(calibration_samples=3))
    with pytest.raises(IntegrityError) as e:
        check_inputs(tmp_path, [out], cfg.with_overrides(prefill_ar=2, calibration_ar=16))
    line = str(e.value)
    assert (
        "\n" not in line
        and "prefill_ar=2 (it ran with 4)" in line
        and "calibration_ar=16 (it ran with 0)" in line
    )
    assert "run `make export` again" in line
    # A field a stage records because it depends on it (compile records the soc it compiled for) counts too.
    compiled = tmp_path / rp.STAGE_DIRS["compile"]
    with stage_output("compile", compiled, [], {"model": "tiny", "soc": "SM8450"}, root=tmp_path) as run:
        (run.dir / "b.bin").write_bytes(b"x")
    check_inputs(tmp_path, [compiled], cfg)
    with pytest.raises(IntegrityError, match=r"soc='SM8550' \(it ran with 'SM8450'\); run `make compile`"):
        check_inputs(tmp_path, [compiled], cfg.with_overrides(soc="SM8550"))


def test_a_single_file_is_checked_against_its_folders_report(tmp_path):
    out = _make_stage(tmp_path, "compile", {"b.bin": b"z" * 50, "other.bin": b"o"})
    _flip(out / "other.bin")
    check_inputs(tmp_path, [out / "b.bin"])  # only b.bin is read
    (out / "b.bin").write_bytes(b"z" * 49)
    with pytest.raises(IntegrityError, match=r"b\.bin has 49 bytes, compile wrote 50; run `make compile`"):
        check_inputs(tmp_path, [out / "b.bin"])


def test_a_checkpoint_file_names_the_download_stage_and_only_its_own_stamps(tmp_path):
    out = _make_stage(tmp_path, "download", {"model.safetensors": b"w" * 64})
    stamps = tmp_path / ".g4v69"
    stamps.mkdir()
    for name in ("download-tiny-aaa.json", "download-tiny-2-bbb.json", "export-ccc.json"):
        (stamps / name).write_text("{}")
    (out / "model.safetensors").write_bytes(b"w" * 32)  # truncated
    with pytest.raises(IntegrityError, match="run `make download` again"):
        check_inputs(tmp_path, [out])
    assert sorted(p.name for p in stamps.iterdir()) == ["download-tiny-2-bbb.json", "export-ccc.json"]


def test_a_folder_without_a_report_asks_for_its_stage(tmp_path):
    (tmp_path / "quantized").mkdir()
    with pytest.raises(IntegrityError, match="holds no finished quantize stage.*`make quantize` first"):
        check_inputs(tmp_path, [tmp_path / "quantized"])


# ---- the reports themselves ----
def _quantize_then_compile(workdir, top1=0.984):
    """A quantize stage with its quality figures, and a compile stage that read its report."""
    quantized = workdir / rp.STAGE_DIRS["quantize"]
    with stage_output("quantize", quantized, [], {}, root=workdir) as run:
        (run.dir / "g.qdq.onnx").write_bytes(b"q" * 20)
        run.figures["quality"] = {"float16": {"top1_agreement": top1, "kl_divergence": 0.0007}}
    compiled = workdir / rp.STAGE_DIRS["compile"]
    with stage_output("compile", compiled, [quantized / "report.json"], {}, root=workdir) as run:
        (run.dir / "g.bin").write_bytes(b"b" * 20)
    stamps = workdir / ".g4v69"
    stamps.mkdir(exist_ok=True)
    for name in ("quantize-q.json", "compile-c.json"):
        (stamps / name).write_text("{}")
    return quantized, compiled


def _edit_top1(folder, top1):
    report = json.loads((folder / "report.json").read_text())
    report["figures"]["quality"]["float16"]["top1_agreement"] = top1
    (folder / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def test_a_report_edited_by_hand_is_refused_by_name(tmp_path):
    quantized, compiled = _quantize_then_compile(tmp_path)
    report = read_report(quantized)
    assert report[rp.REPORT_SEAL] == rp.report_seal(report)
    # The compile stage recorded the quantize report it read, with its sha256.
    assert [f["path"] for f in read_report(compiled)["inputs"]] == ["quantized/report.json"]
    check_inputs(tmp_path, [quantized])
    _edit_top1(quantized, 0.1)  # a floor read from it would have moved
    for paths in ([quantized], [quantized / "report.json"], [compiled]):
        with pytest.raises(IntegrityError) as e:
            check_inputs(tmp_path, paths)
        line = str(e.value)
        assert line == (
            f"{quantized / 'report.json'} changed after quantize wrote it (its report_sha256 does not "
            "match its content); run `make quantize` again"
        )
    assert sorted(p.name for p in (tmp_path / ".g4v69").iterdir()) == ["compile-c.json"]
    # A report without a seal (an older g4v69's, or one rewritten without it) is refused as well.
    report.pop(rp.REPORT_SEAL)
    (quantized / "report.json").write_text(json.dumps(report))
    with pytest.raises(IntegrityError, match="report.json has no report_sha256 .*run `make quantize` again"):
        check_inputs(tmp_path, [quantized])


def test_a_report_a_later_stage_read_is_checked_against_its_record(tmp_path):
    quantized, compiled = _quantize_then_compile(tmp_path)
    check_inputs(tmp_path, [compiled / "report.json"])
    # quantize made again (a whole, sealed report, with other figures) after compile read the first:
    # compile is stale, and a stage reading both says so.
    with stage_output("quantize", quantized, [], {}, root=tmp_path) as run:
        (run.dir / "g.qdq.onnx").write_bytes(b"q" * 20)
        run.figures["quality"] = {"float16": {"top1_agreement": 0.5, "kl_divergence": 0.5}}
    check_inputs(tmp_path, [quantized])
    with pytest.raises(IntegrityError) as e:
        check_inputs(tmp_path, [compiled])
    assert str(e.value) == (
        f"{quantized / 'report.json'} is not the one compile read (its sha256 differs from the record in "
        f"{compiled / 'report.json'}): quantize ran again since; run `make compile` again"
    )
    assert sorted(p.name for p in (tmp_path / ".g4v69").iterdir()) == ["quantize-q.json"]
    # A stage that does not read quantized/ is not stopped by its absence.
    shutil.rmtree(quantized)
    check_inputs(tmp_path, [compiled])


# ---- per-config stamps ----
def test_stamps_are_keyed_by_the_fields_up_to_their_stage():
    tiny = load_config("tiny")
    other_soc = tiny.with_overrides(soc="SM8550")
    longer = tiny.with_overrides(max_context=256)
    assert stamp_name(tiny, "download").startswith("download-tiny-")
    assert stamp_name(other_soc, "export") == stamp_name(tiny, "export")
    assert stamp_name(other_soc, "quantize") != stamp_name(tiny, "quantize")
    # A change upstream changes every later stage's key: its output was made from other inputs.
    assert all(stamp_name(longer, s) != stamp_name(tiny, s) for s in ("export", "quantize", "bundle"))
    assert set(stage_key(tiny, "compile")) >= {"model", "max_context", "soc", "compiler"}


def test_the_makefiles_names_are_the_clis_names():
    cfg = load_config("tiny", {"soc": "sm8550", "calibration_samples": 3})
    names = config_main(["--preset", "tiny", "--soc", "sm8550"], {"G4V69_CALIBRATION_SAMPLES": "3"})
    assert names.split() == [f"model={cfg.model}", f"checkpoint={cfg.checkpoint_name}"] + [
        f"{s}={stamp_name(cfg, s)}" for s in ("download", "export", "quantize", "compile", "bundle")
    ]


def test_a_stamp_replaces_its_stages_other_configs_and_is_dated_like_the_report(tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{}")
    os.utime(report, ns=(10**18, 10**18))
    stamps = tmp_path / ".g4v69"
    stamps.mkdir()
    for name in ("export-old.json", "quantize-q.json", "download-tiny-a.json", "download-e2b-random-b.json"):
        (stamps / name).write_text("{}")
    write_stamp(tmp_path, "export-new.json", {"k": 1}, report)
    write_stamp(tmp_path, "download-tiny-c.json", {"k": 2}, report)
    assert sorted(p.name for p in stamps.iterdir()) == [
        "download-e2b-random-b.json",
        "download-tiny-c.json",
        "export-new.json",
        "quantize-q.json",
    ]
    assert (stamps / "export-new.json").stat().st_mtime_ns == 10**18
    assert json.loads((stamps / "export-new.json").read_text()) == {"k": 1}


# ---- stale partial folders ----
def test_stale_partials_go_and_a_live_runs_stays(tmp_path):
    dead = tmp_path / ".exported.partial-4242"
    dead.mkdir()
    (dead / "big.onnx").write_bytes(b"x")
    old = tmp_path / ".exported.old-17"
    old.mkdir()
    live = tmp_path / ".exported.partial-1"
    live.mkdir()
    with folder_locked_by_another_process(live):
        with stage_output("export", tmp_path / "exported", [], {}, root=tmp_path) as run:
            (run.dir / "a").write_text("a")
        assert not dead.exists() and not old.exists() and live.is_dir()
    assert remove_stale_partials(tmp_path) == [live]
    # A Hub download's staging folder is how a download resumes: never a stale partial.
    staging = tmp_path / ".gemma-4-e2b-it.download"
    staging.mkdir()
    assert remove_stale_partials(tmp_path) == [] and staging.is_dir()


def test_a_running_stage_holds_the_lock_on_its_folder(tmp_path):
    with stage_output("export", tmp_path / "exported", [], {}, root=tmp_path) as run:
        fd = os.open(run.dir.parent, os.O_RDONLY)  # the partial folder
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        assert remove_stale_partials(tmp_path) == []


def test_library_temp_files_stay_in_the_stage_folder(tmp_path):
    import tempfile

    with stage_output("quantize", tmp_path / "quantized", [], {}, root=tmp_path) as run:
        inside = tempfile.mkdtemp()
        partial = str(run.dir.parent)
        assert inside.startswith(partial) and os.environ["TMPDIR"].startswith(partial)
        assert not inside.startswith(str(run.dir))  # the stage's own listing of its output never sees it
    assert not tempfile.gettempdir().startswith(str(tmp_path))
    assert [p.name for p in (tmp_path / "quantized").iterdir()] == ["report.json"]


# ---- disk space and writes ----
def test_short_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(rp, "free_bytes", lambda folder: 10**9)
    with pytest.raises(DiskSpaceError) as e:
        with stage_output("export", tmp_path / "exported", [], {}, root=tmp_path, need_bytes=2 * 10**9):
            raise AssertionError("the stage must not start")
    assert "not enough disk space" in str(e.value) and "1.00 GB free" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_bundle_copy_is_not_a_link(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(b"compiled")
    copy_file(src, tmp_path / "b.bin")
    assert os.stat(src).st_ino != os.stat(tmp_path / "b.bin").st_ino
    with open(tmp_path / "b.bin", "r+b") as f:
        f.write(b"C")
    assert src.read_bytes() == b"compiled"


@pytest.mark.parametrize(
    ("err", "says"),
    [
        (errno.ENOSPC, "the disk is full writing"),
        (errno.EROFS, "set WORKDIR to a folder you can write to"),
    ],
)
def test_a_full_or_read_only_disk_mid_stage_is_one_line_and_leaves_nothing(
    g4v69, tmp_path, monkeypatch, err, says
):
    import stages.download as dl

    def fault(name, dest, seed=0, **kw):
        (dest / "model.safetensors").write_bytes(b"half")
        raise OSError(err, os.strerror(err), str(dest / "model.safetensors"))

    monkeypatch.setattr(dl, "write_builtin_checkpoint", fault)
    work = tmp_path / "w"
    r = g4v69("--preset", "tiny", "--workdir", str(work), "download")
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and says in r.output and "model.safetensors" in r.output
    assert list((work / "checkpoints").iterdir()) == []
    assert not (work / ".g4v69").exists()


def test_enospc_wrapped_by_a_library_is_one_line(g4v69, tmp_path, monkeypatch):
    import stages.download as dl

    def fault(*a, **kw):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos; [Errno 28] No space left"
        )

    monkeypatch.setattr(dl, "write_builtin_checkpoint", fault)
    r = g4v69("--preset", "tiny", "--workdir", str(tmp_path / "w"), "download")
    assert r.exit_code == 2 and "the disk is full" in r.output and len(r.output.strip().splitlines()) == 1


def test_a_finished_stage_is_stamped_dated_like_its_report(g4v69, tmp_path):
    work = tmp_path / "w"
    r = g4v69("--preset", "tiny", "--workdir", str(work), "download")
    assert r.exit_code == 0, r.output
    stamp = work / ".g4v69" / stamp_name(load_config("tiny"), "download")
    report = work / "checkpoints" / "tiny" / "report.json"
    assert stamp.stat().st_mtime_ns == report.stat().st_mtime_ns
    # The download report records every checkpoint file with its sha256: what later stages check.
    recorded = {f["path"] for f in read_report(report.parent)["outputs"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= recorded


def test_verify_floor_against_transformers_is_the_presets_floor_less_the_margin():
    from stages.runtimes.genie.verify import Thresholds, transformers_floor

    tiny = load_config("tiny")
    assert transformers_floor(tiny) == 0.9  # min_top1_agreement_w8 0.95
    assert transformers_floor(tiny.with_overrides(precision="w4a16")) == 0.7  # min_top1_agreement_w4 0.75
    assert transformers_floor(load_config("default")) == 0.55
    assert transformers_floor(tiny.with_overrides(min_top1_agreement_w8=0.99)) == 0.94
    assert Thresholds().top1_with_transformers(tiny) == 0.9
    assert Thresholds.with_overrides(min_top1=0.5).top1_with_transformers(tiny) == 0.5


def _measured(**figures):
    return {
        "matching_prefix": 32,
        "generated": 32,
        "top1_prompt": 1.0,
        "top1_heldout": 1.0,
        "top1_own_graphs": 1.0,
        **figures,
    }


def test_verify_min_top1_never_loosens_the_bundle_against_its_own_graphs():
    from stages.runtimes.genie.verify import OWN_GRAPHS_MIN_TOP1, Thresholds

    tiny = load_config("tiny")
    binaries_off = _measured(top1_own_graphs=0.5)
    for thresholds in (
        Thresholds(),
        Thresholds.with_overrides(min_top1=0),
        Thresholds.with_overrides(0, 0.1),
    ):
        (line,) = thresholds.shortfalls(tiny, binaries_off)
        assert f"the bundle's quantized graphs on the host 0.500, 0.400 below {OWN_GRAPHS_MIN_TOP1}" in line
        assert "VERIFY_MIN_TOP1" not in line and "fixed" in line
    # It does set the floor against transformers, both ways.
    assert Thresholds.with_overrides(min_top1=0).shortfalls(tiny, _measured(top1_prompt=0.2)) == []
    (line,) = Thresholds.with_overrides(min_top1=0.99).shortfalls(tiny, _measured(top1_heldout=0.95))
    assert "held-out text with transformers 0.950, 0.040 below 0.99 (VERIFY_MIN_TOP1)" in line


def test_verify_names_the_presets_floor_it_fell_below():
    from stages.runtimes.genie.verify import Thresholds

    w4 = load_config("tiny", {"precision": "w4a16"})
    assert Thresholds().shortfalls(w4, _measured(top1_prompt=0.72, top1_heldout=0.71)) == []
    (line,) = Thresholds().shortfalls(w4, _measured(top1_heldout=0.65))
    assert line.endswith("0.650, 0.050 below 0.7 (min_top1_agreement_w4 0.75 less 0.05)")
    (line,) = Thresholds().shortfalls(w4, _measured(matching_prefix=3, generated=5))
    assert "match transformers for 3, 2 short of 5 (VERIFY_MIN_PREFIX)" in line


def test_the_held_out_floor_gives_way_by_two_standard_errors_of_its_sample():
    """Gemma 3 270M: 0.766 on verify's 64 held-out predictions, where its quantized graphs measure
    0.897 on quantize's 2,044 tokens and the preset's floor is 0.86 (0.81 for verify)."""
    from stages.runtimes.genie.verify import Thresholds, heldout_floor

    g3 = load_config("gemma3-270m")
    assert heldout_floor(0.81, 64) == 0.712 and heldout_floor(0.81, 0) == 0.81
    assert Thresholds().shortfalls(g3, _measured(top1_heldout=0.766, heldout_predictions=64)) == []
    mine = Thresholds.with_overrides(min_top1=0.81)
    (line,) = mine.shortfalls(g3, _measured(top1_heldout=0.766, heldout_predictions=64))
    assert line.endswith("below 0.81 (VERIFY_MIN_TOP1)")
    (line,) = Thresholds().shortfalls(g3, _measured(top1_heldout=0.6, heldout_predictions=64))
    assert line.endswith(
        "below 0.712 (min_top1_agreement_w8 0.86 less 0.05, less 2 standard errors over 64 predictions)"
    )
