"""The randomized history checker (issue 39): random operations from concurrent clients against
real processes, faults anywhere, then the whole history checked against what was acknowledged.
Anchors: Jepsen's history checking (Elle), FoundationDB's simulation, TigerBeetle's VOPR.

    clients (threads)   add (with an Idempotency-Key), delete an item, read, through whichever
                        server answers; a label of their own they delete whole at the end of
                        its life; corrections (issue 43): relabel an item, rename a label of
                        theirs, merge one into another; one trained label deleted once, one
                        renamed once, one trained image relabelled once
    nemesis (a thread)  the day-two commands as users run them (`snca-gallery upgrade --to X
                        [--switch]`, `rollback`, `backup` + verify, `compact`, `import`), each
                        maybe killed with SIGKILL at a random moment; servers killed (-9) and
                        restarted, stopped (SIGSTOP) and continued, model processes killed or
                        stopped; PostgreSQL stopped (immediate) and started
    journal             every operation: when it was sent and answered, its outcome (ok,
                        failed: nothing changed, unknown: the answer was lost)

At the end the faults stop, a killed command is run again (what docs/operations.md says to do), every
add whose outcome is unknown is retried with its key (answered with its first outcome, or made
now), and the live gallery is read from its store:
- a live gallery exists and is the only one that takes writes (also sampled during the run);
- every acknowledged add is there exactly once, with the label its history gives it: the
  acknowledged deletes, relabels, renames and merges that touched it, in the order a client
  made them, and any of those whose answer was lost applied at any later moment, or never
  (`possible`);
- no acknowledged delete is undone, no item nobody added is there, an id is one item;
- every backup held each add acknowledged before it started; an import that exited 0 is there;
- the servers of the live model end at the store's head with equal gallery checksums.

Every random choice comes from one seed (printed; SNCA_HISTORY_SEED replays the schedule; the
timing of real processes still varies)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from PIL import Image

from tests.process_template import start_module

from .helpers import Server

FAST = {"SNCA_FUSED_BATCHES": "0", "SNCA_MAX_BATCH": "8", "SNCA_WARMUP_SECONDS": "0"}
# servers: a short model timeout (a stopped model process is given up on quickly), writes
# answered at once when a version is not applied
SERVER_ENV = {**FAST, "SNCA_MODEL_TIMEOUT_S": "4", "SNCA_SNAPSHOT_EVERY": "50"}
# the review queue on, every classified query kept: a client names some (issue 43's write path)
SERVER_ENV |= {"SNCA_REVIEW_QUEUE": "1", "SNCA_REVIEW_MARGIN": "1.0"}
TRAINED_VICTIM = "Sandal"  # the trained label a client deletes once
TRAINED_RENAMED = "Ankle boot"  # the trained label a client renames once
TRAINED_RELABELLED = "Bag"  # the label of the trained image a client relabels once


@dataclass
class Op:
    """One client operation as the client saw it."""

    kind: str  # add | name | delete | delete_label | relabel | rename | merge | import
    key: str | None
    label: str | None  # (relabel: the new label; rename, merge: the label renamed)
    sent: float
    done: float = 0.0
    outcome: str = "pending"  # ok | failed | unknown | absent (a delete of nothing)
    ids: list[int] = field(default_factory=list)
    image: int | None = None  # (adds) the first training image's index, to retry it
    count: int = 1  # (adds) images, from `image` on
    detail: str = ""
    to: str | None = None  # (rename, merge) the label it becomes
    dataset_index: int | None = None  # (a trained image's relabel) which image
    queued: list[int] = field(default_factory=list)  # (name) the queued queries named
    # (keyed writes) the request, to replay it with its key: (method, path, httpx kwargs), and
    # its first answer: (status, what of its body a replay must repeat)
    request: tuple | None = None
    answer: tuple | None = None


class Journal:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.lock = threading.Lock()
        self.events: list[tuple[float, str]] = []  # the nemesis's, for the report
        self.checks: list[str] = []  # failures found on the way (backups, live galleries)
        self.samples = 0

    def add(self, op: Op) -> Op:
        with self.lock:
            self.ops.append(op)
        return op

    def event(self, what: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), what))

    def fail(self, what: str) -> None:
        with self.lock:
            self.checks.append(what)


def gen_of_run(run: Path) -> str:
    """The gen (store/galleries.py) of a run dir and its index."""
    from embedding.index import read_manifest
    from embedding.rundir import RunDir
    from service.store.galleries import gen_of

    return gen_of(RunDir(run).load_model_card()[1], read_manifest(run / "index").index_id)


def png_of(raw, i: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(raw.source.get(int(i))[0].numpy()).save(b, "PNG")
    return b.getvalue()


class Cluster:
    """The processes of one history: servers on one backend, the snca-gallery commands."""

    def __init__(self, backend, models: dict[str, Path], tmp: Path, rng: random.Random):
        self.backend, self.models, self.tmp, self.rng = backend, models, tmp, rng
        self.servers: dict[int, tuple[str, bool, Server]] = {}  # n -> (model, pair, server)
        self.lock = threading.Lock()
        self.n = 0
        self.stopped: set[int] = set()  # pids under SIGSTOP
        self.closed = False  # set by stop_all: servers that start after it are stopped
        self.gens = {name: gen_of_run(run) for name, run in models.items()}

    def start(self, model: str, pair: bool, follow: bool = False) -> int:
        extra = ("--follow-alias",) if follow else ()
        s = self.backend.start(
            self.models[model], *extra, env=SERVER_ENV, model_process=pair, wait_for="/healthz"
        )
        with self.lock:
            if self.closed:  # (a restart that came up after the end: nothing may outlive it)
                s.kill(signal.SIGKILL)
                raise RuntimeError("the history is over")
            self.n += 1
            self.servers[self.n] = (model, pair, s)
            return self.n

    def add_model(self, run: Path) -> None:
        """A model a learn made and switched to: servers and commands may use it."""
        name = run.name
        with self.lock:
            self.models[name] = run
            self.gens[name] = gen_of_run(run)

    def urls(self) -> list[str]:
        with self.lock:
            return [s.url for _, _, s in self.servers.values() if s.proc.poll() is None]

    def runs_model_of(self, gen: str) -> bool:
        """Whether a running server was started with the model of gallery `gen` (one started
        with --follow-alias may serve another: this says only what it was given)."""
        with self.lock:
            return any(
                self.gens.get(m) == gen and s.proc.poll() is None
                for m, _, s in self.servers.values()
            )

    def live_gen(self) -> str:
        return self.galleries()["alias_gen"]

    def galleries(self) -> dict:
        """{alias_gen, switched, writable: [gens not on standby], targets: {gen: store}} read
        directly."""
        from service.store.galleries import alias, home_gen, registry
        from service.store.records import STANDBY
        from service.store.registry import backend_class
        from service.store.upgrade import open_galleries

        home = self.backend.url or str(self.backend.tmp / "data" / "gallery.sqlite")
        g = open_galleries(backend_class(home), home)
        try:
            a = alias(g.home)
            gens = sorted({home_gen(g.home), *registry(g.home)})

            def collect() -> dict[str, tuple]:
                out = {}
                for x in gens:
                    if g.exists(x):
                        m = g.open(x).meta()
                        out[x] = (m.get(STANDBY), m.get("live_epoch"))
                return out

            # a double collect: two reads of every gallery that agree saw one moment (the
            # seal changes the source's standby flag, the promotion the target's flag and
            # epoch; the clients' writes change neither)
            seen, writable = collect(), None
            for _ in range(20):
                again = collect()
                if again == seen:
                    writable = [x for x, (flag, _) in seen.items() if flag is None]
                    break
                seen = again
            live = a["gen"] if a else home_gen(g.home)
            reg = registry(g.home)
            return {
                "alias_gen": live,
                "switched": bool(a and a.get("previous")),  # (what a rollback undoes)
                "writable": writable,
                "targets": {x: g.target_of(x) for x in gens},
                "model_of": {x: reg.get(x, {}).get("model_dir") for x in gens},
            }
        finally:
            g.close()
            g.home.close()

    def tool(self, model: str, *args: str) -> subprocess.Popen:
        cmd = self.backend.tool_command(self.models[model], *args)
        path = self.tmp / f"tool-{args[0]}-{uuid.uuid4().hex[:8]}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **FAST)
        p = start_module(cmd[2], cmd[3:], env, None, path)  # (a Popen's poll, wait, kill)
        p.log_path = path  # (what it said, for the journal)
        return p

    def stop_all(self) -> None:
        with self.lock:
            self.closed = True
            servers = list(self.servers.values())
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for _, _, s in servers:
            with contextlib.suppress(Exception):
                s.kill(signal.SIGKILL)


class Client(threading.Thread):
    """Adds (most), deletes of its own acknowledged items, reads; a label of its own deleted
    whole now and then; with `trained`, the trained victim label deleted once."""

    def __init__(self, n: int, cluster: Cluster, journal: Journal, raw, seed: int, trained: bool):
        super().__init__(daemon=True, name=f"client-{n}")
        self.n, self.cluster, self.journal, self.raw = n, cluster, journal, raw
        self.rng = random.Random(seed)
        self.trained = trained
        self.stop = threading.Event()
        # seconds between two operations (0: none): after the window, while the nemesis's last
        # command ends, the clients go on at a trickle (see _history)
        self.pause_s = 0.0
        self.mine: dict[int, str] = {}  # acknowledged, not deleted by me
        self.round = 0
        self.fresh = 0  # labels made by renames
        # with `trained`, early (the carries that follow must take them along): the trained
        # victim label deleted, a trained label renamed, a trained image relabelled, once each
        self.ops = 0
        jobs = ("victim", "rename", "relabel") if trained else ()
        self.trained_at = dict(zip(self.rng.sample(range(2, 30), len(jobs)), jobs, strict=True))

    def label(self) -> str:
        return f"c{self.n}-r{self.round}-{self.rng.randrange(2)}"

    def run(self) -> None:
        with httpx.Client(timeout=15) as http:
            while not self.stop.is_set():
                urls = self.cluster.urls()
                if not urls:
                    time.sleep(0.2)
                    continue
                url = self.rng.choice(urls)
                r = self.rng.random()
                self.ops += 1
                job = self.trained_at.pop(self.ops, None)
                if job == "victim":
                    self.delete_label(http, url, TRAINED_VICTIM)
                elif job is not None:
                    self.trained_fix(http, url, job)
                elif r < 0.06 and self.mine:
                    self.delete_label(http, url, f"c{self.n}-r{self.round}-0")
                    self.round += 1
                elif r < 0.22 and self.mine:
                    self.delete(http, url, self.rng.choice(sorted(self.mine)))
                elif r < 0.30:
                    self.read(http, url)
                elif r < 0.38 and self.mine:
                    self.relabel(http, url, self.rng.choice(sorted(self.mine)))
                elif r < 0.42 and self.mine:
                    self.rename(http, url)
                elif r < 0.47:
                    self.name(http, url)
                else:
                    self.add(http, url)
                if self.pause_s:
                    self.stop.wait(self.pause_s)

    def _send(self, op: Op, http: httpx.Client, url: str, method: str, path: str, **kw):
        """Send a keyed write (op.key as its Idempotency-Key); keep the request and its first
        answer for the replays (replay_keyed)."""
        op.request = (method, path, kw)
        try:
            r = http.request(method, url + path, headers={"Idempotency-Key": op.key}, **kw)
        except httpx.HTTPError as e:
            op.done, op.outcome, op.detail = time.monotonic(), "unknown", type(e).__name__
            time.sleep(0.05)
            return None
        op.done = time.monotonic()
        op.answer = answer_of(r)
        return r

    def _refused(self, op: Op, r: httpx.Response) -> None:
        body = r.json() if r.headers.get("content-type", "").endswith("json") else {}
        committed = body.get("committed")
        # refused, nothing changed: a 4xx, a 503 that did not commit; else (a 503 that
        # committed but was not applied in time, another 5xx): unknown
        if r.status_code < 500 or (r.status_code == 503 and committed is False):
            op.outcome = "failed"
        else:
            op.outcome = "unknown"
        op.detail = f"{r.status_code} {body.get('code')} committed={committed}"
        time.sleep(0.05)

    def add(self, http: httpx.Client, url: str) -> None:
        label, i = self.label(), self.rng.randrange(len(self.raw.targets) - 3)
        n = self.rng.choice((1, 1, 2, 3))  # (a write of several items: all of them, or none)
        op = self.journal.add(Op("add", uuid.uuid4().hex, label, time.monotonic(), image=i))
        op.count = n
        files = [("images", (f"{k}.png", png_of(self.raw, i + k), "image/png")) for k in range(n)]
        r = self._send(op, http, url, "POST", "/gallery/add", data={"label": label}, files=files)
        if r is None:
            return
        if r.status_code == 201:
            op.outcome, op.ids = "ok", r.json()["ids"]
            self.mine.update({x: label for x in op.ids})
        else:
            self._refused(op, r)

    def delete(self, http: httpx.Client, url: str, item: int) -> None:
        op = self.journal.add(Op("delete", uuid.uuid4().hex, None, time.monotonic(), ids=[item]))
        r = self._send(op, http, url, "DELETE", f"/gallery/items/{item}")
        if r is None:
            self.mine.pop(item, None)  # (maybe deleted: never deleted again, never checked)
            return
        if r.status_code == 200:
            op.outcome = "ok"
            self.mine.pop(item, None)
        elif r.status_code == 404:
            op.outcome = "absent"  # (an earlier unknown delete of it did happen)
            self.mine.pop(item, None)
        else:
            self._refused(op, r)

    def delete_label(self, http: httpx.Client, url: str, label: str) -> None:
        op = self.journal.add(Op("delete_label", uuid.uuid4().hex, label, time.monotonic()))
        r = self._send(op, http, url, "DELETE", f"/gallery/labels/{label}")
        self.mine = {i: lab for i, lab in self.mine.items() if lab != label}
        if r is None:
            return
        if r.status_code == 200:
            op.outcome, op.ids = "ok", r.json()["deleted"]
        elif r.status_code == 404:
            op.outcome = "absent"
        else:
            self._refused(op, r)

    def name(self, http: httpx.Client, url: str) -> None:
        """A few queued queries (from GET /review) named with a label of mine: they become
        items, acknowledged like an add."""
        try:
            groups = http.get(url + "/review", params={"limit": 20, "sample": 1}).json()["groups"]
        except (httpx.HTTPError, ValueError, KeyError):
            return
        if not groups:
            return
        ids = self.rng.choice(groups)["ids"][:3]
        label = self.label()
        op = self.journal.add(Op("name", uuid.uuid4().hex, label, time.monotonic()))
        op.queued = ids
        r = self._send(op, http, url, "POST", "/review/name", json={"ids": ids, "label": label})
        if r is None:
            return
        if r.status_code == 201:
            op.outcome, op.ids = "ok", r.json()["ids"]
            self.mine.update({x: label for x in op.ids})
        elif r.status_code == 404:
            op.outcome = "absent"  # (named by another client first, or dismissed by a bound)
        else:
            self._refused(op, r)

    def relabel(self, http: httpx.Client, url: str, item: int) -> None:
        """One of my items to another label of mine (of this round, or one a rename made)."""
        to = self.rng.choice(
            [self.label(), f"c{self.n}-r{self.round}-{self.rng.randrange(2)}"]
            + [lab for lab in set(self.mine.values()) if "-m" in lab]
        )
        op = self.journal.add(Op("relabel", uuid.uuid4().hex, to, time.monotonic(), ids=[item]))
        r = self._send(op, http, url, "PATCH", f"/gallery/items/{item}", json={"label": to})
        if r is None:
            self.mine.pop(item, None)  # (maybe moved: never touched again, checked at the end)
            return
        if r.status_code == 200:
            op.outcome = "ok"
            self.mine[item] = to
        elif r.status_code == 404:
            op.outcome = "absent"
            self.mine.pop(item, None)
        else:
            self._refused(op, r)
            if op.outcome == "unknown":
                self.mine.pop(item, None)

    def rename(self, http: httpx.Client, url: str) -> None:
        """A label of mine renamed to a new one, or merged into another of mine."""
        old = self.rng.choice(sorted(set(self.mine.values())))
        others = sorted(set(self.mine.values()) - {old})
        merge = bool(others) and self.rng.random() < 0.5
        if merge:
            to = self.rng.choice(others)
        else:
            self.fresh += 1
            to = f"c{self.n}-m{self.fresh}"
        kind = "merge" if merge else "rename"
        op = self.journal.add(Op(kind, uuid.uuid4().hex, old, time.monotonic(), to=to))
        body = {"label": old, "into": to} if merge else {"label": old, "to": to}
        r = self._send(op, http, url, "POST", f"/gallery/{kind}", json=body)
        if r is not None and r.status_code == 200:
            op.outcome = "ok"
            self.mine = {i: (to if lab == old else lab) for i, lab in self.mine.items()}
            return
        if r is not None and r.status_code == 404:
            op.outcome = "absent"  # (an earlier unknown write moved or deleted them all)
        elif r is not None:
            self._refused(op, r)
        if op.outcome != "failed":  # (maybe renamed: never touched again, checked at the end)
            self.mine = {i: lab for i, lab in self.mine.items() if lab not in (old, to)}

    def trained_fix(self, http: httpx.Client, url: str, job: str) -> None:
        """Once each: TRAINED_RENAMED renamed ("rename"), one trained image of
        TRAINED_RELABELLED relabelled ("relabel": found by its dataset index in whichever
        gallery is live at the end, if its index holds that image)."""
        if job == "rename":
            to = f"c{self.n}-boots"
            op = self.journal.add(
                Op("rename", uuid.uuid4().hex, TRAINED_RENAMED, time.monotonic(), to=to)
            )
            body = {"label": TRAINED_RENAMED, "to": to}
            r = self._send(op, http, url, "POST", "/gallery/rename", json=body)
        else:
            try:
                page = http.get(
                    url + "/gallery/items", params={"label": TRAINED_RELABELLED, "limit": 1}
                ).json()["items"]
            except (httpx.HTTPError, ValueError, KeyError):
                return
            if not page or page[0]["source"] != "trained":
                return
            item, to = page[0]["id"], f"c{self.n}-coat"
            op = self.journal.add(Op("relabel", uuid.uuid4().hex, to, time.monotonic()))
            op.dataset_index = int(page[0]["metadata"]["dataset_index"])
            r = self._send(op, http, url, "PATCH", f"/gallery/items/{item}", json={"label": to})
        if r is None:
            return
        if r.status_code == 200:
            op.outcome = "ok"
        elif r.status_code == 404:
            op.outcome = "absent"
        else:
            self._refused(op, r)

    def read(self, http: httpx.Client, url: str) -> None:
        i = self.rng.randrange(len(self.raw.targets))
        with contextlib.suppress(httpx.HTTPError):
            http.post(url + "/classify", files={"image": ("q.png", png_of(self.raw, i))})


class Nemesis(threading.Thread):
    """The day-two commands (one at a time, in the background) and the faults (meanwhile),
    from one seeded schedule."""

    def __init__(self, cluster: Cluster, journal: Journal, raw, seed: int, pg=None):
        super().__init__(daemon=True, name="nemesis")
        self.cluster, self.journal, self.raw, self.pg = cluster, journal, raw, pg
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        # a command killed or failed (to run again, as docs/operations.md says), the one running
        self.pending: tuple[str, tuple] | None = None
        self.running: tuple[subprocess.Popen, str, tuple, float | None] | None = None
        self.counts: Counter = Counter()
        self.backups: list[tuple[Path, float, float]] = []
        self.backup_running: tuple[Path, float] | None = None
        self.imports: list[tuple[str, int, str, str]] = []  # (label, images, outcome, folder)
        self.error: BaseException | None = None
        self.learns = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.tend()
                if self.running is None and self.rng.random() < 0.6:
                    self.command()
                if self.rng.random() < 0.35:
                    self.fault()
                self.sample()
                self.stop.wait(self.rng.uniform(0.1, 0.5))
            if self.running is not None:  # the last command ends by itself (bounded)
                p = self.running[0]
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                self.tend()
        except BaseException as e:  # (reported by the test)
            self.error = e

    def sample(self) -> None:
        """At most one gallery takes writes, at any moment."""
        with contextlib.suppress(Exception):
            w = self.cluster.galleries()["writable"]
            if w is None:
                return  # (the galleries kept changing: no consistent sample)
            self.journal.samples += 1
            if len(w) > 1:
                self.journal.fail(f"two galleries take writes at once: {w}")

    def other_model(self) -> str:
        """A model whose gallery is not the live one."""
        live = self.cluster.live_gen()
        return next(m for m, g in self.cluster.gens.items() if g != live)

    def live_model(self) -> str:
        live = self.cluster.live_gen()
        return next((m for m, g in self.cluster.gens.items() if g == live), "a")

    # ------------------------------------------------------------------ the commands
    def launch(self, model: str, args: tuple, kill_p: float) -> None:
        """`snca-gallery ARGS` in the background, to be killed (-9) at a random moment with
        probability kill_p."""
        p = self.cluster.tool(model, *args)
        kill_at = (
            time.monotonic() + self.rng.uniform(0.3, 6.0) if self.rng.random() < kill_p else None
        )
        self.running = (p, model, args, kill_at)

    def tend(self) -> None:
        """The running command: finished (its exit status), or killed when its time came."""
        if self.running is None:
            return
        p, model, args, kill_at = self.running
        name = args[0]
        if p.poll() is None:
            if kill_at is None or time.monotonic() < kill_at:
                return
            p.kill()
            p.wait()
            self.counts[f"{name} killed"] += 1
            self.journal.event(f"killed snca-gallery {' '.join(args)}")
            self.running = None
            if name in ("upgrade", "rollback"):
                self.pending = (model, args)
            return
        rc = p.returncode
        self.running = None
        self.counts[f"{name} rc={rc}"] += 1
        said = ""
        if rc != 0:
            with contextlib.suppress(OSError):
                said = " | " + p.log_path.read_text().strip().splitlines()[-1][-300:]
        self.journal.event(f"snca-gallery {' '.join(args)}: {rc}{said}")
        if name == "backup" and rc == 0 and self.backup_running is not None:
            self.backups.append((*self.backup_running, time.monotonic()))  # (path, start, end)
        if name in ("upgrade", "rollback", "learn"):
            self.pending = None if rc == 0 else (model, args)
            if rc == 0 and name == "learn":  # (a model of its own from now on)
                out = Path(args[args.index("--out") + 1])
                if json.loads((out / "learn.json").read_text()).get("switched"):
                    self.cluster.add_model(out)
            if rc == 0 and (name in ("rollback", "learn") or "--switch" in args):
                self.replay_some()

    def replay_some(self, n: int = 8) -> None:
        """After a switch or a rollback: a few acknowledged keyed writes replayed with their
        keys (replay_keyed), wherever they were made."""
        with self.journal.lock:
            ops = replayable(self.journal.ops)
        urls = self.cluster.urls()
        if not ops or not urls:
            return
        bad, answered = replay_keyed(self.rng.sample(ops, min(n, len(ops))), urls, self.rng, 5)
        self.counts["replays"] += answered
        for b in bad:
            self.journal.fail(b + " (after a switch or rollback)")

    def command(self) -> None:
        r = self.rng.random()
        c = self.cluster
        if self.pending is not None and r < 0.4:
            model, args = self.pending
            self.launch(model, args, 0.2)
        elif r < 0.65:
            args = ("upgrade", "--to", str(c.models[self.other_model()]), "--no-progress")
            switch = ("--switch",) if self.rng.random() < 0.8 else ()
            self.launch(self.live_model(), (*args, *switch), 0.35)
        elif r < 0.75:
            g = c.galleries()
            # a rollback undoes a switch: a gallery built beside without one (an upgrade
            # without --switch) is no previous gallery, and the rollback is refused (rightly;
            # the rerun after the faults then failed too, seed 2824895427)
            if g["switched"] and len(g["targets"]) > 1:
                self.launch(self.live_model(), ("rollback", "--no-progress"), 0.3)
        elif r < 0.85:
            out = c.tmp / f"backup-{uuid.uuid4().hex[:8]}"
            self.backup_running = (out, time.monotonic())
            self.launch(self.live_model(), ("backup", str(out)), 0.0)
        elif r < 0.90:
            keep = str(self.rng.randrange(0, 20))
            self.launch(self.live_model(), ("compact", "--keep", keep), 0.0)
        elif r < 0.95:
            self.learn()
        else:
            self.import_some()

    def learn(self) -> None:
        """`snca-gallery learn` (issue 52): one epoch on the whole gallery, switched whether
        better or not (--min-gain -1: the switch is what is exercised), maybe killed and run
        again with the same --out (resumable)."""
        self.learns += 1
        out = self.cluster.tmp / f"learned-{self.learns}"
        args = ("learn", "--out", str(out), "--epochs", "1", "--min-gain", "-1", "--no-progress")
        self.launch(self.live_model(), args, 0.3)

    # ------------------------------------------------------------------ the faults
    def fault(self) -> None:
        r = self.rng.random()
        if r < 0.4:
            self.kill_server()
        elif r < 0.8:
            self.stop_some()
        elif self.pg is not None:
            self.pg.stop("immediate")
            self.counts["postgresql stopped"] += 1
            self.journal.event("postgresql stopped (immediate)")
            time.sleep(self.rng.uniform(0.3, 1.5))
            self.pg.start()
        else:
            self.start_server()

    def start_server(self) -> None:
        """A replica started (a model at random, following the alias or not)."""
        model = self.rng.choice(sorted(self.cluster.models))
        follow = self.rng.random() < 0.5
        threading.Thread(target=self._restart, args=(model, False, follow), daemon=True).start()
        self.counts["server started"] += 1

    def import_some(self) -> None:
        """`snca-gallery import` of a few images under a new label (maybe killed: then run
        again at the end; resumable)."""
        label = f"imported-{uuid.uuid4().hex[:6]}"
        src = self.cluster.tmp / label
        (src / label).mkdir(parents=True)
        n = self.rng.randrange(2, 5)
        for k in range(n):
            i = self.rng.randrange(len(self.raw.targets))
            (src / label / f"{k}.png").write_bytes(png_of(self.raw, i))
        p = self.cluster.tool(self.live_model(), "import", str(src), "--no-progress")
        killed = False
        if self.rng.random() < 0.3:
            try:
                p.wait(timeout=self.rng.uniform(0.5, 4.0))
            except subprocess.TimeoutExpired:
                p.kill()
                killed = True
        rc = p.wait(timeout=300)
        outcome = "unknown" if killed else ("ok" if rc == 0 else f"rc={rc}")
        self.imports.append((label, n, outcome, str(src)))
        self.counts[f"import {outcome}"] += 1

    def kill_server(self) -> None:
        c = self.cluster
        with c.lock:
            live = [(n, x) for n, x in c.servers.items() if x[2].proc.poll() is None]
        if len(live) < 2:
            return
        n, (model, pair, s) = self.rng.choice(live)
        what = "model process" if pair and self.rng.random() < 0.5 else "server"
        if what == "model process":
            with contextlib.suppress(Exception):
                pid = httpx.get(s.url + "/readyz", timeout=5).json()["model_pid"]
                os.kill(pid, signal.SIGKILL)
                self.counts["model process killed"] += 1
                self.journal.event(f"killed the model process {pid} of server {n}")
            return
        s.kill(signal.SIGKILL)
        self.counts["server killed"] += 1
        self.journal.event(f"killed server {n} ({model})")
        with c.lock:
            del c.servers[n]
        follow = self.rng.random() < 0.5
        threading.Thread(target=self._restart, args=(model, pair, follow), daemon=True).start()

    def _restart(self, model: str, pair: bool, follow: bool) -> None:
        with contextlib.suppress(Exception):
            self.cluster.start(model, pair, follow)

    def stop_some(self) -> None:
        """SIGSTOP a server (or its model process) for a while, then SIGCONT."""
        c = self.cluster
        with c.lock:
            live = [x for x in c.servers.values() if x[2].proc.poll() is None]
        if not live:
            return
        _, pair, s = self.rng.choice(live)
        pid = s.proc.pid
        if pair and self.rng.random() < 0.5:
            with contextlib.suppress(Exception):
                pid = httpx.get(s.url + "/readyz", timeout=5).json()["model_pid"]
        c.stopped.add(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        self.counts["stopped (SIGSTOP)"] += 1
        time.sleep(self.rng.uniform(0.5, 3.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        c.stopped.discard(pid)


def answer_of(r: httpx.Response) -> tuple:
    """(status, what of its body a retry with the same Idempotency-Key must repeat): the ids,
    labels and items moved; not the label's count now, nor the version (a carry copies a
    record into another gallery's log)."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code >= 400:
        return r.status_code, body.get("code")
    keep = ("ids", "label", "deleted", "relabelled", "previous_label", "queued_ids")
    out = {k: body[k] for k in keep if k in body}
    if "previous_label" in body:  # (a rename or merge: its count is the items it moved)
        out["count"] = body.get("count")
    return r.status_code, json.dumps(out, sort_keys=True)


