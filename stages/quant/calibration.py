"""Calibration and evaluation text, tokenized into samples, and the graph inputs the FP chain makes
from them.

Sources: WikiText-2 (raw) through `datasets` (train split to calibrate, test split to evaluate), or
local files (`.txt`, `.jsonl` with a "text" field, `.parquet` with a "text" column); by default the
built-in corpus's calibration and held-out parts, which share no text with each other or with what
the tiny model was trained on.

Every graph is calibrated on what it will see on the phone: the inputs of part k come from running
the float parts before it on the same text, prefill graphs see AR-sized chunks of the samples, and
decode graphs see real decode steps (one token each, teacher-forced on the sample) with caches that
the prefill of the sample's beginning filled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stages.core.config import PipelineConfig
from stages.core.errors import UserFixable
from stages.model.tiny_model import CORPUS_DIR

# WikiText-2 (raw) on the Hub: the dataset repo and its config. A local copy of the repo's files under
# WORKDIR/datasets/<repo> (as `hf download --repo-type dataset Salesforce/wikitext --local-dir ...`
# writes them) is read in place of the Hub: offline machines and CI calibrate on it.
WIKITEXT = ("Salesforce/wikitext", "wikitext-2-raw-v1")
DATASETS_FOLDER = "datasets"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


class CalibrationError(UserFixable, ValueError):
    pass


def read_text_files(paths: list[Path]) -> list[str]:
    texts: list[str] = []
    for path in paths:
        if not path.is_file():
            raise CalibrationError(f"calibration file {path} does not exist")
        if path.suffix == ".txt":
            texts.append(path.read_text(encoding="utf-8"))
        elif path.suffix == ".jsonl":
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if line.strip():
                    try:
                        texts.append(str(json.loads(line)["text"]))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise CalibrationError(
                            f"{path}:{i} is not a JSON object with a 'text' field"
                        ) from None
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise CalibrationError(
                    f"{path} has no 'text' column (columns: {', '.join(table.column_names)})"
                )
            texts += [str(t) for t in table.column("text").to_pylist() if t]
        else:
            raise CalibrationError(f"{path}: unsupported file type; use one of {', '.join(TEXT_SUFFIXES)}")
    return texts


def local_dataset(workdir: Path | None, repo_id: str) -> Path | None:
    """The local copy of a Hub dataset repo under WORKDIR/datasets/, if there is one."""
    folder = workdir / DATASETS_FOLDER / repo_id if workdir is not None else None
    return folder if folder is not None and (folder / "README.md").is_file() else None


def text_source(cfg: PipelineConfig, files: list[Path] | None = None, workdir: Path | None = None) -> str:
    """Where load_texts reads: the files given, the built-in corpus, or WikiText-2's local copy or Hub id."""
    if files:
        return ", ".join(str(f) for f in files)
    if cfg.calibration_dataset != "wikitext-2-raw-v1":
        return f"built-in corpus ({CORPUS_DIR.name}/)"
    local = local_dataset(workdir, WIKITEXT[0])
    return f"{local} (local copy)" if local else f"{WIKITEXT[0]} (Hub)"


def load_texts(
    cfg: PipelineConfig, purpose: str, files: list[Path] | None = None, workdir: Path | None = None
) -> list[str]:
    """Texts to calibrate on (purpose "calibration") or to evaluate on ("heldout"); WikiText-2 from its
    local copy under `workdir` when there is one, else from the Hub."""
    if cfg.calibration_dataset == "wikitext-2-raw-v1" and not files:
        repo_id, config = WIKITEXT
        source = local_dataset(workdir, repo_id)
        try:
            import datasets

            datasets.disable_progress_bars()  # a few seconds of split generation, once per copy
            split = "train" if purpose == "calibration" else "test"
            if source is None:
                rows = datasets.load_dataset(repo_id, config, split=split)["text"]
            else:
                import tempfile

                # Not datasets' cache: it keys a local folder's splits by name, so a replaced copy
                # (the stand-in, then the real files) would be read stale from there.
                with tempfile.TemporaryDirectory(prefix="g4v69-datasets-") as cache:
                    ds = datasets.load_dataset(str(source), config, split=split, cache_dir=cache)
                    rows = list(ds["text"])
        except Exception as e:  # datasets raises many kinds when offline or missing
            where = source or f"the Hub ({repo_id}; no local copy in WORKDIR/{DATASETS_FOLDER}/{repo_id})"
            raise CalibrationError(
                f"cannot load WikiText-2 from {where} ({e.__class__.__name__}: {str(e)[:300]}); without "
                "network, calibrate on local text: G4V69_CALIBRATION_DATASET=files (the built-in corpus, "
                "or your own with QUANT_ARGS='--calibration-files FILE', txt, jsonl or parquet), or put a "
                f"copy of the dataset's files in WORKDIR/{DATASETS_FOLDER}/{repo_id}"
            ) from None
        return ["".join(rows)]
    if files:
        return read_text_files(files)
    return read_text_files([CORPUS_DIR / f"{purpose}.txt"])


