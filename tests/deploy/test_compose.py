"""docker-compose.yml and docker/Dockerfile, checked without an engine (CI has none):
the compose file parses, every profile's services reference files, stages, volumes and settings
that exist, and the bootstrap script is valid sh. docker/smoke.sh does the real thing."""

import re
import subprocess
from pathlib import Path

import yaml

from service.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
# bootstrap.sh reads these besides the service settings
BOOTSTRAP_VARS = {"SNCA_BOOTSTRAP_ARGS", "SNCA_INDEX_ARGS", "SNCA_DATASETS", "SNCA_RETRAIN"}


def _stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE, re.M | re.I))


# the scale profile's database and load balancer are official images, pinned to a major version
OFFICIAL = {"postgres": "postgres:15-bookworm", "lb": "nginx:1.27-bookworm"}


def test_every_service_builds_or_uses_a_built_image():
    services = COMPOSE["services"]
    built = {s["image"] for s in services.values() if "build" in s}
    assert built == {"snca:cpu", "snca:gpu"}
    for name, svc in services.items():
        assert svc["image"] in built or svc["image"] == OFFICIAL.get(name), name
        if "build" in svc:
            b = svc["build"]
            assert (ROOT / b["context"] / b["dockerfile"]).is_file()
            assert b["args"]["VARIANT"] in ("cpu", "gpu")
            assert b.get("target") in (None, *_stages())


def test_profiles_and_dependencies():
    s = COMPOSE["services"]
    default = {n for n, v in s.items() if not v.get("profiles")}
    assert default == {"bootstrap", "api"}  # `docker compose up` = bootstrap, then api
    for api, boot in (("api", "bootstrap"), ("api-gpu", "bootstrap-gpu")):
        assert s[api]["depends_on"][boot]["condition"] == "service_completed_successfully"
        assert s[api]["restart"] == "unless-stopped" and "healthcheck" in s[api]
        assert "/readyz" in " ".join(s[api]["healthcheck"]["test"])
        assert s[api]["volumes"] == s[boot]["volumes"]  # the api sees what bootstrap wrote
    for name in ("api-gpu", "bootstrap-gpu"):
        assert s[name]["profiles"] == ["gpu"]
        dev = s[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert s[name]["environment"]["SNCA_DEVICE"] == "cuda"
    assert s["train"]["profiles"] == ["train"]
    for name in ("bootstrap", "bootstrap-gpu", "train"):  # one-shot: the image's check is the api's
        assert s[name]["healthcheck"] == {"disable": True}, name


def test_scale_profile_postgres_replicas_and_a_load_balancer():
    s = COMPOSE["services"]
    for name in ("postgres", "replica", "lb"):
        assert s[name]["profiles"] == ["scale"], name
    assert "pg_isready" in s["postgres"]["healthcheck"]["test"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in s["postgres"]["volumes"])
    r = s["replica"]
    assert r["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert r["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully"
    assert r["environment"]["SNCA_STORE"].startswith("postgresql://snca:")
    assert "ports" not in r and "replicas" in r["deploy"] and "/readyz" in str(r["healthcheck"])
    assert s["lb"]["depends_on"]["replica"]["condition"] == "service_healthy"
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    assert "server replica:8000" in conf and "proxy_next_upstream" in conf
    assert any(v.startswith("./docker/nginx.conf:") for v in s["lb"]["volumes"])


def test_volumes_are_declared_and_settings_exist():
    declared = set(COMPOSE["volumes"])
    fields = {f"SNCA_{f.upper()}" for f in Settings.model_fields}
    for name, svc in COMPOSE["services"].items():
        if name in OFFICIAL:
            continue
        for v in svc.get("volumes", []):
            # ${VAR:-default} -> its default, then SOURCE:TARGET[:ro]
            src = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v).split(":")[0]
            assert src.startswith(("/", ".")) or src in declared, (name, v)
        for key in svc.get("environment", {}):
            assert key in fields | BOOTSTRAP_VARS, (name, key)
        assert not {"SNCA_API_KEY"} & set(re.findall(r"SNCA_\w+=", DOCKERFILE))  # never baked in
    for f in ("model", "index", "store", "data_dir", "host", "port"):
        assert f"SNCA_{f.upper()}=" in DOCKERFILE, f


def test_dockerfile_is_multistage_non_root_and_copies_existing_files():
    assert {"build", "runtime"} <= _stages()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim", DOCKERFILE, re.M)
    assert re.search(
        r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu", DOCKERFILE, re.M
    )
    assert re.search(r"^USER snca", DOCKERFILE, re.M) and "HEALTHCHECK" in DOCKERFILE
    assert "STOPSIGNAL" in DOCKERFILE and "LABEL org.opencontainers" in DOCKERFILE
    assert not re.search(r"^\s*(RUN|CMD).*\bpython\b(?!3)", DOCKERFILE, re.M)  # python3 only
    for src in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE, re.M):
        for part in src.split():
            if not part.startswith("/"):
                assert (ROOT / part).exists(), part
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"  # allow-list: runs/, venvs out


def test_bootstrap_script_is_valid_sh():
    p = subprocess.run(["sh", "-n", str(ROOT / "docker" / "bootstrap.sh")], capture_output=True)
    assert p.returncode == 0, p.stderr
    smoke = ROOT / "docker" / "smoke.sh"
    assert subprocess.run(["bash", "-n", str(smoke)], capture_output=True).returncode == 0