# first answers a replay must repeat: the write's outcome, recorded with its key (a 503, a 422
# of a malformed request, a 429 recorded nothing: a retry may do the write then)
REPLAYABLE = (200, 201, 404, 409)


def replayable(ops: list[Op]) -> list[Op]:
    return [o for o in ops if o.request and o.answer and o.answer[0] in REPLAYABLE]


def replay_keyed(ops: list[Op], urls: list[str], rng: random.Random, timeout: float = 10):
    """Each of `ops` (acknowledged keyed writes) sent again with its key through one of
    `urls`: it must be answered with its first outcome, marked Idempotent-Replayed, never
    made again. A server that cannot answer now (503: on standby, its store down; no answer)
    is tried on another, else the op is skipped. (failures, replays answered)."""
    bad, answered = [], 0
    with httpx.Client(timeout=timeout) as http:
        for op in ops:
            method, path, kw = op.request
            for url in rng.sample(urls, len(urls)):
                try:
                    r = http.request(method, url + path, headers={"Idempotency-Key": op.key}, **kw)
                except httpx.HTTPError:
                    continue
                if r.status_code == 503:
                    continue
                answered += 1
                got = answer_of(r)
                if got != op.answer or r.headers.get("Idempotent-Replayed") != "true":
                    bad.append(
                        f"the replay of {op.kind} {op.key} ({method} {path}) was answered "
                        f"{got} (replayed: {r.headers.get('Idempotent-Replayed')}), first "
                        f"{op.answer}"
                    )
                break
    return bad, answered


