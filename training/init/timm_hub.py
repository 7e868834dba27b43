"""--init timm:NAME[:FILE] (timm:convnext_tiny, timm:resnet50.a1_in1k:/data/weights.safetensors):
a timm model's pretrained weights (pip install 'snca[timm]'). The file is FILE, or the one timm
itself would fetch, found in the Hugging Face cache (HF_HUB_CACHE, ~/.cache/huggingface/hub)
without a network call; nothing is downloaded here. It is read like any checkpoint (safetensors,
or torch.load(weights_only=True)) and handed to timm as a state_dict, so timm's own adaptation
of its checkpoints applies (key remaps, the classifier left out). The architecture becomes
`timm:NAME`, and the model's pretrained config (input size, mean, std, interpolation, crop_pct,
as timm's resolve_data_config gives them) the run's preprocessing."""

from __future__ import annotations

import logging
from pathlib import Path

from embedding.config import TIMM_PREFIX
from embedding.errors import SNCAError

from .base import Loaded
from .checkpoint import CheckpointFile

HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm's Hugging Face repos hold


def _timm():
    try:
        import timm
    except ImportError:
        raise SNCAError(
            "--init timm:...: timm is not installed (pip install 'snca[timm]')"
        ) from None
    return timm


def _cached_file(spec: str, cfg: dict) -> Path:
    """The pretrained file from the Hugging Face cache, or an error saying where to put it."""
    repo = cfg.get("hf_hub_id")
    if repo:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE

        for name in HF_FILES:
            hit = try_to_load_from_cache(repo, name)
            if isinstance(hit, str):
                return Path(hit)
        raise SNCAError(
            f"--init {spec}: its weights ({repo}, {HF_FILES[0]}) are not in the Hugging Face "
            f"cache {HF_HUB_CACHE} and nothing is downloaded here; on a machine with internet "
            f"access run `hf download {repo} {HF_FILES[0]}` and copy the cache folder "
            f"models--{repo.replace('/', '--')} there (or set HF_HUB_CACHE), or pass the file: "
            f"--init {spec}:PATH"
        )
    url = cfg.get("url") or "its published weights file"
    raise SNCAError(
        f"--init {spec}: timm fetches {url} for it; nothing is downloaded here: fetch it on a "
        f"machine with internet access and pass it as --init {spec}:PATH"
    )


def preprocessing_of(net) -> dict:
    """A timm model's pretrained preprocessing as timm's resolve_data_config gives it (mean,
    std, image_size, in_channels, interpolation, crop_pct): what a run starting from its
    weights must feed it."""
    data = _timm().data.resolve_data_config({}, model=net)
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
        timm = _timm()
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
