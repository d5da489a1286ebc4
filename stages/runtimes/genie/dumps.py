"""The real Genie's own record of a greedy query, read back from its tensor dumps (genie_config.json's
`debug` section: dump-tensors, dump-specs, dump-outputs; real.run_dialog's `dump_dir`): the token ids
it fed its graphs and picked, whatever its text answer says.

Genie answers in text, and re-tokenizing that text gives its ids back only where decoding is exact.
Random weights at E2B geometry pick special and unused tokens that decode to nothing, so the text says
nothing about them; the dumps do. Each call k leaves `<k>_in_inputs_embeds` in the first part's folder
(one embedding-LUT row per token, valid rows first, as the emulator feeds them) and `<k>_out_logits` in
the last part's, with `spec.<graph>.json` giving every tensor's dims and data type. Genie's own
tokenization of the prompt is in its verbose log (`embedding-tokens: [...]`): the prefill calls fill
their rows with those ids in order, each later call feeds the token the one before picked, and the last
call's logits give the last pick. Only a dialog of one query is read: its calls are the query's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from stages.model.contract import INPUTS_EMBEDS as EMBEDS
from stages.model.contract import LOGITS

# QNN data types of the dumped tensors (the spec's `dtype`) as numpy reads their raw bytes.
_DTYPES = {
    "QNN_DATATYPE_UFIXED_POINT_8": np.uint8,
    "QNN_DATATYPE_UFIXED_POINT_16": np.uint16,
    "QNN_DATATYPE_FLOAT_32": np.float32,
    "QNN_DATATYPE_FLOAT_16": np.float16,
}
_PROMPT_IDS = re.compile(r"embedding-tokens: \[([0-9, ]*)\]")


class DumpError(RuntimeError):
    """The dumps do not say what was fed or picked (missing files, rows no LUT row matches)."""


def _tensor_specs(root: Path) -> dict[str, dict[str, dict]]:
    """graph name -> tensor name -> its spec (inputs and outputs)."""
    specs = {}
    for path in root.glob("spec.*.json"):
        spec = json.loads(path.read_text())
        specs[spec["graph_name"]] = {t["name"]: t for t in [*spec["inputs"], *spec.get("outputs", [])]}
    return specs


def _read(path: Path, spec: dict) -> np.ndarray:
    dtype = _DTYPES.get(spec["dtype"])
    if dtype is None:
        raise DumpError(f"{path}: data type {spec['dtype']} is not read here")
    return np.fromfile(path, dtype=dtype).reshape(spec["dims"])


def _calls(root: Path, suffix: str) -> dict[int, Path]:
    """call index -> its dump of `suffix` (e.g. `in_inputs_embeds`), over every graph folder."""
    return {int(p.name[:3]): p for p in root.glob(f"*/[0-9][0-9][0-9]_{suffix}")}


def prompt_ids_from_log(log: Path) -> list[int]:
    """Genie's own tokenization of the query (its verbose log's `embedding-tokens`)."""
    found = _PROMPT_IDS.findall(log.read_text(errors="replace")) if log.is_file() else []
    if not found:
        raise DumpError(f"{log} names no prompt tokens (embedding-tokens): was the log verbose?")
    return [int(t) for t in found[-1].split(",") if t.strip()]


def _lut_id(lut: np.ndarray, row: np.ndarray) -> int | None:
    """The id whose LUT row is `row` (the lowest, where several are: never for a trained or random
    table), or None."""
    candidates = np.flatnonzero(lut[:, 0] == row[0])
    for i in candidates:
        if np.array_equal(lut[i], row):
            return int(i)
    return None


def greedy_ids(dump_dir: Path, log: Path, lut_path: Path, hidden: int) -> list[int]:
    """The ids Genie picked for the one query of the dumped dialog, in order (a stop token included
    where it stopped there). Raises DumpError where the dumps disagree with Genie's own prompt."""
    root = dump_dir / "text_primary"
    specs = _tensor_specs(root)
    embeds, logits = _calls(root, f"in_{EMBEDS}"), _calls(root, f"out_{LOGITS}")
    if not embeds:
        raise DumpError(f"{root} holds no dumped {EMBEDS}")
    prompt = prompt_ids_from_log(log)
    lut = np.fromfile(lut_path, dtype=np.uint16).reshape(-1, hidden)
    left, fed, last_rows = len(prompt), [], 0
    for k in sorted(embeds):
        x = _read(embeds[k], specs[embeds[k].parent.name][EMBEDS]).reshape(-1, hidden)
        last_rows = min(left, len(x)) if left else 1
        left -= min(left, len(x))
        for r, row in enumerate(x[:last_rows]):
            i = _lut_id(lut, row)
            if i is None:
                raise DumpError(f"{embeds[k]}: row {r} is no row of {lut_path.name}")
            fed.append(i)
    if left or fed[: len(prompt)] != prompt:
        raise DumpError(
            f"{root}: the calls fed {fed[: len(prompt)]} where Genie's log tokenized the prompt as {prompt}"
        )
    last = max(embeds)
    if last not in logits:
        raise DumpError(f"{root}: call {last} left no dumped {LOGITS}")
    out = _read(logits[last], specs[logits[last].parent.name][LOGITS])
    row = out.reshape(-1, out.shape[-1])[last_rows - 1]
    return [*fed[len(prompt) :], int(np.argmax(row))]


def bundle_greedy_ids(dump_dir: Path, log: Path, bundle_dir: Path) -> list[int]:
    """greedy_ids with the bundle's embedding LUT (genie_config.json's `embedding`)."""
    from stages.runtimes.genie.files import GENIE_CONFIG

    if not (dump_dir / "text_primary").is_dir():
        raise DumpError(f"{dump_dir}: Genie dumped nothing there")
    lut = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]["embedding"]
    return greedy_ids(dump_dir, log, bundle_dir / lut["lut-path"], int(lut["size"]))
