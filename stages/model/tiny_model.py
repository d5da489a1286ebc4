"""The built-in tiny Gemma 4, trained, so that quantization figures on it mean something.

`python -m stages.model.tiny_model` (in the export image or the venv; about 4 minutes on one core) is the
deterministic script that made the committed fixture:

1. A text corpus available offline everywhere: the docstrings of a fixed list of Python 3.11 standard
   library modules (PSF licence), split by module into disjoint train, calibration and held-out
   parts, committed under `stages/model/data/corpus/` so every machine trains and calibrates on the same
   text (`--rebuild-corpus` extracts it again).
2. transformers' Gemma4ForCausalLM with the built-in tiny config (sliding, full and KV-shared layers,
   PLE), initialised from the download stage's seeded random weights, trained on byte-level windows
   of the train part with AdamW on one thread (thread count changes float reductions).
3. The weights, as bfloat16, in `stages/model/data/tiny-trained.safetensors` (about 0.6 MB) beside a JSON
   with the loss curve and the held-out loss; `g4v69 download --model tiny` writes them.

`python -m stages.model.tiny_model --qat channel` (or `group32`) makes the quantization-aware-trained twins
(`stages/model/data/tiny-qat-<kind>.safetensors`, about a minute each): the trained weights fine-tuned with
every decoder-layer linear weight fake-quantized (straight-through) on a symmetric int4 grid as
Google's Q4_0 QAT checkpoints have it, one scale per output channel or per group of 32 inputs, then
set exactly on that grid and stored as bfloat16: the `-qat-q4_0-unquantized` layout at toy size.
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
from stages.model.builtin_models import BOS_ID, BYTE_OFFSET
from stages.model.geometry import TINY_TEXT_CONFIG, geometry_from_config

DATA_DIR = Path(__file__).parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"
FIXTURE = DATA_DIR / "tiny-trained.safetensors"
FIXTURE_REPORT = DATA_DIR / "tiny-trained.json"
# The QAT twins: group size of the int4 grid (None: one scale per output channel) by kind.
QAT_GROUPS: dict[str, int | None] = {"channel": None, "group32": 32}


def qat_fixture(kind: str) -> Path:
    return DATA_DIR / f"tiny-qat-{kind}.safetensors"


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


def load_fixture(qat: str | None = None) -> dict[str, Any]:
    """The trained tiny weights (names relative to the language model), bfloat16 torch tensors; with
    `qat` (a QAT_GROUPS kind) its quantization-aware-trained twin."""
    from safetensors.torch import load_file

    path = FIXTURE if qat is None else qat_fixture(qat)
    if not path.is_file():
        how = "" if qat is None else f" --qat {qat}"
        raise FileNotFoundError(f"{path} is missing; run `python -m stages.model.tiny_model{how}` to make it")
    return load_file(str(path))


def _deterministic_model(seed: int) -> tuple[Any, Any]:
    """A fresh Gemma4ForCausalLM of the tiny config, on one thread with deterministic algorithms
    (thread count changes float reductions), and its geometry; its weights are the caller's."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    geo = geometry_from_config(TINY_TEXT_CONFIG)
    text = {k: v for k, v in geo.config.items() if k != "model_type"}
    return Gemma4ForCausalLM(Gemma4TextConfig(**text, attn_implementation="eager")), geo


def _train_step(model, opt, x) -> Any:
    """One optimizer step on the windows `x` (clipped gradients); returns the loss."""
    import torch

    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def q4_0(w: Any, group: int | None) -> Any:
    """`w` (out, in) on Q4_0's grid: per group of `group` inputs (None: the whole row), the value of
    largest magnitude m sets the scale d = m / -8, and each weight becomes d * clamp(round(w / d), -8, 7)."""
    import torch

    out, inp = w.shape
    g = w.reshape(out, -1, group or inp)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(g, -1, idx) / -8.0
    d = torch.where(d == 0, torch.ones_like(d), d)
    return (torch.clamp(torch.round(g / d), -8, 7) * d).reshape(out, inp)


def qat_weight_names(geo) -> list[str]:
    """The weights a QAT checkpoint has on its grid: every decoder layer's linear weight."""
    from stages.model.geometry import LINEAR

    return [t.name for layer in geo.layers for t in layer.tensors if t.kind == LINEAR]


def train_qat(kind: str, steps: int = 300, seed: int = 0, batch: int = 16, seq: int = 128, lr: float = 1e-3):
    """Fine-tune the trained tiny weights with the QAT grid of `kind` fake-quantized in the forward
    pass (straight-through gradients), then set every such weight on its grid; returns weights (bf16)
    and figures (held-out loss of the float start, of it rounded onto the grid, and of the QAT result)."""
    import torch
    from torch.nn.utils import parametrize

    group = QAT_GROUPS[kind]

    class FakeQuant(torch.nn.Module):
        def forward(self, w):
            return w + (q4_0(w, group) - w).detach()

    model, geo = _deterministic_model(seed)
    start = {"model." + k: v.float() for k, v in load_fixture().items()}
    assert model.load_state_dict(start, strict=False).missing_keys == ["lm_head.weight"]
    model.tie_weights()
    names = qat_weight_names(geo)
    modules = dict(model.named_modules())
    owners = [modules["model." + n.removesuffix(".weight")] for n in names]
    train_ids, heldout_ids = encode(read_corpus("train")), encode(read_corpus("heldout"))
    model.eval()
    float_loss = heldout_loss(model, heldout_ids, seq)
    for m in owners:
        parametrize.register_parametrization(m, "weight", FakeQuant())
    rounded_loss = heldout_loss(model, heldout_ids, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        _train_step(model, opt, _windows(train_ids, batch, seq, gen))
    train_s = time.perf_counter() - t0
    model.eval()
    for m in owners:  # the weights become their grid values
        parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
    qat_loss = heldout_loss(model, heldout_ids, seq)
    state = model.state_dict()
    weights = {t.name: state["model." + t.name].to(torch.bfloat16).contiguous() for t in geo.all_tensors()}
    figures = {
        "kind": kind,
        "grid": "symmetric int4, Q4_0 (d = max / -8), "
        + ("per output channel" if group is None else f"groups of {group} inputs"),
        "weights_on_grid": len(names),
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "train_s": round(train_s, 1),
        "heldout_nats_per_byte_float": round(float_loss, 4),
        "heldout_nats_per_byte_rounded_onto_grid": round(rounded_loss, 4),
        "heldout_nats_per_byte_qat": round(qat_loss, 4),
        "torch": torch.__version__,
    }
    return {"weights": weights, "figures": figures}


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

    from stages.model.builtin_models import TEXT_PREFIX, random_tensor

    model, geo = _deterministic_model(seed)
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
        loss = _train_step(model, opt, _windows(train_ids, batch, seq, gen))
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
        "--qat", choices=sorted(QAT_GROUPS), help="make a QAT twin of the trained fixture instead"
    )
    ap.add_argument(
        "--rebuild-corpus",
        action="store_true",
        help="extract the corpus from this Python's standard library again (docstrings differ a little "
        "between Python builds and import states, so the committed corpus is the reference)",
    )
    args = ap.parse_args(argv)
    if args.qat:
        result = train_qat(args.qat, seed=args.seed)
        dest = qat_fixture(args.qat)
        save_file(result["weights"], str(dest), metadata={"format": "pt"})
        dest.chmod(0o644)
        dest.with_suffix(".json").write_text(json.dumps(result["figures"], indent=2) + "\n")
        print(json.dumps(result["figures"], indent=2))
        return
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
