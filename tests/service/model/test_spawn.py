"""The model process spawned before the front has its settings (service/model/spawn.py): one
never configured exits quietly, and a `snca-serve` whose start fails lets its early one go."""

import os

from service import cli
from service.model import spawn


def test_a_model_process_never_configured_exits_without_a_word():
    child = spawn.spawn()
    child.discard()  # (what the CLI does when it will not run a model process after all)
    assert child.proc.wait(timeout=60) == 0


def test_a_failed_start_lets_its_early_model_process_go(tmp_path, monkeypatch, capsys):
    made = []
    real = spawn.spawn

    def recording():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(spawn, "spawn", recording)
    monkeypatch.delenv("SNCA_MODEL_PROCESS", raising=False)
    monkeypatch.delenv("SNCA_WORKERS", raising=False)
    monkeypatch.setenv("SNCA_API_KEYS", "admin:short")  # refused before any model is opened
    assert cli.main(["--model", str(tmp_path / "no-such-run"), "--data-dir", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err
    assert len(made) == 1  # spawned first thing...
    assert made[0].proc.wait(timeout=60) == 0  # ...and let go: it exited, configured by no one
    assert spawn._early is None


def test_no_early_model_process_where_none_will_run(monkeypatch):
    monkeypatch.delenv("SNCA_MODEL_PROCESS", raising=False)
    monkeypatch.delenv("SNCA_WORKERS", raising=False)
    monkeypatch.delenv("SNCA_WORKER_FD", raising=False)
    assert cli.runs_a_model_process(["--model", "runs/x"])
    assert not cli.runs_a_model_process(["--no-model-process"])
    assert not cli.runs_a_model_process(["--help"])
    assert not cli.runs_a_model_process(["--workers", "2"])
    assert not cli.runs_a_model_process(["--workers=3"])
    monkeypatch.setenv("SNCA_MODEL_PROCESS", "false")
    assert not cli.runs_a_model_process([])
    assert os.environ.get("SNCA_MODEL_PROCESS") == "false"
