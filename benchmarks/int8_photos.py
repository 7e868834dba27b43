"""What int8 costs a photo model (issue 42, point 4): the served ONNX export of a run (the
engine's own file, MODEL/engines/*.onnx) quantized by ONNX Runtime (static, QDQ, int8 weights
per channel, uint8 activations calibrated on gallery images), against the fp32 export, in one
process: ms per image at batch 1 and 8 on ONNX Runtime (and OpenVINO fp32 for reference), and
kNN top-1 on a held-out set (gallery: training images; queries: test images; cosine, k = 1 and
a k = 10 majority), with the share of queries whose nearest gallery item is the same.

    python benchmarks/int8_photos.py /tmp/bench-lite0 --gallery 1000 --queries 1000 \\
        --json docs/int8_photos.json

The held-out set is Fashion-MNIST (real images; the only labelled set of more than a few images
this machine has), resized to the model's input as the service does. Target (issue 42): int8
only where its kNN top-1 cost is below 1 point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pixels(split: str, n: int, shape: tuple[int, int, int], seed: int):
    """n images of `split` as uint8 (n, C, H, W) at the model's input, and their labels."""
    import torch

    from embedding.datasets import load_raw

    raw = load_raw("fashion-mnist", split)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(len(raw.targets), n, replace=False))
    x = raw.source.images[torch.from_numpy(pick)].float()  # (n, 1, 28, 28)
    c, h, w = shape
    x = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
    x = x.round().clamp(0, 255).to(torch.uint8).expand(-1, c, -1, -1).contiguous()
    return x.numpy(), np.asarray(raw.targets)[pick]


def session(path: Path, threads: int):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = threads, 1
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def quantize(src: Path, dst: Path, calib: np.ndarray, method: str, ops: list[str] | None) -> float:
    """src -> dst, static int8 (QDQ) with `method`'s activation ranges; returns seconds taken."""
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"pixels": calib[i : i + 8]} for i in range(0, len(calib), 8)])

        def get_next(self):
            return next(self.batches, None)

    t = time.perf_counter()
    pre = dst.with_suffix(".pre.onnx")
    with contextlib.chdir(dst.parent):  # both write scratch files into the working directory
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)  # dynamic batch
        _quantize_static(pre, dst, Reader(), method, ops)
    return time.perf_counter() - t


def _quantize_static(pre: Path, dst: Path, reader, method: str, ops: list[str] | None) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(
        str(pre), str(dst), reader, quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        calibrate_method=METHODS[method](CalibrationMethod), op_types_to_quantize=ops,
    )  # fmt: skip


# activation ranges: the calibration set's min/max, its 99.999th percentile, or the range that
# keeps the most information (entropy)
METHODS = {
    "minmax": lambda m: m.MinMax,
    "percentile": lambda m: m.Percentile,
    "entropy": lambda m: m.Entropy,
}


def embed(run_one, x: np.ndarray, dim: int, batch: int = 32) -> np.ndarray:
    out = np.concatenate([run_one(x[i : i + batch]) for i in range(0, len(x), batch)])[:, :dim]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def knn(gal, gy, q, qy) -> dict:
    sims = q @ gal.T  # (Q, G)
    top = np.argsort(-sims, axis=1)[:, :10]
    votes = gy[top]  # (Q, 10)
    maj = np.array([np.bincount(v, minlength=gy.max() + 1).argmax() for v in votes])
    return {"top1_k1": float((votes[:, 0] == qy).mean() * 100),
            "top1_k10": float((maj == qy).mean() * 100), "nearest": top[:, 0]}  # fmt: skip


