import gzip
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from embedding import DataError, ModelConfig
from embedding.datasets import SYSTEM_FASHION_DIR, load_raw, verify_images
from embedding.transforms import eval_transform, train_transform
from training.config import TrainConfig
from training.datasets import IndexedDataset, carve, parse_classes, select


def test_fashion_mnist_is_complete(fashion_train):
    assert len(fashion_train.source) == 60000
    assert fashion_train.source.get(0).shape == (1, 28, 28)
    assert fashion_train.source.get(0).dtype == torch.uint8
    assert np.bincount(fashion_train.targets).tolist() == [6000] * 10
    assert fashion_train.class_names[9] == "Ankle boot"


def test_class_filter_by_id_and_name(fashion_train):
    ids = parse_classes("1,Bag", fashion_train.class_names)
    assert ids == [1, 8]
    split = select(fashion_train, ids, coarse=False)
    assert split.class_names == ["Trouser", "Bag"]
    assert len(split) == 12000
    assert set(split.labels.tolist()) == {0, 1}
    orig = fashion_train.targets[split.positions]
    assert np.array_equal(np.where(orig == 1, 0, 1), split.labels)


def test_unknown_class_is_refused(fashion_train):
    with pytest.raises(DataError, match="unknown class 'Hat'"):
        parse_classes("Hat", fashion_train.class_names)
    with pytest.raises(DataError, match="out of range"):
        parse_classes("10", fashion_train.class_names)


def test_coarse_grouping_keeps_fine_labels(fashion_train):
    split = select(fashion_train, None, coarse=True)
    assert split.class_names == ["tops", "trousers_dresses", "footwear", "bags"]
    expected = {0: 0, 2: 0, 4: 0, 6: 0, 1: 1, 3: 1, 5: 2, 7: 2, 9: 2, 8: 3}
    fine = fashion_train.targets[split.positions]
    assert np.array_equal(split.labels, np.vectorize(expected.get)(fine))
    assert np.array_equal(split.fine_labels, fine)
    assert np.bincount(split.labels).tolist() == [24000, 12000, 18000, 6000]


def test_validation_split_is_stratified_disjoint_and_seeded(fashion_train):
    split = select(fashion_train, None, coarse=False)
    train, val = carve(split, 5000, None, seed=0)
    assert len(val) == 5000 and len(train) == 55000
    assert not set(train.positions) & set(val.positions)
    assert np.bincount(val.labels).tolist() == [500] * 10
    _, val2 = carve(split, 5000, None, seed=0)
    assert np.array_equal(val.positions, val2.positions)
    _, val3 = carve(split, 5000, None, seed=1)
    assert not np.array_equal(val.positions, val3.positions)
    sub, subval = carve(split, 0.1, 2000, seed=0)
    assert len(sub) + len(subval) == 2000 and len(subval) == 200


def test_the_default_validation_split_is_sized_by_the_data(fashion_train):
    """The default --val-size (5,000) on a folder of 96 photos took all but one image a class
    for validation, and training then stopped on a batch size it could not fill: on a small
    dataset the default is a sixth of it; an explicit size that empties a split names the flag."""
    split = select(fashion_train, [0, 1, 2, 3], coarse=False)
    small, _ = carve(split, 0, 96, seed=0)  # 24 images of 4 classes
    train, val = carve(small, TrainConfig.val_size, None, seed=0)
    assert (len(train), len(val)) == (80, 16)
    assert np.bincount(val.labels).tolist() == [4] * 4
    tiny, _ = carve(split, 0, 4, seed=0)  # one image a class
    with pytest.raises(DataError, match=r"--val-size 2 leaves an empty training .* of the 4"):
        carve(tiny, 2, None, seed=0)


