"""Which layers go into which shard, and what the graphs built from them are called.

The export stage cuts the decoder where `partition_layers` says, the compile and bundle stages name
binaries with `graph_name`/`lay_out_binaries` (through the job, stages.planning.job), the planner
prices the same parts: one source for all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from stages.core.config import PipelineConfig
from stages.core.errors import UserFixable


@dataclass(frozen=True)
class GraphKind:
    role: str  # "prefill", "decode" or CALIBRATION_ROLE
    ar: int  # tokens per call


def graph_kinds(cfg: PipelineConfig) -> list[GraphKind]:
    """One graph per part when prefill and decode share a size, two otherwise."""
    if cfg.separate_prefill_and_decode:
        return [GraphKind("prefill", cfg.prefill_ar), GraphKind("decode", cfg.decode_ar)]
    return [GraphKind("prefill", cfg.prefill_ar)]


# The role of the calibration-only twins (`calibration_kind`): exported, never quantized or shipped.
CALIBRATION_ROLE = "calibration"


def calibration_kind(cfg: PipelineConfig) -> GraphKind | None:
    """A twin of the prefill kind at `calibration_ar` tokens per call when prefill_ar is smaller.

    It computes what the prefill graphs compute, so its tensors hold the same values the shipped graphs
    would see on the same text (up to float rounding), in 1/AR as many calls: the quantize stage
    calibrates the shipped graphs from it (`stages.quantize`, which checks the twin node for node)."""
    if cfg.calibration_ar <= cfg.prefill_ar:
        return None  # the prefill graphs take as many tokens per call already
    return GraphKind(CALIBRATION_ROLE, cfg.calibration_ar)


def part_name(part: int, num_parts: int) -> str:
    """1-based, as Genie bundles name their parts: part1_of_4."""
    return f"part{part}_of_{num_parts}"


def graph_name(kind: GraphKind, part: int, num_parts: int) -> str:
    return f"{kind.role}_ar{kind.ar}_{part_name(part, num_parts)}"


def qdq_file_name(graph: str) -> str:
    """The quantize stage's file for a graph (the exported one is `<graph>.onnx`)."""
    return f"{graph}.qdq.onnx"


@dataclass(frozen=True)
class Binary:
    """One context binary: its file name, the part it holds and its graphs in Genie's order
    (prefill before decode). Graphs share weights only when they share a binary."""

    file: str
    part: int
    graphs: tuple[str, ...]

    @property
    def weight_shared(self) -> bool:
        return len(self.graphs) > 1


def lay_out_binaries(
    kinds: list[GraphKind] | tuple[GraphKind, ...], n: int, weight_sharing: bool
) -> list[Binary]:
    """The context binaries of the shipped kinds over n parts, in bundle order (part 1 first).

    Where the SoC shares weights between graphs (v73+), a part's prefill and decode graphs go into
    one binary `part{i}_of_{N}.bin`; on v69 every graph is its own binary `<graph>.bin`, so the
    weights are stored twice.
    """
    layout = []
    for part in range(1, n + 1):
        names = tuple(graph_name(k, part, n) for k in kinds)
        if weight_sharing and len(names) > 1:
            layout.append(Binary(f"{part_name(part, n)}.bin", part, names))
        else:
            layout += [Binary(f"{name}.bin", part, (name,)) for name in names]
    return layout


class PartitionError(UserFixable, ValueError):
    pass


def partition_layers(
    layer_bytes: list[int],
    num_parts: int,
    first_extra: int = 0,
    last_extra: int = 0,
    anchors: list[bool] | None = None,
) -> list[range]:
    """Cut layers into `num_parts` contiguous runs, minimising the largest part's bytes.

    `first_extra` and `last_extra` are bytes that ride with the first and last part (the PLE
    projection before layer 0, the final norm and lm_head after the last layer). The largest part
    bounds the per-context size limit and the peak memory of export and compile. With `anchors` (one
    flag per layer), every part holds a flagged layer where some cut allows it (`part_layers`: Genie
    needs a full-attention layer in every part); where none does, the cut ignores them.
    """
    n = len(layer_bytes)
    if num_parts > n:
        raise PartitionError(
            f"num_shards={num_parts} exceeds the model's {n} decoder layers; allowed values: 1..{n}"
        )
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(i: int, j: int) -> int:  # bytes of a part holding layers i..j-1
        c = prefix[j] - prefix[i]
        if i == 0:
            c += first_extra
        if j == n:
            c += last_extra
        return c

    anchored = [0]
    for a in anchors or []:
        anchored.append(anchored[-1] + bool(a))
    # A part without an anchor costs infinitely; if every cut has one, no cut can satisfy the anchors,
    # and the plain minimax is taken instead (below).
    impossible = float("inf")

    def allowed(i: int, j: int) -> bool:
        return anchors is None or anchored[j] > anchored[i]

    @cache
    def best(i: int, k: int) -> tuple[float, tuple[int, ...]]:
        """Min over cuts of the max part cost for layers i..n-1 in k parts; returns (cost, cut points)."""
        if k == 1:
            return (cost(i, n) if allowed(i, n) else impossible), ()
        options = []
        for j in range(i + 1, n - k + 2):
            rest_cost, rest_cuts = best(j, k - 1)
            options.append((max(cost(i, j) if allowed(i, j) else impossible, rest_cost), (j, *rest_cuts)))
        return min(options)

    worst, cuts = best(0, num_parts)
    if worst == impossible:
        return partition_layers(layer_bytes, num_parts, first_extra, last_extra)
    bounds = [0, *cuts, n]
    return [range(bounds[p], bounds[p + 1]) for p in range(num_parts)]


def copy_graph(src: Path, folder: Path) -> Path:
    """The graph at src (and its external-data file) copied into folder, where onnxruntime may write
    its shape-inferred copy beside it (never in exported/). Copies, not links: onnx refuses external
    data behind a symbolic link or a file with several hard links (what broke the E2B quantize)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for f in src.parent.glob(f"{src.name}*"):
        shutil.copyfile(f, folder / f.name)
    return folder / src.name
