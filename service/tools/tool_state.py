"""What every snca-gallery command that embeds or classifies starts from: the service's own
state on the tool's flags (`open_state`: the model, the live gallery, its store) and the
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


def open_state(args: dict, **overrides):
    """The ServiceState a server on these settings would have (model, gallery, store)."""
    from pydantic import ValidationError

    from service.config import Settings
    from service.startup import ServiceHost, follow_alias

    given = {k.replace("-", "_"): v for k, v in args.items() if k in SETTINGS}
    # a tool embeds in batches of its own: the server's warm-up of every batch size and its
    # fused small-batch copies would only cost start-up (a photo model: ~30 s, several GB);
    # it works on the live gallery of the data dir: the model a switch or a start carried the
    # gallery to, not the one it was made with (which would carry it back)
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


SETTINGS = ("model", "index", "store", "data_dir", "device", "log_level", "thumbnails")
