"""mkdocs hook: the site's home page is the repository's README.md (one text, not two), its
links into docs/ rewritten to the pages beside it."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = readme.read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=text))
    return files