GONE = None  # an item's state once deleted


def _moves(op: Op, item: int | None = None) -> bool:
    """Whether `op` may change the added item `item` (by id) or, item None, any item."""
    if op.kind in ("delete", "relabel"):
        return item is None or item in op.ids
    return op.kind in ("delete_label", "rename", "merge")


def _apply(op: Op, state: str | None) -> str | None:
    """An item's label (GONE: deleted) after `op` took effect, if `op` touches it (_moves)."""
    if state is GONE:
        return GONE
    if op.kind == "delete":
        return GONE
    if op.kind == "delete_label":
        return GONE if state == op.label else state
    if op.kind == "relabel":
        return op.label
    return op.to if state == op.label else state  # rename, merge


def possible(add: Op, item: int, ops: list[Op], lo: float, hi: float) -> set[str | None]:
    """The labels (GONE: deleted) the added item `item` may have at a moment between `lo` and
    `hi`: the writes that touch it answered before `lo` (after `add` was acknowledged) in the
    order sent; any other sent before `hi` (its answer lost, or still running at `lo`, or sent
    while `add` was not yet acknowledged) applied at any later point, or never. A client makes
    its writes one at a time and only on its own labels, so `sent` orders each item's
    certain writes."""
    client = add.label.split("-")[0] + "-"  # (a client's labels: c<n>-...; only it moves them)
    mine = sorted(
        (
            o
            for o in ops
            if _moves(o, item) and o.sent < hi and (o.ids or o.label.startswith(client))
        ),
        key=lambda o: o.sent,
    )

    def closure(states: set, pending: list[Op]) -> set:
        """`states` with any pending write applied, any number of times, in any order (a
        superset of what can happen: each lands at most once; the set stays small)."""
        out, todo = set(states), list(states)
        while todo:
            s = todo.pop()
            for o in pending:
                nxt = _apply(o, s)
                if nxt not in out:
                    out.add(nxt)
                    todo.append(nxt)
        return out

    states, pending = {add.label}, []
    for o in mine:
        if o.outcome == "failed" or (o.sent < add.sent and o.outcome != "unknown"):
            continue  # (refused; or answered before the add was sent: not about this item)
        if o.outcome in ("ok", "absent") and o.sent > add.done and o.done < lo:
            states = {_apply(o, s) for s in states}
        else:
            pending.append(o)
        states = closure(states, pending)
    return states


