"""`snca-train --init SOURCE` (training/init/): each kind of source loads to the same outputs as
the model it was written from; bad files, missing files offline and another architecture are
refused with a message that says why; the model card records where the weights came from.
External formats are written here from their published structure (nothing can be downloaded)."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from torch import nn

from embedding import EmbeddingNet, ModelConfig, save_model
from embedding.errors import SNCAError
from tests.helpers import cli_args, run_cli
from training.init import initialise

X = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def resnet18_config(in_channels: int = 3, **kw) -> ModelConfig:
    """A ResNet-18 with torchvision's own stem (7x7 stride 2 + max-pool), as ImageNet weights
    expect."""
    return ModelConfig(
        arch="resnet18",
        in_channels=in_channels,
        image_size=64,
        mean=[0.5] * in_channels,
        std=[0.25] * in_channels,
        class_names=["a", "b"],
        small_stem=False,
        **kw,
    )


def torchvision_resnet18(fc_out: int | None = None) -> nn.Module:
    """A torchvision ResNet-18 with random (not default-initialised) weights, in eval mode;
    `fc_out`: its fc re-sized (the paper's 128-d embedding) instead of ImageNet's 1,000."""
    torch.manual_seed(1)
    net = torchvision.models.resnet18(weights=None)
    if fc_out is not None:
        net.fc = nn.Linear(net.fc.in_features, fc_out)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    # in the layout EmbeddingNet keeps its backbone (channels-last): the same kernels on both
    # sides, so the tolerances below measure the weights' mapping (a wrong one differs by O(1)),
    # not the ~2e-5 between NCHW and NHWC convolutions
    return net.eval().to(memory_format=torch.channels_last)


def pooled(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torchvision ResNet features before its fc, (B, 512)."""
    fc, net.fc = net.fc, nn.Identity()
    try:
        with torch.no_grad():
            return net(x)
    finally:
        net.fc = fc


def test_a_torchvision_state_dict_gives_the_same_features(tmp_path):
    tv = torchvision_resnet18()
    torch.save(tv.state_dict(), tmp_path / "resnet18.pth")
    model = EmbeddingNet(resnet18_config())
    record = initialise(model, str(tmp_path / "resnet18.pth"))
    with torch.no_grad():
        got = model.eval().features(X)
    assert (got - pooled(tv, X)).abs().max().item() < 1e-5
    # ImageNet's 1,000-way classifier is not an embedding layer: it starts new, and says so
    assert record["embedding_layer"] == "new" and "classifier" in record["notes"][0]
    assert record["kind"] == "checkpoint" and record["sha256"].startswith("sha256:")


def test_the_papers_checkpoint_layout_loads_backbone_and_embedding(tmp_path):
    """microsoft/snca.pytorch's .pth.tar: a DataParallel state_dict (module. prefixes) whose fc
    is the 128-d embedding, beside its epoch and memory bank."""
    tv = torchvision_resnet18(fc_out=128)
    ckpt = {
        "epoch": 130,
        "arch": "resnet18",
        "state_dict": {"module." + k: v for k, v in tv.state_dict().items()},
        "lemniscate": {"memory": torch.randn(10, 128)},
        "best_prec1": 70.59,
    }
    torch.save(ckpt, tmp_path / "snca_resnet18.pth.tar")
    model = EmbeddingNet(resnet18_config())
    record = initialise(model, str(tmp_path / "snca_resnet18.pth.tar"))
    with torch.no_grad():
        want = nn.functional.normalize(tv(X), dim=1)
        got = model.eval()(X)
    assert (got - want).abs().max().item() < 1e-5
    assert record["embedding_layer"] == "loaded"
    assert "left out" in record["notes"][0] and "lemniscate" in record["notes"][0]


def test_a_run_dir_of_this_project_transfers_backbone_and_embedding(tmp_path):
    torch.manual_seed(3)
    src = EmbeddingNet(resnet18_config(embedding_dim=32)).eval()
    save_model(src, tmp_path / "run")
    model = EmbeddingNet(resnet18_config(embedding_dim=32))
    record = initialise(model, str(tmp_path / "run"))
    with torch.no_grad():
        assert (model.eval()(X) - src(X)).abs().max().item() == 0
    assert record["kind"] == "run" and record["embedding_layer"] == "loaded"
    # another embedding size: the backbone transfers, the embedding layer starts new
    other = EmbeddingNet(resnet18_config(embedding_dim=64))
    assert initialise(other, f"run:{tmp_path / 'run'}")["embedding_layer"] == "new"


def test_torchvision_weights_by_name_come_from_the_hub_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("SNCA_OFFLINE", "1")  # (the download: tests/training/test_download.py)
    model = EmbeddingNet(resnet18_config())
    with pytest.raises(SNCAError) as e:
        initialise(model, "torchvision:resnet18")
    file = tmp_path / "torch" / "hub" / "checkpoints"
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    assert str(file) in str(e.value) and url in str(e.value)  # which file, where to put it
    file.mkdir(parents=True)
    tv = torchvision_resnet18()
    torch.save(tv.state_dict(), file / url.rsplit("/", 1)[1])
    record = initialise(model, "torchvision:resnet18")
    with torch.no_grad():
        assert (model.eval().features(X) - pooled(tv, X)).abs().max().item() < 1e-5
    assert record["kind"] == "torchvision" and record["source"] == "torchvision:resnet18"
    # the weights name their architecture: a run with --init torchvision:resnet18 needs no --arch
    from training.config import TrainConfig
    from training.init import resolve

    assert resolve("torchvision:resnet18").train_config(TrainConfig()).arch == "resnet18"
    with pytest.raises(SNCAError, match="no model"):
        initialise(model, "torchvision:nonet")
    with pytest.raises(SNCAError, match="has no weights"):
        initialise(model, "torchvision:resnet18:NOPE")


class Payload:  # pickled by reference: weights_only loading must refuse it
    pass


def test_bad_files_and_other_architectures_are_refused_clearly(tmp_path):
    model = EmbeddingNet(resnet18_config())
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint at all")
    with pytest.raises(SNCAError, match="not a readable checkpoint"):
        initialise(model, str(tmp_path / "junk.pth"))
    with pytest.raises(SNCAError, match="no such file"):
        initialise(model, str(tmp_path / "missing.pth"))
    torch.save({"state_dict": torchvision_resnet18().state_dict(), "obj": Payload()},
               tmp_path / "code.pth")  # fmt: skip
    with pytest.raises(SNCAError, match="refused to unpickle"):
        initialise(model, str(tmp_path / "code.pth"))
    # a conv4 run dir into a ResNet: the keys say why
    conv4 = EmbeddingNet(ModelConfig(arch="conv4", class_names=["a", "b"]))
    save_model(conv4, tmp_path / "conv4")
    with pytest.raises(SNCAError) as e:
        initialise(model, str(tmp_path / "conv4"))
    assert "missing keys: " in str(e.value) and "unexpected keys: features" in str(e.value)
    # a ResNet-18 file into a grey-image ResNet-18: conv1's shape differs
    torch.save(torchvision_resnet18().state_dict(), tmp_path / "rgb.pth")
    grey = EmbeddingNet(resnet18_config(in_channels=1))
    with pytest.raises(SNCAError, match=r"other shapes: conv1.weight"):
        initialise(grey, str(tmp_path / "rgb.pth"))


# a tiny run: both tests below start a second run from it (trained once: tests/helpers.Models)
TINY = dict(subset=300, val_size=60, epochs=1, batch_size=64)


def test_snca_train_init_records_its_source_in_the_model_card(tmp_path, models):
    """The CLI end to end on a tiny run: a second run starts from the first's weights; its
    model card says from which file, with its sha256."""
    tiny = cli_args(TINY)
    a, _ = models.run(**TINY)
    p = run_cli("training", *tiny, "--no-progress", "--out", tmp_path / "b", "--init", a)
    assert p.returncode == 0, p.stderr
    assert "initialised from" in p.stdout + p.stderr
    card = json.loads((tmp_path / "b" / "model.json").read_text())
    init = card["training"]["init"]
    assert init["kind"] == "run" and init["embedding_layer"] == "loaded"
    assert init["file"] == str(a / "model.safetensors") and init["sha256"].startswith("sha256:")
    p = run_cli("training", *tiny, "--no-progress", "--out", tmp_path / "c",
                "--init", tmp_path / "nothing.pth")  # fmt: skip
    assert p.returncode == 2 and "no such file" in p.stderr, p.stderr


def test_fine_tuning_freezes_stages_scales_the_backbone_lr_and_holds_batchnorm(tmp_path, models):
    """--freeze-stages 2 --backbone-lr 0.1 --bn-frozen after --init: the first two conv4 blocks
    and every backbone BatchNorm statistic end as they started, the later blocks and the
    embedding layer move; without the flags every block moves."""
    from embedding.artifacts import read_safetensors

    tiny = cli_args(TINY)
    run, _ = models.run(**TINY)
    flags = ["--freeze-stages", "2", "--backbone-lr", "0.1", "--bn-frozen", "--lr", "0.5"]
    p = run_cli("training", *tiny, *flags, "--no-progress", "--out", tmp_path / "b",
                "--init", run)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "froze 2 backbone stage(s)" in p.stdout + p.stderr
    p = run_cli("training", *tiny, "--lr", "0.5", "--no-progress", "--out", tmp_path / "c",
                "--init", run)  # fmt: skip
    assert p.returncode == 0, p.stderr
    a, b, c = (
        read_safetensors(r / "model.safetensors")[0] for r in (run, tmp_path / "b", tmp_path / "c")
    )

    def same(x, k):
        return torch.equal(a[k], x[k])

    # conv4 block i is backbone.features.{4i}: conv, {4i+1}: BatchNorm
    for block in (0, 1):
        assert same(b, f"backbone.features.{4 * block}.weight")  # frozen
        assert same(b, f"backbone.features.{4 * block + 1}.weight")
    for block in (2, 3):
        assert not same(b, f"backbone.features.{4 * block}.weight")  # trained
    assert not same(b, "embed.weight")
    stats = [k for k in a if k.endswith(("running_mean", "running_var"))]
    assert stats and all(same(b, k) for k in stats)  # --bn-frozen
    # the same run without the flags moves every block and the statistics
    assert not same(c, "backbone.features.0.weight") and not all(same(c, k) for k in stats)


def test_param_groups_put_the_trainable_backbone_at_its_factor():
    from training.finetune import freeze, param_groups, stages

    model = EmbeddingNet(resnet18_config())
    assert len(stages(model)) == 5  # stem, layer1..layer4
    n = freeze(model, 2)
    assert n == sum(p.numel() for m in stages(model)[:2] for s in m for p in s.parameters())
    groups = param_groups(model, model.backbone, 0.1)
    back, rest = groups
    assert back["lr_factor"] == 0.1 and rest["lr_factor"] == 1.0
    assert {id(p) for p in rest["params"]} == {id(p) for p in model.embed.parameters()}
    frozen = {id(p) for s in stages(model)[:2] for m in s for p in m.parameters()}
    assert not frozen & {id(p) for p in back["params"]}  # frozen ones are left out
    assert len(back["params"]) + len(frozen) == len(list(model.backbone.parameters()))


# ---------------------------------------------------------------------------- timm
def timm_resnet18():
    """timm's resnet18 with random weights and BatchNorm statistics, as its Hugging Face file
    holds them (the classifier `fc` included)."""
    import timm  # the [timm] extra, in `dev` too: `make test` installs it (no skip)

    torch.manual_seed(2)
    net = timm.create_model("resnet18", pretrained=False)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    # in the layout EmbeddingNet keeps its backbone (channels-last): the same kernels on both
    # sides, so the tolerances below measure the weights' mapping (a wrong one differs by O(1)),
    # not the ~2e-5 between NCHW and NHWC convolutions
    return net.eval().to(memory_format=torch.channels_last)


def test_timm_weights_by_name_load_through_timm_with_their_preprocessing(tmp_path, monkeypatch):
    """timm:NAME:FILE and timm:NAME from the Hugging Face cache (offline; a missing file says
    which repo and where): the same pooled features as the timm model written, the architecture
    becomes timm:NAME and the pretrained config the preprocessing."""
    from safetensors.torch import save_file

    from training.init import resolve
    from training.init.base import apply

    net = timm_resnet18()
    file = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, file)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = net.forward_head(net.forward_features(x), pre_logits=True)  # (2, 512)

    loaded = resolve(f"timm:resnet18:{file}")
    assert loaded.arch == "timm:resnet18" and loaded.kind == "timm"
    pre = loaded.preprocessing
    cfg = net.pretrained_cfg
    assert pre["mean"] == pytest.approx(cfg["mean"]) and pre["image_size"] == 224
    assert (pre["interpolation"], pre["crop_pct"]) == (cfg["interpolation"], cfg["crop_pct"])
    mc = loaded.model_config(resnet18_config())
    assert (mc.interpolation, mc.crop_pct) == (cfg["interpolation"], cfg["crop_pct"])
    model = EmbeddingNet(ModelConfig(**{**mc.to_dict(), "arch": "timm:resnet18"}))
    record = apply(model, loaded)
    with torch.no_grad():
        assert (model.eval().features(x) - want).abs().max().item() < 1e-5
    assert record["sha256"].startswith("sha256:") and record["kind"] == "timm"

    # from the Hugging Face cache, offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    with pytest.raises(SNCAError) as e:
        resolve("timm:resnet18")
    repo = cfg["hf_hub_id"]
    assert repo in str(e.value) and str(cache) in str(e.value) and ":PATH" in str(e.value)
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(file.read_bytes())
    (cache / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    model2 = EmbeddingNet(ModelConfig(**{**mc.to_dict(), "arch": "timm:resnet18"}))
    apply(model2, resolve("timm:resnet18"))
    with torch.no_grad():
        assert (model2.eval().features(x) - want).abs().max().item() < 1e-5

    # refused clearly: a model timm does not have, a file of another model
    with pytest.raises(SNCAError, match="Unknown model"):
        resolve("timm:no_such_net")
    with pytest.raises(SNCAError, match="does not fit timm's resnet34"):
        resolve(f"timm:resnet34:{file}")


def test_snca_train_init_timm_writes_a_model_the_service_rebuilds(tmp_path):
    """The CLI with --init timm:resnet18:FILE on a tiny colour ImageFolder: the card holds the
    timm architecture, its crop and filter; load_model rebuilds it from the card."""
    from PIL import Image
    from safetensors.torch import save_file

    from embedding.artifacts import load_model

    net = timm_resnet18()
    file = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, file)
    r = torch.Generator().manual_seed(0)
    for c, colour in (("red", 0), ("blue", 2)):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(8):
            a = torch.randint(0, 90, (40, 60, 3), generator=r, dtype=torch.uint8)
            a[..., colour] += 150
            Image.fromarray(a.numpy()).save(tmp_path / "imgs" / c / f"{i}.png")
    p = run_cli(
        "training", "--dataset", "imagefolder", "--data-dir", tmp_path / "imgs",
        "--image-size", "64", "--init", f"timm:resnet18:{file}", "--epochs", "1",
        "--batch-size", "8", "--val-size", "0", "--no-progress", "--out", tmp_path / "run",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    card = json.loads((tmp_path / "run" / "model.json").read_text())
    cfg = card["config"]
    assert cfg["arch"] == "timm:resnet18" and cfg["image_size"] == 64  # the user's size wins
    assert (cfg["interpolation"], cfg["crop_pct"]) == ("bicubic", 0.95)
    assert card["training"]["init"]["kind"] == "timm"
    model = load_model(tmp_path / "run")
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 128)
