"""Image decoding (content-sniffed, size-checked) and the model forward, off the event loop."""

from __future__ import annotations

import io
import os
import time
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from embedding.errors import ArtifactError
from embedding.inference import autocast_context
from embedding.model import EmbeddingNet, in_space, space_dim
from embedding.transforms import eval_geometry, resize_side
from service.model.accel import NormalizedInput, fuse_for_shape, optimize_for_cpu

# What the service accepts, by the format Pillow reads from the bytes (never the filename).
FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
    "GIF": "image/gif",
}


# Leading bytes of each accepted format: a file that starts like one of them but that Pillow
# cannot identify is a broken image (400), not a foreign format (415).
SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)


def sniff(data: bytes) -> str | None:
    """The accepted format `data` claims to be by its leading bytes, or None."""
    for sig, fmt in SIGNATURES:
        if data.startswith(sig):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:2] == b"BM" and len(data) >= 14 and int.from_bytes(data[2:6], "little") >= 14:
        return "BMP"
    return None


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, read without Pillow (a tenth of its open), or
    None for anything else. It checks nothing more: a front that sends a query encoded
    (Uploads.prepare_async) uses it only where the model process's full `open_image` of the
    same bytes gives the problem, if any, that the front's would have."""
    if len(data) < 24 or data[:8] != SIGNATURES[0][0] or data[8:16] != b"\x00\x00\x00\rIHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# problem `code` by status (service/http/problems.py); an empty file says so itself
IMAGE_CODES = {400: "image_undecodable", 413: "image_too_large", 415: "image_unsupported"}


