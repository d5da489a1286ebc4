"""The bundle stage: compiled binaries + LUTs + tokenizer + rendered configs -> genie_bundle/.

The two configs are Jinja2 templates (templates/*.j2) rendered from one context that this module
derives from the pipeline config, the SoC table, the checkpoint and the export and compile reports:
tensor names and dimensions come from the binaries' recorded graph I/O, quantization parameters
from the LUTs the export wrote, ids from the checkpoint. Before anything is written the rendered
configs are checked against the project's schemas (templates/*.schema.json), against the files and
tensors they name, and, where onnxruntime-qnn is installed, against Genie's own validator.

manifest.json lists every file with its size and sha256, the source checkpoint, the pipeline
config, the QAIRT version the binaries need and the tool versions: nothing time- or path-dependent,
so two bundles built from the same inputs have identical manifests.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from stages.core.config import PipelineConfig
from stages.core.pipeline import output_dir
from stages.core.report import (
    REPORT_NAME,
    StageJob,
    copy_file,
    read_report,
    sha256_file,
)
from stages.model.contract import (
    CACHE_PREFIX,
    LOGITS,
    LUT_INPUTS,
    MASK_NAME,
    ROPE_PREFIX,
    cache_slots,
    rope_name,
)
from stages.model.encoding import REQUANTIZE, Encoding, feed_mode, shared_tensor_mismatches
from stages.model.geometry import FULL, SLIDING, Geometry
from stages.planning.results import CompileResult, ExportResult, StageReport, require_result
from stages.runtimes import RuntimeFailure
from stages.runtimes.genie.files import GENIE_CONFIG, HTP_EXT_CONFIG, MANIFEST, TOKENIZER, TOKENIZER_CONFIG
from stages.runtimes.genie.rules import (
    LUT_DATATYPES,
    LUT_SECTION,
    context_length_problems,
    dialog_context_size,
    lut_problems,
    sampler_problems,
    sliding_mask_problems,
)

TEMPLATES = Path(__file__).resolve().parents[3] / "templates"
# Gemma 4's published sampling defaults (its generation_config.json), used when a checkpoint
# carries none: the tiny model's has only token ids.
GEMMA_SAMPLER = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
SAMPLER_SEED = 42  # a fixed seed: the same prompt samples the same answer on every run
# Genie on the phone: 3 threads on the big cores (0xe0: cores 5-7 of 8).
ENGINE_THREADS = 3
ENGINE_CPU_MASK = "0xe0"


class BundleError(RuntimeFailure):
    """The bundle cannot be built; the message names the value or file and what to do."""


# ---- the render context ----
def _io(compiled: CompileResult) -> dict[str, dict[str, dict[str, Any]]]:
    """Graph name -> {"inputs": {tensor: encoding}, "outputs": {...}} over every binary."""
    return compiled.graph_io


def _first(io: dict, direction: str, name: str) -> dict[str, Any]:
    for graph in io.values():
        if name in graph[direction]:
            return graph[direction][name]
    raise BundleError(f"no compiled graph has the {direction[:-1]} tensor {name!r}; run `make compile` again")


def checkpoint_fields(checkpoint_dir: Path) -> dict[str, dict[str, Any]]:
    """The genie_config.json fields the checkpoint decides, by their Genie names: context bos-token,
    eos-token (the stop ids) and pad-token, and the sampler (its generation_config.json's settings,
    Gemma's published ones where it has none, seed SAMPLER_SEED). The bundle writes them; verify holds
    a bundle's config to them."""
    from stages.model.checkpoint import Checkpoint, stop_token_ids

    config = Checkpoint(checkpoint_dir).geometry.config
    gen_path = checkpoint_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return {
        "context": {
            "bos-token": gen.get("bos_token_id", config.get("bos_token_id")),
            "eos-token": stop_token_ids(checkpoint_dir),
            "pad-token": gen.get("pad_token_id", config.get("pad_token_id", 0)),
        },
        "sampler": {
            "seed": SAMPLER_SEED,
            "temp": gen.get("temperature", GEMMA_SAMPLER["temperature"]),
            "top-k": gen.get("top_k", GEMMA_SAMPLER["top_k"]),
            "top-p": gen.get("top_p", GEMMA_SAMPLER["top_p"]),
        },
    }


def kv_dims(inputs: dict[str, list[int]]) -> dict[str, int]:
    """Cache prefix ("past_", "swa_") -> the width of its entries: a key cache input is
    (1, 1, head_dim, kv_len), and its head_dim is the group's kv-dim."""
    dims = {}
    for attention in (FULL, SLIDING):
        prefix = f"{CACHE_PREFIX[attention]}_"
        keys = [shape for t, shape in inputs.items() if re.match(rf"{prefix}key_\d+_h\d+_in$", t)]
        if keys:
            dims[prefix] = keys[0][-2]
    return dims


def full_masks(io: dict[str, dict[str, dict[str, Any]]]) -> list[list[int]]:
    """Each graph's full-attention mask shape (1, 1, AR, context), from compile's graph I/O."""
    return [g["inputs"][MASK_NAME[FULL]]["shape"] for g in io.values() if MASK_NAME[FULL] in g["inputs"]]


def past_entries(masks: list[list[int]], geo: Geometry) -> list[int]:
    """The past entries a full-attention cache holds in each graph kind, read from the graphs' masks
    (1, 1, AR, context): what Genie can keep before a graph has no slot left (rules.dialog_context_size)."""
    return sorted({cache_slots(geo, FULL, shape[-1], shape[-2]) for shape in masks})


def backend_kv_dim(dims: dict[str, int]) -> int:
    """QnnHtp's top-level kv-dim: Genie's default for a cache group that names none (qualla
    engines/qnn-htp.cpp reads it, default 128); ours is the smallest group's, as in Qualcomm's own
    E2B bundle, and every group names its own."""
    return min(dims.values())


def render_context(
    cfg: PipelineConfig,
    checkpoint_dir: Path,
    exported: ExportResult,
    compiled: CompileResult,
) -> dict[str, Any]:
    """Everything the two templates print, derived; nothing here is a hand-copied number."""
    from stages.model.checkpoint import Checkpoint

    geo = Checkpoint(checkpoint_dir).geometry
    soc = cfg.soc_info
    io = _io(compiled)
    ids = checkpoint_fields(checkpoint_dir)
    logits = _first(io, "outputs", LOGITS)
    masks = full_masks(io)
    if not masks:
        raise BundleError(
            f"no compiled graph has the input tensor {MASK_NAME[FULL]!r}; run `make compile` again"
        )
    dims = kv_dims({t: e["shape"] for g in io.values() for t, e in g["inputs"].items()})
    groups = []
    for attention in (FULL, SLIDING):
        prefix = f"{CACHE_PREFIX[attention]}_"
        if prefix not in dims:
            continue
        groups.append(
            {
                "prefix": prefix,
                "kv_dim": dims[prefix],
                "mask": MASK_NAME[attention],
                "window": geo.sliding_window if attention == SLIDING else None,
            }
        )
    rope_params = geo.config["rope_parameters"]
    ropes = []
    for attention in (FULL, SLIDING):
        prefix = ROPE_PREFIX[attention]
        cos = _first(io, "inputs", rope_name(attention, "cos"))
        params = rope_params[attention]
        scaling = None
        if params.get("rope_type", "default") != "default":
            scaling = {
                "type": params["rope_type"],
                "partial_rotary_factor": params.get("partial_rotary_factor", 1.0),
            }
        ropes.append(
            {"prefix": prefix, "dim": cos["shape"][-1], "theta": params["rope_theta"], "scaling": scaling}
        )
    luts = {}
    for key, lut in exported.luts.items():
        luts[LUT_SECTION[key]] = {
            "path": Path(lut.path).name,
            "size": lut.size,
            "datatype": LUT_DATATYPES[lut.bits],
            "scale": lut.scale,
            "offset": lut.offset,
            "source": lut.path,
        }
    return {
        "context": {
            "size": dialog_context_size(past_entries(masks, geo)),
            "n_vocab": logits["shape"][-1],
            "bos": ids["context"]["bos-token"],
            "eos": ids["context"]["eos-token"],
            "pad": ids["context"]["pad-token"],
        },
        "sampler": ids["sampler"],
        "tokenizer": TOKENIZER,
        "engine": {
            "n_threads": ENGINE_THREADS,
            "cpu_mask": ENGINE_CPU_MASK,
            "kv_dim": backend_kv_dim(dims),
            "extensions": HTP_EXT_CONFIG,
        },
        "ctx_bins": [b.file for b in compiled.binaries],
        "ropes": ropes,
        "cache_groups": groups,
        "luts": luts,
        "soc": {"soc_model": soc.soc_model, "dsp_arch": soc.dsp_arch},
        "perf_profile": "burst",
        "rpc_control_latency": 100,
        "weight_sharing": any(b.weight_shared for b in compiled.binaries),
    }


def render(template: str, context: dict[str, Any]) -> dict[str, Any]:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, autoescape=False
    )
    text = env.get_template(template).render(**context)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"templates/{template} rendered invalid JSON: {e}") from None


