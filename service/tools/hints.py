"""What `make run` and `make photos` print before they serve: which model will serve which
gallery, and the lines to try it, from the gallery as it is (issue 53: an empty gallery is
called empty, a gallery that is not is counted, a gallery carried to a retrained model is
served by it and the line says how to choose).

    python -m service.tools.hints photos --model runs/photos-lite0 [--host H --port P]
    python -m service.tools.hints run --model runs/demo [--host H --port P]

The lines are the README's (tests/service/tools/test_hints.py holds them to it). It reads the
store only (no model is loaded) and never writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def gallery_state(model: Path) -> tuple[Path, Path, dict[str, int] | None, str | None]:
    """(model that will serve with --follow-alias, its data dir, live items per label or None
    when there is no gallery yet, what following the gallery did in words or None)."""
    from embedding.index import read_manifest
    from embedding.rundir import RunDir
    from service.config import Settings
    from service.startup import follow_alias
    from service.store.registry import backend_class, locate_gallery, open_as_found

    settings = Settings(model=model, follow_alias=True)
    moved = follow_alias(settings)
    home = settings.home_store
    cls = backend_class(home)
    if not cls.exists(home):
        return Path(settings.model), Path(settings.data_dir), None, moved
    try:
        fingerprint = RunDir(settings.model).load_model_card()[1]
        where, _ = locate_gallery(
            home, settings.data_dir, fingerprint, read_manifest(settings.index).index_id
        )
    except Exception:  # (a model not built yet: the home store is the gallery)
        where = home
    store = open_as_found(where)
    try:
        with store.reader() as view:
            counts = view.label_counts()
    finally:
        store.close()
    return Path(settings.model), Path(settings.data_dir), counts, moved


def photos_lines(examples: str, url: str) -> list[str]:
    """The README's lines to register the example cup and ask about others."""
    files = " ".join(f"-F images=@{examples}/cup-{i}.jpg" for i in range(1, 6))
    return [
        f"curl -s -F label=cup {files} {url}/gallery/add",
        f"curl -s -F image=@{examples}/cup-query.jpg {url}/classify",
        f"curl -s -F image=@{examples}/moon.jpg {url}/classify",
    ]


def run_lines(examples: str, url: str) -> list[str]:
    """The README's lines to try `make run`'s model."""
    return [
        f"curl -s -F image=@{examples}/sneaker.png {url}/classify",
        f"curl -s -F label=my-logo -F images=@{examples}/logo.png {url}/gallery/add",
        f"curl -s -F image=@{examples}/logo-2.png '{url}/search?k=5'",
    ]


def hints(kind: str, model: Path, host: str, port: int) -> list[str]:
    url = f"http://{host}:{port}"
    served, data_dir, counts, moved = gallery_state(model)
    out = []
    if moved:
        out += [
            f"The gallery in {data_dir} was carried to {served}: serving it.",
            f"  (to serve {model} instead: .venv/bin/snca-serve --model {model}, which carries "
            "the gallery back to it; an archive is kept)",
        ]
    examples = f"{model}/examples"
    if kind == "photos":
        if not counts:
            out.append("The gallery is empty: register about five photos of each thing "
                       "(in another terminal):")  # fmt: skip
            out += ["  " + line for line in photos_lines(examples, url)]
        else:
            out.append(f"The gallery holds {sum(counts.values())} items of {len(counts)} labels "
                       f"({data_dir}); ask about a photo (in another terminal):")  # fmt: skip
            out.append(f"  curl -s -F image=@{examples}/cup-query.jpg {url}/classify")
        out.append(f"  your own, a folder per label: .venv/bin/snca-gallery import --model "
                   f"{served} --thumbnails my-photos/")  # fmt: skip
        out.append(
            f"  learn from them (live, no stop): .venv/bin/snca-gallery learn --model {served}"
        )
    else:
        out.append("Try it (in another terminal):")
        out += ["  " + line for line in run_lines(examples, url)]
    out.append(f"  the web page: {url}/  API docs: {url}/docs")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("run", "photos"))
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    try:
        lines = hints(a.kind, a.model, a.host, a.port)
    except Exception as e:  # (the hints must never stop `make run` from serving)
        print(f"(could not read the gallery's state: {e})", file=sys.stderr)
        return 0
    print("\n" + "\n".join(lines) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
