"""--init timm:NAME[:FILE] (timm:convnext_tiny, timm:resnet50.a1_in1k:/data/weights.safetensors):
a timm model's pretrained weights (pip install 'snca[timm]'). The file is FILE, or the one timm
itself would fetch, found in the Hugging Face cache (HF_HUB_CACHE, ~/.cache/huggingface/hub)
without a network call, else downloaded (huggingface_hub's download and checks) unless
SNCA_OFFLINE=1 or HF_HUB_OFFLINE=1. It is read like any checkpoint (safetensors,
or torch.load(weights_only=True)) and handed to timm as a state_dict, so timm's own adaptation
of its checkpoints applies (key remaps, the classifier left out). The architecture becomes
`timm:NAME`, and the model's pretrained config (input size, mean, std, interpolation, crop_pct,
as timm's resolve_data_config gives them) the run's preprocessing."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from embedding.config import TIMM_PREFIX
from embedding.errors import SNCAError

from .base import Loaded
from .checkpoint import CheckpointFile
from .download import fetch, offline

HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm's Hugging Face repos hold


def timm_module(spec: str = "timm:...", extra: str = "timm"):
    """The timm module, or an error naming the --init source and the extra that installs it."""
    try:
        import timm
    except ImportError:
        raise SNCAError(
            f"--init {spec}: timm is not installed (pip install 'snca[{extra}]')"
        ) from None
    return timm


def _cached_file(spec: str, cfg: dict) -> Path:
    """The pretrained file from the Hugging Face cache, else downloaded there by
    huggingface_hub (its hash check; HF_ENDPOINT honoured), or from timm's URL into torch's hub
    cache; when offline (SNCA_OFFLINE, HF_HUB_OFFLINE), an error saying where to put it."""
    repo = cfg.get("hf_hub_id")
    if repo:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE

        for name in HF_FILES:
            hit = try_to_load_from_cache(repo, name)
            if isinstance(hit, str):
                return Path(hit)
        if not offline():
            return _hf_download(spec, repo)
        raise SNCAError(
            f"--init {spec}: its weights ({repo}, {HF_FILES[0]}) are not in the Hugging Face "
            f"cache {HF_HUB_CACHE} and downloads are off (SNCA_OFFLINE or HF_HUB_OFFLINE); on "
            f"a machine with internet access run `hf download {repo} {HF_FILES[0]}` and copy the "
            f"cache folder models--{repo.replace('/', '--')} there (or set HF_HUB_CACHE), or "
            f"pass the file: --init {spec}:PATH"
        )
    url = cfg.get("url")
    if not url:
        raise SNCAError(
            f"--init {spec}: timm names no weights file for it; pass --init {spec}:PATH"
        )
    import torch.hub

    return fetch(url, Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name, spec)


def _hf_download(spec: str, repo: str) -> Path:
    """hf_hub_download of the repo's weights (safetensors first), into the Hugging Face cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    print(f"downloading {repo} from the Hugging Face Hub", file=sys.stderr, flush=True)
    for name in HF_FILES:
        try:
            return Path(hf_hub_download(repo, name))
        except EntryNotFoundError:
            continue
        except Exception as e:  # network, auth, a repo that moved: say which and what to do
            raise SNCAError(
                f"--init {spec}: downloading {repo} failed ({type(e).__name__}: {e}); pass the "
                f"file: --init {spec}:PATH"
            ) from None
    raise SNCAError(f"--init {spec}: {repo} holds none of {', '.join(HF_FILES)}")


def preprocessing_of(net) -> dict:
    """A timm model's pretrained preprocessing as timm's resolve_data_config gives it (mean,
    std, image_size, in_channels, interpolation, crop_pct): what a run starting from its
    weights must feed it."""
    data = timm_module().data.resolve_data_config({}, model=net)
    return {
        "mean": [float(m) for m in data["mean"]],
        "std": [float(s) for s in data["std"]],
        "image_size": int(data["input_size"][-1]),
        "in_channels": int(data["input_size"][0]),
        "interpolation": str(data["interpolation"]),
        "crop_pct": float(data["crop_pct"]),
    }


class _TimmLoadLog(logging.Handler):
    """Collects timm's "Missing keys (...)" / "Unexpected keys (...)" messages of a load."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.misfits: list[str] = []
        self.logger = logging.getLogger("timm.models._builder")

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("Missing keys", "Unexpected keys")):
            head = msg.split(") ", 1)[0] + ")"
            self.misfits.append(head if len(head) < 400 else head[:400] + "...)")

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


class TimmWeights:
    @staticmethod
    def claims(spec: str) -> bool:
        return spec.startswith(TIMM_PREFIX)

    @staticmethod
    def load(spec: str) -> Loaded:
        timm = timm_module(spec)
        name, _, file = spec.removeprefix(TIMM_PREFIX).partition(":")
        try:
            bare = timm.create_model(name, pretrained=False, num_classes=0)
        except RuntimeError as e:  # Unknown model (...)
            raise SNCAError(f"--init {spec}: {e}") from None
        cfg = dict(bare.pretrained_cfg or {})
        path = Path(file) if file else _cached_file(spec, cfg)
        state = CheckpointFile.load(str(path), kind="timm").state
        # timm's own loading of its checkpoint (filter_fn, classifier dropped). Without the
        # classifier it loads non-strictly and only logs what did not fit: that is an error here.
        with _TimmLoadLog() as said:
            try:
                net = timm.create_model(
                    name,
                    pretrained=True,
                    num_classes=0,
                    pretrained_cfg_overlay={"state_dict": state},
                )
            except (RuntimeError, KeyError, ValueError) as e:
                raise SNCAError(f"--init {spec}: {path} does not fit timm's {name}: {e}") from None
        if said.misfits:
            raise SNCAError(
                f"--init {spec}: {path} does not fit timm's {name}: " + "; ".join(said.misfits)
            )
        pre = preprocessing_of(net)
        backbone = {f"backbone.{k}": v for k, v in net.state_dict().items()}
        return Loaded("timm", spec, backbone, path, arch=TIMM_PREFIX + name, preprocessing=pre)
