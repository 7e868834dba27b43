"""Is this something new? The open-set measurements of docs/RESULTS.md (issue 21).

    # a new label must not swallow an old one: register 1 or 5 images of a trained class under
    # a new name; the share of that class's queries the new label takes, per rule
    python benchmarks/open_set.py overlap runs/demo --split val
    # open-set recognition on a 7-class model: near OOD (its 3 held-out classes), far OOD (noise,
    # flat, inverted, scikit-learn's handwritten digits), anchors from the softmax baseline
    python benchmarks/open_set.py ood runs/base7b-nca --softmax runs/base7b-softmax --split val
    # what the score costs on the hot path (the compiled kde call, batch of 64, 55,000 items)
    python benchmarks/open_set.py cost

Everything runs through the service's own Gallery (service/gallery: the vote, the open-set
score, the leave-one-out calibration), on a Flat index of the run's gallery, so what is measured
is what /classify answers. The gallery is the training images re-embedded (`--source
recompute`, what snca-build-index builds by default) unless `--source memory`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.datasets import TensorSource, load_raw
from embedding.index import tune_faiss
from embedding.inference import embed_images
from embedding.rundir import RunDir
from embedding.transforms import eval_transform
from embedding.votes import VOTES
from embedding.votes.kde_shrunk import KdeShrunk
from service.gallery.gallery import Gallery
from service.gallery.vectors import VectorIndex
from service.store import Item
from training.datasets import build_data
from training.evaluate import run_config
from training.fewshot import embed_positions


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data
def gallery_of(run: Path, source: str):
    """(model, cfg, data, raw, gallery (N, d), gallery labels (N,) in the run's class order)."""
    rd = RunDir(run)
    model = rd.load_model()
    cfg = run_config(run)
    data = build_data(cfg)
    raw = data.train.raw
    bank = rd.load_memory()
    g = bank.embeddings if source == "memory" else embed_positions(model, raw, bank.indices.numpy())
    return model, cfg, data, raw, g, bank.labels


def make_gallery(
    g: torch.Tensor, y: torch.Tensor, names: list[str], temperature: float, k: int,
    world=None, world_tpr: float = 0.99,
):  # fmt: skip
    """A service Gallery (Flat index) holding rows g (N, d) with labels y (N,) named `names`
    (with the world check's fit `world`, when given)."""
    import faiss

    tune_faiss()
    d = g.shape[1]
    gal = Gallery(VectorIndex(faiss.IndexIDMap2(faiss.IndexFlatIP(d)), {}), d, temperature,
                  unknown_k=k, world=world, world_tpr=world_tpr)  # fmt: skip
    emb = g.numpy().astype(np.float32)
    ids = np.arange(len(emb), dtype=np.int64)
    gal.vectors.add(ids, emb)  # the trained items, as a start-up loads them (source trained)
    lab = y.numpy()
    gal.load_items([Item(int(i), names[int(lab[i])], "trained", None, emb[i]) for i in ids])
    return gal


def add_label(gal: Gallery, name: str, emb: np.ndarray, stats=None) -> None:
    start = int(gal.rows.ids.max()) + 1 if gal.rows.n else 0
    gal.apply_add(list(range(start, start + len(emb))), name, emb.astype(np.float32),
                  gal.version + 1, stats)  # fmt: skip


def far_ood_images(test_images: np.ndarray, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """uint8 (m, 28, 28) far-out-of-distribution inputs: uniform noise, flat greys, inverted
    test images, scikit-learn's real handwritten digits (8x8, 0..16) upsampled to 28x28."""
    from PIL import Image
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(seed)
    digits = load_digits().images  # (1797, 8, 8) 0..16
    up = np.stack(
        [
            np.asarray(
                Image.fromarray((im * 255.0 / 16.0).astype(np.uint8)).resize(
                    (28, 28), Image.BILINEAR
                )
            )
            for im in digits[:n]
        ]
    )
    pick = rng.choice(len(test_images), n, replace=False)
    return {
        "noise": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        "flat": np.repeat(np.linspace(0, 255, n).astype(np.uint8), 28 * 28).reshape(n, 28, 28),
        "inverted": 255 - test_images[pick],
        "digits": up,
    }


def embed_arrays(fn, model_cfg, images: np.ndarray) -> torch.Tensor:
    """uint8 (m, H, W) -> fn's outputs (m, D) through the eval transform (the service's)."""
    src = TensorSource(torch.from_numpy(images).unsqueeze(1))
    return embed_images(fn, src, np.arange(len(images)), eval_transform(model_cfg),
                        torch.device("cpu"), 512)  # fmt: skip


# ---------------------------------------------------------------- metrics
def auroc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of an in-distribution input > score of an OOD one), ties half (Mann-Whitney)."""
    allv = np.concatenate([pos, neg])
    ranks = np.empty(len(allv))
    order = np.argsort(allv, kind="mergesort")
    ranks[order] = np.arange(1, len(allv) + 1)
    # average ranks of ties
    _, inv, cnt = np.unique(allv, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    ranks = (sums / cnt)[inv]
    r = ranks[: len(pos)].sum()
    return float((r - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def fpr_at(pos: np.ndarray, neg: np.ndarray, tpr: float = 0.95) -> float:
    """Share of OOD inputs accepted at the threshold that accepts `tpr` of in-distribution."""
    t = np.quantile(pos, 1.0 - tpr, method="lower")
    return float((neg >= t).mean())


# ---------------------------------------------------------------- overlap
def overlap(a) -> dict:
    """Register `shots` images of a trained class under a new name; the share of the class's
    other queries that the new label takes, per rule (and the share of other classes' queries)."""
    model, cfg, data, raw, g, gy = gallery_of(a.run, a.source)
    names = list(data.model_cfg.class_names)
    t = model.config.temperature
    if a.split == "val":
        q, qy = embed_positions(model, raw, data.val.positions), torch.from_numpy(data.val.labels)
        shot_q, shot_y = q, qy
    else:
        test = load_raw(cfg.dataset, "test", cfg.data_dir)
        q = embed_positions(model, test, np.arange(len(test.targets)))
        qy = torch.from_numpy(np.array([names.index(test.class_names[c]) for c in test.targets]))
        # shots from the validation split: never the queries
        shot_q, shot_y = (
            embed_positions(model, raw, data.val.positions),
            torch.from_numpy(data.val.labels),
        )
    rules = [r.strip() for r in a.rules.split(",")]
    gal = make_gallery(g, gy, names, t, 10)
    rng = np.random.default_rng(a.seed)
    out: dict = {}
    for shots in [int(s) for s in a.shots.split(",")]:
        res = {r: {"taken": [], "others": []} for r in rules}
        per_class = {r: {} for r in rules}
        for c, name in enumerate(names):
            pool = np.nonzero((shot_y == c).numpy())[0]
            for _ in range(a.draws):
                pick = rng.choice(pool, shots, replace=False)
                sub = make_sub(gal)
                add_label(sub, "new-label", shot_q[pick].numpy())
                mine = (qy == c).numpy()
                if a.split == "val":
                    mine[pick] = False  # the shots are not queries
                mine = np.nonzero(mine)[0]
                others = rng.choice(np.nonzero((qy != c).numpy())[0], a.others, replace=False)
                qq = q[np.concatenate([mine, others])]
                for r in rules:
                    took = classify_all(sub, qq, r)[0] == "new-label"
                    res[r]["taken"].append(float(took[: len(mine)].mean()))
                    res[r]["others"].append(float(took[len(mine) :].mean()))
                    per_class[r].setdefault(name, []).append(float(took[: len(mine)].mean()))
        out[shots] = {
            r: {
                "taken": float(np.mean(v["taken"])),
                "taken_max_class": max(float(np.mean(x)) for x in per_class[r].values()),
                "others": float(np.mean(v["others"])),
                "per_class": {n: float(np.mean(x)) for n, x in per_class[r].items()},
            }
            for r, v in res.items()
        }
        for r, v in out[shots].items():
            log(
                f"{shots}-shot {r:10s}: takes {100 * v['taken']:.1f}% of its class's queries "
                f"(worst class {100 * v['taken_max_class']:.1f}%), {100 * v['others']:.2f}% of "
                "the others'"
            )
    return out


def make_sub(gal: Gallery) -> Gallery:
    """A copy of `gal` to add a label to (the base rows are shared, not re-added)."""
    import copy

    sub = copy.copy(gal)
    sub.vectors = VectorIndex(_clone_index(gal.vectors.index), {})
    sub.rows = copy.deepcopy(gal.rows)
    sub.stats = copy.deepcopy(gal.stats)
    sub.openset = copy.deepcopy(gal.openset)
    sub._snapshot = None
    sub._thresholds = {}
    from service.gallery.lock import RWLock

    sub.lock = RWLock()
    return sub


def _clone_index(index):
    import faiss

    return faiss.clone_index(index)


def classify_all(gal: Gallery, q: torch.Tensor, rule: str):
    """(labels, label ids, probabilities, scores, best similarities) of every query."""
    res = []
    for s in range(0, len(q), 1000):
        res += gal.classify(q[s : s + 1000].contiguous(), rule, 30)
    return (
        np.array([c.label for c in res], dtype=object),
        np.array([c.label_id for c in res]),
        np.array([c.confidence for c in res]),
        np.array([-2.0 if c.unknown_score is None else c.unknown_score for c in res]),
        np.array([c.best_similarity for c in res]),
    )


# ---------------------------------------------------------------- ood
def ood(a) -> dict:
    model, cfg, data, raw, g, gy = gallery_of(a.run, a.source)
    names = list(data.model_cfg.class_names)
    t = model.config.temperature
    base_ids = [raw.class_names.index(n) for n in names]
    novel_ids = [c for c in range(len(raw.class_names)) if c not in base_ids]
    test = load_raw(cfg.dataset, "test", cfg.data_dir)
    rng = np.random.default_rng(a.seed)
    # in-distribution queries and near-OOD inputs
    if a.split == "val":
        id_pos = data.val.positions
        id_src = raw
        novel_train = np.nonzero(np.isin(raw.targets, novel_ids))[0]
        near_pos, near_src = rng.choice(novel_train, a.near, replace=False), raw
        far_src_images = raw.source.images[rng.choice(data.val.positions, a.far, replace=False)]
    else:
        id_pos = np.nonzero(np.isin(test.targets, base_ids))[0]
        id_src = test
        near_pos, near_src = np.nonzero(np.isin(test.targets, novel_ids))[0], test
        far_src_images = test.source.images[np.nonzero(np.isin(test.targets, base_ids))[0]]
    far_src_images = np.asarray(far_src_images).reshape(len(far_src_images), 28, 28)
    fars = far_ood_images(far_src_images, a.far, a.seed)
    log(f"embedding: {len(id_pos)} in-distribution, {len(near_pos)} near OOD, far OOD "
        + ", ".join(f"{k} {len(v)}" for k, v in fars.items()))  # fmt: skip
    q_id = embed_positions(model, id_src, id_pos)
    q_near = embed_positions(model, near_src, near_pos)
    q_far = {k: embed_arrays(model, model.config, v) for k, v in fars.items()}
    out: dict = {"split": a.split, "source": a.source, "n_id": len(q_id), "n_near": len(q_near)}
    sets = {"near": q_near, **{f"far:{k}": v for k, v in q_far.items()}}
    # softmax anchors: maximum softmax probability and energy of the baseline's classifier
    anchors = {}
    if a.softmax:
        srd = RunDir(a.softmax)
        sm = srd.load_model()
        from safetensors.torch import load_file

        w = load_file(str(srd.classifier))

        def logits_of(src, pos=None, arrays=None):
            z = (
                embed_images(sm.project, src.source, pos, eval_transform(sm.config),
                             torch.device("cpu"), 512)
                if arrays is None
                else embed_arrays(sm.project, sm.config, arrays)
            )  # fmt: skip
            return z @ w["weight"].T + w["bias"]

        lid = logits_of(id_src, id_pos)
        lsets = {"near": logits_of(near_src, near_pos)}
        for k, v in fars.items():
            lsets[f"far:{k}"] = logits_of(None, arrays=v)
        anchors["softmax MSP"] = (
            torch.softmax(lid, 1).max(1).values.numpy(),
            {k: torch.softmax(v, 1).max(1).values.numpy() for k, v in lsets.items()},
        )
        anchors["softmax energy"] = (
            torch.logsumexp(lid, 1).numpy(),
            {k: torch.logsumexp(v, 1).numpy() for k, v in lsets.items()},
        )
    scores: dict[str, tuple] = dict(anchors)
    calibrated = {}
    for k in [int(x) for x in a.ks.split(",")]:
        gal = make_gallery(g, gy, names, t, k)
        _, lid_id, p_id, s_id, b_id = classify_all(gal, q_id, a.vote)
        per = {n: classify_all(gal, v, a.vote) for n, v in sets.items()}
        scores[f"kNN label k={k}"] = (s_id, {n: v[3] for n, v in per.items()})
        if k == a.k:
            scores["vote top-1 probability"] = (p_id, {n: v[2] for n, v in per.items()})
            scores["best cosine (SNCA_UNKNOWN_SIMILARITY)"] = (
                b_id,
                {n: v[4] for n, v in per.items()},
            )

            # Sun et al. exactly: the k-th nearest of the whole gallery
            def kth(qq, kk=k, gal=gal):
                sims, _ = gal.vectors.search(qq.numpy(), kk)
                return sims[:, kk - 1]

            scores[f"kNN global k={k} (Sun et al.)"] = (
                kth(q_id),
                {n: kth(v) for n, v in sets.items()},
            )
            th = gal.thresholds(a.tpr)
            acc_id = s_id >= th[lid_id]
            calibrated = {
                "k": k,
                "tpr_target": a.tpr,
                "id_accepted": float(acc_id.mean()),
                "rejected": {n: float((v[3] < th[v[1]]).mean()) for n, v in per.items()},
                "fixed_0.5_rejected": {
                    "id": float((b_id < 0.5).mean()),
                    **{n: float((v[4] < 0.5).mean()) for n, v in per.items()},
                },
                "thresholds": {names[c]: float(th[c]) for c in range(len(names))},
            }
            if a.register:
                calibrated["after_registration"] = register_novel(
                    a, model, gal, raw, novel_ids, q_id, lid_id, s_id, th, q_near, per["near"], rng
                )
    table = {}
    for name, (sid, sets_) in scores.items():
        near = sets_["near"]
        far = np.concatenate([v for n, v in sets_.items() if n.startswith("far:")])
        table[name] = {
            "near_auroc": auroc(sid, near),
            "near_fpr95": fpr_at(sid, near),
            "far_auroc": auroc(sid, far),
            "far_fpr95": fpr_at(sid, far),
            **{f"{n}_auroc": auroc(sid, v) for n, v in sets_.items() if n.startswith("far:")},
        }
        r = table[name]
        log(f"{name:40s} near AUROC {r['near_auroc']:.3f} FPR95 {r['near_fpr95']:.3f} | far "
            f"AUROC {r['far_auroc']:.3f} FPR95 {r['far_fpr95']:.3f}")  # fmt: skip
    out["scores"] = table
    out["calibrated"] = calibrated
    c = calibrated
    if c:
        log(f"calibrated (k={c['k']}, TPR {c['tpr_target']}): in-distribution accepted "
            f"{100 * c['id_accepted']:.1f}%; rejected: "
            + ", ".join(f"{n} {100 * v:.1f}%" for n, v in c["rejected"].items()))  # fmt: skip
    return out


def register_novel(a, model, gal, raw, novel_ids, q_id, lid_id, s_id, th, q_near, near_res, rng):
    """Register each held-out class from `a.register` training images; how many of the
    near-OOD (held-out class) queries are unknown before and after, and the in-distribution
    acceptance before and after."""
    before_unknown = float((near_res[3] < th[near_res[1]]).mean())
    sub = make_sub(gal)
    for c in novel_ids:
        pool = np.nonzero(raw.targets == c)[0]
        pick = rng.choice(pool, a.register, replace=False)
        add_label(sub, f"new:{raw.class_names[c]}", embed_positions(model, raw, pick).numpy())
    th2 = sub.thresholds(a.tpr)
    lab, lid, _, s, _ = classify_all(sub, q_near, a.vote)
    _, lid_b, _, s_b, _ = classify_all(sub, q_id, a.vote)
    res = {
        "shots": a.register,
        "near_unknown_before": before_unknown,
        "near_unknown_after": float((s < th2[lid]).mean()),
        "near_to_new_labels": float(np.mean([str(x).startswith("new:") for x in lab])),
        "id_accepted_before": float((s_id >= th[lid_id]).mean()),
        "id_accepted_after": float((s_b >= th2[lid_b]).mean()),
    }
    log(
        f"after registering {a.register} images of each held-out class: held-out queries "
        f"unknown {100 * res['near_unknown_before']:.1f}% -> {100 * res['near_unknown_after']:.1f}%"
        f" ({100 * res['near_to_new_labels']:.1f}% to the new labels); known accepted "
        f"{100 * res['id_accepted_before']:.1f}% -> {100 * res['id_accepted_after']:.1f}%"
    )
    return res


# ---------------------------------------------------------------- world (issue 28)
def world_fit_of(run: Path, model, raw, g_indices: np.ndarray, labels: np.ndarray, seed: int):
    """The run dir's world.safetensors, else fitted as snca-build-index does (80/20 of the
    training images)."""
    from embedding import world

    rd = RunDir(run)
    if rd.world.is_file():
        return world.load(rd.world, model.fingerprint), "run dir (validation-calibrated)"
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(g_indices))
    cut = int(0.8 * len(order))
    fit_rows, cal_rows = order[:cut][:20000], order[cut:][:5000]
    w = world.fit_from_images(model, raw.source, g_indices[fit_rows], g_indices[cal_rows],
                              labels[cal_rows], torch.device("cpu"))  # fmt: skip
    return w, "fitted on training images (as snca-build-index for an old run)"


def vectors_and_stats(model, images_u8: torch.Tensor):
    """uint8 (m, C, H, W) at the model's size -> (unit vectors (m, d), statistics (m, D))."""
    from embedding import world
    from embedding.transforms import normalize_batch

    return world.collect(
        model, [normalize_batch(images_u8[s : s + 1000], model.config)
                for s in range(0, len(images_u8), 1000)]
    )  # fmt: skip


def photo_sets(model_cfg, seed: int) -> dict[str, torch.Tensor]:
    """Real photographs (scikit-image's, shipped in its wheel) as the service would see them:
    random crops of 14 photos (not the cup), 40 portraits (LFW); uint8 at the model's size."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))
    import skimage.data
    from photos import OTHERS, crops, photo
    from PIL import Image

    from embedding.transforms import eval_geometry

    geo = eval_geometry(model_cfg)
    pics = [c for i, n in enumerate(OTHERS) for c in crops(photo(n), 20, seed + i)]
    faces = [Image.fromarray((f * 255).astype(np.uint8)) for f in skimage.data.lfw_subset()[:40]]
    return {
        "photos": torch.stack([geo(p) for p in pics]),
        "portraits": torch.stack([geo(p) for p in faces]),
    }


def world(a) -> dict:
    """Both checks together, as /classify answers (service Gallery, SNCA defaults): known
    images accepted; every outlier family, real digits and photographs flagged unknown; near
    OOD (held-out classes of a partial model); the registration case of a photographed cup."""
    from embedding import outliers

    model, cfg, data, raw, g, gy = gallery_of(a.run, "recompute")
    names = list(data.model_cfg.class_names)
    bank = RunDir(a.run).load_memory()
    fit, how = world_fit_of(a.run, model, raw, bank.indices.numpy(), gy.numpy(), a.seed)
    log(f"world statistics: {how}; D = {len(fit.mean)}, same_radius {fit.same_radius:.2f}, "
        f"spread {fit.spread:.2f}")  # fmt: skip
    gal = make_gallery(g, gy, names, model.config.temperature, 10, fit, a.world_tpr)
    test = load_raw(cfg.dataset, "test", cfg.data_dir)
    base_ids = [raw.class_names.index(n) for n in names]
    novel_ids = [c for c in range(len(raw.class_names)) if c not in base_ids]
    if a.split == "val":
        src, id_pos = raw, data.val.positions
        near_pos = np.nonzero(np.isin(raw.targets, novel_ids))[0]
    else:
        src, id_pos = test, np.nonzero(np.isin(test.targets, base_ids))[0]
        near_pos = np.nonzero(np.isin(test.targets, novel_ids))[0]
    rng = np.random.default_rng(a.seed)
    id_pos = id_pos[rng.permutation(len(id_pos))[: a.known]]
    near_pos = near_pos[rng.permutation(len(near_pos))[: a.known]]

    def u8(positions):
        return torch.stack([src.source.get(int(i)) for i in positions])

    x_id = u8(id_pos)
    sets: dict[str, torch.Tensor] = {}
    if len(near_pos):
        sets["near: held-out classes"] = u8(near_pos)
    gen = torch.Generator().manual_seed(a.seed)
    base = x_id[torch.randperm(len(x_id), generator=gen)[: a.per]]
    for fam in outliers.FAMILIES:
        tag = "held out" if fam in outliers.HELD_OUT else "trained" if a.oe else "generated"
        sets[f"{fam} ({tag})"] = outliers.FAMILIES[fam](base.clone(), gen)
    far = far_ood_images(np.asarray(x_id[:, 0]), a.per, a.seed)
    sets["digits (scikit-learn)"] = torch.from_numpy(far["digits"]).unsqueeze(1)
    if model.config.in_channels == 1:
        sets.update(photo_sets(model.config, a.seed))
    true_names = [raw.class_names[t] for t in src.targets[id_pos]]

    def judge(x):
        v, st = vectors_and_stats(model, x)
        res = []
        for s0 in range(0, len(v), 1000):
            res += gal.classify(v[s0 : s0 + 1000].contiguous(), a.vote, 30, None, False,
                                st[s0 : s0 + 1000].numpy())  # fmt: skip
        th = gal.thresholds(a.tpr)
        label_ok = np.array([c.unknown_score is None or c.unknown_score >= th[c.label_id]
                             for c in res])  # fmt: skip
        world_ok = np.array([c.world.ok for c in res])
        scores = np.array([-2.0 if c.unknown_score is None else c.unknown_score for c in res])
        return res, label_ok, world_ok, scores

    res_id, lab_id, wor_id, s_id = judge(x_id)
    top1 = float(np.mean([c.label == t for c, t in zip(res_id, true_names, strict=True)]))
    out = {
        "run": str(a.run), "split": a.split, "world": how, "world_tpr": a.world_tpr,
        "tpr": a.tpr, "vote": a.vote, "known": len(x_id), "top1": top1,
        "known_accepted": {"label": float(lab_id.mean()), "world": float(wor_id.mean()),
                           "both": float((lab_id & wor_id).mean())},
        "flagged": {},
    }  # fmt: skip
    log(f"known ({a.split}, {len(x_id)}): top-1 {100 * top1:.2f}%, accepted by the label check "
        f"{100 * lab_id.mean():.1f}%, the world check {100 * wor_id.mean():.1f}%, both "
        f"{100 * (lab_id & wor_id).mean():.1f}%")  # fmt: skip
    for name, x in sets.items():
        _, lab, wor, s = judge(x)
        flagged = ~(lab & wor)
        out["flagged"][name] = {
            "n": len(x),
            "both": float(flagged.mean()),
            "label": float((~lab).mean()),
            "world": float((~wor).mean()),
        }
        if name.startswith("near"):
            out["near_auroc_label_score"] = auroc(s_id, s)
            out["near_fpr95_label_score"] = fpr_at(s_id, s)
        log(f"{name:32s} flagged unknown {100 * flagged.mean():5.1f}% (label check "
            f"{100 * (~lab).mean():5.1f}%, world check {100 * (~wor).mean():5.1f}%)")  # fmt: skip
    if model.config.in_channels == 1:
        out["registration"] = register_photos(a, model, gal)
    return out


def register_photos(a, model, gal) -> dict:
    """Point 3 of issue 28: five crops of one photo of a cup registered as "coffee"; 60 other
    crops of the cup (mirrored at random) and the unrelated photos classified."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))
    from photos import CUP_BOX, crops, photo

    from embedding.transforms import eval_geometry

    geo = eval_geometry(model.config)
    cup = photo("coffee")
    sub = make_sub(gal)
    v, st = vectors_and_stats(model, torch.stack([geo(c) for c in crops(cup, 5, 1, CUP_BOX)]))
    add_label(sub, "coffee", v.numpy(), st.numpy())
    c_id = sub.stats.ids["coffee"]

    def ask(x):
        v, st = vectors_and_stats(model, x)
        res = sub.classify(v, a.vote, 30, None, False, st.numpy())
        th = sub.thresholds(a.tpr)
        ok = [(c.unknown_score is None or c.unknown_score >= th[c.label_id]) and c.world.ok
              for c in res]  # fmt: skip
        return [c.label_id for c in res], np.array(ok)

    lab, ok = ask(torch.stack([geo(c) for c in crops(cup, 60, 2, CUP_BOX, flip=True)]))
    won = float(np.mean([(c == c_id) and k for c, k in zip(lab, ok, strict=True)]))
    other = photo_sets(model.config, a.seed + 100)
    strangers = torch.cat([other["photos"][::4], other["portraits"][:10]])
    lab2, ok2 = ask(strangers)
    res = {"cup_won_and_known": won, "unrelated_known": float(ok2.mean()),
           "unrelated_answered_coffee": float(np.mean([c == c_id for c in lab2])),
           "unrelated": len(strangers)}  # fmt: skip
    log(f"registration: 5 crops of a cup as 'coffee': other cup crops won and known "
        f"{100 * won:.0f}%; {len(strangers)} unrelated photos known {100 * ok2.mean():.0f}% "
        f"(answered 'coffee' {100 * res['unrelated_answered_coffee']:.0f}%)")  # fmt: skip
    return res


def cost(a) -> dict:
    """What the open-set score adds to the service's hot path: the compiled kde call (batch
    `--batch` against `--items` unit rows in 10 labels) and, as the step-by-step path computes
    it, the score alone (embedding.openset.label_kth_grouped), timed back to back in one
    process."""
    from embedding.openset import label_groups, label_kth_grouped
    from embedding.votes import kde_prepare
    from service.gallery.compiled import scripted_kde_top

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(a.items, 128, generator=g), dim=1)
    y = torch.arange(a.items) % 10
    q = torch.nn.functional.normalize(torch.randn(a.batch, 128, generator=g), dim=1)
    lab, counts, onehot = kde_prepare(y, 10, 0.05)
    order, starts = label_groups(y, 10)
    kcs = torch.full((10,), 10)
    full = scripted_kde_top()
    score = torch.jit.script(label_kth_grouped)
    sims = q @ x.T
    xt = x.T.contiguous()  # (d, N): what the service passes (Rows.embeddings_t)
    pred = torch.randint(0, 10, (a.batch,), generator=g)

    def run_full():
        full(q, xt, lab, onehot, counts, 0.05, 5, None, order, starts, kcs, 0.5)

    def run_score():
        score(sims, order, starts, pred, kcs[pred])

    out = {}
    for name, fn in (("kde call with the score", run_full), ("the score alone", run_score)):
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(a.repeat):
            fn()
        out[name] = (time.perf_counter() - t) / a.repeat * 1e3
    share = out["the score alone"] / out["kde call with the score"]
    log(f"batch {a.batch} x {a.items} items, {a.threads} threads: kde call with the score "
        f"{out['kde call with the score']:.1f} ms, the score alone {out['the score alone']:.1f} "
        f"ms ({100 * share:.0f}%)")  # fmt: skip
    return {**out, "share": share, "batch": a.batch, "items": a.items, "threads": a.threads}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overlap", help="a new label registered from a trained class's images")
    o.add_argument("run", type=Path)
    o.add_argument("--split", choices=("val", "test"), default="val")
    o.add_argument("--source", choices=("recompute", "memory"), default="recompute")
    o.add_argument("--rules", default=",".join(VOTES))
    o.add_argument("--shots", default="1,5")
    o.add_argument("--draws", type=int, default=3, help="draws per class")
    o.add_argument("--others", type=int, default=1000, help="queries of other classes per draw")
    o.add_argument("--alpha", type=float, help="kde_shrunk's alpha (default: the rule's)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--json", type=Path)
    d = sub.add_parser("ood", help="open-set recognition: near and far OOD, anchors")
    d.add_argument("run", type=Path, help="a model trained on some classes (--classes)")
    d.add_argument("--softmax", type=Path, help="the softmax baseline on the same classes")
    d.add_argument("--split", choices=("val", "test"), default="val")
    d.add_argument("--source", choices=("recompute", "memory"), default="recompute")
    d.add_argument("--vote", default="kde_shrunk")
    d.add_argument("--ks", default="10", help="k of the score to try (comma-separated)")
    d.add_argument("--k", type=int, default=10, help="k for calibration and the anchors")
    d.add_argument("--tpr", type=float, default=0.95)
    d.add_argument("--near", type=int, default=3000, help="split=val: near-OOD inputs")
    d.add_argument("--far", type=int, default=500, help="inputs per far-OOD kind")
    d.add_argument("--register", type=int, default=5, help="then register N images per "
                   "held-out class (0: no)")  # fmt: skip
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", type=Path)
    w = sub.add_parser("world", help="both checks together (issue 28): families, photos, "
                       "known images, near OOD, a registered photo label")  # fmt: skip
    w.add_argument("run", type=Path)
    w.add_argument("--split", choices=("val", "test"), default="val")
    w.add_argument("--vote", default="kde_shrunk")
    w.add_argument("--tpr", type=float, default=0.95, help="the label check's rate")
    w.add_argument("--world-tpr", type=float, default=0.99, help="the world check's rate")
    w.add_argument("--known", type=int, default=5000, help="known (and near-OOD) queries")
    w.add_argument("--per", type=int, default=500, help="inputs per generated family")
    w.add_argument("--oe", action="store_true", help="the run was trained with outlier "
                   "exposure (labels the trained families in the table)")  # fmt: skip
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--json", type=Path)
    c = sub.add_parser("cost", help="what the open-set score adds to the compiled kde call")
    c.add_argument("--items", type=int, default=55000)
    c.add_argument("--batch", type=int, default=64)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--repeat", type=int, default=30)
    c.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if getattr(a, "alpha", None) is not None:
        KdeShrunk.alpha = a.alpha
    out = {"overlap": overlap, "ood": ood, "cost": cost, "world": world}[a.cmd](a)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