def per_image_ms(run_one, x: np.ndarray, batch: int, repeat: int) -> float:
    xb = x[:batch]
    run_one(xb)
    t = time.perf_counter()
    for _ in range(repeat):
        run_one(xb)
    return (time.perf_counter() - t) / repeat / batch * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path, help="a served photo run (its engines/ has the export)")
    ap.add_argument("--gallery", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--calibration", type=int, default=64, help="gallery images to calibrate")
    ap.add_argument("--method", choices=tuple(METHODS), default="minmax")
    ap.add_argument("--ops", help="op types to quantize, comma-separated (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    ops = a.ops.split(",") if a.ops else None
    exports = sorted((a.run / "engines").glob("*.onnx"))
    if not exports:
        sys.exit(f"{a.run}/engines has no export: serve the run once (snca-serve) to make it")
    src = exports[0]
    card = json.loads(src.with_suffix(".json").read_text())
    cfg = json.loads((a.run / "model.json").read_text())
    dim = int(cfg.get("config", cfg).get("embedding_dim", 128))
    shape = tuple(card["input_shape"])
    gx, gy = pixels("train", a.gallery, shape, 0)
    qx, qy = pixels("test", a.queries, shape, 1)
    log(f"{src.name}: {shape}, gallery {len(gx)} training images, {len(qx)} test queries")

    out: dict = {"export": src.name, "input_shape": list(shape), "threads": a.threads,
                 "method": a.method, "ops": ops or "all", "calibration": min(a.calibration, len(gx)),
                 "gallery": len(gx), "queries": len(qx)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        q8 = Path(tmp) / "int8.onnx"
        out["quantize_s"] = round(quantize(src, q8, gx[: a.calibration], a.method, ops), 1)
        out["bytes"] = {"fp32": src.stat().st_size, "int8": q8.stat().st_size}
        runners = {}
        for name, path in (("onnxruntime fp32", src), ("onnxruntime int8", q8)):
            s = session(path, a.threads)
            runners[name] = lambda x, s=s: s.run(None, {"pixels": x})[0]
        try:
            import openvino as ov

            core = ov.Core()
            compiled = core.compile_model(
                core.read_model(str(src)), "CPU",
                {"INFERENCE_NUM_THREADS": a.threads, "INFERENCE_PRECISION_HINT": "f32"},
            )  # fmt: skip
            runners["openvino fp32"] = lambda x, c=compiled: c(x)[0]
        except ImportError:
            pass
        emb = {}
        for name, run_one in runners.items():
            t = time.perf_counter()
            gal, q = embed(run_one, gx, dim), embed(run_one, qx, dim)
            emb[name] = (gal, q)
            k = knn(gal, gy, q, qy)
            row = {"top1_k1": round(k["top1_k1"], 2), "top1_k10": round(k["top1_k10"], 2),
                   "embed_s": round(time.perf_counter() - t, 1)}  # fmt: skip
            for b in (1, 8):
                row[f"ms_per_image_b{b}"] = round(per_image_ms(run_one, qx, b, a.repeat), 2)
            if name != "onnxruntime fp32":
                ref = emb["onnxruntime fp32"]
                row["same_nearest"] = round(
                    float((k["nearest"] == knn(ref[0], gy, ref[1], qy)["nearest"]).mean() * 100), 2
                )
                row["cosine_to_fp32_min"] = round(float((q * ref[1]).sum(1).min()), 4)
            out[name] = row
            log(f"{name}: {row}")
    fp, i8 = out["onnxruntime fp32"], out["onnxruntime int8"]
    out["int8_top1_cost_points"] = round(fp["top1_k1"] - i8["top1_k1"], 2)
    out["int8_speedup_b1"] = round(fp["ms_per_image_b1"] / i8["ms_per_image_b1"], 2)
    out["int8_speedup_b8"] = round(fp["ms_per_image_b8"] / i8["ms_per_image_b8"], 2)
    log(f"int8: kNN top-1 {i8['top1_k1']} vs {fp['top1_k1']} (cost "
        f"{out['int8_top1_cost_points']} points), speed {out['int8_speedup_b1']}x at batch 1, "
        f"{out['int8_speedup_b8']}x at 8")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
