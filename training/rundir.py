"""The run dir (embedding/rundir.py names its files) appears complete or not at all.

A run trains in `<out>.partial/` (checkpoints, metrics) and is renamed to `<out>` only when
every artifact is written and fsynced. An interrupted run leaves `<out>.partial/` for --resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from embedding.errors import SNCAError
from embedding.files import publish_dir
from embedding.rundir import RunDir

# The checkpoint is one file, written atomically: tensors + the JSON state in its metadata, so
# a kill can never leave weights of one epoch beside the bookkeeping of another.
CHECKPOINT = RunDir.CHECKPOINT


def staging_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _non_empty(p: Path) -> bool:
    return p.exists() and (not p.is_dir() or any(p.iterdir()))


def prepare(out: Path, resume: bool, overwrite: bool) -> tuple[Path, bool, bool]:
    """Return (staging dir, resuming?, created by this call?) after checking what exists.

    A staging dir created here (fresh, or a copy of a finished run to extend) holds nothing
    worth keeping until this run writes a checkpoint: `discard` removes it on failure."""
    stage = staging_path(out)
    if out.exists() and not out.is_dir():
        raise SNCAError(f"--out {out} exists and is not a directory")
    if resume and overwrite:
        raise SNCAError("--resume and --overwrite contradict each other; pass one")
    if resume:
        if (stage / CHECKPOINT).is_file():
            return stage, True, False
        if (out / CHECKPOINT).is_file():
            # Extending a finished run: continue in a copy, swap in when done.
            if stage.exists():
                shutil.rmtree(stage)
            # the run's own files only: an index dir built inside it belongs to the old model
            shutil.copytree(
                out, stage, ignore=lambda d, names: [n for n in names if (Path(d) / n).is_dir()]
            )
            return stage, True, True
        raise SNCAError(f"--resume: no checkpoint in {stage} or {out}; nothing to resume")
    if _non_empty(stage) and not overwrite:
        raise SNCAError(
            f"an interrupted run is in {stage}; pass --resume to continue it or --overwrite to "
            "start over"
        )
    if _non_empty(out) and not overwrite:
        raise SNCAError(
            f"--out {out} exists and is not empty; pass --resume to continue or extend it, or "
            "--overwrite to replace it (the old run stays until the new one completes)"
        )
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    return stage, False, True


def discard(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def finalize(stage: Path, out: Path) -> None:
    """fsync everything in `stage`, then swap it into place as `out`."""
    publish_dir(stage, out)
