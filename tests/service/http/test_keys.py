"""Scoped API keys (service/http/keys.py): a read key is refused on every write route and
accepted on every read route, the OpenAPI document and /readyz say so, the key file rotates
without a restart, and no key appears in a log or an error."""

from __future__ import annotations

import logging
import os
import time

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.http.app import create_app
from service.http.deps import ACCESS_KEY
from service.http.keys import RECHECK_S, KeyRing, parse_entries
from tests.service.helpers import png

READ, WRITE, OLD = "dash-read-7f3c2a", "ops-write-91ab4d", "plain-old-key-55"


def routes_of(app, level):
    """(method, path template, path) of every route of `level` in the app's OpenAPI document
    (each route states its access level there), path parameters filled in."""
    out = []
    for template, ops in app.openapi()["paths"].items():
        path = template.replace("{item_id}", "1").replace("{label}", "Trouser")
        out += [(m.upper(), template, path) for m, op in ops.items() if op.get(ACCESS_KEY) == level]
    return out


def client(run, data_dir, **kw):
    app = create_app(Settings(model=run, data_dir=data_dir, model_process=False, **kw))
    return TestClient(app, base_url="http://localhost")


def test_a_read_key_reads_everything_and_writes_nothing(
    base_run, tmp_path, fmnist_test, caplog, capfd
):
    caplog.set_level(logging.DEBUG)
    keys = f"read:{READ}, write:{WRITE}"
    with client(base_run, tmp_path / "d", api_keys=keys, api_key=OLD) as c:
        writes, reads = routes_of(c.app, "write"), routes_of(c.app, "read")
        assert len(writes) >= 4 and len(reads) >= 6, (writes, reads)
        for method, _, path in writes:
            r = c.request(method, path, headers={"X-API-Key": READ})
            assert r.status_code == 403, (method, path, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["code"] == "insufficient_scope"
            for key in (None, "wrong-key-123"):
                h = {"X-API-Key": key} if key else {}
                assert c.request(method, path, headers=h).status_code == 401, (method, path)
            for key in (WRITE, OLD):  # past the check: the route's own answer
                r = c.request(method, path, headers={"X-API-Key": key})
                assert r.status_code not in (401, 403), (method, path, key, r.text)
        for method, _, path in reads:
            for key in (READ, WRITE, OLD):
                r = c.request(method, path, headers={"X-API-Key": key})
                assert r.status_code not in (401, 403), (method, path, r.text)
            # a read key configured: reads need a key (SNCA_PROTECT_READS by default)
            assert c.request(method, path).status_code == 401, (method, path)
        # real work with each scope
        f = {"images": ("a.png", png(fmnist_test, 0), "image/png")}
        r = c.post("/gallery/add", data={"label": "mine"}, files=f, headers={"X-API-Key": WRITE})
        assert r.status_code == 201, r.text
        q = {"image": ("q.png", png(fmnist_test, 0), "image/png")}
        assert c.post("/classify", files=q, headers={"X-API-Key": READ}).status_code == 200
        labels = c.get("/gallery/labels", headers={"X-API-Key": READ}).json()
        assert "mine" in {x["label"] for x in labels["labels"]}
        # /readyz says what the key may do (the page disables its write controls on "read")
        assert c.get("/readyz", headers={"X-API-Key": READ}).json()["access"] == "read"
        assert c.get("/readyz", headers={"X-API-Key": WRITE}).json()["access"] == "write"
        assert c.get("/readyz").json() == {
            "status": "ready",
            "store_writable": True,
            "access": "none",
        }
        # the OpenAPI document states it: a key on every read and write route, 403 on writes
        doc = c.get("/openapi.json", headers={"X-API-Key": READ}).json()
        for method, template, _ in writes + reads:
            op = doc["paths"][template][method.lower()]
            assert op.get("security") == [{"APIKeyHeader": []}], (method, template)
            is_write = op[ACCESS_KEY] == "write"
            assert ("403" in op["responses"]) == is_write, (method, template)
    text = caplog.text + capfd.readouterr().err
    for key in (READ, WRITE, OLD):
        assert key not in text


def test_read_keys_leave_reads_open_when_told(base_run, tmp_path):
    with client(base_run, tmp_path / "d", api_keys=f"read:{READ}", protect_reads=False) as c:
        assert c.get("/gallery/labels").status_code == 200
        assert c.request("DELETE", "/gallery/labels/Trouser").status_code == 401
        assert c.get("/readyz").json()["access"] == "read"  # reads open, writes need a key


def test_the_key_file_rotates_without_a_restart(base_run, tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    f = tmp_path / "keys"
    f.write_text(f"# dashboards\nread:{READ}\nwrite:{WRITE}\n")
    with client(base_run, tmp_path / "d", api_keys_file=f) as c:
        h = {"X-API-Key": READ}
        assert c.get("/gallery/labels", headers=h).status_code == 200
        assert c.delete("/gallery/items/1", headers=h).status_code == 403
        new_read, new_write = "rotated-read-0001", "rotated-write-002"
        _rewrite(f, f"read:{new_read}\nwrite:{new_write}\n")
        time.sleep(RECHECK_S + 0.1)
        assert c.get("/gallery/labels", headers=h).status_code == 401  # the old key is gone
        assert c.get("/gallery/labels", headers={"X-API-Key": new_read}).status_code == 200
        r = c.delete("/gallery/items/1", headers={"X-API-Key": new_write})
        assert r.status_code not in (401, 403), r.text
        # a broken file keeps the keys in force (and says why, naming no key)
        _rewrite(f, f"admin:{READ}\n")
        time.sleep(RECHECK_S + 0.1)
        assert c.get("/gallery/labels", headers={"X-API-Key": new_read}).status_code == 200
        logs = caplog.text + capfd.readouterr().err  # (the service's JSON logs go to stderr)
        assert "key file not reloaded" in logs
        # only write keys now: reads open again, and the OpenAPI document follows
        _rewrite(f, f"write:{new_write}\n")
        time.sleep(RECHECK_S + 0.1)
        assert c.get("/gallery/labels").status_code == 200
        doc = c.get("/openapi.json").json()
        assert "security" not in doc["paths"]["/gallery/labels"]["get"]
        assert doc["paths"]["/gallery/add"]["post"]["security"] == [{"APIKeyHeader": []}]
    logs += caplog.text + capfd.readouterr().err
    for key in (READ, WRITE, new_read, new_write):
        assert key not in logs


def _rewrite(path, text):
    """Replace the file as an editor or a secret manager does (a new file renamed over it)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.parametrize(
    "text",
    ["reader:abcdefgh123", "read abcdefgh123", "write:short", "read:", "write:has space here"],
)
def test_a_wrong_entry_is_refused_without_echoing_the_key(text):
    with pytest.raises(ValueError) as e:
        parse_entries(text, "SNCA_API_KEYS", lines=True)
    assert "entry 1" in str(e.value)
    assert text.partition(":")[2].strip() not in str(e.value) or not text.partition(":")[2]


def test_the_server_refuses_to_start_on_a_wrong_key_setting(base_run, tmp_path, capsys):
    from service.cli import main

    bad = tmp_path / "keys"
    bad.write_text("write:fine-key-1234\nsuper:secret-key-9876\n")
    assert main(["--model", str(base_run), "--api-keys-file", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "entry 2 is not SCOPE:KEY" in err and "secret-key-9876" not in err, err
    os.environ["SNCA_API_KEYS"] = "read:abc"
    try:
        assert main(["--model", str(base_run), "--port", "0"]) == 2
    finally:
        del os.environ["SNCA_API_KEYS"]
    assert "SNCA_API_KEYS: entry 1: a key has at least 8 characters" in capsys.readouterr().err


def test_scopes_combine_and_compare_every_key():
    ring = KeyRing([("read", "same-key-000"), ("write", "same-key-000"), ("read", "r-key-0000")])
    assert ring.scope("same-key-000") == "write"
    assert ring.scope("r-key-0000") == "read"
    assert ring.scope("") is None and ring.scope(None) is None
    assert ring.needs_key("read") and ring.needs_key("write") and not ring.needs_key("public")
    assert not KeyRing([]).needs_key("write")


def test_a_key_file_rewritten_in_place_is_applied_only_once_whole(tmp_path, monkeypatch):
    """A key file caught half-rewritten in place (its `write:` line there, its `read:` line
    not yet) opened the reads for a moment and turned the read key's 403 into 401 (issue 39,
    finding 9). Now a file rewritten in place is applied only once it has not changed for
    SETTLE_S; one renamed into place (whole by construction) at once."""
    from service.http import keys

    monkeypatch.setattr(keys, "RECHECK_S", 0.0)
    f = tmp_path / "keys"
    f.write_text(f"read:{READ}\nwrite:{WRITE}\n")
    ring = KeyRing([], f)
    assert ring.reads_protected and ring.scope(READ) == "read"
    with open(f, "w") as out:  # in place, as `>` or an editor without a rename does
        out.write(f"write:{WRITE}\n")  # ... and the read line has not come yet
    assert ring.reads_protected and ring.scope(READ) == "read"  # the keys in force stay
    assert ring.reloads == 1
    past = time.time() - 2 * keys.SETTLE_S  # the file has not changed since: whole
    os.utime(f, (past, past))
    assert not ring.reads_protected and ring.scope(READ) is None
    assert ring.reloads == 2
    _rewrite(f, f"read:{OLD}\nwrite:{WRITE}\n")  # a rename: applied at once
    assert ring.scope(OLD) == "read" and ring.reloads == 3
