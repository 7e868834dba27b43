"""The inference engines (service/model/engines): every architecture the project serves exports
and answers as the torch module does, a stale export is refused and rebuilt, a failing engine
leaves torch serving with a log line saying why, and the service answers the same either way."""

import json
import logging

import pytest
import torch

from embedding.config import ModelConfig
from embedding.model import EmbeddingNet
from service.config import Settings
from service.model import engines
from service.model.accel import differs
from service.model.embedder import Embedder
from service.model.engines import choice
from service.model.runtime import ModelRuntime

from ..helpers import img, make_client, of_class
from .nets import net_with_statistics


def _installed() -> list[str]:
    out = []
    for name in engines.ENGINES:
        try:
            engines.engine_class(name)
            out.append(name)
        except ImportError:
            pass
    return out


INSTALLED = _installed()


def _model(arch: str, size: int, channels: int, seed: int = 0) -> EmbeddingNet:
    cfg = ModelConfig(
        arch=arch, image_size=size, in_channels=channels, mean=(0.5,) * channels,
        std=(0.25,) * channels,
    )  # fmt: skip
    return net_with_statistics(cfg, seed)


def test_the_engines_the_service_ships_with_are_installed():
    """pyproject's serve extra installs both: auto has a choice to make."""
    assert list(engines.ENGINES) == INSTALLED


@pytest.mark.parametrize(
    "arch,size,channels",
    [("conv4", 28, 1), ("resnet18", 32, 3), ("timm:tf_efficientnet_lite0", 64, 3)],
)
def test_every_architecture_exports_and_each_engine_gives_the_torch_rows(
    arch, size, channels, tmp_path
):
    m = _model(arch, size, channels)
    x = torch.randint(0, 256, (5, channels, size, size), dtype=torch.uint8)
    for world in (True, False):
        e = Embedder(m, torch.device("cpu"), world=world)
        with torch.inference_mode():
            want = e.u8(x).float()  # the eager torch module: the reference
        for name in INSTALLED:
            chosen = e.use_engine([tmp_path], name)
            assert chosen.name == name, chosen.note
            got = e.forward(x)
            assert got.shape == want.shape
            assert differs(want, got) <= choice.ENGINE_ATOL
            assert differs(want[:1], e.forward(x[:1])) <= choice.ENGINE_ATOL  # any batch size


def test_a_stale_or_modified_export_is_refused_and_rebuilt(tmp_path):
    a, b = _model("conv4", 28, 1, seed=0), _model("conv4", 28, 1, seed=1)
    x = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    ea = Embedder(a, torch.device("cpu"), world=True)
    first = ea.use_engine([tmp_path], "onnxruntime")
    assert "exported" in first.note and "stale" not in first.note
    assert "cached" in ea.use_engine([tmp_path], "onnxruntime").note
    card = json.loads((tmp_path / "embedding-world.json").read_text())
    # another model (a retrained run in the same dir): the export says whose it is, refused
    eb = Embedder(b, torch.device("cpu"), world=True)
    second = eb.use_engine([tmp_path], "onnxruntime")
    assert "stale" in second.note and "model_fingerprint" in second.note, second.note
    rebuilt = json.loads((tmp_path / "embedding-world.json").read_text())
    assert rebuilt["model_fingerprint"] != card["model_fingerprint"]
    with torch.inference_mode():
        assert differs(eb.u8(x).float(), eb.forward(x)) <= choice.ENGINE_ATOL
    # bytes changed after it was written: refused by its SHA-256, exported again
    onnx = tmp_path / "embedding-world.onnx"
    onnx.write_bytes(onnx.read_bytes() + b"\0")
    third = eb.use_engine([tmp_path], "onnxruntime")
    assert "modified" in third.note, third.note
    with torch.inference_mode():
        assert differs(eb.u8(x).float(), eb.forward(x)) <= choice.ENGINE_ATOL


def test_an_engine_that_disagrees_or_is_missing_leaves_torch_serving_and_says_why(
    tmp_path, monkeypatch, caplog
):
    m = _model("conv4", 28, 1)
    settings = Settings(
        model=tmp_path / "run", data_dir=tmp_path / "data", warmup_seconds=0, fused_batches=0
    )
    monkeypatch.setattr(choice, "ENGINE_ATOL", -1.0)  # every engine "differs"
    with caplog.at_level(logging.WARNING, logger="snca.service"):
        rt = ModelRuntime.load(settings, m, "embedding", inline=True)
    assert rt.info.engine == "torch" and rt.embedder.engine is None
    said = [r.getMessage() for r in caplog.records if "engine torch" in r.getMessage()]
    assert len(said) == 1 and "differ" in said[0], said
    x = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    with torch.inference_mode():
        assert differs(rt.embedder.u8(x).float(), rt.embedder.forward(x)) <= 1e-4
    # an engine whose package is missing: named in the note, torch serves
    monkeypatch.setattr(engines, "ENGINES", {"nope": "service.model.engines.absent:Nope"})
    chosen = choice.choose("auto", rt.embedder.u8, x, {}, [tmp_path])
    assert chosen.engine is None and "nope: not installed" in chosen.note


def test_the_service_answers_the_same_on_each_engine(base_run, fmnist_test, tmp_path):
    """A real gallery (the trained run's 6,000 items): the same labels for 100 test images,
    probabilities and open-set scores within 1e-3, and /readyz names the engine."""
    images = [i for c in range(10) for i in of_class(fmnist_test, c, 10)]
    answers = {}
    for engine in ("torch", "auto"):
        with make_client(base_run, tmp_path / engine, engine=engine) as c:
            ready = c.get("/readyz").json()
            if engine == "torch":
                assert ready["engine"] == "torch"
            else:  # one of the installed engines (which one is this CPU's to say)
                assert ready["engine"] in INSTALLED, ready
            assert ready["engine_note"]
            answers[engine] = []
            for part in (images[:50], images[50:]):  # (at most 64 images a request)
                files = [("images", img(fmnist_test, int(i))["image"]) for i in part]
                r = c.post("/classify/batch", files=files)
                assert r.status_code == 200, r.text
                answers[engine] += r.json()["results"]
    for a, b in zip(answers["torch"], answers["auto"], strict=True):
        assert (a["label"], a["nearest_label"], a["unknown"]) == (
            b["label"], b["nearest_label"], b["unknown"]
        )  # fmt: skip
        for key in ("nearest_probability", "best_similarity", "unknown_score"):
            assert abs(a[key] - b[key]) <= 1e-3, (key, a[key], b[key])
        # the world score is a Mahalanobis distance (hundreds): 1e-3 of its size
        assert abs(a["world_score"] - b["world_score"]) <= 1e-3 * max(1.0, abs(a["world_score"]))
