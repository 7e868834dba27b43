"""`snca-train --dataset gallery`: train on what users labelled in a served gallery.

The gallery belongs to a served model, which is also where training starts (`--init RUN_DIR`).
Its live items' stored images are read from the store (SQLite, or PostgreSQL with `--store`),
at one point in time, by the service's own `snca-gallery export` in a child process (the stages
never import each other: the service knows where a model's gallery lives, its generations and
its schema), into `<out>.gallery/` beside the run dir: `images/<label>/`, `labels.json` (the
folder of each label), `export.json` (the gallery version, counts). That copy is what the run
trained on (the run's `data_dir`; an index build that indexes the training images reads it) and
what `--resume` trains on again, whatever was added since. Added items without a stored image
are counted and left out, with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from embedding.errors import SNCAError

from .config import TrainConfig


def export_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".gallery")


def served_model(init: str | None) -> Path:
    """The served model's run dir (the gallery's model) from --init."""
    path = Path(init[4:] if init and init.startswith("run:") else init or "")
    if not init or not (path / "model.json").is_file():
        raise SNCAError(
            "--dataset gallery trains on the gallery of a served model, starting from it: "
            "give that model's run dir as --init (e.g. --init runs/photos-lite0)"
        )
    return path


def materialize(
    cfg: TrainConfig,
    store: str | None,
    resume: bool,
    width_given: bool = False,
    log=print,
    trained: bool = False,
    hold_out: float | None = None,
) -> dict:
    """Export the gallery (or, on --resume, reuse the export the run started on); point
    cfg.data_dir at its images; unless `width_given` (--embedding-dim), keep the served
    model's embedding width, so that its embedding layer is where training starts (a model
    served with nothing trained: the identity on its pooled features). `trained`: the trained
    items' images too (snca-gallery export --trained); `hold_out`: a share of every label's
    items left out, under heldout/ (--hold-out). Returns export.json."""
    model = served_model(cfg.init)
    if not width_given and not resume:
        card = json.loads((model / "model.json").read_text())
        cfg.embedding_dim = int(card["config"]["embedding_dim"])
    dest = export_dir(cfg.out)
    summary = dest / "export.json"
    if resume and summary.is_file():
        log(f"snca-train: resuming on the gallery exported to {dest}")
    else:
        if dest.exists():
            if not summary.is_file():
                raise SNCAError(f"{dest} exists and is not a gallery export: move it away")
            shutil.rmtree(dest)  # an earlier run's export: this run trains on the gallery now
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "service.tools.gallery_tool", "export", str(tmp)]
        cmd += ["--model", str(model), "--progress" if cfg.progress else "--no-progress"]
        cmd += ["--trained"] if trained else []
        cmd += ["--hold-out", str(hold_out)] if hold_out else []
        if cfg.data_dir:
            cmd += ["--data-dir", str(cfg.data_dir)]
        if store:
            cmd += ["--store", store]
        log(f"snca-train: reading the gallery of {model} into {dest}", flush=True)
        try:  # its summary is ours below; its progress, warnings and errors go to stderr
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        except OSError as e:
            raise SNCAError(f"cannot run snca-gallery export: {e}") from None
        if p.returncode != 0:  # (a training-only install: its error names the missing module)
            raise SNCAError("reading the gallery failed (snca-gallery export, above)")
        os.replace(tmp, dest)
    meta = json.loads(summary.read_text())
    images = dest / "images"
    if not meta.get("images"):
        raise SNCAError(
            f"the gallery holds no stored images to train on ({meta.get('items', 0)} items, "
            f"{meta.get('added_without_image', 0)} added without a stored image)"
        )
    log(
        f"snca-train: the gallery at version {meta['gallery_version']}: {meta['images']} "
        f"stored images of {sum(1 for d in images.iterdir() if d.is_dir())} labels"
        + (
            f"; {meta['added_without_image']} added without a stored image are left out"
            if meta.get("added_without_image")
            else ""
        ),
        flush=True,
    )
    cfg.data_dir = str(images)
    return meta


def record_gallery(out: str | Path, meta: dict, init: str | None) -> None:
    """Write OUT/gallery.json (embedding.rundir.RunDir.GALLERY): the data dir of the gallery
    the run was trained on (from the export's summary), so that snca-serve and snca-gallery
    given this run find that gallery without --data-dir."""
    from embedding.files import atomic_write_json

    if not meta.get("data_dir"):
        return  # (an export made before the summary named its data dir)
    atomic_write_json(
        Path(out) / "gallery.json",
        {"data_dir": meta["data_dir"], "model": str(served_model(init).resolve())},
    )
