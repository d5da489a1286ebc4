"""Calibration text: WikiText-2 read from a local copy of its Hub files through `datasets` itself."""

from pathlib import Path

import pytest

from stages.core.config import load_config
from stages.quant.calibration import (
    DATASETS_FOLDER,
    WIKITEXT,
    CalibrationError,
    load_texts,
    local_dataset,
    write_wikitext_copy,
)


def test_a_local_copy_of_wikitext_is_read_by_datasets_in_place_of_the_hub(tmp_path: Path):
    pytest.importorskip("datasets")
    cfg = load_config()  # the default preset calibrates on WikiText-2 raw
    assert cfg.calibration_dataset == "wikitext-2-raw-v1"
    splits = {"train": " = A = \n\n one line\n two lines\n", "validation": " v\n", "test": " = T = \n held\n"}
    dest = write_wikitext_copy(tmp_path / DATASETS_FOLDER / WIKITEXT[0], splits, "a test copy")
    assert local_dataset(tmp_path, WIKITEXT[0]) == dest
    # The layout the Hub serves: the config's folder of one parquet per split, mapped by the README.
    assert sorted(p.name for p in (dest / WIKITEXT[1]).iterdir()) == [
        f"{s}-00000-of-00001.parquet" for s in ("test", "train", "validation")
    ]
    assert load_texts(cfg, "calibration", None, tmp_path) == [splits["train"]]
    assert load_texts(cfg, "heldout", None, tmp_path) == [splits["test"]]
    # Written again: replaced whole, no temporary folder left beside it.
    write_wikitext_copy(dest, {**splits, "train": " new\n"}, "again")
    assert load_texts(cfg, "calibration", None, tmp_path) == [" new\n"]
    assert [p.name for p in dest.parent.iterdir()] == ["wikitext"]


def test_a_broken_local_copy_is_a_clear_error(tmp_path: Path):
    pytest.importorskip("datasets")
    dest = tmp_path / DATASETS_FOLDER / WIKITEXT[0]
    dest.mkdir(parents=True)
    (dest / "README.md").write_text("---\nconfigs:\n- config_name: other\n  data_files: x/*\n---\n")
    with pytest.raises(CalibrationError, match=r"cannot load WikiText-2 from .*datasets/Salesforce/wikitext"):
        load_texts(load_config(), "calibration", None, tmp_path)
