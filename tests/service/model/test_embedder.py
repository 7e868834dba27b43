"""The start-up warm-up runs every batch size the micro-batcher can form, so serving never meets
a new input shape: no oneDNN kernel build (C heap) and no slow first batch later under load."""

import ctypes

import pytest
import torch

from embedding import load_model
from service.model.embedder import Embedder


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _c_heap_in_use_mb() -> float:
    libc = ctypes.CDLL("libc.so.6")  # glibc (Debian): mallinfo2 since 2.33
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return (mi.uordblks + mi.hblkhd) / 2**20


def _embedder(base_run) -> Embedder:
    e = Embedder(load_model(base_run), torch.device("cpu"))
    e.optimize()
    return e


def test_warmup_runs_every_batch_size(base_run):
    e = _embedder(base_run)
    seen, run = [], e.runner

    def spy(x):
        seen.append(x.shape[0])
        return run(x)

    e.runner = spy
    took, warmed = e.warmup_every_size(12)
    assert seen == list(range(1, 13)) and took > 0 and warmed == 12
    seen.clear()  # a budget spent: the smallest sizes first, then it stops
    took, warmed = e.warmup_every_size(64, budget_s=0.0)
    assert seen == [1] and warmed == 1


def test_after_warmup_no_batch_size_grows_the_heap(base_run):
    """Measured for conv4: ~0.3 MB of C heap per new batch size before, none after."""
    e = _embedder(base_run)
    torch.set_num_threads(1)
    e.fuse_small_batches(8)  # as the service does: fused copies for the small sizes
    e.warmup_every_size(64)
    c, s = e.model.config.in_channels, e.model.config.image_size
    x = torch.zeros(64, c, s, s, dtype=torch.uint8)
    before = _c_heap_in_use_mb()
    for b in range(64, 0, -1):  # every size again, in another order
        e.embed(x[:b])
    assert _c_heap_in_use_mb() - before < 2.0


def test_fused_small_batch_copies_give_the_eager_vectors(base_run):
    """A fused copy (one per batch size, checked at start on its own example) gives the eager
    model's vectors on other images too, and embed() routes each size to its copy."""
    from embedding.transforms import normalize_batch
    from service.model.accel import fuse_for_shape

    e = _embedder(base_run)
    torch.set_num_threads(1)
    c, s = e.model.config.in_channels, e.model.config.image_size
    x = torch.randint(0, 256, (3, c, s, s), dtype=torch.uint8, generator=torch.Generator())
    with torch.no_grad():
        want = e.model(normalize_batch(x, e.model.config)).numpy()
    calls = []
    for b in (1, 2, 3):
        fused, why = fuse_for_shape(e.u8, torch.zeros(b, c, s, s, dtype=torch.uint8))
        assert why == "fused"

        def spy(t, fused=fused):
            calls.append(t.shape[0])
            return fused(t)

        e.by_size[b] = spy
    for b in (1, 2, 3):
        got = e.embed(x[:b])
        assert got.shape == (b, e.dim)
        assert abs(got - want[:b]).max() < 1e-4
    assert calls == [1, 2, 3]
    assert sorted(e.fuse_small_batches(0)) == [1, 2, 3]  # up_to 0 adds none


def test_fuse_for_shape_refuses_a_copy_that_differs():
    from embedding.config import ModelConfig
    from embedding.model import EmbeddingNet
    from service.model.accel import NormalizedInput, fuse_for_shape

    m = NormalizedInput(EmbeddingNet(ModelConfig()).eval(), ModelConfig())
    x = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    fused, why = fuse_for_shape(m, x, atol=-1.0)
    assert fused is None and why.startswith("fused copy differs")
    fused, why = fuse_for_shape(m, x.float()[:, :, :5])  # an input the model cannot take
    assert fused is None and why.startswith("fusion failed")


def test_outputs_are_compared_column_by_column_to_their_own_scale():
    """The traced copy is checked against each output column's scale: a ResNet's world
    statistics (values in the hundreds) differ by ~1e-4 after BatchNorm folding, which once sent
    every ResNet service with the world check back to the eager model (ResNet-18 at 224 px:
    27% slower; the served case is in test_colour_photos). Unit vectors: 1e-4 as they are."""
    from service.model.accel import differs

    a = torch.tensor([[1.0, 200.0], [-0.5, -150.0]])
    assert differs(a, a + torch.tensor([[0.0, 0.01], [0.0, 0.0]])) == pytest.approx(5e-5, rel=1e-3)
    assert differs(a, a + torch.tensor([[0.0, 0.0], [2e-4, 0.0]])) == pytest.approx(2e-4, rel=1e-3)