class ImageError(Exception):
    """A client's image is unusable; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or IMAGE_CODES[status]


def open_image(data: bytes, max_pixels: int, name: str = "image") -> Image.Image:
    """Read and check the header only (cheap): 415 for anything that is not one of FORMATS,
    413 above `max_pixels`, 400 for an empty file or no pixels."""
    if not data:
        raise ImageError(400, f"{name}: the file is empty", "image_empty")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        claimed = sniff(data)
        if claimed:
            raise ImageError(
                400,
                f"{name}: starts like a {claimed} file but cannot be read (truncated or corrupt)",
            ) from None
        raise ImageError(415, f"{name}: not an image ({', '.join(FORMATS)} are accepted)") from None
    except Image.DecompressionBombError as e:
        raise ImageError(413, f"{name}: too many pixels ({e})") from None
    except (OSError, ValueError) as e:
        raise ImageError(400, f"{name}: cannot be decoded: {e}") from None
    if img.format not in FORMATS:
        raise ImageError(
            415, f"{name}: {img.format} images are not accepted ({', '.join(FORMATS)} are)"
        )
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(400, f"{name}: the image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(413, f"{name}: {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
    return img


def load_image(
    img: Image.Image, name: str = "image", min_side: int | None = None
) -> tuple[Image.Image, str]:
    """Decode an `open_image` result: first frame of animations, EXIF orientation applied.
    400 for a file that claims a format but does not decode (truncated, corrupt, bomb).
    `min_side`: a JPEG may be decoded at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT scaling,
    PIL's draft) as long as both sides stay at least this: a 12-megapixel phone photo for a
    224 px model decodes in 11 instead of 50 ms and resizes in 1 instead of 80 ms."""
    fmt = img.format
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.seek(0)  # animated images: the first frame
            if min_side and fmt == "JPEG":
                img.draft(img.mode, (min_side, min_side))
            img.load()
            # upright in place: the usual image has no orientation, and a copy of it cost
            # ~9 % of the open + decode of a 28x28 PNG (127 -> 116 us, docs/PERFORMANCE.md)
            ImageOps.exif_transpose(img, in_place=True)
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as e:
        raise ImageError(400, f"{name}: cannot be decoded as {FORMATS[fmt]}: {e}") from None
    return img, FORMATS[fmt]


class Preprocessing:
    """What turns an upload into model input and model output into rows, from the model card
    alone (no weights): the front process of a worker (service/model/remote.py) has this and
    no model."""

    def __init__(self, config, dim: int, world_dim: int = 0):
        self.config = config  # ModelConfig
        self.geometry = eval_geometry(config)
        # JPEGs decode at a reduced scale while both sides stay >= twice the resize target:
        # the antialiased resize that follows then sees >= 2x its output, as from a full decode
        # (embeddings within 1e-3 of the full decode's, tests/service/model/test_embedder.py)
        self.decode_side = 2 * resize_side(config)
        self.dim = dim
        self.world_dim = world_dim  # statistics after the vector in each row (0: none)

    def preprocess(self, img: Image.Image) -> torch.Tensor:
        """PIL image -> uint8 (C, H, W) at the model's size; `embed` normalises the batch."""
        try:
            return self.geometry(img)
        except (OSError, ValueError) as e:
            raise ImageError(400, f"image cannot be converted: {e}") from None

    def pixels(self, img: Image.Image) -> np.ndarray:
        """`preprocess` as a C-contiguous uint8 numpy array (C, H, W): what the service queues.
        A greyscale image already at the model's size (Fashion-MNIST's 28x28) is read with
        one copy of its bytes, the same values as `preprocess` gives: numpy's and torch's own
        conversions each release and retake the GIL, which on a busy server means waiting
        for the other thread each time (docs/PERFORMANCE.md)."""
        size = self.config.image_size
        if img.mode == "L" and self.config.in_channels == 1 and img.size == (size, size):
            try:
                data = img.tobytes()
            except (OSError, ValueError) as e:
                raise ImageError(400, f"image cannot be converted: {e}") from None
            return np.frombuffer(data, dtype=np.uint8).reshape(1, size, size)
        return np.ascontiguousarray(self.preprocess(img).numpy())

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of `pixels`."""
        return (self.config.in_channels, self.config.image_size, self.config.image_size)

    def split(self, rows):
        """Forward rows (n, dim [+ world_dim]) -> (vectors (n, dim), statistics (n, D) or
        None), numpy or torch as given; the vectors contiguous."""
        if not self.world_dim:
            return rows, None
        v, s = rows[:, : self.dim], rows[:, self.dim :]
        if isinstance(rows, torch.Tensor):
            return v.contiguous(), s.numpy()
        return np.ascontiguousarray(v), np.ascontiguousarray(s)


class Embedder(Preprocessing):
    """The model in eval mode with its eval transform (both from the model card)."""

    def __init__(
        self,
        model: EmbeddingNet,
        device: torch.device,
        amp: bool = True,
        space="embedding",
        world: bool = False,
    ):
        """`world`: every forward also gives the world statistics (embedding/world.py): rows
        of [vector (dim) | statistics (world_dim)]; `split` takes them apart."""
        try:
            self.model = in_space(model.to(device).eval(), space).eval()  # embedding.model
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        world_dim = 0
        if world:
            from embedding.world import WorldNet, stats_dim

            world_dim = stats_dim(model)
            self.model = WorldNet(model, space).eval()
        super().__init__(model.config, space_dim(model, space), world_dim)
        self.space = space
        self.device = device
        self.net = model  # the EmbeddingNet itself
        self.fingerprint = getattr(model, "fingerprint", None)  # (embedding.artifacts.load_model)
        self.world = world
        self.engine = None  # an engines.base.Engine serving uint8 batches instead of torch
        self.amp = amp
        # uint8 batch -> vectors, normalisation included (what embed() calls; see optimize())
        self.u8 = NormalizedInput(self.model, self.model.config)
        self.runner: torch.nn.Module = self.u8
        self.by_size: dict[int, torch.nn.Module] = {}  # batch size -> fused copy (CPU)
        self.mode = "eager"
        # batch size -> (uint8 (B, C, H, W) input tensor, a byte view of it); see stack_pixels
        self._inputs: dict[int, tuple[torch.Tensor, memoryview]] = {}

    def _example(self, b: int, seed: int) -> torch.Tensor:
        c, s = self.model.config.in_channels, self.model.config.image_size
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (b, c, s, s), dtype=torch.uint8, generator=g)

    def use_engine(self, dirs: list, setting: str = "auto"):
        """On CPU, serve through the inference engine `setting` picks (service/model/engines;
        the export cached in the first writable of `dirs`); returns engines.choice.Chosen, whose
        `engine` is None where torch keeps serving (`note` says why)."""
        from service.model.engines.choice import Chosen, choose
        from service.model.engines.export import wanted

        if self.device.type != "cpu":
            return Chosen(None, "torch", f"the model runs on {self.device} (engines: CPU only)")
        fp = self.fingerprint
        if fp is None:  # a model built in memory: its weights name it
            from embedding.artifacts import model_fingerprint

            fp = model_fingerprint(self.net.config, self.net.state_dict())
        c = self.model.config
        want = wanted(fp, self.space, self.world, (c.in_channels, c.image_size, c.image_size))
        chosen = choose(setting, self.u8, self._example(4, 0), want, list(dirs))
        self.engine = chosen.engine
        if self.engine is not None:
            self.mode = chosen.name
        return chosen

    def optimize(self) -> str:
        """On CPU, swap in the traced oneDNN module (checked against eager; falls back to it).
        Call on the thread that will run the model."""
        if self.device.type == "cpu":
            self.runner, self.mode = optimize_for_cpu(self.u8, self._example(8, 0))
        return self.mode

    @torch.inference_mode()
    def fuse_small_batches(self, up_to: int, memory_mb: float = float("inf")) -> list[int]:
        """After `optimize`, at the serving thread count: a oneDNN-graph fused copy for each
        batch size 1..up_to, kept where it is at least 10% faster than the general module
        (timed here, best of 5), stopping at the first size where it is not (the gain shrinks
        with the batch) or where the copies would take more than `memory_mb` of resident
        memory (each holds its own weights and kernels: ~8 MB for conv4, ~100 MB for
        ResNet-18, measured). Small batches are what a server at moderate load runs, and their
        fixed cost is what queues requests there. Returns the sizes that got one."""
        if self.device.type != "cpu" or self.mode != "optimized":
            return []
        base = _rss_mb()
        for b in range(1, up_to + 1):
            x = self._example(b, b)
            fused, _why = fuse_for_shape(self.u8, x)
            if fused is None or _best_time(fused, x) > 0.9 * _best_time(self.runner, x):
                break
            if base is not None and _rss_mb() - base > memory_mb:
                break  # this copy does not fit: dropped
            self.by_size[b] = fused
        return sorted(self.by_size)

    def stack_pixels(self, pixels: list[np.ndarray]) -> torch.Tensor:
        """`pixels` arrays -> one uint8 (B, C, H, W) tensor, by plain byte copies into an input
        tensor kept per batch size: no torch or numpy call, each of which would release the
        GIL and wait to get it back. The tensor is overwritten by the next call with as many
        images: the model thread, the only caller, uses it before then."""
        b = len(pixels)
        entry = self._inputs.get(b)
        if entry is None:
            c, s = self.model.config.in_channels, self.model.config.image_size
            t = torch.empty((b, c, s, s), dtype=torch.uint8)
            entry = self._inputs[b] = (t, memoryview(t.numpy()).cast("B"))
        t, flat = entry
        n = len(flat) // b
        for i, p in enumerate(pixels):
            flat[i * n : (i + 1) * n] = memoryview(p).cast("B")
        return t

    def embed(self, batch: torch.Tensor) -> np.ndarray:
        """(B, C, H, W) uint8 images from `preprocess` (or already normalised floats)
        -> (B, d) float32 unit rows (numpy): the vectors alone (`forward` gives the world
        statistics beside them)."""
        return np.ascontiguousarray(self.forward(batch).numpy()[:, : self.dim])

    @torch.inference_mode()
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """`embed` as a CPU torch tensor (the service's vote takes it as it is)."""
        # uint8: normalised inside the module, once per batch (a fused copy for small sizes)
        if batch.dtype == torch.uint8:
            if self.engine is not None:  # (the engine's call releases the GIL once)
                return torch.from_numpy(self.engine.run(batch.numpy()))
            run = self.by_size.get(batch.shape[0], self.runner)
        else:  # already normalised floats
            run = self.model
        if self.device.type == "cpu":
            # the serving path: one call into the (traced) module and nothing else that
            # releases and retakes the GIL, which the event loop's thread holds half the time
            v = run(batch)
            return v if v.dtype == torch.float32 else v.float()
        batch = batch.to(self.device, non_blocking=True)
        with autocast_context(self.device, self.amp):
            v = run(batch)
        return v.float().cpu()

    def warmup(self, sizes=(1, 2, 8, 64)) -> None:
        """Forwards at a few batch sizes (twice: the traced module specialises on its first
        calls) so that the first requests are not the slow ones."""
        c, s = self.model.config.in_channels, self.model.config.image_size
        for b in [*sizes, *sizes]:
            self.embed(torch.zeros(b, c, s, s, dtype=torch.uint8))

    def batch_cap(self, max_batch: int, min_gain: float) -> tuple[int, dict[int, float]]:
        """The largest batch worth forming, up to `max_batch`: from 8 images, a size twice as
        large (or max_batch) is taken while it runs an image at least `min_gain` faster, or
        runs whole within CHEAP_BATCH_MS (best of 2 after one call, at the serving thread
        count). Returns (size, {size timed: ms per image}). A batch's working memory grows with
        its size (EfficientNet-Lite0 at 224 px under OpenVINO: ~12.6 MB an image, 6.2 / 6.4 /
        6.4 ms an image at 8 / 16 / 64 on 2 cores), so a size that buys no speed costs memory
        and every request in it waits for the whole batch."""
        size = min(8, max_batch)
        if min_gain <= 0 or size == max_batch:
            return max_batch, {}
        c, s = self.model.config.in_channels, self.model.config.image_size

        def per_image(b: int) -> float:
            x = torch.zeros(b, c, s, s, dtype=torch.uint8)
            return _best_time(self.embed, x, repeats=2) / b * 1000

        timed = {size: per_image(size)}
        while size < max_batch:
            bigger = min(2 * size, max_batch)
            timed[bigger] = per_image(bigger)
            gain = timed[bigger] <= timed[size] * (1 - min_gain)
            if not gain and timed[bigger] * bigger > CHEAP_BATCH_MS:
                break
            size = bigger
        return size, timed

    def warmup_every_size(
        self, max_batch: int, budget_s: float = float("inf")
    ) -> tuple[float, int]:
        """One forward at every batch size 1..max_batch, at the serving thread count, smallest
        first, until `budget_s` seconds are spent; returns (seconds, largest size warmed).
        oneDNN builds and caches kernels per input shape (and thread count): conv4 takes ~0.3 MB
        of C heap per new batch size (measured, flat once all 64 were seen). Without this the
        first batch of each size arrives at a random time under load, as an RSS step and a slow
        batch; with it, memory is flat from the start. Every size costs that many images: all
        64 are ~1 s for conv4 but ~60 s for ResNet-18 at 224 px on 2 cores, hence the budget
        (the sizes past it build their kernels on first use). An engine that keeps only its
        last few shapes compiled (Engine.shapes_kept) is warmed up to that many: each size past
        it would evict a smaller one, and the heap kept their transient buffers (a Lite0 model
        process warmed 1..64 under OpenVINO: 1.77 GB; 1..8: measured in docs/PERFORMANCE.md)."""
        kept = getattr(self.engine, "shapes_kept", None)
        if kept is not None:
            max_batch = min(max_batch, kept)
        c, s = self.model.config.in_channels, self.model.config.image_size
        t0 = time.perf_counter()
        x = torch.zeros(max_batch, c, s, s, dtype=torch.uint8)
        warmed = 0
        for b in range(1, max_batch + 1):
            if warmed and time.perf_counter() - t0 > budget_s:
                break
            self.embed(x[:b])
            warmed = b
        return time.perf_counter() - t0, warmed


# a batch that runs within this is never refused by batch_cap: little memory, no wait anyone
# notices (conv4 at 28 px: 64 images in ~16 ms on 2 cores; the vote after it amortises its own
# per-batch cost over the whole batch, which the forward's timing does not see)
CHEAP_BATCH_MS = 20.0


def _best_time(module: torch.nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls (after one untimed call)."""
    module(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        module(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _rss_mb() -> float | None:
    """This process's resident memory in MB (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None
