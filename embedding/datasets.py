"""Raw image datasets as found on disk: Fashion-MNIST (IDX files), CIFAR-10/100 (torchvision),
ImageFolder. Shared by training (which selects and splits them) and the index builder (which
re-embeds the training images of a run by their dataset index). torch is imported by the
loaders that make tensors: the dataset names alone cost no torch (snca-train refuses bad
arguments before it loads torch).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import DataError

if TYPE_CHECKING:
    import torch

DATASETS = ("fashion-mnist", "cifar10", "cifar100", "imagefolder", "gallery")
# datasets of image files in label folders: "gallery" is a served gallery's stored images,
# exported by snca-train beside the run (training/gallery_source.py)
FOLDER_DATASETS = ("imagefolder", "gallery")

FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
# Sub-category protocol (DESIGN.md): tops, trousers/dresses, footwear, bags.
FASHION_COARSE = [0, 1, 0, 1, 0, 2, 0, 2, 3, 2]
FASHION_COARSE_NAMES = ["tops", "trousers_dresses", "footwear", "bags"]

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
# CIFAR-100 fine label id -> superclass id (the dataset's own `coarse_labels`).
CIFAR100_COARSE = [
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11,
    6, 11, 5, 10, 7, 6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5,
    5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13,
    16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
]  # fmt: skip
CIFAR100_COARSE_NAMES = [
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables",
    "household_electrical_devices", "household_furniture", "insects", "large_carnivores",
    "large_man-made_outdoor_things", "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores", "medium_mammals", "non-insect_invertebrates", "people",
    "reptiles", "small_mammals", "trees", "vehicles_1", "vehicles_2",
]  # fmt: skip

STATS = {  # per-channel mean / std of the training images
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}
STATS["gallery"] = STATS["imagefolder"]
SYSTEM_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def default_data_dir() -> Path:
    env = os.environ.get("SNCA_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "snca" / "data"


# ---------------------------------------------------------------------------- raw sources
class TensorSource:
    """Images held in memory as uint8 (N, C, H, W)."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def __len__(self) -> int:
        return self.images.shape[0]

    def get(self, i: int) -> torch.Tensor:
        return self.images[i]


class FileSource:
    """Images on disk, decoded on access, EXIF orientation applied (a phone's portrait photo is
    stored landscape with an Orientation tag: trained, indexed and thumbnailed upright, as the
    service reads an upload); an unreadable file raises DataError naming it."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def get(self, i: int) -> Image.Image:
        path = self.paths[i]
        try:
            with Image.open(path) as im:
                im.load()
                return ImageOps.exif_transpose(im)  # a copy, upright
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            raise DataError(f"unreadable image {path}: {e}") from None


@dataclass
class RawDataset:
    """One split of a dataset as found on disk, labels as the dataset defines them."""

    name: str
    source: TensorSource | FileSource
    targets: np.ndarray  # (N,) int64 class ids
    class_names: list[str]
    in_channels: int
    image_size: int
    coarse_of: list[int] | None = None  # class id -> coarse id
    coarse_names: list[str] | None = None
    # The folder to pass as `data_dir` to find these very files again (absolute); the run
    # dir's provenance record keeps it so later stages read what training read.
    root: Path | None = None


# ---------------------------------------------------------------------------- Fashion-MNIST
def _read_idx(path: Path, expect_dims: int) -> np.ndarray:
    """Parse an IDX file (optionally gzipped); raise DataError naming the file if corrupt."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"corrupt or unreadable data file {path}: {e}") from None
    if len(raw) < 4 + 4 * expect_dims or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"corrupt data file {path}: not an unsigned-byte IDX file")
    if raw[3] != expect_dims:
        raise DataError(f"corrupt data file {path}: {raw[3]} dimensions, expected {expect_dims}")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(expect_dims)]
    body = raw[4 + 4 * expect_dims :]
    if len(body) != int(np.prod(dims)):
        raise DataError(
            f"corrupt data file {path}: header says {dims} ({int(np.prod(dims))} bytes) "
            f"but the file holds {len(body)} bytes (truncated?)"
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _fashion_candidates(data_dir: Path | None) -> list[Path]:
    dirs = []
    if os.environ.get("SNCA_DATA_DIR"):
        root = Path(os.environ["SNCA_DATA_DIR"])
        dirs += [root, root / "fashion-mnist", root / "FashionMNIST" / "raw"]
    if data_dir is not None:
        dirs = [data_dir, data_dir / "fashion-mnist", data_dir / "FashionMNIST" / "raw", *dirs]
    dirs.append(SYSTEM_FASHION_DIR)
    cache = default_data_dir()
    dirs.append(cache / "FashionMNIST" / "raw")
    return dirs


def _find_file(dirs: list[Path], stem: str) -> Path | None:
    for d in dirs:
        for name in (stem + ".gz", stem):
            if (d / name).is_file():
                return d / name
    return None


def load_fashion_mnist(
    split: str, data_dir: Path | None = None, download: bool = True
) -> RawDataset:
    import torch

    prefix = "train" if split == "train" else "t10k"
    dirs = _fashion_candidates(data_dir)
    img_path = _find_file(dirs, f"{prefix}-images-idx3-ubyte")
    lbl_path = _find_file(dirs, f"{prefix}-labels-idx1-ubyte")
    if img_path is None or lbl_path is None:
        if not download:
            raise DataError(
                "Fashion-MNIST not found in "
                + ", ".join(str(d) for d in dirs)
                + " (install the Debian package dataset-fashion-mnist or set SNCA_DATA_DIR)"
            )
        root = data_dir or default_data_dir()
        try:
            import torchvision

            torchvision.datasets.FashionMNIST(str(root), train=split == "train", download=True)
        except Exception as e:  # network errors come in many types
            raise DataError(
                f"Fashion-MNIST not found locally and the download into {root} failed: {e}. "
                "Install dataset-fashion-mnist (apt) or set SNCA_DATA_DIR to a folder with the "
                "IDX files."
            ) from None
        return load_fashion_mnist(split, root, download=False)
    images = _read_idx(img_path, 3)
    labels = _read_idx(lbl_path, 1).astype(np.int64)
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{img_path} has {images.shape[0]} images but {lbl_path} has {labels.shape[0]} labels"
        )
    if labels.size and labels.max() > 9:
        raise DataError(f"corrupt data file {lbl_path}: label {labels.max()} out of range 0-9")
    return RawDataset(
        name="fashion-mnist",
        source=TensorSource(torch.from_numpy(images.copy()).unsqueeze(1)),  # (N, 1, 28, 28)
        targets=labels,
        class_names=list(FASHION_CLASSES),
        in_channels=1,
        image_size=28,
        coarse_of=list(FASHION_COARSE),
        coarse_names=list(FASHION_COARSE_NAMES),
        root=img_path.parent.resolve(),
    )


