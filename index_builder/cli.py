"""snca-build-index: export a training run into a FAISS index dir for the service.

snca-build-index runs/demo --out runs/demo/index
snca-build-index runs/demo --out runs/demo/ivf --factory IVF256,Flat --nprobe 16
snca-build-index runs/demo --out runs/demo/hnsw --factory HNSW32 --source recompute
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from embedding.cliutil import positive_int
from embedding.errors import SNCAError
from embedding.model import SPACES
from embedding.sysalloc import keep_freed_memory

from .build import DEVICES, EMBEDDING_SOURCES, BuildConfig, build, current_build, gallery_trained


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snca-build-index",
        description="Export a training run dir (model + memory bank) into an index dir: a FAISS "
        "index (IndexIDMap2, inner product on unit vectors), a SQLite gallery store and "
        "manifest.json. The dir appears complete or not at all.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, help="training run dir written by snca-train")
    p.add_argument("--out", type=Path, help="index dir to write (default: RUN_DIR/index)")
    p.add_argument(
        "--source",
        choices=EMBEDDING_SOURCES,
        help="recompute (default): re-embed the training images with the final model and the "
        "eval transform, as queries and added images are embedded; memory: the final memory "
        "bank rows (the paper's protocol: cheaper, but they lag the final model, so added "
        "labels and the open-set calibration see a shifted gallery; docs/RESULTS.md)",
    )
    p.add_argument(
        "--space",
        choices=SPACES,
        default="embedding",
        help="embedding: the NCA embedding (the paper's); spatial: the backbone's last "
        "feature map, unpooled and L2-normalised (576-d for conv4), which lets labels added "
        "from a few images win far more often (docs/RESULTS.md); the service embeds queries "
        "in the index's space",
    )
    p.add_argument(
        "--factory",
        default="Flat",
        help="FAISS index factory string, inner product: Flat (exact), IVF1024,Flat, "
        "HNSW32, IVF4096,PQ32, ...; or auto: the builder picks for the size (Flat up to "
        "--auto-exact-max vectors, IVF-Flat up to 5M, IVF-PQ beyond) and sets nprobe from "
        "--recall-target measured on 1,000 held-out queries (recorded in the manifest)",
    )
    p.add_argument(
        "--recall-target",
        type=float,
        default=0.95,
        help="--factory auto: the recall@10 nprobe must reach (default 0.95)",
    )
    p.add_argument(
        "--auto-exact-max",
        type=positive_int,
        default=200_000,
        help="--factory auto: galleries up to this many vectors get Flat (default 200000)",
    )
    p.add_argument(
        "--nprobe",
        type=positive_int,
        help="IVF: lists searched per query, recorded for the service "
        "(default sqrt(nlist), at least 8, at most nlist)",
    )
    p.add_argument(
        "--ef-search",
        type=positive_int,
        help="HNSW: search breadth efSearch, recorded for the service (default 128)",
    )
    p.add_argument(
        "--ef-construction",
        type=positive_int,
        help="HNSW: graph build breadth efConstruction (default 128; FAISS's own is 40)",
    )
    p.add_argument(
        "--train-sample",
        type=positive_int,
        help="vectors used to train IVF/PQ indexes (default: all, at most 500000)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where FAISS trains and adds (cuda needs the faiss GPU build); the written "
        "index is always CPU-readable",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=512, help="recompute: images per forward pass"
    )
    p.add_argument("--num-workers", type=int, default=0, help="recompute: data-loader workers")
    p.add_argument(
        "--data-dir",
        help="re-embedding and thumbnails: the training images' folder, if not where training "
        "read them (recorded in the run dir's dataset.json)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the training sample")
    p.add_argument(
        "--thumbnails",
        action="store_true",
        help="store a small preview of every dataset item in the gallery store (the web page "
        "shows them; ~0.4 KB per Fashion-MNIST item)",
    )
    p.add_argument(
        "--trained-items",
        dest="trained_items",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="index the run's training images; --no-trained-items indexes none, for a run "
        "trained on a served gallery's images, whose items snca-gallery upgrade --to (or a "
        "start on the same data dir) carries; indexed too, each would be in the gallery twice "
        "(default: none for a run of snca-train --dataset gallery, all otherwise)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out (kept until the new index is complete)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep --out when it already holds an index of this run's model built with the "
        "same factory, source, space, thumbnails and search parameters; build (replacing "
        "it) otherwise. `make run` uses it to start again in seconds",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bars (on a terminal)",
    )
    return p


def _trained_on(run_dir: Path) -> str | None:
    """The dataset the run was trained on (None: no readable config.json)."""
    try:
        return json.loads((Path(run_dir) / "config.json").read_text()).get("dataset")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()  # re-embedding allocates the same large batches over and over
    given = {f.name: getattr(args, f.name) for f in fields(BuildConfig) if hasattr(args, f.name)}
    if given.get("trained_items") is None:  # a gallery's own images: the carry brings them
        # (a run that learned from the whole gallery indexes its trained items: their carry
        # finds them by dataset index; what users added comes from the store)
        given["trained_items"] = (
            _trained_on(args.run_dir) != "gallery" or gallery_trained(args.run_dir) is not None
        )
    cfg = BuildConfig(
        **{
            **given,
            "out": args.out or args.run_dir / "index",
            "source": args.source or "recompute",
            "num_workers": max(0, args.num_workers),
        }
    )
    if cfg.reuse and (m := current_build(cfg)) is not None:
        print(
            f"index: {cfg.out} — {m.count} vectors, {m.factory}, built {m.created_at} from this "
            "model with these options: kept"
        )
        return 0
    try:
        m = build(cfg)
    except SNCAError as e:
        print(f"snca-build-index: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "snca-build-index: interrupted; the previous index (if any) is untouched",
            file=sys.stderr,
        )
        return 130
    params = ", ".join(f"{k}={v}" for k, v in m.search_params.items()) or "exact"
    print(
        f"index: {cfg.out} — {m.count} vectors (d={m.dim}, {m.source}), "
        f"{len(m.labels)} labels, {m.factory} ({params}), built on {m.build.get('device')} "
        f"in {m.build.get('seconds', 0):.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
