"""`snca-gallery learn`: the served model learns from what its gallery holds now, in one
operation that switches live only to a model that is not worse.

    export  the live gallery at one point in time, the trained items' images included (from
            their dataset) and a held-out share of every label of 4+ items set aside (one at least)
            (snca-gallery export --trained --hold-out F, run by snca-train itself)
    train   snca-train --dataset gallery --gallery-trained --init SERVED: NCA from the served
            model, on every live item with its label now (trained, added, corrected)
    index   snca-build-index: the gallery's trained items re-embedded under their own dataset
            keys (a carry finds them as any trained item); the added ones come from the store
    compare both models on the held-out items (each against its own gallery minus the held-out
            items, the served vote): top-1 on the held-out trained items ("base") and added
            ones ("added"), their harmonic mean; the new model must be at least as good
    switch  snca-gallery upgrade --to NEW --switch (the carry: every write made meanwhile is
            carried, nothing acknowledged is lost; rollback switches back)

Each step leaves its result in the run dir OUT (`OUT/learn.json` says which are done), so a
learn killed anywhere is run again with the same OUT and goes on from the last step done (the
training itself resumes from its checkpoint; the carry from its last write). Training and
indexing run as their own commands (the stages never import each other); their output is
passed on line by line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from embedding.errors import SNCAError
from service.tools.gallery_ops import _open_home, _runtime, settings_of, upgrade

STATE = "learn.json"
MIN_ITEMS = 20  # a gallery with fewer live items has nothing to learn from
STEPS = ("trained", "indexed", "compared", "switched")
# class-balanced draws in training (snca-train --balance; 1: every label drawn as often, the better
# of 0.5 and 1 measured, docs/RESULTS.md): a label users made of 50 images
# beside trained classes of 6,000 is otherwise drawn 120 times less often than each of them
BALANCE = 1.0


def served(args: dict, say) -> tuple[Path, Path, object]:
    """(model dir, index dir, settings) of the model whose gallery is live (the alias's, when
    an upgrade switched to another model than --model, or the one the gallery was last
    carried to: startup.follow_alias)."""
    from service.startup import follow_alias

    settings = settings_of(args, follow_alias=True)
    _, _, home = _open_home(settings)  # (says plainly when there is no gallery)
    home.close()
    moved = follow_alias(settings)
    if moved:
        say(f"{moved}: learning from it")
    return Path(settings.model), Path(settings.index), settings


def default_out(model: Path, version: int) -> Path:
    """runs/<name>-learned-v<gallery version>, beside the served model's run dir."""
    base = model.resolve().name.split("-learned-v")[0]
    return model.resolve().parent / f"{base}-learned-v{version}"