def backup_holds(path: Path, ops: list[Op], started: float, ended: float) -> list[str]:
    """Adds acknowledged before the backup started that it lacks, or holds under a label their
    history cannot give them at any point between its start and its end (its read is at one
    point between the two). (A deleted item may have no row at all in the backup: the live
    gallery may have been carried from another after the delete, and a carry copies live
    items only.)"""
    conn = sqlite3.connect(f"file:{path / 'gallery.sqlite'}?mode=ro", uri=True)
    try:
        rows = dict(
            conn.execute(
                "SELECT id, label FROM items WHERE source = 'added' AND deleted_seq IS NULL"
            ).fetchall()
        )
    finally:
        conn.close()
    bad = []
    for op in ops:
        if op.kind in ("add", "name") and op.outcome == "ok" and op.done < started:
            for i in op.ids:
                can = possible(op, i, ops, started, ended)
                if rows.get(i) not in can:
                    bad.append(
                        f"add {i} ({op.label}) acknowledged before the backup: "
                        f"{rows.get(i, 'missing')} in it, its history says one of {sorted(map(str, can))}"
                    )
    return bad


def check(
    journal: Journal,
    live: dict[int, tuple[str, str]],
    trained_live: dict[int, str],
    imports,
) -> list[str]:
    """The final state against the history: `live` (id -> (label, metadata)) the live
    gallery's added items, `trained_live` (dataset index -> label, GONE when deleted) the
    trained items its index holds."""
    ops = journal.ops
    bad = list(journal.checks)
    inf = float("inf")
    seen: dict[int, str] = {}
    for op in ops:
        if op.kind not in ("add", "name") or op.outcome != "ok":
            continue
        for i in op.ids:
            if seen.setdefault(i, op.label) != op.label:
                bad.append(f"id {i} acknowledged for {seen[i]!r} and for {op.label!r}")
            can = possible(op, i, ops, inf, inf)
            got = live.get(i, (GONE,))[0]
            if got not in can:
                said = [
                    f"{o.kind} {o.outcome} {o.detail}" for o in ops if _moves(o, i) and i in o.ids
                ]
                bad.append(
                    f"acknowledged add {i} ({op.label}) is {got or 'missing'}; its history "
                    f"says one of {sorted(map(str, can))} {said}"
                )
    journaled = set(seen)
    for i, (label, _) in live.items():
        if i in journaled or label.startswith("imported-"):
            continue
        bad.append(f"item {i} ({label}) was never acknowledged to anyone")
    labels = {lab for lab in trained_live.values() if lab is not GONE}
    for op in ops:
        ok = op.outcome == "ok"
        victim = ok and op.kind == "delete_label" and op.label == TRAINED_VICTIM
        if victim and TRAINED_VICTIM in labels:
            bad.append(f"the deleted trained label {TRAINED_VICTIM} is live again")
        renamed = ok and op.kind == "rename" and op.label == TRAINED_RENAMED
        if renamed and (TRAINED_RENAMED in labels or op.to not in labels):
            bad.append(f"the trained label {TRAINED_RENAMED} renamed {op.to}: not so")
        fix = op.kind == "relabel" and op.dataset_index is not None and op.outcome == "ok"
        if fix and op.dataset_index in trained_live:  # (an image this model's index holds)
            got = trained_live[op.dataset_index]
            if got != op.label:
                bad.append(f"trained image {op.dataset_index} relabelled {op.label}: it is {got}")
    counts = Counter(lab for lab, _ in live.values())
    for label, n, outcome, _ in imports:
        if outcome in ("ok", "rerun") and counts.get(label, 0) != n:
            bad.append(f"import {label}: {counts.get(label, 0)} of {n} images live")
    return bad