# ---- checks ----
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """The draft-07 subset the project's schemas use: type, required, properties,
    additionalProperties=false, items, min/maxItems, enum, pattern, minLength, minimum, maximum,
    exclusiveMinimum."""
    at = where or "/"
    kind = schema.get("type")
    if kind:
        ok = isinstance(value, _TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(value, bool)
        )
        if not ok:
            return [f"{at}: expected {kind}, got {type(value).__name__} {value!r}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{at}: empty string")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{at}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{at}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{at}: {value} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            errors.append(f"{at}: {value} <= {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: unknown key {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{where}/{k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{at}: {len(value)} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}/{i}")
    return errors


def lut_feeds(genie: dict[str, Any], io: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """How Genie fills each LUT-fed graph input of each graph from the config's LUT
    (`stages.model.encoding.feed_mode`): "copy", "unpack", "requantize", or None (it cannot)."""
    d = genie["dialog"]
    feeds = []
    for tensor, lut_key in LUT_INPUTS.items():
        section = d.get(LUT_SECTION[lut_key])
        if section is None:
            continue
        lut = Encoding(section["datatype"], section["quant-param"]["scale"], section["quant-param"]["offset"])
        for graph, gio in io.items():
            if tensor in gio["inputs"]:
                enc = Encoding.of_io(gio["inputs"][tensor])
                feeds.append(
                    {
                        "lut": LUT_SECTION[lut_key],
                        "tensor": tensor,
                        "graph": graph,
                        "lut_encoding": lut.describe(),
                        "input_encoding": enc.describe(),
                        "mode": feed_mode(lut, enc),
                    }
                )
    return feeds


def config_vs_graphs(
    dialog: dict[str, Any],
    inputs: dict[str, list[int]],
    outputs: dict[str, list[int]],
    geo: Geometry,
    masks: list[list[int]],
) -> list[str]:
    """Where genie_config.json's dialog disagrees with the graphs' input and output shapes or the model:
    context size (from every graph's full-attention mask, `masks`: the graph kinds hold different
    pasts), vocabulary, LUT widths, cache groups (prefix, kv-dim, mask, window), RoPE. One set of
    rules for two sources: the bundle stage passes the compile report's I/O before it writes anything,
    verify the shapes it reads from the quantized graphs the binaries were compiled from."""
    problems: list[str] = []

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            problems.append(f"genie_config.json {what} is {got}, the graphs and the model say {want}")

    if masks:
        expect("context.size", dialog["context"]["size"], dialog_context_size(past_entries(masks, geo)))
    if LOGITS in outputs:
        expect("context.n-vocab", dialog["context"]["n-vocab"], outputs[LOGITS][-1])
    for tensor, key in LUT_INPUTS.items():
        section = LUT_SECTION[key]
        if section in dialog and tensor not in inputs:
            problems.append(f"{section}: no graph input {tensor}")
        elif section in dialog:
            expect(f"{section}.size", dialog[section]["size"], math.prod(inputs[tensor][2:]))
        elif tensor in inputs:
            problems.append(f"genie_config.json has no {section} section to feed the graph input {tensor}")
    dims = kv_dims(inputs)
    if dims:
        expect(
            "engine.backend.QnnHtp.kv-dim",
            dialog["engine"]["backend"]["QnnHtp"].get("kv-dim"),
            backend_kv_dim(dims),
        )
    for group in dialog["engine"]["cache-groups"]:
        attention = FULL if group["prefix"] == f"{CACHE_PREFIX[FULL]}_" else SLIDING
        keys = [s for t, s in inputs.items() if re.match(rf"{group['prefix']}key_\d+_h\d+_in$", t)]
        if not keys:
            problems.append(f"cache group prefix {group['prefix']!r} matches no key cache input")
            continue
        expect(f"cache group {group['prefix']!r} kv-dim", group["kv-dim"], keys[0][-2])
        expect(
            f"cache group {group['prefix']!r} mask", group["attention-mask-tensor-name"], MASK_NAME[attention]
        )
        if group["attention-mask-tensor-name"] not in inputs:
            problems.append(f"attention mask {group['attention-mask-tensor-name']!r} is no graph input")
        if attention == SLIDING:
            window = group["longcontext"]["sliding-window"]["window-size"]
            expect("sliding window-size", window, geo.sliding_window)
    ropes = dialog["engine"]["model"].get("positional-encoding", [])
    ropes = {r.get("prefix", ""): r for r in (ropes if isinstance(ropes, list) else [ropes])}
    for attention in (FULL, SLIDING):
        prefix = ROPE_PREFIX[attention]
        params = geo.config["rope_parameters"][attention]
        rope = ropes.get(prefix)
        if rope is None:
            problems.append(f"genie_config.json has no positional-encoding for {prefix or 'the global'} RoPE")
            continue
        where = f"positional-encoding {prefix or '(global)'}"
        expect(f"{where} rope-theta", rope["rope-theta"], params["rope_theta"])
        cos = inputs.get(rope_name(attention, "cos"))
        expect(f"{where} rope-dim", rope["rope-dim"], cos[-1] if cos else None)
        factor = (rope.get("rope-scaling") or {}).get("partial-rotary-factor")
        want = params.get("partial_rotary_factor", 1.0) if params.get("rope_type") == "proportional" else None
        expect(f"{where} partial-rotary-factor", factor, want)
    return problems


def consistency_errors(
    genie: dict[str, Any], files: dict[str, Path], io: dict[str, dict[str, dict[str, Any]]], geo: Geometry
) -> list[str]:
    """What the schema cannot see: the files the config names must exist, its shapes agree with the
    graphs' (`config_vs_graphs`), its sampler is one Genie accepts, Genie must be able to feed every
    LUT-fed input from its LUT, and every
    tensor several graphs share must have one encoding (what Genie checks when it loads the binaries)."""
    d = genie["dialog"]
    errors = []
    for name in d["engine"]["model"]["binary"]["ctx-bins"]:
        if name not in files:
            errors.append(f"ctx-bin {name} is not in the bundle")
    shapes = {
        direction: {t: e["shape"] for g in io.values() for t, e in g[direction].items()}
        for direction in ("inputs", "outputs")
    }
    errors += config_vs_graphs(d, shapes["inputs"], shapes["outputs"], geo, full_masks(io))
    errors += [f"genie_config.json {e}" for e in sampler_problems(d["sampler"], d["context"]["n-vocab"])]
    for lut_key in LUT_INPUTS.values():
        key = LUT_SECTION[lut_key]
        lut = d.get(key)
        if lut is None:
            continue
        path = files.get(lut["lut-path"])
        if path is None:
            errors.append(f"{key} lut-path {lut['lut-path']} is not in the bundle")
            continue
        errors += lut_problems({f"{key} ({lut['lut-path']})": path.stat().st_size})
    for feed in lut_feeds(genie, io):
        if feed["mode"] is None:
            errors.append(
                f"{feed['graph']}: Genie cannot feed graph input {feed['tensor']} ({feed['input_encoding']}) "
                f"from the {feed['lut']} LUT ({feed['lut_encoding']}): it copies a LUT of the input's exact "
                "encoding or requantizes fixed-point to fixed-point of the same signedness, nothing else; "
                "quantize again with this version (it reads LUT-fed inputs with their LUT's encoding)"
            )
    prefixes = tuple(group["prefix"] for group in d["engine"]["cache-groups"])
    errors += shared_tensor_mismatches(io, prefixes)
    return errors


GENIE_VALIDATOR = "libGenie.so (onnxruntime-qnn, QAIRT 2.51): GenieDialogConfig_createFromJson"


def genie_validator_errors(genie: dict[str, Any]) -> list[str]:
    """Genie's own schema check through onnxruntime-qnn's x86 libGenie.so (QAIRT 2.51). Genie prints
    its findings on stderr (fd 2): they are captured. Where the library is missing or will not load,
    that is the one problem returned: a config no validator has read is not passed on."""
    import ctypes
    import tempfile

    try:
        import onnxruntime_qnn

        lib = ctypes.CDLL(str(Path(onnxruntime_qnn.__file__).parent / "libGenie.so"))
    except (ImportError, OSError) as e:
        return [
            f"Genie's validator could not run ({e.__class__.__name__}: {e}): it is libGenie.so from "
            "onnxruntime-qnn, which the compile and export images carry; run with RUNNER=docker, or "
            "install the pinned onnxruntime-qnn (docker/compile/requirements.lock) into this environment"
        ]
    create = lib.GenieDialogConfig_createFromJson
    create.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    create.restype = ctypes.c_int32
    lib.GenieDialogConfig_free.argtypes = [ctypes.c_void_p]
    handle = ctypes.c_void_p()
    with tempfile.TemporaryFile() as capture:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        for fd in saved:
            os.dup2(capture.fileno(), fd)
        try:
            status = create(json.dumps(genie).encode(), ctypes.byref(handle))
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        capture.seek(0)
        said = capture.read().decode(errors="replace").strip()
    if status == 0:
        lib.GenieDialogConfig_free(handle)
        return []
    return [f"libGenie.so rejected genie_config.json (status {status}): {said}"]


# ---- the stage ----
def bundle_name(cfg: PipelineConfig) -> str:
    return f"{cfg.checkpoint_name}-{cfg.soc.lower()}-{cfg.precision}-ctx{cfg.max_context}"


def run_bundle(cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path) -> dict[str, Any]:
    """The whole stage; returns its report. A bad input raises BundleError and writes nothing."""
    from stages.model.chat import chat_template, join_adjacent_string_literals

    compiled_dir, export_dir = output_dir(workdir, "compile"), output_dir(workdir, "export")
    compiled = require_result(workdir, "compile", CompileResult, BundleError)
    exported = require_result(workdir, "export", ExportResult, BundleError)
    luts = [export_dir / v.path for v in exported.luts.values()]
    job = StageJob("bundle", cfg, workdir)
    job.check([compiled_dir, export_dir / REPORT_NAME, checkpoint_dir, *luts])
    context = render_context(cfg, checkpoint_dir, exported, compiled)
    genie = render("genie_config.json.j2", context)
    htp_ext = render("htp_backend_ext_config.json.j2", context)
    # Files the bundle will hold, by name, from where they are now.
    files: dict[str, Path] = {b.file: compiled_dir / b.file for b in compiled.binaries}
    for lut in context["luts"].values():
        files[lut["path"]] = export_dir / lut["source"]
    files[TOKENIZER] = checkpoint_dir / TOKENIZER
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise BundleError(f"missing inputs: {', '.join(missing)}; run the stage that makes them again")
    io = _io(compiled)
    _check_configs(genie, htp_ext, files, io, checkpoint_dir)
    feeds = lut_feeds(genie, io)
    for feed in feeds:
        if feed["mode"] == REQUANTIZE:
            # Allowed (Genie requantizes each row it looks up), but not what quantize makes: say so.
            print(
                f"warning: {feed['graph']}: Genie will requantize the {feed['lut']} LUT "
                f"({feed['lut_encoding']}) into {feed['tensor']} ({feed['input_encoding']}) on every lookup",
                file=sys.stderr,
            )

    tok_cfg_path = checkpoint_dir / TOKENIZER_CONFIG
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    tok_cfg["chat_template"] = join_adjacent_string_literals(chat_template(checkpoint_dir))
    download = StageReport.read(checkpoint_dir) or StageReport("download")
    inputs = [compiled_dir / REPORT_NAME, export_dir / REPORT_NAME, *files.values()]
    need = sum(p.stat().st_size for p in files.values())
    with job.output(inputs, need) as run:
        for name, src in files.items():
            copy_file(src, run.dir / name)
        _write_json(run.dir / GENIE_CONFIG, genie)
        _write_json(run.dir / HTP_EXT_CONFIG, htp_ext)
        _write_json(run.dir / TOKENIZER_CONFIG, tok_cfg)
        keep_readme = job.out_dir / "README.md"
        if keep_readme.is_file():
            shutil.copy2(keep_readme, run.dir / "README.md")
        manifest = _manifest(cfg, workdir, run.dir, compiled, context["ctx_bins"], download)
        _write_json(run.dir / MANIFEST, manifest)
        run.figures.update(
            {
                "name": manifest["name"],
                "files": len(manifest["files"]),
                "bytes": sum(f["bytes"] for f in manifest["files"]),
                "manifest_sha256": sha256_file(run.dir / MANIFEST),
                "lut_feeds": feeds,
                "genie_validator": GENIE_VALIDATOR,
            }
        )
    return read_report(job.out_dir)


def _check_configs(
    genie: dict[str, Any], htp_ext: dict[str, Any], files: dict[str, Path], io, checkpoint_dir: Path
) -> None:
    """The rendered configs against their schemas, the graphs and files they name, and Genie's own
    validator (where libGenie.so is installed); BundleError listing every problem."""
    from stages.model.checkpoint import Checkpoint

    problems = [f"genie_config.json{e}" for e in schema_errors(genie, _schema("genie_config"))]
    problems += [
        f"htp_backend_ext_config.json{e}" for e in schema_errors(htp_ext, _schema("htp_backend_ext_config"))
    ]
    problems += consistency_errors(genie, files, io, Checkpoint(checkpoint_dir).geometry)
    problems += sliding_mask_problems(genie["dialog"])
    problems += context_length_problems(io, MASK_NAME[FULL])
    if not problems:
        problems += genie_validator_errors(genie)
    if problems:
        raise BundleError("the rendered configs are wrong:\n  " + "\n  ".join(problems))


def _manifest(
    cfg: PipelineConfig,
    workdir: Path,
    folder: Path,
    compiled: CompileResult,
    ctx_bins: list[str],
    download: StageReport,
) -> dict[str, Any]:
    """manifest.json: what the bundle is for and was built from, and every file with its hash."""
    export_dir, compiled_dir = output_dir(workdir, "export"), output_dir(workdir, "compile")
    listed = sorted(p for p in folder.iterdir() if p.name not in (MANIFEST, REPORT_NAME, "README.md"))
    return {
        "name": bundle_name(cfg),
        "soc": cfg.soc,
        "soc_model": cfg.soc_info.soc_model,
        "dsp_arch": cfg.soc_info.dsp_arch,
        "qairt_version": compiled.backend.qairt_version,
        "genie_config": GENIE_CONFIG,
        "htp_backend_ext_config": HTP_EXT_CONFIG,
        "binaries": ctx_bins,
        "checkpoint": {
            "model": cfg.model,
            "revision": download.figures.get("revision", cfg.model_revision),
            "files": [f for f in download.outputs if f.get("path") != REPORT_NAME],
        },
        "config": cfg.to_dict(),
        "compiler": compiled.backend.name,
        "tool_versions": {
            stage: (StageReport.read(d) or StageReport(stage)).tool_versions
            for stage, d in (
                ("export", export_dir),
                ("quantize", output_dir(workdir, "quantize")),
                ("compile", compiled_dir),
            )
        },
        "lock_sha256": _lock_hashes(),
        "files": [{"path": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in listed],
    }


def _schema(name: str) -> dict[str, Any]:
    return json.loads((TEMPLATES / f"{name}.schema.json").read_text())


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _lock_hashes() -> dict[str, str]:
    docker = TEMPLATES.parent / "docker"
    return {p.parent.name: sha256_file(p) for p in sorted(docker.glob("*/requirements.lock"))}


def check_manifest(bundle_dir: Path, manifest_path: Path | None = None) -> list[str]:
    """Every difference between a bundle folder and its manifest (empty: they match)."""
    manifest_path = manifest_path or bundle_dir / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} does not exist"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    for f in manifest["files"]:
        path = bundle_dir / f["path"]
        if not path.is_file():
            problems.append(f"{f['path']}: missing")
        elif path.stat().st_size != f["bytes"]:
            problems.append(f"{f['path']}: {path.stat().st_size} bytes, manifest says {f['bytes']}")
        elif sha256_file(path) != f["sha256"]:
            problems.append(f"{f['path']}: sha256 differs from the manifest")
    listed = {f["path"] for f in manifest["files"]} | {MANIFEST, REPORT_NAME, "README.md"}
    problems += [
        f"{p.name}: not in the manifest" for p in sorted(bundle_dir.iterdir()) if p.name not in listed
    ]
    return problems
