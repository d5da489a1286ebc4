"""Genie (QAIRT's LLM runtime, `genie-t2t-run` / libGenie.so) as a `stages.runtimes.Runtime`.

- `bundle.py`: the bundle stage: binaries, LUTs, tokenizer, genie_config.json and
  htp_backend_ext_config.json rendered from templates/ and checked against the compiled graphs.
- `verify.py`: the verify stage: hashes, the bundle's configs against its graphs, the bundle under
  the emulator against transformers and against its own quantized graphs.
- `emulator.py`: the host emulator of how Genie drives the graphs (LUT feeds, KV cache, sampling).
- `device.py`: adb push of the bundle and the QAIRT runtime, and genie-t2t-run on the phone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig


class GenieRuntime:
    name = "genie"

    def layout_problems(self, cfg: PipelineConfig, geo) -> list[str]:
        """A graph call wider than a sliding-window group's past: its first call on an empty cache
        evicts from an empty queue (qualla SlidingWindow::processUpdate)."""
        from stages.contract import CACHE_PREFIX
        from stages.geometry import SLIDING
        from stages.graphs import past_len
        from stages.runtimes.genie.rules import window_overflow

        if not any(layer.attention == SLIDING for layer in geo.layers):
            return []
        problems = []
        for ar in sorted({cfg.prefill_ar, cfg.decode_ar}):
            slots = past_len(geo, SLIDING, cfg, ar)
            if ar > slots:
                problems.append(window_overflow(CACHE_PREFIX[SLIDING], ar, slots, 0))
        return problems

    def package(self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path) -> dict[str, Any]:
        from stages.chat import ChatError
        from stages.runtimes.genie.bundle import BundleError, run_bundle

        try:
            return run_bundle(cfg, workdir, checkpoint_dir)
        except ChatError as e:  # the checkpoint's chat template
            raise BundleError(str(e)) from None

    def check(
        self, cfg: PipelineConfig, workdir: Path, checkpoint_dir: Path, prompt: str, **options: Any
    ) -> dict[str, Any]:
        """options: max_new_tokens, engine ("htp": the binaries on QNN's HTP emulation; "cpu": their
        compiler inputs), thresholds (verify.Thresholds), heldout_check (False: VERIFY_HELDOUT=off)."""
        from stages.chat import ChatError
        from stages.checkpoint import CheckpointError
        from stages.runner import RunnerError
        from stages.runtimes.genie.verify import VerifyError, run_verify

        try:
            return run_verify(cfg, workdir, checkpoint_dir, prompt, **options)
        except (ChatError, CheckpointError, RunnerError) as e:
            raise VerifyError(str(e)) from None

    def push(self, bundle_dir: Path, sdk_root: Path | None, serial: str | None, adb: str) -> dict[str, Any]:
        from stages.runtimes.genie.device import push_bundle

        return push_bundle(bundle_dir, sdk_root, serial, adb)

    def run(self, bundle_dir: Path, prompt: str, serial: str | None, adb: str) -> dict[str, Any]:
        from stages.chat import ChatError
        from stages.runtimes.genie.device import DeviceError, read_manifest, run_on_device

        read_manifest(bundle_dir)  # no bundle: say which stage to run before reading its files
        try:
            text = query_text(bundle_dir, prompt)
        except ChatError as e:
            raise DeviceError(f"{bundle_dir}: {e}") from None
        return run_on_device(bundle_dir, text, serial, adb)


def query_text(bundle_dir: Path, prompt: str) -> str:
    """The text `make run` hands genie-t2t-run for a one-turn prompt: the bundle's chat template
    rendered, less its leading BOS text where the config's bos-token is one Genie prepends itself
    (qualla dialog.cpp Dialog::query adds bos-token >= 0 before the text's ids), else it would be
    there twice. verify's emulator starts from the same text. Light imports only: push and run work
    in the tools image (no numpy, no onnx)."""
    from stages.chat import render_chat
    from stages.runtimes.genie.files import GENIE_CONFIG, TOKENIZER_CONFIG

    text = render_chat(bundle_dir, prompt)
    dialog = json.loads((bundle_dir / GENIE_CONFIG).read_text())["dialog"]
    bos = json.loads((bundle_dir / TOKENIZER_CONFIG).read_text()).get("bos_token")
    if dialog["context"].get("bos-token", -1) >= 0 and isinstance(bos, str) and text.startswith(bos):
        text = text[len(bos) :]
    return text


RUNTIME = GenieRuntime()
