"""The job: what one config builds from one checkpoint geometry, worked out once.

`Job.build` derives the parts (decoder layers per shard), the shipped graph kinds, the calibration
twin, every graph's I/O spec and the context binaries; the export stage builds it and records it in
its report, quantize hands it on in its own, and the later stages read it back typed
(`ExportResult.job`, `QuantizeResult.job`) instead of deriving any of it again from the config.

Stdlib only (with the stdlib-only core it imports): the tools image reads reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from stages.core.config import PipelineConfig
from stages.core.precision import DECODER_ROLE, LM_HEAD_ROLE, NORM_ROLE, PLE_ROLE, WeightScheme
from stages.core.soc import Soc
from stages.model.contract import GraphSpec, graph_specs, window_cache
from stages.model.geometry import EMBEDDING, FULL, LINEAR, NORM, PLE, Geometry, Tensor
from stages.model.graphs import (
    CALIBRATION_ROLE,
    Binary,
    GraphKind,
    calibration_kind,
    graph_kinds,
    lay_out_binaries,
    partition_layers,
)

# A geometry tensor's kind -> the role whose storage rule it follows (the embedding is the tied lm_head).
KIND_ROLES = {LINEAR: DECODER_ROLE, EMBEDDING: LM_HEAD_ROLE, PLE: PLE_ROLE, NORM: NORM_ROLE}


def weight_scheme(t: Tensor, cfg: PipelineConfig) -> WeightScheme:
    """How a weight is stored in a context binary."""
    if t.kind not in KIND_ROLES:
        raise ValueError(f"{t.name} ({t.kind}) does not live in a graph")
    return cfg.weight_scheme(KIND_ROLES[t.kind])


def tensor_bytes(tensors: list[Tensor], cfg: PipelineConfig) -> int:
    return sum(weight_scheme(t, cfg).stored_bytes(t.numel) for t in tensors)


def part_extras(geo: Geometry) -> tuple[list[Tensor], list[Tensor]]:
    """Weights outside the decoder layers: the PLE projection rides with the first part, the final
    norm and the lm_head (the tied embedding, an explicit weight in the graph) with the last."""
    return list(geo.ple_projection), [geo.final_norm, geo.embedding]


def part_layers(geo: Geometry, cfg: PipelineConfig) -> list[range]:
    """The decoder layers of each part, balanced by weight bytes at the config's precision, each part
    holding a full-attention layer where the split allows it: with window-sized caches (Gemma 4) a part
    of sliding layers alone takes no `attention_mask`, and QAIRT 2.51's Genie then cannot tell the
    context length ("Couldn't determine context length from tensors", then stoi: out of range; E2B
    at w4a16 cut layers 0-3 into part 1). The bundle stage refuses what is left (`rules`).

    The job's parts: export cuts its graphs here, and the plan prices the same job.
    """
    head, tail = part_extras(geo)
    layer_bytes = [tensor_bytes(list(layer.tensors), cfg) for layer in geo.layers]
    anchors = [layer.attention == FULL for layer in geo.layers] if window_cache(geo) else None
    return partition_layers(
        layer_bytes, cfg.num_shards, tensor_bytes(head, cfg), tensor_bytes(tail, cfg), anchors
    )


@dataclass(frozen=True)
class Job:
    parts: tuple[tuple[int, ...], ...]  # the decoder layers of each part, part 1 first
    kinds: tuple[GraphKind, ...]  # the shipped graph kinds, prefill first
    calibration: GraphKind | None  # the calibration-only twin's kind, exported and never shipped
    specs: tuple[GraphSpec, ...]  # every exported graph, the twins included
    binaries: tuple[Binary, ...]  # the context binaries, in Genie's ctx-bins order

    @classmethod
    def build(cls, geo: Geometry, cfg: PipelineConfig, specs: bool = True) -> Job:
        """The job of `cfg` on `geo`; raises what the part split and the contract raise. specs=False:
        the job as the plan prices it, without the graphs' I/O specs (nothing priced reads them), so
        a layout whose graphs the contract refuses to build is still priced."""
        parts = part_layers(geo, cfg)
        kinds = tuple(graph_kinds(cfg))
        twin = calibration_kind(cfg)
        binaries = tuple(lay_out_binaries(kinds, len(parts), cfg.soc_info.weight_sharing))
        exported = kinds + ((twin,) if twin else ())
        return cls(
            parts=tuple(tuple(r) for r in parts),
            kinds=kinds,
            calibration=twin,
            specs=tuple(graph_specs(geo, cfg.max_context, parts, exported)) if specs else (),
            binaries=binaries,
        )

    def on_soc(self, soc: Soc) -> Job:
        """The job with its binaries laid out for `soc`: the SoC is a quantize field (export does not
        depend on it), so quantize lays the binaries out again for its own before handing the job on."""
        return replace(
            self, binaries=tuple(lay_out_binaries(self.kinds, len(self.parts), soc.weight_sharing))
        )

    @property
    def part_ranges(self) -> list[range]:
        """Each part's decoder layers as a range (parts hold consecutive layers)."""
        return [range(p[0], p[-1] + 1) for p in self.parts]

    @property
    def shipped_specs(self) -> tuple[GraphSpec, ...]:
        """The graphs that are quantized, compiled and shipped (every kind but the twin)."""
        return tuple(s for s in self.specs if s.role != CALIBRATION_ROLE)

    @property
    def shipped_graphs(self) -> tuple[str, ...]:
        """The shipped graphs' names, in the binaries' order."""
        return tuple(g for b in self.binaries for g in b.graphs)

    def to_dict(self) -> dict[str, Any]:
        kind = lambda k: {"role": k.role, "ar": k.ar}  # noqa: E731
        return {
            "parts": [list(p) for p in self.parts],
            "kinds": [kind(k) for k in self.kinds],
            "calibration": kind(self.calibration) if self.calibration else None,
            "specs": [s.to_dict() for s in self.specs],
            "binaries": [{"file": b.file, "part": b.part, "graphs": list(b.graphs)} for b in self.binaries],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(
            parts=tuple(tuple(p) for p in d["parts"]),
            kinds=tuple(GraphKind(**k) for k in d["kinds"]),
            calibration=GraphKind(**d["calibration"]) if d["calibration"] else None,
            specs=tuple(GraphSpec.from_dict(s) for s in d["specs"]),
            binaries=tuple(Binary(b["file"], b["part"], tuple(b["graphs"])) for b in d["binaries"]),
        )