# ---------------------------------------------------------------------------- CIFAR
def load_cifar(
    name: str, split: str, data_dir: Path | None = None, download: bool = True
) -> RawDataset:
    # torchvision verifies the md5 of every batch file before unpickling it (the official
    # CIFAR "python version" is pickled): a tampered file is rejected, not loaded.
    import torch
    import torchvision

    root = data_dir or default_data_dir()
    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    try:
        ds = cls(str(root), train=split == "train", download=download)
    except RuntimeError as e:
        raise DataError(f"{name} not found or corrupted under {root}: {e}") from None
    except Exception as e:
        raise DataError(f"{name}: download into {root} failed: {e}") from None
    images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
    coarse = (
        (list(CIFAR100_COARSE), list(CIFAR100_COARSE_NAMES)) if name == "cifar100" else (None, None)
    )
    return RawDataset(
        name=name,
        source=TensorSource(images),  # (N, 3, 32, 32)
        targets=np.asarray(ds.targets, dtype=np.int64),
        class_names=list(ds.classes),
        in_channels=3,
        image_size=32,
        coarse_of=coarse[0],
        coarse_names=coarse[1],
        root=Path(root).resolve(),
    )


# ---------------------------------------------------------------------------- ImageFolder
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".bmp",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
    ".gif",
)


def load_image_folder(root: Path, split: str, image_size: int, in_channels: int) -> RawDataset:
    """root/<class>/<image> (or root/train/<class>/..., root/test/<class>/...)."""
    given = root = Path(root)
    if (root / split).is_dir():
        root = root / split
    elif split != "train":
        raise DataError(f"no {split}/ folder under {root}")
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{root} has no class sub-folders (expected root/<class>/<image files>)")
    paths, targets = [], []
    for ci, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(root / c, followlinks=True)):
            for fn in sorted(files):
                if fn.lower().endswith(IMAGE_EXTENSIONS):
                    paths.append(os.path.join(dirpath, fn))
                    targets.append(ci)
    if not paths:
        raise DataError(f"{root} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    return RawDataset(
        name="imagefolder",
        source=FileSource(paths),
        targets=np.asarray(targets, dtype=np.int64),
        class_names=classes,
        in_channels=in_channels,
        image_size=image_size,
        root=given.resolve(),
    )


def load_gallery_export(images: Path, split: str, image_size: int, in_channels: int) -> RawDataset:
    """A gallery exported by `snca-gallery export`: IMAGES/<folder>/<image>, the folder of each
    label in IMAGES/../labels.json (a label that is no safe folder name has a number): the
    class names are the gallery's labels."""
    if split != "train":
        raise DataError(f"an exported gallery has no {split} split")
    raw = load_image_folder(images, split, image_size, in_channels)
    try:
        folders = json.loads((Path(images).parent / "labels.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{images}: not an exported gallery (labels.json: {e})") from None
    label_of = {folder: label for label, folder in folders.items()}
    raw.class_names = [label_of.get(c, c) for c in raw.class_names]
    raw.name = "gallery"
    return raw


def verify_images(source: FileSource, positions: np.ndarray, progress: bool = True) -> None:
    """Open every image once so an unreadable file fails before training starts."""
    from .progress import track

    for p in track(positions, len(positions), "checking images", "img", enabled=progress):
        try:
            with Image.open(source.paths[p]) as im:
                im.verify()
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            raise DataError(f"unreadable image {source.paths[p]}: {e}") from None


def load_raw(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    image_size: int | None = None,
    in_channels: int | None = None,
    download: bool = True,
) -> RawDataset:
    data_dir = Path(data_dir) if data_dir else None
    if name == "fashion-mnist":
        return load_fashion_mnist(split, data_dir, download)
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, split, data_dir, download)
    if name == "imagefolder":
        if data_dir is None:
            raise DataError(
                "--dataset imagefolder needs --data-dir pointing at root/<class>/<images>"
            )
        return load_image_folder(data_dir, split, image_size or 64, in_channels or 3)
    if name == "gallery":
        if data_dir is None:
            raise DataError("--dataset gallery: no exported gallery (snca-train makes it)")
        return load_gallery_export(data_dir, split, image_size or 224, in_channels or 3)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
