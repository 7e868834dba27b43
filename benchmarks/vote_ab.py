"""The compiled kde call (service/gallery/compiled.py) of this tree against an older commit's,
interleaved in one process: ms per call at each batch size, one thread, unit rows in 10 labels
(kde_shrunk's prior, the service's default rule), and the largest difference of their answers.

    git worktree add /tmp/base bc3323f
    python benchmarks/vote_ab.py --base /tmp/base --rounds 3

The older call is loaded from the worktree's file and called with the arguments its signature
names (the one before this tree's took no label array).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("base_compiled", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ms(fn, repeat: int) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="worktree of the older commit")
    ap.add_argument("--items", type=int, default=55_000)
    ap.add_argument("--labels", type=int, default=10)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from embedding.openset import label_groups
    from embedding.votes import kde_prepare
    from service.gallery.compiled import scripted_kde_top

    torch.set_num_threads(1)
    old = _load(a.base / "service/gallery/compiled.py")  # with this tree's embedding/
    base = old.scripted_kde_top()
    base_params = list(inspect.signature(old.kde_top).parameters)  # its arguments, by name
    here = scripted_kde_top()
    g = torch.Generator().manual_seed(0)
    c = a.labels
    x = torch.nn.functional.normalize(torch.randn(a.items, 128, generator=g), dim=1)
    y = torch.arange(a.items) % c
    xt = x.T.contiguous()  # (d, N): what the service passes (Rows.embeddings_t)
    lab, counts, onehot = kde_prepare(y, c, 0.05)
    order, starts = label_groups(y, c)
    kcs = torch.full((c,), 10)
    values = dict(gallery_t=xt, lab=lab, onehot=onehot, counts=counts, temperature=0.05, top=5,
                  live=None, order=order, starts=starts, kcs=kcs, alpha=0.5)  # fmt: skip
    rows = []
    for r in range(a.rounds):
        for b in [int(s) for s in a.batches.split(",")]:
            q = torch.nn.functional.normalize(torch.randn(b, 128, generator=g), dim=1)
            old_args = [q] + [values[p] for p in base_params[1:]]
            new_args = (q, xt, lab, onehot, counts, 0.05, 5, None, order, starts, kcs, 0.5)
            old_out, new_out = base(*old_args), here(*new_args)
            diff = max(float((o.float() - n.float()).abs().max()) for o, n in
                       zip(old_out, new_out, strict=True))  # fmt: skip
            row = {"round": r + 1, "batch": b,
                   "base_ms": round(_ms(lambda x=old_args: base(*x), a.repeat), 3),
                   "this_ms": round(_ms(lambda x=new_args: here(*x), a.repeat), 3),
                   "max_abs_difference": diff}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    if a.json:
        a.json.write_text(json.dumps({"items": a.items, "labels": c, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
