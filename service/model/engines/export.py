"""The serving module exported to ONNX for an inference engine, cached in the run dir.

One file per (space, world check) in `<run>/engines/` (else `<data dir>/engines/` where the run
dir is read-only), with a JSON card beside it: the fingerprint of the model it came from, the
space, whether the world statistics are in it, the input shape, the torch version and opset
that wrote it, and the SHA-256 of the ONNX bytes. An export whose card does not match the
model being served (a retrained run, another torch, a modified file) is stale: never used,
exported again. The engine's outputs are still checked against the torch module at start
(engines/__init__.py): the card says where the file came from, the check that it is right.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from embedding.index import sha256_file

EXPORT_FORMAT = 1
OPSET = 17
INPUT, OUTPUT = "pixels", "rows"  # uint8 (B, C, H, W) -> float32 (B, d [+ D])


def wanted(fingerprint: str, space: str, world: bool, shape: tuple[int, ...]) -> dict:
    """The card an export for this model must carry."""
    return {
        "format": EXPORT_FORMAT,
        "model_fingerprint": fingerprint,
        "space": space,
        "world_statistics": world,
        "input_shape": list(shape),  # (C, H, W); the batch size is dynamic
        "torch": torch.__version__,
        "opset": OPSET,
    }


def stale(onnx: Path, want: dict) -> str | None:
    """Why the export at `onnx` (its card beside it) cannot serve `want`'s model; None: it can."""
    card_path = onnx.with_suffix(".json")
    if not onnx.is_file() or not card_path.is_file():
        return "no export yet"
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as e:
        return f"its card {card_path} cannot be read ({e})"
    if not isinstance(card, dict):
        return f"its card {card_path} is not a JSON object"
    for key, value in want.items():
        if card.get(key) != value:
            return f"it was made for {key} {card.get(key)!r}, this model has {value!r}"
    if card.get("sha256") != sha256_file(onnx):
        return f"{onnx.name} was modified after it was written (SHA-256 differs from its card)"
    return None


def export(module: torch.nn.Module, example: torch.Tensor, want: dict, dirs: list[Path]):
    """`module` (uint8 (B, C, H, W) -> float32 (B, w)) as an ONNX file for `want`'s model:
    the cached one where its card matches, else exported now into the first writable of
    `dirs`. Returns (path, what happened: "cached", "exported in X s" or "exported in X s;
    <why the cached one was stale>")."""
    name = f"{want['space']}{'-world' if want['world_statistics'] else ''}.onnx"
    why_not = None
    for d in dirs:
        reason = stale(d / name, want)
        if reason is None:
            return d / name, "cached"
        if reason != "no export yet" and why_not is None:
            why_not = f"{d / name} was stale ({reason}): exported again"
    errors = []
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            path = _write(module, example, want, d / name)
        except OSError as e:  # read-only run dir: the next place
            errors.append(f"{d}: {e}")
            continue
        said = f"exported in {time.perf_counter() - t0:.1f} s"
        return path, said if why_not is None else f"{said}; {why_not}"
    raise OSError("no place to write the export: " + "; ".join(errors))


def _write(module: torch.nn.Module, example: torch.Tensor, want: dict, path: Path) -> Path:
    """Export to a temporary file beside `path`, then rename it and its card into place: a
    worker starting at the same moment reads either the old pair or a whole new one (a card
    from one writer beside the file of another differs in SHA only if the bytes differ, and
    is then exported again)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".export-", suffix=".onnx")
    os.close(fd)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation
            # dynamo=False: the TorchScript exporter, which needs no onnxscript and exports
            # every backbone here (conv4, ResNets, timm's EfficientNets) in < 1 s
            torch.onnx.export(
                module.eval(),
                (example,),
                tmp,
                input_names=[INPUT],
                output_names=[OUTPUT],
                dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}},
                opset_version=OPSET,
                dynamo=False,
            )
        card = {**want, "sha256": sha256_file(Path(tmp))}
        card_tmp = Path(tmp).with_suffix(".json")
        card_tmp.write_text(json.dumps(card, indent=2) + "\n")
        os.replace(tmp, path)
        os.replace(card_tmp, path.with_suffix(".json"))
    finally:
        for p in (Path(tmp), Path(tmp).with_suffix(".json")):
            p.unlink(missing_ok=True)
    return path