def stores_intact(cluster: Cluster, gen: str) -> list[str]:
    """Every gallery's store readable and (SQLite) intact; the live one's log gap-free from its
    floor to its head."""
    from service.store.registry import open_as_found

    bad = []
    for g, target in cluster.galleries()["targets"].items():
        s = open_as_found(target)
        try:
            if hasattr(s, "integrity_check") and s.integrity_check() != "ok":
                bad.append(f"{g}: integrity_check says {s.integrity_check()}")
            if g == gen:
                floor, last, missing = s.log_gaps()
                if missing:
                    bad.append(f"{g}: no log row for writes {missing[:10]} of ({floor}, {last}]")
        finally:
            s.close()
    return bad


def read_live(cluster: Cluster) -> tuple[dict[int, tuple[str, str]], dict[int, str], str]:
    """(id -> (label, metadata) of live added items, dataset index -> label of the trained
    items its index holds (GONE: deleted), gen) of the live gallery, read from its store."""
    from service.store.registry import open_as_found

    g = cluster.galleries()
    live = g["alias_gen"]
    s = open_as_found(g["targets"][live])
    try:
        rows = s.select("SELECT id, label, source, metadata, deleted_seq IS NULL FROM items")
    finally:
        s.close()
    added = {r[0]: (r[1], r[3]) for r in rows if r[2] == "added" and r[4]}
    trained = {
        json.loads(r[3])["dataset_index"]: (r[1] if r[4] else GONE)
        for r in rows
        if r[2] == "trained"
    }
    return added, trained, live


