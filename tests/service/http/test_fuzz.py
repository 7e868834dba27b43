"""Property-based fuzzing of every route with schemathesis `--checks all`, against the
service's own OpenAPI document, on a real uvicorn process: no 5xx, every response (status,
content type, body, headers) as published, schema-valid requests accepted and schema-violating
ones refused, the security requirement as enforced. Runs without a key configured, and with
one, with and without the header. SNCA_FUZZ_EXAMPLES (50) examples per operation; `make
stress` runs more (docs/RELIABILITY.md). tests/service/http/schemathesis.toml says what OpenAPI
cannot (image validity), tests/service/http/st_hooks.py works around one schemathesis bug."""

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ..helpers import Server

HERE = Path(__file__).resolve().parent
MAX_EXAMPLES = int(os.environ.get("SNCA_FUZZ_EXAMPLES", "50"))
# A new seed every run (a fixed one explores the same cases forever: `--seed 1` never drew
# the X-Min-Gallery-Version that stalled every route); printed, and SNCA_FUZZ_SEED replays it.
SEED = int(os.environ.get("SNCA_FUZZ_SEED") or int.from_bytes(os.urandom(4), "big"))


def schemathesis(url: str, out: Path, *extra: str) -> tuple[int, int, int, str]:
    exe = Path(sys.executable).with_name("schemathesis")
    p = subprocess.run(
        [
            str(exe),
            "--config-file",
            str(HERE / "schemathesis.toml"),
            "run",
            f"{url}/openapi.json",
            "-n",
            str(MAX_EXAMPLES),
            "--seed",
            str(SEED),
            "-c",
            "all",
            "--workers",
            "1",
            "--no-color",
            # POST /admin/learn starts a retraining that switches the gallery it serves to
            # another model (tests/service/http/test_browser.py and tools/test_learn.py test it)
            "--exclude-operation-id",
            "learn_start_admin_learn_post",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=out,
        env=dict(
            os.environ,
            SCHEMATHESIS_HOOKS="tests.service.http.st_hooks",
            PYTHONPATH=str(HERE.parents[2]),
        ),
    )
    m = re.search(r"(\d+) generated, (\d+) passed", p.stdout)
    generated, passed = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return p.returncode, generated, passed, p.stdout[-4000:]


@pytest.fixture(scope="module")
def servers(base_run, tmp_path_factory):
    """{with a key configured: its server}, each started once for the module (the keyed one
    serves two runs: with the wrong or no key, and with the key)."""
    started = {}

    def get(keyed: bool) -> Server:
        if keyed not in started:
            env = {"SNCA_MIN_VERSION_WAIT_S": "0"}  # (a 503 for a version not reached: at once)
            if keyed:
                env["SNCA_API_KEY"] = "fuzz-key"
            started[keyed] = Server(base_run, tmp_path_factory.mktemp("fuzz") / "serve", env)
        return started[keyed]

    yield get
    for server in started.values():
        server.kill(15)


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, "wrong-or-missing", "fuzz-key"])
def test_schemathesis_finds_no_5xx_and_no_schema_violation(servers, tmp_path, key):
    server = servers(key is not None)
    extra = ["-H", f"X-API-Key: {key}"] if key == "fuzz-key" else []
    print(f"schemathesis seed {SEED} (SNCA_FUZZ_SEED={SEED} replays it)")
    rc, generated, passed, out = schemathesis(server.url, tmp_path, *extra)
    assert rc == 0, f"seed {SEED} (replay: SNCA_FUZZ_SEED={SEED}): {out}"
    assert generated >= 10 * MAX_EXAMPLES and passed == generated, out
    assert httpx.get(server.url + "/healthz").status_code == 200
    print(f"schemathesis ({key or 'no key'}): {generated} cases, all passed")
    assert "Traceback" not in server.read_log()  # nothing crashed inside either
