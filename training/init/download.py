"""Fetching published weights when the network allows it, with the libraries' own download and
hash check, and never when the user said offline (SNCA_OFFLINE=1, or Hugging Face's
HF_HUB_OFFLINE=1, which timm's downloads obey too).

A file lands in its cache (torch's hub dir) only complete and only when its hash matched:
torch.hub's download writes a temporary file, checks the sha256 prefix the file's name carries
(torchvision's weights: resnet50-11ad3fa6.pth) and only then moves it into place."""

from __future__ import annotations

import os
import re
import sys
import urllib.error
from pathlib import Path

from embedding.errors import SNCAError

TRUE = ("1", "true", "yes", "on")
# torchvision's published weights; SNCA_WEIGHTS_MIRROR replaces this (an organisation's mirror)
TORCHVISION_BASE = "https://download.pytorch.org/models/"


def offline() -> bool:
    """Whether downloads are forbidden: SNCA_OFFLINE or HF_HUB_OFFLINE set true."""
    return any(
        os.environ.get(v, "").strip().lower() in TRUE for v in ("SNCA_OFFLINE", "HF_HUB_OFFLINE")
    )


def mirrored(url: str) -> str:
    """`url` with torchvision's base replaced by SNCA_WEIGHTS_MIRROR, when that is set."""
    base = os.environ.get("SNCA_WEIGHTS_MIRROR", "").strip()
    if base and url.startswith(TORCHVISION_BASE):
        return base.rstrip("/") + "/" + url[len(TORCHVISION_BASE) :]
    return url


def hash_prefix(url: str) -> str | None:
    """The sha256 prefix a published file's name carries (resnet50-11ad3fa6.pth: 11ad3fa6)."""
    found = re.search(r"-([a-f0-9]{6,})\.", Path(url).name)
    return found.group(1) if found else None


def fetch(url: str, dest: Path, spec: str) -> Path:
    """Download `url` to `dest` (checked against the hash its name carries); SNCAError naming
    the URL and where to put the file by hand when offline or when it fails."""
    by_hand = f"fetch {url} on a machine with internet access and place it at {dest}"
    if offline():
        raise SNCAError(
            f"--init {spec}: {dest} is missing and downloads are off (SNCA_OFFLINE or "
            f"HF_HUB_OFFLINE); {by_hand}"
        )
    import torch.hub

    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {url} -> {dest}", file=sys.stderr, flush=True)
    try:
        torch.hub.download_url_to_file(
            url, str(dest), hash_prefix(url), progress=sys.stderr.isatty()
        )
    except (urllib.error.URLError, OSError) as e:
        raise SNCAError(f"--init {spec}: downloading {url} failed ({e}); {by_hand}") from None
    except RuntimeError as e:  # torch.hub: 'invalid hash value (expected ..., got ...)'
        dest.unlink(missing_ok=True)
        raise SNCAError(f"--init {spec}: {url} is not the published file: {e}") from None
    return dest
