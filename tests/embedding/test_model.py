import pytest
import torch

from embedding import ArtifactError, EmbeddingNet, ModelConfig, load_model, save_model
from embedding.artifacts import MODEL_CARD, MODEL_WEIGHTS, model_fingerprint
from embedding.transforms import eval_transform


@pytest.mark.parametrize(
    "arch,channels,size",
    [
        ("conv4", 1, 28),
        ("conv4", 3, 32),
        ("resnet18", 1, 28),
        ("resnet18", 3, 32),
        ("resnet34", 2, 16),
    ],
)
def test_embedding_shapes_and_unit_norm(arch, channels, size):
    cfg = ModelConfig(
        arch=arch,
        in_channels=channels,
        image_size=size,
        mean=(0.5,) * channels,
        std=(0.25,) * channels,
        embedding_dim=64,
    )
    net = EmbeddingNet(cfg).eval()
    v = net(torch.randn(3, channels, size, size))
    assert v.shape == (3, 64)
    torch.testing.assert_close(v.norm(dim=1), torch.ones(3))


def test_resnet50_feature_dim_and_imagenet_stem():
    cfg = ModelConfig(
        arch="resnet50",
        in_channels=3,
        image_size=64,
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
        small_stem=False,
    )
    net = EmbeddingNet(cfg).eval()
    assert net.feature_dim == 2048
    assert net.backbone.conv1.kernel_size == (7, 7)
    assert net(torch.randn(2, 3, 64, 64)).shape == (2, 128)


def test_conv4_is_the_papers_small_net():
    net = EmbeddingNet(ModelConfig())
    convs = [m for m in net.backbone.modules() if isinstance(m, torch.nn.Conv2d)]
    bns = [m for m in net.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    pools = [m for m in net.backbone.modules() if isinstance(m, torch.nn.MaxPool2d)]
    assert len(convs) == len(bns) == len(pools) == 4
    assert all(c.out_channels == 64 and c.kernel_size == (3, 3) for c in convs)
    assert net.feature_dim == 64  # 28 -> 14 -> 7 -> 3 -> 1


def test_bad_config_is_refused_with_a_clear_message():
    with pytest.raises(ArtifactError, match="arch 'vgg'"):
        ModelConfig(arch="vgg")
    with pytest.raises(ArtifactError, match="one value per input channel"):
        ModelConfig(in_channels=3)
    with pytest.raises(ArtifactError, match="unknown keys: colour"):
        ModelConfig.from_dict({"colour": 1})


def test_artifact_round_trip_same_embeddings(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(class_names=[f"c{i}" for i in range(10)])
    net = EmbeddingNet(cfg)
    net.train()
    net(torch.randn(16, 1, 28, 28))  # move the BN running stats away from their init
    net.eval()
    fp = save_model(net, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.fingerprint == fp
    assert loaded.config == cfg
    x = torch.randn(5, 1, 28, 28)
    torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)
    # the backbone runs channels-last (oneDNN's native layout: 1.4-1.9x on a CPU), loaded too;
    # the file holds the same values in the default layout
    for m in (net, loaded):
        convs = [p for p in m.backbone.parameters() if p.ndim == 4]
        assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
        assert not all(p.is_contiguous() for p in convs)
    # The model card alone rebuilds the preprocessing.
    img = torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8)
    t = eval_transform(loaded.config)(img)
    assert t.shape == (1, 28, 28) and t.dtype == torch.float32


def test_fingerprint_detects_modified_weights_and_config(tmp_path):
    net = EmbeddingNet(ModelConfig())
    fp = save_model(net, tmp_path)
    state = net.state_dict()
    state2 = {k: v.clone() for k, v in state.items()}
    state2["embed.bias"][0] += 1e-3
    assert model_fingerprint(net.config, state2) != fp
    assert model_fingerprint(ModelConfig(temperature=0.1), state) != fp
    # A weights file swapped under the card is refused.
    other = EmbeddingNet(ModelConfig())
    save_model(other, tmp_path / "other")
    (tmp_path / MODEL_WEIGHTS).write_bytes((tmp_path / "other" / MODEL_WEIGHTS).read_bytes())
    with pytest.raises(ArtifactError, match="fingerprint"):
        load_model(tmp_path)


def test_corrupt_or_missing_artifacts_name_the_file(tmp_path):
    save_model(EmbeddingNet(ModelConfig()), tmp_path)
    w = tmp_path / MODEL_WEIGHTS
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ArtifactError, match="corrupt safetensors file .*model.safetensors"):
        load_model(tmp_path)
    (tmp_path / MODEL_CARD).write_text("{not json")
    with pytest.raises(ArtifactError, match="model.json"):
        load_model(tmp_path)
    with pytest.raises(ArtifactError, match="missing file"):
        load_model(tmp_path / "nowhere")


def test_no_pickle_in_artifacts(tmp_path):
    save_model(EmbeddingNet(ModelConfig()), tmp_path)
    for f in tmp_path.iterdir():
        assert b"\x80\x04" not in f.read_bytes()[:2]  # pickle protocol header
    assert {f.name for f in tmp_path.iterdir()} == {MODEL_CARD, MODEL_WEIGHTS}
