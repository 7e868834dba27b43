"""What every snca-gallery command that embeds or classifies starts from: the service's own
state on the tool's flags (`open_state`: the model, the live gallery, its store; a command that
only reads the gallery: `open_served_store`, no model loaded) and the
bounded read of an image file (`read_image_file`). Its own module so that the commands'
modules (gallery_tool, classify_folder) share it without importing each other."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from embedding.errors import SNCAError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def read_image_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (OSError otherwise): the size is
    checked before reading, and no more than limit + 1 bytes are ever read (a file that grows,
    or a sparse one, cannot make this take more memory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO would block an open)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file: {path}")
        if st.st_size > limit:
            raise OSError(f"{st.st_size} bytes; the limit is {limit} (SNCA_MAX_UPLOAD_BYTES)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"over {limit} bytes (SNCA_MAX_UPLOAD_BYTES)")
    return data


def tool_settings(args: dict, **overrides):
    """The Settings a server on the tool's flags would have, on the live gallery of the data
    dir: the model a switch or a start carried the gallery to, not the one it was made with
    (which would carry it back); said on stderr when it is another than --model."""
    from pydantic import ValidationError

    from service.config import Settings
    from service.startup import follow_alias

    given = {k.replace("-", "_"): v for k, v in args.items() if k in SETTINGS}
    # a tool embeds in batches of its own: the server's warm-up of every batch size and its
    # fused small-batch copies would only cost start-up (a photo model: ~30 s, several GB)
    overrides = {"warmup_seconds": 0, "fused_batches": 0, "follow_alias": True, **overrides}
    try:
        settings = Settings(**given, **overrides)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SNCAError(msgs) from None
    given_model = settings.model
    moved = follow_alias(settings)
    if moved:
        print(f"snca-gallery: {moved} (not {given_model})", file=sys.stderr, flush=True)
    return settings


def open_state(args: dict, **overrides):
    """The ServiceHost a server on these settings would have (model, gallery, store)."""
    return open_host(tool_settings(args, **overrides))


def open_host(settings):
    """The ServiceHost of `settings` (tool_settings), opened and finished as a server's start
    does, except that it never carries a gallery to another model (an error says how)."""
    from service.startup import ServiceHost

    host = ServiceHost(settings)
    opening = host.open()
    if opening.plan is not None:
        host.stop()
        raise SNCAError(
            f"the gallery in {opening.data.path} belongs to another model than "
            f"{settings.model}: give that model's run dir as --model, or carry the gallery to "
            f"this one first (snca-gallery upgrade --model THAT_RUN --to {settings.model} "
            "--switch, while it serves; or start snca-serve on this model)"
        )
    host.finish()
    return host


def open_served_store(settings):
    """The store of the gallery a server of `settings` (tool_settings) would serve, opened as
    found without loading the model, when that gallery exists, is this model's and nothing
    waits for a server's start (a start-up migration's swap, a switch to settle); None
    otherwise (open_host does what a start does). What reads the gallery only (export) needs
    no more: opening the service state loads the model (5-6 s, every learn's export)."""
    from embedding.errors import ArtifactError
    from embedding.index import read_manifest
    from embedding.rundir import RunDir
    from service.store.records import CARRIED_TO, STANDBY
    from service.store.registry import backend_class, locate_gallery, open_as_found

    try:
        fingerprint = RunDir(settings.model).load_model_card()[1]
        index_id = read_manifest(settings.index).index_id
    except (ArtifactError, OSError, ValueError):
        return None  # (open_host says what is wrong with them)
    home = settings.home_store
    target, _ = locate_gallery(home, settings.data_dir, fingerprint, index_id)
    cls = backend_class(target)
    if not cls.exists(target):
        return None  # (never served: a start seeds it)
    metas = [cls.meta_of(target)] + ([cls.meta_of(home)] if str(target) != str(home) else [])
    if (metas[0].get("model_fingerprint"), metas[0].get("index_id")) != (fingerprint, index_id):
        return None  # another model's: a start would carry it
    if any(CARRIED_TO in m or STANDBY in m for m in metas):
        return None
    return open_as_found(target)


SETTINGS = ("model", "index", "store", "data_dir", "device", "log_level", "thumbnails")
