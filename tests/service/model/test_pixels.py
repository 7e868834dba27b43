"""The serving path's input: Embedder.pixels (numpy, read without GIL-releasing conversions for
greyscale images at the model's size) must give exactly what preprocess gives, and
stack_pixels / run_batch must batch them without mixing images up."""

import numpy as np
import pytest
import torch
from PIL import Image

from embedding import load_model
from service.config import Settings
from service.gallery.query import VoteQuery
from service.model.embedder import Embedder
from service.model.runtime import Job
from service.startup import ServiceHost


@pytest.fixture(scope="module")
def embedder(base_run):
    return Embedder(load_model(base_run), torch.device("cpu"))


def _images(n: int, seed: int = 0) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, (28, 28), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize(
    "make",
    [
        lambda a: Image.fromarray(a),  # L 28x28: the fast path
        lambda a: Image.fromarray(a).convert("RGB"),  # colour: converted
        lambda a: Image.fromarray(a).resize((40, 33)),  # another size: resized
        lambda a: Image.fromarray(a).convert("P"),  # palette
    ],
)
def test_pixels_equal_preprocess(embedder, make):
    img = make(_images(1)[0])
    px = embedder.pixels(img)
    assert px.dtype == np.uint8 and px.shape == (1, 28, 28) and px.flags.c_contiguous
    assert np.array_equal(px, embedder.preprocess(img).numpy())


def test_stack_pixels_keeps_each_image_in_its_row(embedder):
    for b in (1, 2, 3, 2, 1):  # buffers are reused per size: each call must be whole
        arrays = [a[None] for a in _images(b, seed=b * 7 + 1)]
        t = embedder.stack_pixels(arrays)
        assert t.shape == (b, 1, 28, 28) and t.dtype == torch.uint8
        assert np.array_equal(t.numpy(), np.stack(arrays))


def test_run_batch_matches_one_by_one(base_run, tmp_path):
    """A batch of classify and embed jobs: each result as if run alone, and embed rows that
    later batches do not overwrite (they must not be views of the reused input/output)."""
    host = ServiceHost(Settings(model=base_run, data_dir=tmp_path))
    st = host.finish().runtime
    try:
        px = [st.embedder.pixels(Image.fromarray(a)) for a in _images(3, seed=5)]
        params = VoteQuery("kde", 30)
        jobs = [Job("classify", px[0], params), Job("embed", px[1]), Job("classify", px[2], params)]
        out = st.batcher.call(lambda: st.run_batch(jobs))
        row = out[1].copy()
        alone = [st.batcher.call(lambda j=j: st.run_batch([j])[0]) for j in jobs]
        st.batcher.call(lambda: st.run_batch([Job("embed", px[0]), Job("embed", px[2])]))
        np.testing.assert_allclose(out[1], row)  # not overwritten by the later batch
        np.testing.assert_allclose(out[1], alone[1], atol=1e-5)
        for i in (0, 2):
            assert out[i].label == alone[i].label
            assert out[i].confidence == pytest.approx(alone[i].confidence, abs=1e-5)
    finally:
        host.stop()
