"""The built-in tiny Gemma 4, trained, so that quantization figures on it mean something.

`python -m stages.tiny_model` (in the export image or the venv; about 4 minutes on one core) is the
deterministic script that made the committed fixture:

1. A text corpus available offline everywhere: the docstrings of a fixed list of Python 3.11 standard
   library modules (PSF licence), split by module into disjoint train, calibration and held-out
   parts, committed under `stages/data/corpus/` so every machine trains and calibrates on the same
   text (`--rebuild-corpus` extracts it again).
2. transformers' Gemma4ForCausalLM with the built-in tiny config (sliding, full and KV-shared layers,
   PLE), initialised from the download stage's seeded random weights, trained on byte-level windows
   of the train part with AdamW on one thread (thread count changes float reductions).
3. The weights, as bfloat16, in `stages/data/tiny-trained.safetensors` (about 0.6 MB) beside a JSON
   with the loss curve and the held-out loss; `g4v69 download --model tiny` writes them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

# The built-in byte-level tokenizer's ids: special tokens, then one id per byte.
from stages.builtin_models import BOS_ID, BYTE_OFFSET
from stages.geometry import TINY_TEXT_CONFIG, geometry_from_config

DATA_DIR = Path(__file__).parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"
FIXTURE = DATA_DIR / "tiny-trained.safetensors"
FIXTURE_REPORT = DATA_DIR / "tiny-trained.json"
CORPUS_PARTS = ("train", "calibration", "heldout")

# Modules whose docstrings make the corpus, in this order; every 10th (offset 3) goes to calibration,
# every 10th (offset 7) to held-out, so the two never share a module with each other or with training.
CORPUS_MODULES = (
    "textwrap collections itertools functools json re pathlib argparse string datetime decimal fractions "
    "statistics random heapq bisect csv logging unittest email http.client urllib.parse shutil tempfile "
    "subprocess threading queue asyncio contextlib dataclasses enum typing abc io os sys math zipfile "
    "tarfile sqlite3 xml.etree.ElementTree html difflib pprint inspect ast tokenize calendar hashlib "
    "secrets base64 struct codecs locale gettext operator copy pickle shelve glob fnmatch configparser "
    "optparse getopt cmd shlex socket ssl select selectors signal mmap ctypes uuid ipaddress smtplib "
    "imaplib ftplib poplib wave colorsys venv zipapp doctest pdb timeit trace tracemalloc gc weakref "
    "types numbers cmath array graphlib sched concurrent.futures multiprocessing platform errno warnings "
    "traceback atexit builtins"
).split()


def module_text(name: str) -> str:
    mod = importlib.import_module(name)
    parts = [inspect.getdoc(mod) or ""]
    for attr, obj in sorted(vars(mod).items()):
        if not attr.startswith("_") and getattr(obj, "__module__", None) == mod.__name__:
            doc = inspect.getdoc(obj)
            if doc:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def build_corpus() -> dict[str, str]:
    split: dict[str, list[str]] = {p: [] for p in CORPUS_PARTS}
    for i, name in enumerate(CORPUS_MODULES):
        part = "calibration" if i % 10 == 3 else "heldout" if i % 10 == 7 else "train"
        split[part].append(module_text(name))
    return {k: "\n\n".join(v) + "\n" for k, v in split.items()}


def read_corpus(part: str) -> str:
    """A committed corpus part: train, calibration or heldout."""
    return (CORPUS_DIR / f"{part}.txt").read_text(encoding="utf-8")


def encode(text: str) -> list[int]:
    """The built-in tokenizer's ids for plain text (no special tokens inside), without a BOS."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def load_fixture() -> dict[str, Any]:
    """The trained tiny weights (names relative to the language model), bfloat16 torch tensors."""
    from safetensors.torch import load_file

    if not FIXTURE.is_file():
        raise FileNotFoundError(f"{FIXTURE} is missing; run `python -m stages.tiny_model` to make it")
    return load_file(str(FIXTURE))


def _windows(ids: list[int], batch: int, seq: int, gen) -> Any:
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
    body = torch.stack([data[s : s + seq - 1] for s in starts.tolist()])
    return torch.cat([torch.full((batch, 1), BOS_ID, dtype=torch.long), body], dim=1)


def heldout_loss(model, ids: list[int], seq: int) -> float:
    """Mean next-token loss (nats per byte) over consecutive windows of the held-out text."""
    import torch

    losses, counts = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - seq, seq - 1):
            x = torch.tensor([[BOS_ID, *ids[s : s + seq - 1]]])
            out = model(input_ids=x, labels=x)
            losses += float(out.loss) * (seq - 1)
            counts += seq - 1
    return losses / counts


def train(steps: int, seed: int = 0, batch: int = 16, seq: int = 128, lr: float = 3e-3) -> dict[str, Any]:
    """Train the tiny config from its seeded random init; returns weights (bf16) and figures."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from stages.builtin_models import TEXT_PREFIX, random_tensor

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    text = {k: v for k, v in geo.config.items() if k != "model_type"}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text, attn_implementation="eager"))
    # The same seeded init `download --model` would write for a random checkpoint.
    init = {
        "model." + t.name: random_tensor(TEXT_PREFIX + t.name, t.shape, geo.config, seed).float()
        for t in geo.all_tensors()
    }
    missing = model.load_state_dict(init, strict=False).missing_keys
    assert missing == ["lm_head.weight"], missing
    model.tie_weights()

    train_ids, heldout_ids = encode(read_corpus("train")), encode(read_corpus("heldout"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    curve = []
    model.eval()
    start_loss = heldout_loss(model, heldout_ids, seq)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x = _windows(train_ids, batch, seq, gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            curve.append([step, round(loss.item(), 4)])
    train_s = time.perf_counter() - t0
    model.eval()
    end_loss = heldout_loss(model, heldout_ids, seq)
    state = model.state_dict()
    weights = {t.name: state["model." + t.name].to(torch.bfloat16).contiguous() for t in geo.all_tensors()}
    figures = {
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "lr": lr,
        "seed": seed,
        "train_s": round(train_s, 1),
        "train_bytes": len(train_ids),
        "heldout_bytes": len(heldout_ids),
        "heldout_nats_per_byte_before": round(start_loss, 4),
        "heldout_nats_per_byte_after": round(end_loss, 4),
        "heldout_perplexity_after": round(math.exp(end_loss), 3),
        "loss_curve": curve,
        "torch": torch.__version__,
    }
    return {"weights": weights, "figures": figures}


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rebuild-corpus",
        action="store_true",
        help="extract the corpus from this Python's standard library again (docstrings differ a little "
        "between Python builds and import states, so the committed corpus is the reference)",
    )
    args = ap.parse_args(argv)
    if args.rebuild_corpus or not CORPUS_DIR.is_dir():
        CORPUS_DIR.mkdir(parents=True, exist_ok=True)
        for part, text in build_corpus().items():
            (CORPUS_DIR / f"{part}.txt").write_text(text, encoding="utf-8")
    result = train(args.steps, args.seed)
    save_file(result["weights"], str(FIXTURE), metadata={"format": "pt"})
    FIXTURE.chmod(0o644)  # safetensors writes 0600
    FIXTURE_REPORT.write_text(json.dumps(result["figures"], indent=2) + "\n")
    f = result["figures"]
    print(
        f"{FIXTURE}: held-out loss {f['heldout_nats_per_byte_before']} -> {f['heldout_nats_per_byte_after']} "
        f"nats/byte after {f['steps']} steps in {f['train_s']} s"
    )


if __name__ == "__main__":
    main()
