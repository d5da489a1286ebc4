"""The verify stage: check a bundle on the host before anyone spends time on the phone.

It reads the bundle itself: the manifest's hashes, genie_config.json, the LUT files, and for every
binary the quantized graph it was compiled from. Checks: every file matches the manifest; every
binary carries its graph's I/O tensor names; the graph I/O agrees with the config (embedding
widths, vocabulary, context size, cache groups and their kv-dims, the sliding window, LUT sizes).
Then a prompt runs through the host runner on exactly those files (the bundle's LUTs, the quantized
graphs) and through transformers on the same checkpoint: greedy tokens, the length of the common
prefix, top-1 agreement along transformers' greedy path, and both texts go to verify/report.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from stages.bundle import GENIE_CONFIG, MANIFEST, check_manifest
from stages.config import PipelineConfig, stage_fields
from stages.contract import CACHE_PREFIX, INPUTS_EMBEDS, MASK_NAME, PER_LAYER_INPUTS
from stages.geometry import FULL, SLIDING
from stages.graphs import qdq_file_name
from stages.report import REPORT_NAME, check_inputs, read_report, stage_output

LUT_BYTES = {"ufixed8": 1, "ufixed16": 2}


class VerifyError(ValueError):
    """The bundle is broken; the message lists what and what to do."""


def _graph_io(path: Path) -> dict[str, dict[str, list[int]]]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)

    def dims(v) -> list[int]:
        return [d.dim_value for d in v.type.tensor_type.shape.dim]

    return {
        "inputs": {v.name: dims(v) for v in m.graph.input},
        "outputs": {v.name: dims(v) for v in m.graph.output},
    }


def check_bundle(bundle_dir: Path, quantized_dir: Path, compiled: dict[str, Any], geo) -> list[str]:
    """Every way the bundle disagrees with itself, its binaries' graphs or the model (empty: none)."""
    problems = check_manifest(bundle_dir)
    genie = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    binaries = {b["file"]: b for b in compiled["figures"]["binaries"]}
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for name in genie["engine"]["model"]["binary"]["ctx-bins"]:
        path = bundle_dir / name
        if name not in binaries or not path.is_file():
            problems.append(f"ctx-bin {name}: not a binary of the compile stage, or missing from the bundle")
            continue
        data = path.read_bytes()
        for graph in binaries[name]["graphs"]:
            source = quantized_dir / qdq_file_name(graph["name"])
            if not source.is_file():
                problems.append(f"{name}: its source graph {source} is missing")
                continue
            io = _graph_io(source)
            for direction in ("inputs", "outputs"):
                recorded = {t: e["shape"] for t, e in graph["io"][direction].items()}
                if recorded != io[direction]:
                    problems.append(f"{name}: graph {direction} differ from {source.name}")
            absent = [t for d in io.values() for t in d if t.encode() not in data]
            if absent:
                problems.append(f"{name}: lacks the tensors {', '.join(absent[:6])}")
            inputs.update(io["inputs"])
            outputs.update(io["outputs"])
    if not inputs:
        return problems + ["no binary could be checked"]

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            problems.append(f"genie_config.json {what} is {got}, the graphs say {want}")

    expect("context.size", genie["context"]["size"], inputs[MASK_NAME[FULL]][-1])
    expect("context.n-vocab", genie["context"]["n-vocab"], outputs["logits"][-1])
    expect("embedding.size", genie["embedding"]["size"], inputs[INPUTS_EMBEDS][-1])
    if "perlayer-embedding" in genie:
        expect(
            "perlayer-embedding.size",
            genie["perlayer-embedding"]["size"],
            int(np.prod(inputs[PER_LAYER_INPUTS][2:])),
        )
    for group in genie["engine"]["cache-groups"]:
        attention = FULL if group["prefix"] == f"{CACHE_PREFIX[FULL]}_" else SLIDING
        keys = [s for t, s in inputs.items() if re.match(rf"{group['prefix']}key_\d+_h\d+_in$", t)]
        if not keys:
            problems.append(f"cache group {group['prefix']!r} matches no key cache input")
            continue
        expect(f"cache group {group['prefix']!r} kv-dim", group["kv-dim"], keys[0][-2])
        expect(
            f"cache group {group['prefix']!r} mask", group["attention-mask-tensor-name"], MASK_NAME[attention]
        )
        if attention == SLIDING:
            window = group["longcontext"]["sliding-window"]["window-size"]
            expect("sliding window-size", window, geo.sliding_window)
    for key in ("embedding", "perlayer-embedding"):
        lut = genie.get(key)
        if lut is None:
            continue
        path = bundle_dir / lut["lut-path"]
        want = geo.vocab_size * lut["size"] * LUT_BYTES[lut["datatype"]]
        if path.is_file() and path.stat().st_size != want:
            problems.append(
                f"{lut['lut-path']}: {path.stat().st_size} bytes, {geo.vocab_size} rows x {lut['size']} x "
                f"{LUT_BYTES[lut['datatype']]} B expected"
            )
    return problems


