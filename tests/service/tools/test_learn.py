"""`snca-gallery learn` end to end on the tiny real model (5 Fashion-MNIST classes) with two new
labels of 30 images each: it trains on the whole gallery, indexes, compares on the held-out part,
keeps the served model when the learned one is not better by what is asked, switches when it
is (the writes made meanwhile carried), and a learn killed with SIGKILL in training goes on when
run again. On SQLite and a real PostgreSQL, with a server writing to the same gallery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from service.tools.learn import decide

from ..helpers import Backend, of_class, png

NEW = (("top", 0), ("pullover", 2))  # (label, Fashion-MNIST class): none of them trained


def _shots(root, raw, n=30):
    for label, cls in NEW:
        (root / label).mkdir(parents=True)
        for j, i in enumerate(of_class(raw, cls, n)):
            (root / label / f"{j}.png").write_bytes(png(raw, i))
    return root


def _live(backend) -> tuple[str | None, dict[str, int]]:
    """(the live gallery's model dir, live items per label), read from the store."""
    from service.store.galleries import alias, registry
    from service.store.registry import open_as_found

    home = backend.url or str(backend.tmp / "data" / "gallery.sqlite")
    h = open_as_found(home)
    try:
        a = alias(h)
        model = registry(h).get(a["gen"], {}).get("model_dir") if a else None
        target = h.sibling(home, a["gen"]) if a else home
    finally:
        h.close()
    s = open_as_found(target)
    try:
        rows = s.select(
            "SELECT label, COUNT(*) FROM items WHERE deleted_seq IS NULL GROUP BY label"
        )
    finally:
        s.close()
    return model, dict(rows)


def _ids_live(backend, ids: list[int]) -> bool:
    """Whether the live gallery holds these ids (the same items, carried with their ids)."""
    from service.store.galleries import alias
    from service.store.registry import open_as_found

    home = backend.url or str(backend.tmp / "data" / "gallery.sqlite")
    h = open_as_found(home)
    try:
        a = alias(h)
        target = h.sibling(home, a["gen"]) if a else home
    finally:
        h.close()
    s = open_as_found(target)
    try:
        return set(s.items(ids)) == set(ids)
    finally:
        s.close()


def _unlearned(backend, run) -> int:
    from service.learned import Unlearned
    from service.store.galleries import alias
    from service.store.registry import open_as_found

    home = backend.url or str(backend.tmp / "data" / "gallery.sqlite")
    h = open_as_found(home)
    try:
        target = h.sibling(home, alias(h)["gen"])
    finally:
        h.close()
    s = open_as_found(target)
    try:
        return Unlearned(run).count(s, s.last_seq())[0]
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_learn_keeps_the_served_model_unless_the_learned_one_is_better(
    kind, request, base_run, tmp_path, fmnist_train
):
    pg = request.getfixturevalue("postgres") if kind == "postgresql" else None
    backend = Backend(kind, tmp_path, pg)
    server = backend.start(base_run, model_process=False)
    try:
        backend.tool(base_run, "import", _shots(tmp_path / "shots", fmnist_train), "--no-progress")
        _, before = _live(backend)
        # what the served model has not learned: the 60 images users added (/readyz says)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            said = httpx.get(server.url + "/readyz", timeout=30).json().get("unlearned", {})
            if said.get("items") == 60:
                break
            time.sleep(1)
        assert said.get("items") == 60, said
        out = tmp_path / "learned"
        # asked for a gain no model reaches: trained, indexed, compared, not switched
        p = backend.tool(
            base_run, "learn", "--out", out, "--epochs", "1", "--min-gain", "1", "--no-progress"
        )
        st = json.loads((out / "learn.json").read_text())
        assert st["trained"] and st["indexed"] and st["compared"]["held_out"] > 0, p.stdout
        assert "not better" in p.stdout and "the served model stays" in p.stdout, p.stdout
        c = st["compared"]
        assert c["old"]["added_items"] == c["new"]["added_items"] > 0  # (both new labels held)
        assert _live(backend)[0] is None  # (never switched)
        # a write acknowledged after the training: the switch must carry it
        with httpx.Client(base_url=server.url, timeout=60) as http:
            files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in (7, 8)]
            late = http.post("/gallery/add", data={"label": "late"}, files=files).json()["ids"]
        # again with the same --out: no retraining, the decision from the same numbers
        p = backend.tool(base_run, "learn", "--out", out, "--min-gain", "-1", "--no-progress")
        assert "learn 1/4" not in p.stdout and "learn 4/4" in p.stdout, p.stdout
        model, after = _live(backend)
        assert model == str(out.resolve()), p.stdout
        assert after == {**before, "late": 2}, (before, after)
        assert _ids_live(backend, late), late
        # the learned model has learned all but its held-out items and the 2 added since
        held = json.loads((tmp_path / "learned.gallery" / "export.json").read_text())["held_out"]
        assert _unlearned(backend, out) == held["images"] + 2
        assert decide(c, 1.0)[0] is False and decide(c, -1.0)[0] is True
    finally:
        server.kill()


def test_a_learn_killed_in_training_goes_on_when_run_again(base_run, tmp_path, fmnist_train):
    backend = Backend("sqlite", tmp_path)
    backend.tool(base_run, "import", _shots(tmp_path / "shots", fmnist_train), "--no-progress")
    out = tmp_path / "learned"
    cmd = backend.tool_command(base_run, "learn", "--out", str(out), "--epochs", "3")
    p = subprocess.Popen(
        [*cmd, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # (the learn and the training it runs: one group, killed -9)
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
    )
    seen = []
    deadline = time.monotonic() + 600
    for line in p.stdout:
        seen.append(line)
        if "epoch 1/3" in line or time.monotonic() > deadline:
            break
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert any("epoch 1/3" in x for x in seen), "".join(seen)
    assert out.with_name(out.name + ".partial").is_dir()  # (the training's checkpoint)
    q = backend.tool(base_run, "learn", "--out", out, "--min-gain", "-1", "--no-progress")
    assert "resum" in q.stdout.lower(), q.stdout
    st = json.loads((out / "learn.json").read_text())
    assert st["trained"] and st["switched"], q.stdout
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert [m["epoch"] for m in metrics if "epoch" in m][-1] == 3
    assert _live(backend)[1]["top"] == 30
