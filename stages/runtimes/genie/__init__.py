"""Genie (QAIRT's LLM runtime, `genie-t2t-run` / libGenie.so) as a `stages.runtimes.Runtime`.

- `bundle.py`: the bundle stage: binaries, LUTs, tokenizer, genie_config.json and
  htp_backend_ext_config.json rendered from templates/ and checked against the compiled graphs.
- `verify.py`: the verify stage: hashes, the bundle's configs against its graphs, the bundle under
  the emulator against transformers and against its own quantized graphs.
- `emulator.py`: the host emulator of how Genie drives the graphs (LUT feeds, KV cache, sampling).
- `device.py`: adb push of the bundle and the QAIRT runtime, and genie-t2t-run on the phone.
- `prompt.py`: the prompt text genie-t2t-run gets, for `make run` and the emulator alike.
- `rules.py`: what Genie's runtime refuses (sliding-window steps, sampler ranges), worded once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.config import PipelineConfig


class GenieRuntime:
    name = "genie"

    def layout_problems(self, cfg: PipelineConfig, geo) -> list[str]:
        """A graph call as wide as a sliding-window group's past or wider: Genie 2.51 never writes
        that group's cache (rules.window_not_written, measured with the real libGenie.so)."""
        from stages.model.contract import CACHE_PREFIX, cache_slots, window_cache
        from stages.model.geometry import SLIDING
        from stages.runtimes.genie.rules import window_not_written

        if not window_cache(geo) or not any(layer.attention == SLIDING for layer in geo.layers):
            return []
        problems = []
        for ar in sorted({cfg.prefill_ar, cfg.decode_ar}):
            slots = cache_slots(geo, SLIDING, cfg.max_context, ar)
            if ar >= slots:
                problems.append(window_not_written(CACHE_PREFIX[SLIDING], ar, slots))
        return problems

    def describe_layout(self, prefill_ar: int, decode_ar: int) -> str:
        from stages.runtimes.genie.rules import layout_behaviour

        return layout_behaviour(prefill_ar, decode_ar)

    def usable_context(self, geo, max_context: int, ars: list[int]) -> int:
        """genie_config.json's context.size for these graph kinds (rules.dialog_context_size): the
        past a full-attention cache holds in the widest graph (`cache_slots`)."""
        from stages.model.contract import cache_slots
        from stages.model.geometry import FULL
        from stages.runtimes.genie.rules import dialog_context_size

        return dialog_context_size(cache_slots(geo, FULL, max_context, ar) for ar in ars)

    def lut_problems(self, lut_bytes: dict[str, int]) -> list[str]:
        from stages.runtimes.genie.rules import lut_problems

        return lut_problems(lut_bytes)

    def package(self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path) -> dict[str, Any]:
        from stages.model.chat import ChatError
        from stages.runtimes.genie.bundle import BundleError, run_bundle

        try:
            return run_bundle(cfg, workdir, checkpoint_dir)
        except ChatError as e:  # the checkpoint's chat template
            raise BundleError(str(e)) from None

    def check(
        self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path, prompt: str, **options: Any
    ) -> dict[str, Any]:
        """options: max_new_tokens, engine (None: the config's verify_engine), min_prefix and min_top1
        (None: verify.Thresholds' defaults), heldout_check (False: VERIFY_HELDOUT=off), real_genie
        (False: VERIFY_REAL_GENIE=off), real_genie_all_cases (True: VERIFY_REAL_GENIE=full)."""
        from stages.model.chat import ChatError
        from stages.model.checkpoint import CheckpointError
        from stages.quant.runner import RunnerError
        from stages.runtimes.genie.verify import Thresholds, VerifyError, run_verify

        thresholds = Thresholds.with_overrides(options.pop("min_prefix", None), options.pop("min_top1", None))
        try:
            return run_verify(cfg, workdir, checkpoint_dir, prompt, thresholds=thresholds, **options)
        except (ChatError, CheckpointError, RunnerError) as e:
            raise VerifyError(str(e)) from None

    def answer_on_host(self, workdir: Path, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """verify's Genie emulator on the CPU engine: the ctx-bins' compiler inputs, fed the bundle's LUTs,
        masks, RoPE tables and KV$ as Genie feeds them."""
        from stages.core.pipeline import output_dir
        from stages.planning.results import CompileResult, read_result
        from stages.runtimes.genie.emulator import EmulatorError, GenieEmulator
        from stages.runtimes.genie.files import GENIE_CONFIG
        from stages.runtimes.genie.real_checks import top2_margins
        from stages.runtimes.genie.verify import VerifyError

        bundle_dir = output_dir(workdir, "bundle")
        compiled = read_result(workdir, "compile", CompileResult)
        if compiled is None or not (bundle_dir / GENIE_CONFIG).is_file():
            raise VerifyError(f"{bundle_dir} holds no bundle; run `make bundle` first")
        try:
            emulator = GenieEmulator(bundle_dir, compiled, "cpu", output_dir(workdir, "quantize"))
        except EmulatorError as e:
            raise VerifyError(f"{bundle_dir}: {e}") from None
        run = emulator.generate(prompt_ids, max_new_tokens, greedy=True)
        return {
            "tokens": list(run.tokens),
            "prefill_s": run.prefill_s,
            "decode_s": run.decode_s,
            "stopped_by": run.stopped_by,
            "top2_margins": [round(m, 4) for m in top2_margins(run.logits)],
        }

    def check_files(self, folder: Path, manifest: Path) -> list[str]:
        from stages.runtimes.genie.bundle import check_manifest

        return check_manifest(folder, manifest)

    def push(self, bundle_dir: Path, sdk_root: Path | None, serial: str | None, adb: str) -> dict[str, Any]:
        from stages.runtimes.genie.device import push_bundle

        return push_bundle(bundle_dir, sdk_root, serial, adb)

    def run(self, bundle_dir: Path, prompt: str, serial: str | None, adb: str) -> dict[str, Any]:
        from stages.model.chat import ChatError
        from stages.runtimes.genie.device import DeviceError, read_manifest, run_on_device
        from stages.runtimes.genie.prompt import query_text

        read_manifest(bundle_dir)  # no bundle: say which stage to run before reading its files
        try:
            text = query_text(bundle_dir, prompt)
        except ChatError as e:
            raise DeviceError(f"{bundle_dir}: {e}") from None
        return run_on_device(bundle_dir, text, serial, adb)


RUNTIME = GenieRuntime()
