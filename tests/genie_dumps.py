"""The emulator's feeds of every graph call against the real Genie's own dumps of them
(`debug.dump-tensors`), shared by the real-Genie tests of each model family."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def compare_feeds_with_dumps(emulator, dumps: Path) -> int:
    """Asserts that every input Genie dumped for the emulator's recorded calls (`emulator.record`
    set before the run) equals the emulator's feed: exactly, or within one step of the RoPE tables'
    last bit in at most 2% of entries for RoPE tables and KV caches. Returns the tensors compared."""
    compared = 0
    for k, call in enumerate(emulator.recorded):
        n = call.step["n_process"]
        for graph, feeds, _ in call.runs:
            folder = dumps / "text_primary" / graph.qnn_name
            if re.search(r"part1_of_\d+$", graph.name):  # every call runs the first part
                assert (folder / f"{k:03d}_in_inputs_embeds").is_file(), (
                    f"call {k}: Genie ran no {graph.name}"
                )
            for name, want in feeds.items():
                path = folder / f"{k:03d}_in_{name}"
                if not path.is_file():  # Genie skips the last part of prefill chunks whose logits it drops
                    continue
                got = np.fromfile(path, dtype=want.dtype).reshape(want.shape)
                if name.startswith("xfer_kvshare"):
                    continue  # the caches above, plus the new rows of padded positions nobody reads
                if name.startswith("xfer_"):
                    got, want = got[:, :n], want[:, :n]  # hand-over rows of the valid positions
                if "position_ids" in name:  # a padded row's RoPE is Genie's own choice: it attends nothing
                    got, want = got[..., :n, :], want[..., :n, :]
                apart = np.abs(got.astype(np.int64) - want.astype(np.int64))
                # RoPE angles in double: a last-bit difference in cos/sin moves an entry by one step,
                # and a key computed from it may move by one step too. Everything else is exact.
                loose = "position_ids" in name or name.endswith("_in")
                assert apart.max() <= (1 if loose else 0), (
                    f"call {k} {graph.name} {name}: {apart.max()} apart"
                )
                assert (apart > 0).mean() <= 0.02, (
                    f"call {k} {graph.name} {name}: {(apart > 0).sum()} entries"
                )
                compared += 1
    return compared
