"""`make reproduce QUICK=1` (python -m experiments.reproduce --quick) on a tiny subset: the whole
grid trains, evaluates, and writes the report block, the figures and the raw numbers."""

import json

import pytest

from experiments.reproduce import BEGIN, END, GROUPS, grid, write_report
from tests.helpers import run_cli


@pytest.mark.slow
def test_quick_grid_end_to_end(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "RESULTS.md").write_text(
        f"# Results\n\nhand-written intro\n\n{BEGIN}\nold\n{END}\n\ntail\n"
    )
    out = tmp_path / "runs"
    p = run_cli(
        "experiments.reproduce",
        "--quick",
        "--subset",
        "600",
        "--out",
        out,
        "--docs",
        docs,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    raw = json.loads((out / "results.json").read_text())
    names = {j.name for j in grid(True, 600)}
    assert set(raw["jobs"]) == names
    for name, job in raw["jobs"].items():
        assert job["train"]["status"] == "ok", name
        top1 = job["closed"]["memory"]["knn_top1@30"]
        assert 10.0 < top1 <= 100.0, (name, top1)  # above chance on 10 classes, a real number
    assert "fine" in raw["jobs"]["coarse-nca"]["closed"]
    # quick: a stratified 2,000 of the test images, never all 10,000
    assert raw["jobs"]["main-nca"]["closed"]["queries"] == 2000
    # and ~2,000 of each few-shot pool (the same share of each of its 3 or 7 classes, rounded)
    pools = raw["jobs"]["fewshot-nca"]["pools"]
    assert set(pools) == {"shots", "base_queries", "novel_queries"}, pools
    assert all(abs(n - 2000) <= 7 for n in pools.values()), pools
    eps = raw["jobs"]["fewshot-nca"]["episodes"]
    assert set(eps) == {"1", "5"} and all(0 < e["mean"] <= 1 for e in eps.values())
    text = (docs / "RESULTS.md").read_text()
    assert text.startswith("# Results\n\nhand-written intro") and text.rstrip().endswith("tail")
    assert "old" not in text and text.count(BEGIN) == 1 and text.count(END) == 1
    for section in ("Closed set", "Ablations", "Sub-category", "Few-shot", "Targets"):
        assert section in text, section
    for fig in ("curves", "accuracy_vs_k", "per_class_gain", "neighbours"):
        png = docs / "figures" / f"{fig}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig
        assert f"figures/{fig}.png" in text


def test_bad_arguments_name_the_problem(tmp_path):
    p = run_cli("experiments.reproduce", "--only", "main,bogus", "--out", tmp_path)
    assert p.returncode == 2 and "bogus" in p.stderr
    p = run_cli("experiments.reproduce", "--subset", "5", "--out", tmp_path)
    assert p.returncode == 2 and "--subset" in p.stderr


def test_report_block_is_appended_then_replaced(tmp_path):
    path = tmp_path / "R.md"
    path.write_text("# R\n\nkept\n")
    write_report(path, f"{BEGIN}\nfirst\n{END}\n")
    write_report(path, f"{BEGIN}\nsecond\n{END}\n")
    text = path.read_text()
    assert "kept" in text and "second" in text and "first" not in text
    assert set(GROUPS) == {j.group for j in grid(False, None)}
