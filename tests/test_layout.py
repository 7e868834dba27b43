"""The layout's one rule (docs/ARCHITECTURE.md): the three stages import only the shared
contract, never each other, and the contract imports no stage. Checked on the source (every
import statement, also the ones inside functions)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("training", "index_builder", "service")
ALLOWED = {
    "embedding": set(),
    "training": {"embedding"},
    "index_builder": {"embedding"},
    "service": {"embedding"},
    "experiments": {"embedding", "training"},  # a driver over the stages; no stage imports it
}
PROJECT = set(ALLOWED)


def imported_packages(package: str) -> dict[str, set[str]]:
    """{file: top-level project packages it imports} for every .py file of `package`."""
    out = {}
    for f in (ROOT / package).rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = (found & PROJECT) - {package}
    return out


def test_no_stage_imports_a_sibling_and_the_contract_imports_no_stage():
    bad = [
        f"{f} imports {', '.join(sorted(pkgs - ALLOWED[package]))}"
        for package in ALLOWED
        for f, pkgs in imported_packages(package).items()
        if pkgs - ALLOWED[package]
    ]
    assert not bad, bad
    # the check sees imports at all: the stages do import the contract
    for stage in STAGES:
        assert any("embedding" in p for p in imported_packages(stage).values()), stage


# ------------------------------------------------------------------------------ inside service/
# service/'s folders say what runs where; each may import only the layers below it. The assembly
# (cli, config, state, workers, registration, ...) sits at the top level and may import every
# folder but http/ (test_the_core_knows_nothing_of_http), as startup/ (the assembly's start, in
# parts by concern) does;
# config (the settings) is imported by the layers that read settings, and imports only store/.
SERVICE_TOP = {
    "__init__",
    "__main__",
    "cli",
    "config",
    "state",
    "workers",
    "model_process",
    "registration",
    "metrics",
    "logs",
    "learned",  # what the served model has not learned from (/readyz)
    "learn_job",  # snca-gallery learn as the service's background job, its lock
}
SERVICE_LAYERS = {
    "store": set(),  # the system of record: nothing of the service above it
    "gallery": {"store"},  # the in-memory index, vote, open set
    "model": {"store", "gallery", "config", "logs"},  # runtime, embedder, batcher
    "review": {"store", "gallery", "config", "logs"},  # the review queue: keep, group
    # the app, routes: the service's operations (registration) and what it observes
    "http": {"store", "gallery", "model", "review", "config", "state", "startup"}
    | {"registration", "metrics", "logs", "learn_job"},
    "tools": {"store", "gallery", "model", "review", "config", "state", "startup"}
    | {"registration", "logs", "learn_job", "learned"},  # the CLIs
    "config": {"store"},
    # start-up: opening, which gallery, the start-up carry, finishing, the host
    "startup": {"store", "gallery", "model", "review", "config", "state", "metrics", "logs"}
    | {"registration", "learned", "learn_job", "workers"},
    "metrics": set(),  # what every process counts (prometheus)
    "logs": set(),  # JSON lines with the request id
}


def service_imports() -> dict[str, set[str]]:
    """{service module (dotted, under service.): the service modules it imports}."""
    out = {}
    for f in (ROOT / "service").rglob("*.py"):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("service.")}
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{f}: relative import (write service.<folder>...)"
                if node.module.startswith("service."):
                    found.add(node.module)
                    found |= {f"{node.module}.{a.name}" for a in node.names}
        out[mod] = found
    return out


def _part(mod: str) -> str:
    """The layer of a service module: its folder, or its own name at the top level."""
    return mod.split(".")[1] if mod.count(".") >= 1 else mod


def test_service_top_level_holds_only_the_assembly():
    top = {p.stem for p in (ROOT / "service").glob("*.py")}
    assert top == SERVICE_TOP, top ^ SERVICE_TOP
    folders = {p.name for p in (ROOT / "service").iterdir() if p.is_dir() and p.name[0] != "_"}
    assert folders == set(SERVICE_LAYERS) - {"config", "metrics", "logs"}


def test_service_layers_import_only_the_layers_below():
    bad = []
    for mod, imports in service_imports().items():
        layer = _part(mod)
        if layer not in SERVICE_LAYERS:  # the assembly: anything
            continue
        for imp in imports:
            other = _part(imp)
            if other != layer and other not in SERVICE_LAYERS[layer]:
                bad.append(f"{mod} imports {imp}")
    assert not bad, bad
    # the check sees imports at all
    assert "service.store.sqlite" in service_imports()["service.store.registry"]


def _cycles(package: str) -> list[list[str]]:
    """Import cycles between the modules of `package` (module-level and inside functions)."""
    graph: dict = {}
    for f in (ROOT / package).rglob("*.py"):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = [n for n in ast.walk(ast.parse(f.read_text(), str(f)))]
    packages = {m for m in graph if (ROOT / m.replace(".", "/")).is_dir()}
    for mod, nodes in graph.items():
        deps = set()
        here = mod if mod in packages else mod.rsplit(".", 1)[0]
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                # `from pkg import mod` depends on the module, not on pkg's __init__
                subs = {f"{base}.{a.name}" for a in node.names} & set(graph)
                deps |= subs or {base}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[mod] = deps
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    found, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append([*path[path.index(d) :], d] if d in path else [m, d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_no_module_imports_form_a_circle():
    for package in ("training", "service", "embedding", "index_builder"):
        assert not _cycles(package), (package, _cycles(package))


# The one door to HTTP: http/ itself, and cli (which builds the app and serves it). Everything
# else (the assembly included) is the core: it imports nothing of http/, nor the web framework.
HTTP_DOOR = {"http", "cli", "__main__"}
WEB = ("fastapi", "starlette", "uvicorn")


def test_the_core_knows_nothing_of_http():
    bad = [
        f"{mod} imports {imp}"
        for mod, imports in service_imports().items()
        if _part(mod) not in HTTP_DOOR
        for imp in imports
        if _part(imp) == "http"
    ]
    for f in (ROOT / "service").rglob("*.py"):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        if _part(mod) in HTTP_DOOR:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [f"{mod} imports {n}" for n in names if n.split(".")[0] in WEB]
    assert not bad, bad
    # the check sees imports: the door does import http/ and the web framework
    assert any(_part(i) == "http" for i in service_imports()["service.cli"])


def test_no_test_module_imports_another():
    """Shared helpers live in a helpers module or a conftest, never in a test module."""
    bad = []
    for f in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[-1]] + [a.name for a in node.names]
                if node.module.split(".")[-1].startswith("test_") or (
                    node.level and not node.module and any(n.startswith("test_") for n in names)
                ):
                    bad.append(f"{f.relative_to(ROOT)} imports {node.module}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{f.relative_to(ROOT)} imports {a.name}"
                    for a in node.names
                    if a.name.split(".")[-1].startswith("test_")
                ]
    assert not bad, bad


def test_no_route_imports_another():
    """Routes share what they share through http/'s own modules (fields, urls, inputs,
    idempotency, schemas), never by importing another route: each route module is one leaf."""
    routes = {m for m in service_imports() if m.startswith("service.http.routes.")}
    bad = [
        f"{m} imports {i}"
        for m in routes
        for i in service_imports()[m]
        if i.startswith("service.http.routes.") and i != m
    ]
    assert not bad, bad
    assert len(routes) >= 8  # (the check sees the routes)


# The benchmarks drive the real service the way the tests do, through the tests' helper modules
# (a real server, images, real photographs cropped, a real PostgreSQL): this edge, and only it,
# is declared here.
BENCHMARKS_MAY_IMPORT = {
    "tests.helpers",
    "tests.service.helpers",
    "tests.service.photos",
    "tests.service.pg",
}


def _imports_from(folder: str) -> dict[str, set[str]]:
    """{file: modules it imports from (absolute, or relative resolved)} for a folder's .py files."""
    out = {}
    for f in (ROOT / folder).rglob("*.py"):
        pkg = list(f.relative_to(ROOT).parent.parts)
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - (node.level - 1)] if node.level else []
                found.add(".".join([*base, *([node.module] if node.module else [])]))
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        out[str(f.relative_to(ROOT))] = found
    return out


def test_conftest_files_are_imported_by_no_one_and_benchmarks_use_only_test_helpers():
    """conftest files hold fixtures and hooks, which pytest finds itself; what tests share is a
    helpers module. The benchmarks' way into the tests is the declared helper modules."""
    bad = [
        f"{f} imports {m}"
        for folder in ("tests", "benchmarks")
        for f, mods in _imports_from(folder).items()
        for m in mods
        if m.split(".")[-1] == "conftest"
    ]
    bad += [
        f"{f} imports {m}"
        for f, mods in _imports_from("benchmarks").items()
        for m in mods
        if m.split(".")[0] == "tests" and m not in BENCHMARKS_MAY_IMPORT
    ]
    assert not bad, bad
    # (the check sees imports: the tests do import their helpers)
    assert any("tests.service.helpers" in m for m in _imports_from("tests").values())


def test_the_service_tests_mirror_its_folders():
    """Each folder of service/ has its tests in tests/service/<folder>/ (where a newcomer looks)."""
    folders = {p.name for p in (ROOT / "service").iterdir() if p.is_dir() and p.name[0] != "_"}
    tests = {p.name for p in (ROOT / "tests" / "service").iterdir() if p.is_dir()}
    assert folders <= tests, folders - tests
