"""Bad input to snca-train: a clear message, a non-zero exit, no traceback wall, nothing lost."""

import numpy as np
from PIL import Image

from tests.helpers import run_cli

TINY = [
    "--subset",
    "300",
    "--val-size",
    "60",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--no-progress",
]


FOLDER = ("--dataset", "imagefolder", "--data-dir")  # then the folder


def _fails(proc, *needles):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def test_unknown_dataset_and_arch(tmp_path):
    _fails(
        run_cli("training", "--dataset", "mnist", "--out", tmp_path / "r"),
        "invalid choice: 'mnist'",
    )
    _fails(run_cli("training", "--arch", "vgg16", "--out", tmp_path / "r"), "unknown arch 'vgg16'")
    _fails(  # a timm name timm does not know: said before any data is read
        run_cli(
            "training", "--arch", "timm:no_such_net", "--subset", "300", "--out", tmp_path / "r"
        ),
        "timm:no_such_net",
        "Unknown model",
    )


def test_bad_numbers(tmp_path):
    _fails(run_cli("training", "--epochs", "-1", "--out", tmp_path / "r"), "integer >= 0")
    _fails(run_cli("training", "--epochs", "0", "--out", tmp_path / "r"), "pass them with --init")
    _fails(
        run_cli("training", "--temperature", "-1", "--out", tmp_path / "r"), "temperature must be"
    )
    _fails(
        run_cli("training", "--knn-k", "1,x", "--out", tmp_path / "r"), "comma-separated integers"
    )


def test_config_file_unknown_key_and_missing_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 2\nlearning_rate: 0.1\n")
    _fails(
        run_cli("training", "--config", cfg, "--out", tmp_path / "r"), "unknown keys: learning_rate"
    )
    _fails(run_cli("training", "--config", tmp_path / "none.yaml"), "does not exist")


def test_missing_and_corrupt_data_files_are_named(tmp_path):
    _fails(
        run_cli("training", *FOLDER, tmp_path / "nope", "--out", tmp_path / "r"),
        "does not exist",
    )
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b broken gzip")
    (bad / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b broken gzip")
    _fails(
        run_cli("training", *TINY, "--out", tmp_path / "r", env={"SNCA_DATA_DIR": str(bad)}),
        "train-images-idx3-ubyte.gz",
    )


def test_unreadable_image_in_image_folder_is_named(tmp_path):
    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(
                root / c / f"{i}.png"
            )
    (root / "b" / "zz_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    p = run_cli(
        "training",
        "--dataset",
        "imagefolder",
        "--data-dir",
        root,
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--val-size",
        "10",
        "--no-progress",
        "--out",
        tmp_path / "r",
    )
    _fails(p, "zz_bad.png")
    assert not (tmp_path / "r").exists()
    assert not (tmp_path / "r.partial").exists()  # no stray staging dir either


def test_class_filter_that_leaves_nothing(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    (root / "empty").mkdir()
    Image.new("RGB", (8, 8)).save(root / "a" / "x.png")
    _fails(
        run_cli("training", *FOLDER, root, "--classes", "empty", "--out", tmp_path / "r"),
        "leaves no",
    )


def test_existing_out_needs_resume_or_overwrite_and_is_kept(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _fails(run_cli("training", *TINY, "--out", out), "--resume", "--overwrite")
    assert (out / "precious.txt").read_text() == "keep me"
    _fails(run_cli("training", *TINY, "--out", tmp_path / "fresh", "--resume"), "no run to resume")
    _fails(run_cli("training", *TINY, "--out", out, "--resume", "--overwrite"), "contradict")


def test_batch_larger_than_data(tmp_path):
    _fails(
        run_cli(
            "training",
            "--subset",
            "100",
            "--val-size",
            "20",
            "--batch-size",
            "256",
            "--out",
            tmp_path / "r",
            "--no-progress",
        ),
        "lower --batch-size",
    )
    assert not (tmp_path / "r").exists()
    assert not (tmp_path / "r.partial").exists()


def test_snca_eval_dispatches_and_rejects_unknown_commands(tmp_path, capsys):
    from training.eval_cli import eval_cli

    assert eval_cli(["nope"]) == 2 and "usage: snca-eval" in capsys.readouterr().err
    assert eval_cli(["closed", str(tmp_path / "missing")]) == 2
    assert "evaluate: error: missing file" in capsys.readouterr().err
    assert eval_cli(["fewshot", str(tmp_path / "missing")]) == 2
    assert "fewshot: error:" in capsys.readouterr().err


def test_progress_lines_when_the_output_is_not_a_terminal(tmp_path):
    """Logs, CI and Docker get a line every SNCA_PROGRESS_SECONDS, not one per epoch (a run
    was silent for minutes at a time); --no-progress stays silent."""
    args = [a for a in TINY if a != "--no-progress"]
    p = run_cli("training", *args, "--out", tmp_path / "r", env={"SNCA_PROGRESS_SECONDS": "0"})
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("epoch 1/1: ")]
    assert len(lines) >= 5 and "steps (" in lines[0] and "\r" not in p.stderr, p.stderr
    q = run_cli("training", *TINY, "--out", tmp_path / "q", env={"SNCA_PROGRESS_SECONDS": "0"})
    assert q.returncode == 0 and "steps (" not in q.stderr, q.stderr


def test_a_subset_keeps_most_of_itself_for_training():
    """--subset 6000 with the default validation split (5,000) once trained on 1,000 images:
    without --val-size a subset validates on a sixth of itself; an explicit size is kept."""
    from training.cli import build_parser, resolve_config

    p = build_parser()
    cfg, _, _ = resolve_config(p.parse_args(["--subset", "6000", "--out", "x"]))
    assert cfg.val_size == 1000
    cfg, _, _ = resolve_config(p.parse_args(["--subset", "60000", "--out", "x"]))
    assert cfg.val_size == 5000
    cfg, _, _ = resolve_config(
        p.parse_args(["--subset", "6000", "--val-size", "3000", "--out", "x"])
    )
    assert cfg.val_size == 3000
    cfg, _, _ = resolve_config(p.parse_args(["--out", "x"]))
    assert cfg.val_size == 5000


def test_bad_arguments_are_refused_before_torch_is_loaded(tmp_path):
    """snca-train parses and checks its arguments on the standard library, numpy and PIL: a
    mistake is answered in a fraction of a second, not after torch's ~1.5 s import (the config
    module and what it imports load no torch; training.distributed and the loaders import it
    when the run starts)."""
    import subprocess
    import sys

    code = """if True:
        import sys
        from training.cli import main

        def rc(args):
            try:
                return main([*args, "--out", sys.argv[1]])
            except SystemExit as e:  # (argparse's own errors)
                return e.code

        bad = (["--dataset", "mnist"], ["--temperature", "-1"], ["--arch", "vgg16"],
               ["--epochs", "0"], ["--outlier-families", "nope"])
        print([rc(a) for a in bad], "torch" in sys.modules)
    """
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True
    )
    assert p.stdout.strip() == "[2, 2, 2, 2, 2] False", p.stdout + p.stderr
    assert "unknown nope" in p.stderr and "pass them with --init" in p.stderr, p.stderr