def summary(journal: Journal, nemesis: Nemesis) -> str:
    c = Counter(f"{o.kind} {o.outcome}" for o in journal.ops)
    return (
        ", ".join(f"{v} {k}" for k, v in sorted(c.items()))
        + "; nemesis: "
        + ", ".join(f"{v} {k}" for k, v in sorted(nemesis.counts.items()))
        + f"; {journal.samples} samples of the galleries"
        + "".join(f"\n  refused: {what}" for _, what in journal.events if " | " in what)
    )


def trace(
    cluster: Cluster, journal: Journal, ids: list[int], path: Path, labels: set | None = None
) -> None:
    """What a failure needs to be understood, written to `path` (JSON lines): the operations
    on `ids` or of `labels` (an item nobody was told of has no operation naming its id), the
    nemesis's events, every gallery's meta, log and rows of those ids, and the
    commands' output."""
    import json

    from service.store.registry import open_as_found

    t0 = min((o.sent for o in journal.ops), default=0.0)
    with open(path, "w") as f:

        def put(**kw) -> None:
            f.write(json.dumps(kw, default=str) + "\n")

        for o in journal.ops:
            if set(o.ids) & set(ids) or o.label in (labels or ()):
                put(op={**o.__dict__, "sent": o.sent - t0, "done": o.done - t0})
        for at, what in journal.events:
            put(event=what, at=at - t0)
        for gen, target in cluster.galleries()["targets"].items():
            try:
                s = open_as_found(target)
                try:
                    rows = []
                    if ids:
                        q = "SELECT id, label, add_seq, deleted_seq FROM items WHERE id IN ({})"
                        rows = s.select(q.format(", ".join(str(int(i)) for i in ids)))
                    meta = {k: v for k, v in s.meta().items()}
                    logs = s.select("SELECT seq, op, items, at FROM log ORDER BY seq")
                    put(gallery=gen, rows=rows, meta=meta, log=logs)
                finally:
                    s.close()
            except Exception as e:  # (a trace of what could be read)
                put(gallery=gen, error=repr(e))
        for log in sorted(cluster.tmp.glob("tool-*.log")):
            put(tool=log.name, output=log.read_text()[-2000:])
        for m in sorted(cluster.tmp.glob("backup-*/backup.json")):
            put(backup=str(m.parent), manifest=json.loads(m.read_text()))