def bundle_runner(bundle_dir: Path, export_dir: Path, quantized_dir: Path):
    """The host runner on the bundle's own LUT files (quantization from its genie_config.json) and the
    quantized graphs its binaries were compiled from."""
    from stages.runner import HostRunner, LutEmbedder, LutSpec

    runner = HostRunner.from_export(export_dir, luts=True, graph_dir=quantized_dir)
    genie = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    names = {"embedding": "embedding", "per_layer_embedding": "perlayer-embedding"}
    specs = {}
    for key, genie_key in names.items():
        lut = genie.get(genie_key)
        if lut is None:
            continue
        bits = 8 * LUT_BYTES[lut["datatype"]]
        q = lut["quant-param"]
        rows = (bundle_dir / lut["lut-path"]).stat().st_size // (lut["size"] * bits // 8)
        specs[key] = LutSpec(lut["lut-path"], rows, lut["size"], bits, q["scale"], q["offset"])
    runner.embed = LutEmbedder(runner.geo, bundle_dir, specs)
    return runner


def run_verify(
    cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path, prompt: str, max_new_tokens: int = 32
) -> dict[str, Any]:
    """The whole stage; returns its report. A broken bundle raises VerifyError."""
    from stages.chat import ChatTokenizer
    from stages.checkpoint import Checkpoint, stop_token_ids
    from stages.reference import greedy_tokens, logits_of, transformers_model

    bundle_dir, compiled_dir = workdir / "genie_bundle", workdir / "compiled"
    quantized_dir, export_dir = workdir / "quantized", workdir / "exported"
    compiled = read_report(compiled_dir)
    if read_report(bundle_dir) is None or compiled is None:
        raise VerifyError(f"{bundle_dir} holds no finished bundle; run `make bundle` first")
    check_inputs(workdir, [bundle_dir, quantized_dir, checkpoint_dir])
    geo = Checkpoint(checkpoint_dir).geometry
    problems = check_bundle(bundle_dir, quantized_dir, compiled, geo)
    if problems:
        raise VerifyError(f"{bundle_dir} is broken ({len(problems)} problems):\n  " + "\n  ".join(problems))

    tok = ChatTokenizer(checkpoint_dir)
    genie = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    stop_ids = set(stop_token_ids(checkpoint_dir))
    if set(genie["context"]["eos-token"]) != stop_ids:
        raise VerifyError(
            f"{bundle_dir / GENIE_CONFIG} stops at tokens {genie['context']['eos-token']}, the checkpoint at "
            f"{sorted(stop_ids)}; run `make bundle` again"
        )
    prompt_ids = tok.chat_ids(prompt)
    room = genie["context"]["size"] - len(prompt_ids) - (-len(prompt_ids)) % cfg.prefill_ar
    max_new_tokens = max(1, min(max_new_tokens, room))
    runner = bundle_runner(bundle_dir, export_dir, quantized_dir)
    ours = runner.generate(prompt_ids, max_new_tokens, stop_ids)
    model = transformers_model(checkpoint_dir)
    theirs = greedy_tokens(model, prompt_ids, max_new_tokens, stop_ids)
    common = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs, strict=False)) if a != b), None)
    common = min(len(ours.tokens), len(theirs)) if common is None else common
    # Top-1 along transformers' greedy path: both chains read the same tokens at every position.
    path = prompt_ids + theirs[:-1]
    ref_top1 = logits_of(model, path)[len(prompt_ids) - 1 :].argmax(-1)
    runner.reset()
    got = runner.prefill(prompt_ids)[-1:]
    steps = [got] + [runner.step([t]) for t in theirs[:-1]]
    our_top1 = np.concatenate(steps).argmax(-1)
    agreement = float((our_top1 == ref_top1).mean()) if len(ref_top1) else 1.0
    out_dir = workdir / "verify"
    options = {"model": cfg.model, "soc": cfg.soc, **{k: getattr(cfg, k) for k in stage_fields("verify")}}
    inputs = [bundle_dir / MANIFEST, bundle_dir / REPORT_NAME]
    with stage_output("verify", out_dir, inputs, options, root=workdir) as run:
        run.figures.update(
            {
                "bundle": json.loads((bundle_dir / MANIFEST).read_text())["name"],
                "checks": "manifest hashes, binary graph I/O vs quantized graphs and genie_config.json",
                "prompt": prompt,
                "prompt_tokens": len(prompt_ids),
                "bundle_tokens": ours.tokens,
                "transformers_tokens": theirs,
                "matching_prefix_tokens": common,
                "top1_agreement": agreement,
                "bundle_text": tok.decode(ours.tokens),
                "transformers_text": tok.decode(theirs),
                "host_prefill_tokens_per_s": round(ours.prefill_tokens_per_s, 2),
                "host_decode_tokens_per_s": round(ours.decode_tokens_per_s, 2),
            }
        )
    return read_report(out_dir)
