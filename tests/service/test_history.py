"""The randomized history checker (tests/service/history.py) against real processes, on SQLite
and a real PostgreSQL: concurrent clients write through real servers of two models while the
day-two commands run and processes are killed and stopped; then every acknowledged write is
checked. SNCA_HISTORY_SECONDS (default 15) of faults per backend in `make test`;
`make stress` runs longer, over several seeds. SNCA_HISTORY_SEED replays a schedule."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

from service.store import backup

from .helpers import Backend, replaced_model
from .history import (
    Client,
    Cluster,
    Journal,
    Nemesis,
    answer_of,
    backup_holds,
    check,
    png_of,
    read_live,
    replay_keyed,
    replayable,
    stores_intact,
    trace,
)
from .history import summary as describe

SECONDS = float(os.environ.get("SNCA_HISTORY_SECONDS", "15"))
CLIENTS = 3
TAIL_PAUSE_S = 0.5  # each client's pause between operations after the window


@pytest.fixture(scope="module")
def new_model(base_run, tmp_path_factory):
    """The second model: other weights, and a third of its index's trained images other
    images than the base model's (issue 51: with one index's images a label's delete carried
    by image hid a label change that was not carried by label)."""
    out = tmp_path_factory.mktemp("history") / "run"
    return replaced_model(base_run, out, seed=3, other_images=3)


def seed_of(kind: str) -> int:
    given = os.environ.get("SNCA_HISTORY_SEED")
    return int(given) if given else int.from_bytes(os.urandom(4), "big")


@pytest.fixture(scope="module")
def untrained_models(base_run, new_model, tmp_path_factory):
    """Two models served with nothing trained (`snca-train --init RUN --epochs 0`, an index of
    no vectors: issue 41's start from pretrained weights), of different weights: their
    galleries hold added items only, their world check is fitted on them, and an upgrade
    carries between two stores seeded from empty indexes."""
    from index_builder.build import BuildConfig, build
    from training.cli import main as train

    out = {}
    for name, src in (("a", base_run), ("b", new_model)):
        run = tmp_path_factory.mktemp("untrained") / name
        assert train(["--init", str(src), "--epochs", "0", "--out", str(run), "--no-progress"]) == 0
        build(BuildConfig(run_dir=run, out=run / "index", progress=False), log=lambda m: None)
        out[name] = run
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_no_acknowledged_write_is_lost_under_random_faults(
    kind, request, base_run, new_model, tmp_path, fmnist_train, record_property
):
    pg = request.getfixturevalue("postgres") if kind == "postgresql" else None
    models = {"a": base_run, "b": new_model}
    _history(kind, models, pg, tmp_path, fmnist_train, record_property, trained=True)


@pytest.mark.slow
def test_no_acknowledged_write_is_lost_with_nothing_trained(
    untrained_models, tmp_path, fmnist_train, record_property
):
    """The same checker on two models served with nothing trained (SQLite: the store code
    is the backends' shared one; what differs here is the seed and the world check)."""
    _history("sqlite", untrained_models, None, tmp_path, fmnist_train, record_property, False)


def _history(
    kind: str, models: dict, pg, tmp_path, fmnist_train, record_property, trained: bool
) -> None:
    """`record_property`: pytest's; the seed and the phases' times go into the junit report,
    which keeps no stdout of a passing test (a slow schedule, 260-340 s against ~60, could not
    be replayed from CI's report)."""
    seed = seed_of(kind)
    record_property("history_seed", seed)
    label = kind if trained else f"{kind}, nothing trained"
    print(f"\nhistory[{label}]: seed {seed} (SNCA_HISTORY_SEED={seed} replays its schedule)")
    backend = Backend(kind, tmp_path, pg)
    rng = random.Random(seed)
    cluster = Cluster(backend, models, tmp_path, rng)
    journal = Journal()
    nemesis = Nemesis(cluster, journal, fmnist_train, rng.randrange(2**32), pg)
    clients = [
        Client(k, cluster, journal, fmnist_train, rng.randrange(2**32), trained=trained and k == 0)
        for k in range(CLIENTS)
    ]
    t = {"start": time.monotonic()}
    try:
        starts = [
            threading.Thread(target=cluster.start, args=("a", pair)) for pair in (True, False)
        ]
        for x in starts:
            x.start()
        for x in starts:
            x.join()
        t["servers up"] = time.monotonic()
        for c in clients:
            c.start()
        nemesis.start()
        time.sleep(SECONDS)
        t["window over"] = time.monotonic()
        # the window is over: no more faults or commands; the command running (a learn: its
        # training, index, compare and switch, ~17 s alone) ends with writes still coming, at
        # a trickle (full speed, a learn ran 75 s past a 15 s window and the 2,500 writes made
        # meanwhile took 13 s more to replay, seed 3731307863)
        for c in clients:
            c.pause_s = TAIL_PAUSE_S
        nemesis.stop.set()
        nemesis.join(timeout=600)
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(timeout=60)
        t["faults over"] = time.monotonic()
        tail_ops = sum(1 for o in journal.ops if o.done and o.done > t["window over"])
        record_property("history_operations_after_the_window", tail_ops)
        assert nemesis.error is None, repr(nemesis.error)
        settle(cluster, nemesis, pg)
        t["commands rerun"] = time.monotonic()
        url = live_server(cluster)
        t["a live server"] = time.monotonic()
        tries = resolve(journal, url, fmnist_train, nemesis, cluster)
        t["settled"] = time.monotonic()
        record_property("history_resolve", tries.describe())
        # every acknowledged keyed write retried with its key: answered as the first time
        bad, replays = replay_keyed(replayable(journal.ops), cluster.urls(), rng)
        nemesis.counts["replays at the end"] += replays
        t["replayed"] = time.monotonic()
        live, trained, gen = read_live(cluster)
        bad += check(journal, live, trained, nemesis.imports)
        for path, started, ended in nemesis.backups:
            backup.verify(path)
            bad += backup_holds(path, journal.ops, started, ended)
        bad += replicas_agree(cluster, gen)
        bad += stores_intact(cluster, gen)
        g = cluster.galleries()
        if g["writable"] != [g["alias_gen"]]:
            bad.append(f"after the faults: writable {g['writable']}, alias {g['alias_gen']}")
        phases = ", ".join(f"{k} at {v - t['start']:.0f} s" for k, v in t.items() if k != "start")
        print(
            f"history[{label}] seed {seed}: {describe(journal, nemesis)}; {len(live)} added "
            f"items live; {phases}, checked at {time.monotonic() - t['start']:.0f} s; "
            f"{tail_ops} operations after the window"
        )
        if bad:
            import re

            ids = sorted({int(m) for b in bad for m in re.findall(r"\b(?:item|add|id) (\d+)", b)})
            labels = {m for b in bad for m in re.findall(r"\(([\w-]+)\)", b)}
            trace(cluster, journal, ids, tmp_path / "trace.jsonl", labels)
            print(f"the trace of the failure: {tmp_path / 'trace.jsonl'}")
        assert not bad, f"seed {seed} (SNCA_HISTORY_SEED={seed}): " + "; ".join(bad[:20])
        adds = sum(1 for o in journal.ops if o.kind == "add" and o.outcome == "ok")
        assert adds >= 10, describe(journal, nemesis)
    finally:
        for c in clients:
            c.stop.set()
        nemesis.stop.set()
        cluster.stop_all()
        if pg is not None:
            pg.start_if_stopped()
        t["stopped"] = time.monotonic()
        at = ", ".join(f"{k} at {v - t['start']:.0f} s" for k, v in t.items() if k != "start")
        record_property("history_phases", at)
        record_property("history_operations", describe(journal, nemesis))


def settle(cluster: Cluster, nemesis: Nemesis, pg) -> None:
    """The faults are over: everything continued, PostgreSQL up, a killed command run again
    (what docs/operations.md says to do); it must succeed."""
    import contextlib

    for pid in list(cluster.stopped):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    if pg is not None:
        pg.start_if_stopped()
    if nemesis.pending is not None:
        model, args = nemesis.pending
        p = cluster.tool(model, *args)
        assert p.wait(timeout=600) == 0, f"the rerun of snca-gallery {' '.join(args)} failed"


# How long a running server of the live gallery's model gets to be ready (one resumed or
# restarted just now) before live_server starts one: a test server starts in ~1 s since
# tests/process_template.py (20 s before, when a start took 3-5 s on a loaded VM).
GRACE_S = 5


def live_server(cluster: Cluster) -> str:
    """The URL of a server that takes writes on the live gallery (one started with
    --follow-alias if none does: its start also settles a switch). A running server of the
    live gallery's model gets GRACE_S to be ready; with none, one is started at once (after a
    learn switched to its new model, the servers of the old one answer 503 standby: a 20 s wait
    for them was a third of a history, seed 12345)."""
    deadline = time.monotonic() + 120
    if not cluster.runs_model_of(cluster.live_gen()):
        deadline -= GRACE_S
    while time.monotonic() < deadline:
        for url in cluster.urls():
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        if not cluster.urls() or time.monotonic() > deadline - 120 + GRACE_S:
            n = cluster.start("a", pair=False, follow=True)
            s = cluster.servers[n][2]
            s.wait("/readyz", timeout=120)
            return s.url
        time.sleep(0.5)
    raise AssertionError("no server takes writes on the live gallery")


class Tries:
    """What resolve spent: writes retried, their 503 answers (what, when) and the time (the
    junit report's history_resolve: where a slow settle went)."""

    def __init__(self):
        self.t0, self.writes, self.unavailable = time.monotonic(), 0, []

    def saw(self, r) -> None:
        detail = (
            r.json().get("detail", "")
            if r.headers.get("content-type", "").endswith("json")
            else r.text
        )
        self.unavailable.append(f"{time.monotonic() - self.t0:.1f} s: {detail[:120]}")

    def describe(self) -> str:
        first = "; ".join(self.unavailable[:2] + self.unavailable[-1:])
        return (
            f"{self.writes} writes retried in {time.monotonic() - self.t0:.1f} s, "
            f"{len(self.unavailable)} answered 503" + (f" ({first})" if first else "")
        )


def resolve(journal: Journal, url: str, raw, nemesis: Nemesis, cluster: Cluster) -> Tries:
    """Every add whose answer was lost, or that a 503 said changed nothing, retried with its
    Idempotency-Key: its first outcome (a 503 that said "nothing was changed" for a write that
    was made is a finding), or made now. A killed import run again."""
    tries = Tries()
    with httpx.Client(timeout=30) as c:
        for op in journal.ops:
            if op.kind != "add" or op.outcome not in ("unknown", "failed"):
                continue
            if op.outcome == "failed" and not op.detail.startswith("503"):
                continue
            files = [
                ("images", (f"{k}.png", png_of(raw, op.image + k), "image/png"))
                for k in range(op.count)
            ]
            tries.writes += 1
            for _ in range(60):
                r = c.post(
                    url + "/gallery/add",
                    data={"label": op.label},
                    files=files,
                    headers={"Idempotency-Key": op.key},
                )
                if r.status_code != 503:
                    break
                tries.saw(r)
                time.sleep(0.5)
                # a server just resumed (SIGCONT) learns only now that its gallery was carried
                # to the other model or is on standby (503, nothing changed, its /readyz 503
                # from then on): write where the live gallery is, as its answer says to
                url = live_server(cluster)
            assert r.status_code == 201, r.text
            replayed = r.headers.get("Idempotent-Replayed") == "true"
            if op.outcome == "failed" and replayed:
                journal.fail(f"add {op.key} was answered {op.detail} but had been committed")
            op.outcome, op.ids, op.done = "ok", r.json()["ids"], time.monotonic()
            op.answer = answer_of(r)
    with httpx.Client(timeout=30) as c:  # names whose answer was lost, asked again
        for op in journal.ops:
            if op.kind != "name" or op.outcome != "unknown":
                continue
            tries.writes += 1
            for _ in range(60):
                r = c.post(
                    url + "/review/name",
                    json={"ids": op.queued, "label": op.label},
                    headers={"Idempotency-Key": op.key},
                )
                if r.status_code != 503:
                    break
                tries.saw(r)
                time.sleep(0.5)
                url = live_server(cluster)
            op.answer = answer_of(r)
            if r.status_code == 201:  # made then (replayed) or now
                op.outcome, op.ids, op.done = "ok", r.json()["ids"], time.monotonic()
            else:  # 404: not made, and its queries are gone (named by another, or carried)
                assert r.status_code == 404, r.text
                op.outcome = "failed"
    for k, (label, n, outcome, folder) in enumerate(nemesis.imports):
        if outcome == "unknown":
            p = cluster.tool(nemesis.live_model(), "import", folder, "--no-progress")
            assert p.wait(timeout=300) == 0, f"the rerun of import {label} failed"
            nemesis.imports[k] = (label, n, "rerun", folder)
    return tries


def replicas_agree(cluster: Cluster, gen: str) -> list[str]:
    """Every server that takes writes (ready: the live gallery's) reaches the store's head,
    and they agree on the gallery's checksum there."""
    from service.store.registry import open_as_found

    store = open_as_found(cluster.galleries()["targets"][gen])
    try:
        head = store.last_seq()
    finally:
        store.close()
    sums: dict[str, str] = {}
    for url in cluster.urls():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/readyz", timeout=5)
            except httpx.HTTPError:
                break
            body = r.json()
            if r.status_code == 200 and body["gallery_version"] >= head:
                sums[url] = body["gallery_checksum"]
                break
            if body.get("status") == "standby" or "carried to" in body.get("store_error", ""):
                break  # (a server of another model's gallery, or of one carried away from it)
            time.sleep(0.2)
    if not sums:
        return [f"no server of the live gallery reached its head {head}"]
    if len(set(sums.values())) > 1:
        return [f"servers at write {head} disagree: {sums}"]
    return []


def test_the_checker_holds_each_item_to_its_history_of_corrections():
    """The checker itself (no processes): an item's label is what its acknowledged writes
    give it in order; a write whose answer was lost may have happened at any later moment or
    never; anything else is a finding."""
    from .history import Op, check, possible

    def op(kind, t, label=None, ids=(), outcome="ok", to=None):
        return Op(kind, "k", label, t, t + 0.5, outcome, list(ids), to=to)

    add = op("add", 0, "c0-r0-0", [7])
    j = Journal()
    j.ops = [
        add,
        op("relabel", 1, "c0-r0-1", [7]),
        op("rename", 2, "c0-r0-1", to="c0-m1"),
        op("rename", 3, "c1-r0-1", to="c1-m1"),  # another client's label
    ]
    assert possible(add, 7, j.ops, float("inf"), float("inf")) == {"c0-m1"}
    assert check(j, {7: ("c0-m1", None)}, {}, []) == []
    assert check(j, {7: ("c0-r0-1", None)}, {}, [])  # the acknowledged rename undone
    assert check(j, {}, {}, [])  # lost
    j.ops.append(op("delete_label", 4, "c0-m1", outcome="unknown"))
    j.ops.append(op("merge", 5, "c0-r0-0", to="c0-m1"))  # (not its label: no effect)
    assert possible(add, 7, j.ops, float("inf"), float("inf")) == {"c0-m1", None}
    j.ops.append(op("relabel", 6, "c0-x", [7], outcome="unknown"))
    assert possible(add, 7, j.ops, float("inf"), float("inf")) == {"c0-m1", None, "c0-x"}
    # a backup read between 1.2 and 1.4 (the relabel answered at 1.5: either label)
    assert possible(add, 7, j.ops, 1.2, 1.4) == {"c0-r0-0", "c0-r0-1"}
    # a trained label renamed and a trained image relabelled, acknowledged
    fix = op("relabel", 8, "c0-coat")
    fix.dataset_index = 12
    j.ops += [op("rename", 9, "Ankle boot", to="c0-boots"), fix]
    assert check(j, {7: ("c0-x", None)}, {3: "c0-boots", 12: "c0-coat"}, []) == []
    assert check(j, {7: ("c0-x", None)}, {3: "Ankle boot", 12: "c0-coat"}, [])
    assert check(j, {7: ("c0-x", None)}, {3: "c0-boots", 12: "Coat"}, [])
