"""Progress off a terminal: a line every few seconds with counts, share, status and time left;
nothing when disabled; a tqdm bar on a terminal."""

import io

from embedding.progress import Progress, track


def test_lines_when_not_a_terminal():
    out = io.StringIO()
    with Progress(4, "epoch 1/2", "steps", stream=out, every=0.0, isatty=False) as p:
        p.note("loss 0.5")
        for _ in range(4):
            p.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[1].startswith("epoch 1/2: 2/4 steps (50%), loss 0.5, ")
    assert "left" in lines[1] and "left" not in lines[-1]


def test_a_line_only_every_interval():
    out = io.StringIO()
    with Progress(1000, "x", stream=out, every=3600.0, isatty=False) as p:
        for _ in range(1000):
            p.update()
    assert out.getvalue() == ""


def test_disabled_is_silent_and_a_terminal_gets_a_bar():
    out = io.StringIO()
    assert list(track(range(3), 3, "x", enabled=False)) == [0, 1, 2]
    with Progress(3, "bar", stream=out, every=0.0, isatty=True) as p:
        p.update(3)
    assert "bar" in out.getvalue() and "\r" in out.getvalue()  # tqdm redraws one line
    logged = []
    with Progress(2, "to a logger", every=0.0, write=logged.append) as p:
        p.update(2)
    assert logged == [logged[0]] and logged[0].startswith("to a logger: 2/2")


def test_time_left_counts_the_work_after_the_bar(monkeypatch):
    """ "~N left" is the whole run's: the epochs after this one count (the README's sample once
    said "~2 s left" with minutes to go)."""
    import embedding.progress as progress

    clock = iter([0.0, 10.0, 10.0, 20.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    # 10 s for 1 of 2 steps: 10 s for this epoch's last step, 2 later epochs of 2 steps: 40 s
    p = Progress(2, "epoch 1/3", "steps", stream=out, every=0.0, isatty=False, later_units=4)
    p.update()
    assert out.getvalue().rstrip().endswith("~50 s left"), out.getvalue()
    out2 = io.StringIO()
    q = Progress(2, "epoch 2/3", "steps", stream=out2, every=0.0, isatty=False, later_seconds=60)
    q.update()
    assert out2.getvalue().rstrip().endswith("~70 s left"), out2.getvalue()