def _state(out: Path) -> dict:
    try:
        return json.loads((out / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _save(out: Path, st: dict) -> None:
    from embedding.files import atomic_write_json

    atomic_write_json(out / STATE, st)


def _stream(cmd: list[str], say, what: str) -> None:
    """Run `cmd`, passing its output on line by line; SNCAError naming `what` if it fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    except OSError as e:
        raise SNCAError(f"cannot run {what}: {e}") from None
    for line in p.stdout:
        say("  " + line.rstrip())
    if p.wait() != 0:
        raise SNCAError(f"{what} failed (exit status {p.returncode}; its output is above)")


def learn(args: dict, say=print) -> int:
    """One learn at a time per data dir (service/learn_job.py's lock: the page's start too)."""
    from service.learn_job import held

    settings = settings_of(args)
    with held(settings.data_dir) as mine:
        if not mine:
            raise SNCAError(
                f"a learn is running on {settings.data_dir} already (started from the page or "
                "another terminal): wait for it (GET /admin/learn says how far it is)"
            )
        return _learn(args, say)


def _learn(args: dict, say) -> int:
    model, index, settings = served(args, say)
    version, live = _gallery_size(settings)
    if live < MIN_ITEMS:
        raise SNCAError(
            f"the gallery holds {live} live items: too few to learn from (at least {MIN_ITEMS}; "
            "register more images, then learn)"
        )
    out = Path(args.get("out") or default_out(model, version)).resolve()
    st = _state(out)
    if st.get("served") not in (None, str(model.resolve())):
        raise SNCAError(
            f"{out} was learned from {st['served']}, not from {model}: choose another --out"
        )
    st.update(served=str(model.resolve()), served_index=str(index.resolve()))
    epochs = int(args.get("epochs") or 3)
    hold = float(args.get("hold_out") if args.get("hold_out") is not None else 0.1)
    took = st.setdefault("seconds", {})

    def done(step: str, t: float) -> None:
        took[step] = round(took.get(step, 0.0) + time.monotonic() - t, 1)
        say(f"  ({step}: {took[step]:.0f} s)")
        _save(out, st)

    if not st.get("trained"):
        say(f"learn 1/4: training {out.name} from {model.name} on the gallery ({epochs} epochs)")
        t = time.monotonic()
        _train(args, settings, model, out, epochs, hold, say)
        st["trained"] = True
        done("trained", t)
    if not st.get("indexed"):
        say("learn 2/4: indexing the gallery's trained items with the new model")
        t = time.monotonic()
        thumbs = ["--thumbnails"] if settings.thumbnails else []
        cmd = [sys.executable, "-m", "index_builder", str(out), "--reuse", *thumbs]
        _stream([*cmd, _progress(args)], say, "snca-build-index")
        st["indexed"] = True
        done("indexed", t)
    if "compared" not in st:
        say("learn 3/4: comparing the served model and the new one on the held-out items")
        t = time.monotonic()
        st["compared"] = compare(args, settings, model, index, out, say)
        done("compared", t)
    c = st["compared"]
    better, why = decide(c, float(args.get("min_gain") or 0.0))
    say(f"held-out items: served {_said(c['old'])}; learned {_said(c['new'])}{why}")
    if not better:
        say(f"learn: the served model stays ({model}); the learned one is kept in {out}")
        return 0
    if args.get("switch") is False:
        say(f"learn: not switched (--no-switch): snca-gallery upgrade --to {out} --switch")
        return 0
    if not st.get("switched"):
        say(
            f"learn 4/4: switching the live gallery to {out.name} (the writes made meanwhile carried)"
        )
        up = {k: v for k, v in args.items() if k not in ("out", "epochs", "hold_out", "cmd")}
        t = time.monotonic()
        upgrade(
            {**up, "model": str(model), "index": str(index), "to": str(out), "switch": True}, say
        )
        st["switched"] = True
        done("switched", t)
    say(f"learn: done, {out} serves the gallery (snca-gallery rollback switches back)")
    return 0


def _progress(args: dict) -> str:
    return "--progress" if args.get("progress", True) else "--no-progress"


def _said(r: dict) -> str:
    parts = [
        f"{name} {100 * r[name]:.1f}%" for name in ("base", "added") if r.get(name) is not None
    ]
    return ", ".join(parts) + (f", H {r['h']:.3f}" if r.get("h") is not None else "")


def _gallery_size(settings) -> tuple[int, int]:
    """(gallery version, live items) of the live gallery."""
    s = _live_store(settings)
    try:
        n = s.select("SELECT COUNT(*) FROM items WHERE deleted_seq IS NULL")[0][0]
        return s.last_seq(), int(n)
    finally:
        s.close()


def _train(args: dict, settings, model: Path, out: Path, epochs: int, hold: float, say) -> None:
    from embedding.rundir import RunDir

    cmd = [sys.executable, "-m", "training", "--dataset", "gallery", "--init", str(model)]
    cmd += ["--data-dir", str(settings.data_dir), "--gallery-trained", "--epochs", str(epochs)]
    cmd += ["--gallery-hold-out", str(hold)] if hold else []
    cmd += ["--store", settings.store_url] if settings.store_url else []
    cmd += ["--val-size", "0", "--out", str(out), _progress(args)]
    balance = args.get("balance")
    cmd += ["--balance", str(BALANCE if balance is None else balance)]
    if (out / RunDir.SUMMARY).is_file():
        return  # (trained before a kill that came before learn.json said so)
    if out.with_name(out.name + ".partial").is_dir():
        cmd.append("--resume")  # (a killed learn: training goes on from its checkpoint)
    if args.get("seed") is not None:
        cmd += ["--seed", str(args["seed"])]
    _stream(cmd, say, "snca-train")


def compare(args: dict, settings, model: Path, index: Path, out: Path, say) -> dict:
    """Top-1 of the served and the learned model on the held-out items (export's heldout/):
    each model votes against its own gallery without them (the served: the live gallery's
    stored vectors; the learned: its index's trained items and the added ones re-embedded, as
    the carry will), with the served vote and k."""
    from embedding.index import open_index_dir
    from embedding.rundir import RunDir

    export = out.with_name(out.name + ".gallery")
    rows = [json.loads(x) for x in (export / "items.jsonl").read_text().splitlines() if x]
    held = [r for r in rows if r.get("held_out")]
    if not held:
        return {"old": {}, "new": {}, "held_out": 0}
    images = [(export / r["image"]).read_bytes() for r in held]
    kinds = ["base" if r["source"] == "trained" else "added" for r in held]
    truth = [r["label"] for r in held]
    held_ids = {r["id"] for r in held}
    held_keys = {_key(r.get("metadata")) for r in held if r["source"] == "trained"}
    res = {}
    for name, (run, ix_dir) in (("old", (model, index)), ("new", (out, out / "index"))):
        m = RunDir(run).load_model()
        ix = open_index_dir(ix_dir, expected_fingerprint=m.fingerprint)
        rt = _runtime(args, run, ix_dir, ix, m)
        try:
            q, _, errs = rt.embed_stored(images)
            if any(e is not None for e in errs):
                raise SNCAError(
                    f"a held-out image cannot be read by {run}: {next(e for e in errs if e)}"
                )
            g, labels = _gallery(settings, name, ix, rt, held_ids, held_keys)
        finally:
            rt.close()
        res[name] = _score(q, g, labels, truth, kinds, m.config.temperature, settings)
        say(f"  {name}: {run.name}: {len(g)} gallery items, {_said(res[name])}")
    return {"old": res["old"], "new": res["new"], "held_out": len(held)}


def decide(c: dict, min_gain: float = 0.0) -> tuple[bool, str]:
    """Whether the learned model may serve: its held-out score (H, or the one top-1 there is)
    at least the served one's plus `min_gain`; and why not, in words. No held-out item (every
    label under 4 items): not unless `min_gain` < 0 (nothing shows it is not worse)."""
    if not c.get("held_out"):  # (no evidence: switched only when asked to take a worse one)
        if min_gain < 0:
            return True, " (no held-out item to compare on; switched: --min-gain below 0)"
        return False, (
            " — nothing to compare on: every label has fewer than 4 items (register more, or "
            "--min-gain -1 to switch without a comparison)"
        )
    old, new = _value(c["old"]), _value(c["new"])
    if new >= old + min_gain:
        return True, ""
    need = f" + {min_gain:g} (--min-gain)" if min_gain else ""
    return False, f" — not better: {new:.3f} < {old:.3f}{need}"


def _key(md) -> tuple | None:
    md = md or {}
    return (md.get("dataset"), md.get("dataset_index")) if "dataset_index" in md else None


def _gallery(settings, which: str, ix, rt, held_ids: set, held_keys: set):
    """(embeddings (N, d), labels) of a model's gallery without the held-out items: the served
    model's, the live store's vectors; the learned one's, its index's trained items (with the
    live gallery's labels of them now) and the live added items re-embedded by it."""
    from service.store.records import vec

    live = _live_store(settings)
    try:
        with live.reader() as r:
            items = [it for it in r.live_items() if it.id not in held_ids]
            trained_now = r.conn.execute(
                "SELECT metadata, label FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
            ).fetchall()
            added, after = [], -1
            while which == "new":
                page = r.added_items(after, 500)
                if not page:
                    break
                added += [it for it in page if it.id not in held_ids and it.image is not None]
                after = page[-1].id
    finally:
        live.close()
    if which == "old":
        return np.stack([it.embedding for it in items]), [it.label for it in items]
    labels_now = {_key(json.loads(md) if md else None): lab for md, lab in trained_now}
    import sqlite3

    # (the index dir's seed store, read without a write: its checksum is in the manifest)
    conn = sqlite3.connect(f"file:{ix.store}?mode=ro&immutable=1", uri=True)
    try:
        rows = conn.execute(
            "SELECT metadata, embedding FROM items WHERE source = 'trained'"
        ).fetchall()
    finally:
        conn.close()
    emb, labels = [], []
    for md, e in rows:
        k = _key(json.loads(md) if md else None)
        if k in held_keys or k not in labels_now:
            continue  # (held out, or deleted since the export)
        emb.append(vec(e))
        labels.append(labels_now[k])
    if added:
        ae, _, errs = rt.embed_stored([it.image for it in added])
        emb += list(ae)
        labels += [it.label for it, err in zip(added, errs, strict=True) if err is None]
    return np.stack(emb).astype(np.float32), labels


def _live_store(settings):
    """The live gallery's store (the alias's, else the home store), opened as found."""
    from service.store.galleries import live_gen
    from service.store.registry import open_as_found
    from service.tools.gallery_ops import _gallery_target

    cls, home, h = _open_home(settings)
    try:
        target = _gallery_target(cls, home, h, live_gen(h))
    finally:
        h.close()
    return open_as_found(target)


def _score(
    q, g, labels: list[str], truth: list[str], kinds: list[str], sigma: float, settings
) -> dict:
    """Top-1 of the served vote on the queries q against gallery g, per kind, and their H."""
    import torch

    from embedding.votes import GalleryView, get_rule

    names = sorted(set(labels) | set(truth))
    ids = {n: i for i, n in enumerate(names)}
    view = GalleryView.of(
        torch.from_numpy(np.ascontiguousarray(g)),
        torch.tensor([ids[x] for x in labels]),
        len(names),
        sigma,
    )
    rule = get_rule(settings.vote)
    qt = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
    pred = torch.cat(
        [rule.probs(qt[s : s + 512], view, settings.k).argmax(1) for s in range(0, len(qt), 512)]
    )
    ok = np.array([names[int(p)] == t for p, t in zip(pred, truth, strict=True)])
    kinds_a = np.array(kinds)
    out = {}
    for kind in ("base", "added"):
        m = kinds_a == kind
        out[kind] = float(ok[m].mean()) if m.any() else None
        out[f"{kind}_items"] = int(m.sum())
    vals = [v for v in (out["base"], out["added"]) if v is not None]
    out["h"] = (
        2 * vals[0] * vals[1] / (vals[0] + vals[1])
        if len(vals) == 2 and sum(vals) > 0
        else (vals[0] if vals else None)
    )
    return out


def _value(r: dict) -> float:
    return -math.inf if r.get("h") is None else float(r["h"])


COMMANDS = {"learn": learn}