def test_large_jpegs_decode_reduced_to_twice_the_resize_and_embed_the_same():
    """A phone-sized JPEG decodes at a fraction of its size (libjpeg's DCT scaling) while both
    sides stay >= twice the resize target; the embedding is the full decode's within 1e-3 (the
    antialiased resize still sees >= 2x its output). 12 MP: 11 vs 50 ms decode, 1 vs 80 ms
    resize on this CPU (docs/PERFORMANCE.md)."""
    import io

    import numpy as np
    import skimage.data
    from PIL import Image

    from embedding.config import ModelConfig
    from embedding.model import EmbeddingNet
    from service.model.embedder import load_image, open_image

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="resnet18", in_channels=3, image_size=224, mean=[0.5] * 3, std=[0.25] * 3,
        class_names=["a", "b"], small_stem=False,
    )  # fmt: skip
    e = Embedder(EmbeddingNet(cfg).eval(), torch.device("cpu"))
    assert e.decode_side == 2 * 256
    for w, h in ((4032, 3024), (2000, 3000), (700, 600)):
        b = io.BytesIO()
        Image.fromarray(skimage.data.astronaut()).resize((w, h)).save(b, "JPEG", quality=90)
        data = b.getvalue()
        full, _ = load_image(open_image(data, 10**8))
        small, _ = load_image(open_image(data, 10**8), min_side=e.decode_side)
        assert full.size == (w, h) and min(small.size) >= e.decode_side
        if min(w, h) >= 2 * e.decode_side:
            assert small.size[0] <= w // 2  # decoded at 1/2 or less
        with torch.inference_mode():
            a, b2 = (e.embed(torch.from_numpy(np.stack([e.pixels(x)]))) for x in (full, small))
        # measured: 12 MP max |diff| 1.9e-4, cosine 0.9999997
        assert float((a * b2).sum()) > 0.99999 and np.abs(a - b2).max() < 1e-3
    grey = io.BytesIO()  # a greyscale JPEG keeps its mode
    Image.new("L", (1200, 900), 128).save(grey, "JPEG")
    assert load_image(open_image(grey.getvalue(), 10**8), min_side=512)[0].mode == "L"


def test_the_service_runs_numpy_blas_on_one_thread(base_run, tmp_path):
    """numpy's OpenBLAS (pthreads) threads spin after each call (the world check's matmul) and
    took a core from the next forward: ResNet-50 at 224 px classified a photo in 87 instead of
    55 ms."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from service.config import Settings
    from service.startup import ServiceHost

    before = threadpool_info()
    host = ServiceHost(Settings(model=base_run, data_dir=tmp_path / "d"))
    try:
        st = host.finish()
        # OpenMP's thread count is per thread: what counts is the model thread's (where the
        # world check and the FAISS search run)
        blas = [
            d
            for d in st.runtime.batcher.call(threadpool_info)
            if d["internal_api"] == "openblas" and d["threading_layer"] == "pthreads"
        ]
        assert blas and all(d["num_threads"] == 1 for d in blas)
    finally:
        host.stop()
        threadpool_limits({d["prefix"]: d["num_threads"] for d in before})


def test_a_pngs_size_read_from_its_header_is_pillows():
    import io
    import warnings

    from PIL import Image

    from service.model.embedder import png_size
    from tests.service.hostile_images import corpus

    base = Image.fromarray((torch.arange(784).reshape(28, 28) % 251).to(torch.uint8).numpy())
    seen = 0
    for name, data, _ in corpus(base):
        try:
            with warnings.catch_warnings():  # (the corpus's corrupt TIFF: Pillow warns)
                warnings.simplefilter("ignore")
                img = Image.open(io.BytesIO(data))
            want, fmt = img.size, img.format
        except Exception:
            continue
        got = png_size(data)
        assert got == (want if fmt == "PNG" else None), name
        seen += fmt == "PNG"
    assert seen >= 10
    assert png_size(b"\x89PNG\r\n\x1a\n") is None and png_size(b"") is None