WIKITEXT_SPLITS = ("train", "validation", "test")


def write_wikitext_copy(dest: Path, splits: dict[str, str], note: str) -> Path:
    """Files in the layout of the WikiText dataset repo on the Hub (README.md whose front matter maps
    each config's splits to files, and `<config>/<split>-00000-of-00001.parquet` with a "text" column
    of lines, as WikiText's rows are), holding `splits` (split -> text) under WikiText-2 raw's config.
    The stand-in that the bench and the tests read where the Hub cannot be reached; `note` (the
    README's body) says what the text really is. Written to a temporary folder, then renamed."""
    import shutil
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    _, config = WIKITEXT
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        (tmp / config).mkdir()
        files = []
        for split in WIKITEXT_SPLITS:
            lines = splits[split].splitlines(keepends=True)
            pq.write_table(pa.table({"text": lines}), tmp / config / f"{split}-00000-of-00001.parquet")
            files.append(f"  - split: {split}\n    path: {config}/{split}-*")
        front = f"---\nconfigs:\n- config_name: {config}\n  data_files:\n" + "\n".join(files) + "\n---\n"
        (tmp / "README.md").write_text(front + "\n" + note + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def token_samples(texts: list[str], encode, bos_id: int, count: int, length: int) -> list[list[int]]:
    """`count` consecutive windows of `length` tokens (a BOS, then text) over the texts joined."""
    ids: list[int] = []
    for text in texts:
        ids += encode(text)
    body = length - 1
    windows = [[bos_id, *ids[i : i + body]] for i in range(0, len(ids) - body + 1, body)][:count]
    if not windows:
        raise CalibrationError(f"the text holds {len(ids)} tokens, fewer than one sample of {length}")
    return windows


def decode_split(sample: list[int], decode_steps: int) -> tuple[list[int], list[int]]:
    """The part of a sample that prefills the caches and the part fed as decode steps."""
    steps = min(decode_steps, max(len(sample) - 1, 0))
    return sample[: len(sample) - steps], sample[len(sample) - steps :]


def calls(samples: list[list[int]], role: str, prefill_ar: int, decode_steps: int) -> int:
    """How many calls of a graph kind graph_feeds() makes for these samples."""
    if role == "prefill":
        return sum(-(-len(s) // prefill_ar) for s in samples)
    return sum(len(decode_split(s, decode_steps)[1]) for s in samples)


def graph_feeds(
    runner, samples: list[list[int]], role: str, part: int, decode_steps: int
) -> Iterator[dict[str, np.ndarray]]:
    """Inputs of one graph (role, 1-based part) as the float chain produces them, one call at a time.

    Runs only the parts up to `part` and streams, so memory does not grow with the sample count. For
    decode graphs, every sample's beginning is prefilled first and its cache state kept; the prefill
    graphs are then released before the decode steps run, so the two graph kinds (each a full copy of
    the weights) are never loaded together.
    """
    captured: list[dict[str, np.ndarray]] = []

    def observe(spec, feeds: dict[str, np.ndarray], _outputs: Any, _n: int) -> None:
        if spec.role == role and spec.part == part:
            captured.append({k: np.array(v, copy=True) for k, v in feeds.items()})

    ar = runner.prefill_ar
    runner.observer = observe
    try:
        if role == "prefill":
            for sample in samples:
                runner.reset()
                for i in range(0, len(sample), ar):
                    runner.step(sample[i : i + ar], role="prefill", parts=part)
                    yield from captured
                    captured.clear()
            return
        states = []
        for sample in samples:
            head, tail = decode_split(sample, decode_steps)
            runner.reset()
            for i in range(0, len(head), ar):
                runner.step(head[i : i + ar], role="prefill", parts=part)
            states.append((runner.snapshot(), tail))
        runner.release("prefill")
        for state, tail in states:
            runner.restore(state)
            for tok in tail:
                if runner.position + 1 > runner.context:
                    break
                runner.step([tok], role="decode", parts=part)
                yield from captured
                captured.clear()
    finally:
        runner.observer = None
        # The quantizer that reads these feeds holds its own copy of the graph: free ours.
        runner.release("prefill")
        runner.release("decode")
