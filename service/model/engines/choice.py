"""Which engine serves (SNCA_ENGINE): `choose` loads the engines asked for on the export,
checks each against the torch module (ENGINE_ATOL), times them and keeps the fastest, and
remembers the timing beside the export (CHOICE_FILE, per CPU and engine versions) so that the
next start on this machine loads only the winner; torch is the fallback, with the reason."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from service.model import engines as registry
from service.model.accel import differs
from service.model.engines.base import Engine
from service.model.engines.export import export

# an engine's rows against the torch module's, each column relative to its scale (accel.differs):
# fp32 engines measured 5e-7..2e-5 on conv4, ResNets and EfficientNet-Lite0
ENGINE_ATOL = 1e-4


CHOICE_FILE = "choice.json"


@dataclass
class Chosen:
    engine: Engine | None  # None: the torch path
    name: str  # "torch" or an ENGINES key
    note: str  # why this one (auto's timings, a fallback's reason) and the export's fate
    per_image_ms: float | None = None  # one thread, the engine's own timing (None: not timed)
    onnx: Path | None = None  # the export the engine runs

    def at_threads(self, threads: int) -> None:
        """Reload the engine at `threads` threads (it was chosen on one)."""
        if self.engine is not None and threads != 1:
            self.engine = type(self.engine)(self.onnx, threads)


def _version(name: str) -> str | None:
    """The installed version of engine `name`'s package (an ENGINES key is its pip package's
    name), None where it is not installed; read from its metadata, nothing imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except (PackageNotFoundError, ValueError):
        return None


def cpu_model() -> str:
    """The CPU's model name and its vector extensions (what an engine's kernels pick from)."""
    name, flags = "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "?":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(sorted(f for f in have if f.startswith(("avx", "amx"))))
    except OSError:
        pass
    return f"{name} [{flags}]"


def _time(engine: Engine, x: np.ndarray, repeats: int = 3) -> float:
    """Seconds per image of the fastest of `repeats` calls (after one untimed call)."""
    engine.run(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.run(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(x)


def _check(engine: Engine, example: torch.Tensor, reference: torch.Tensor) -> None:
    """Raise ValueError where the engine's rows differ from the torch module's."""
    for b in (len(example), 1):
        got = torch.from_numpy(np.asarray(engine.run(example[:b].numpy()), dtype=np.float32))
        err = differs(reference[:b], got)
        if not err <= ENGINE_ATOL:
            raise ValueError(f"its rows differ from the torch module's by {err:.1e}")


def choose(
    setting: str,
    module: torch.nn.Module,
    example: torch.Tensor,
    want: dict,
    dirs: list[Path],
) -> Chosen:
    """The engine `setting` asks for (auto: the fastest that agrees with torch) on one thread,
    or torch with why. `module`: the eager serving module (uint8 (B, C, H, W) -> rows), the
    export's source and the reference; `example`: a uint8 batch of 4 to check and time on;
    `want`: export.wanted(...); `dirs`: where the export may be cached, in order."""
    if setting == "torch":
        return Chosen(None, "torch", "SNCA_ENGINE=torch")
    names = list(registry.ENGINES) if setting == "auto" else [setting]
    why_not = [f"{n}: not installed (no {n} package)" for n in names if _version(n) is None]
    names = [n for n in names if _version(n) is not None]
    if not names:  # (nothing imported, nothing exported)
        return Chosen(None, "torch", f"SNCA_ENGINE={setting}, torch serves: {'; '.join(why_not)}")
    try:
        onnx, exported = export(module, example, want, dirs)
    except Exception as e:  # an architecture the exporter cannot express, a full disk
        return Chosen(
            None,
            "torch",
            f"SNCA_ENGINE={setting}, torch serves: the model could not be exported to ONNX "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
        )
    with torch.inference_mode():
        reference = module(example).float()
    cpu = cpu_model()
    remembered = _remembered(onnx, cpu, names) if setting == "auto" else None
    classes = {}
    for name in [remembered] if remembered is not None else names:  # timed before: the winner
        try:  # (only what is used is imported: OpenVINO alone takes ~0.4 s of CPU)
            classes[name] = registry.engine_class(name)
        except ImportError as e:
            why_not.append(f"{name}: cannot be imported ({e})")
    timings: dict[str, float] = {}
    winner: tuple[str, Engine] | None = None
    for name, cls in classes.items():
        try:
            eng = cls(onnx, 1)
            _check(eng, example, reference)
            x = example.numpy()
            timings[name] = (_time(eng, x[:1]) + _time(eng, x)) / 2 * 1000
        except Exception as e:
            why_not.append(
                f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
            continue
        if winner is None or timings[name] < timings[winner[0]]:
            winner = (name, eng)  # (a loser is dropped here: one engine's weights held)
    if winner is None:
        return Chosen(None, "torch", f"SNCA_ENGINE={setting}, torch serves: {'; '.join(why_not)}")
    name, eng = winner
    if setting == "auto" and remembered is None and len(timings) > 1:
        _remember(onnx, cpu, timings)
    said = ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(timings.items(), key=lambda t: t[1]))
    how = (
        f"the fastest on this CPU when first timed ({CHOICE_FILE})"
        if remembered is not None
        else f"ms/image at batch 1 and 4, one thread: {said}"
        if setting == "auto"
        else f"SNCA_ENGINE={setting}"
    )
    notes = [how, f"export {exported}", *why_not]
    return Chosen(eng, name, "; ".join(notes), timings[name], onnx)


def _choice_key(cpu: str, names: list[str]) -> dict:
    return {"cpu": cpu, "engines": {n: _version(n) for n in sorted(names)}}


def _remembered(onnx: Path, cpu: str, names: list[str]) -> str | None:
    """The engine auto picked for this export on this CPU with these engine versions before."""
    try:
        saved = json.loads((onnx.parent / CHOICE_FILE).read_text())
        entry = saved.get(onnx.name) or {}
        if entry.get("key") == _choice_key(cpu, names) and entry.get("sha256") == _card_sha(onnx):
            return entry["winner"] if entry.get("winner") in names else None
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    return None


def _card_sha(onnx: Path) -> str | None:
    try:
        return json.loads(onnx.with_suffix(".json").read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None


def _remember(onnx: Path, cpu: str, timings: dict[str, float]) -> None:
    path = onnx.parent / CHOICE_FILE
    try:
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(saved, dict):
            saved = {}
    except (OSError, ValueError):
        saved = {}
    saved[onnx.name] = {
        "key": _choice_key(cpu, list(timings)),
        "sha256": _card_sha(onnx),
        "winner": min(timings, key=timings.get),
        "ms_per_image": timings,
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # workers starting together: one file each
    try:
        tmp.write_text(json.dumps(saved, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # not remembered: timed again next start