def test_indexed_dataset_yields_image_label_index(fashion_train):
    split = select(fashion_train, [0, 1], coarse=False)
    split, _ = carve(split, 0, 100, seed=0)
    cfg = ModelConfig()
    ds = IndexedDataset(split, eval_transform(cfg))
    x, y, i = ds[7]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert y == split.labels[7] and i == 7
    xa, _, _ = IndexedDataset(split, train_transform(cfg))[7]
    assert xa.shape == (1, 28, 28)


def _write_idx_gz(path, arr, dims):
    header = bytes([0, 0, 8, dims]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    path.write_bytes(gzip.compress(header + arr.astype(np.uint8).tobytes()))


def test_snca_data_dir_comes_first_and_truncated_files_are_named(tmp_path, monkeypatch):
    imgs = np.random.default_rng(0).integers(0, 255, (20, 28, 28))
    _write_idx_gz(tmp_path / "train-images-idx3-ubyte.gz", imgs, 3)
    _write_idx_gz(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(20) % 10, 1)
    monkeypatch.setenv("SNCA_DATA_DIR", str(tmp_path))
    raw = load_raw("fashion-mnist", "train")
    assert len(raw.source) == 20  # found in $SNCA_DATA_DIR before the system copy
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:-50])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz"):
        load_raw("fashion-mnist", "train")
    bad.write_bytes(b"garbage, not gzip or idx")
    with pytest.raises(DataError, match="corrupt data file .*train-images"):
        load_raw("fashion-mnist", "train")


def test_label_count_mismatch_is_named(tmp_path, monkeypatch):
    _write_idx_gz(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((20, 28, 28)), 3)
    _write_idx_gz(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(19), 1)
    monkeypatch.setenv("SNCA_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match="20 images but .* 19 labels"):
        load_raw("fashion-mnist", "train")


def test_system_copy_is_where_apt_puts_it():
    assert (SYSTEM_FASHION_DIR / "train-images-idx3-ubyte.gz").is_file()


def _image_folder(root, corrupt=False, empty_class=False):
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            arr = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.png")
    if corrupt:
        (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    if empty_class:
        (root / "zebra").mkdir()
    return root


def test_image_folder_loads_and_resizes(tmp_path):
    raw = load_raw(
        "imagefolder", "train", _image_folder(tmp_path / "imgs"), image_size=32, in_channels=3
    )
    assert raw.class_names == ["cat", "dog"] and len(raw.source) == 12
    cfg = ModelConfig(in_channels=3, image_size=32, mean=(0.5,) * 3, std=(0.2,) * 3)
    x = eval_transform(cfg)(raw.source.get(0))
    assert x.shape == (3, 32, 32)


def test_image_folder_unreadable_image_is_named(tmp_path):
    raw = load_raw("imagefolder", "train", _image_folder(tmp_path / "imgs", corrupt=True))
    with pytest.raises(DataError, match="broken.jpg"):
        verify_images(raw.source, np.arange(len(raw.source)), progress=False)
    bad = raw.source.paths.index(str(tmp_path / "imgs" / "dog" / "broken.jpg"))
    with pytest.raises(DataError, match="unreadable image .*broken.jpg"):
        raw.source.get(bad)


def test_filter_leaving_no_data_is_refused(tmp_path):
    raw = load_raw("imagefolder", "train", _image_folder(tmp_path / "imgs", empty_class=True))
    ids = parse_classes("zebra", raw.class_names)
    with pytest.raises(DataError, match="leaves no"):
        select(raw, ids, coarse=False)


def test_missing_folders_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_raw("imagefolder", "train", tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    shutil.copy(__file__, tmp_path / "flat" / "x.py")
    with pytest.raises(DataError, match="no class sub-folders"):
        load_raw("imagefolder", "train", tmp_path / "flat")
    with pytest.raises(DataError, match="unknown dataset"):
        load_raw("mnist", "train")
    with pytest.raises(DataError, match="no coarse grouping"):
        select(load_raw("imagefolder", "train", _image_folder(tmp_path / "i")), None, coarse=True)
