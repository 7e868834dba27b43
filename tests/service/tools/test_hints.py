"""What `make run` and `make photos` print (service/tools/hints.py) is what the README says, and
an empty gallery is the only one called empty (issue 53)."""

from __future__ import annotations

import re
from pathlib import Path

from service.tools import hints

ROOT = Path(__file__).resolve().parents[3]
URL = "http://127.0.0.1:8000"


def readme_block_after(marker: str) -> list[str]:
    """The lines of the first ```bash block after `marker` in README.md."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(marker) :], re.S)
    assert block, marker
    return [ln for ln in block[1].splitlines() if ln.strip()]


def test_the_printed_lines_are_the_readmes():
    assert readme_block_after("In another terminal:") == hints.run_lines("runs/demo/examples", URL)
    photos = readme_block_after("register\na label from five of them")
    assert photos == hints.photos_lines("runs/photos-lite0/examples", URL)
    make = (ROOT / "Makefile").read_text()
    assert "-m service.tools.hints run --model $(OUT)" in make
    assert "-m service.tools.hints photos --model $(PHOTOS)" in make


def test_an_empty_gallery_is_called_empty_and_only_then(tmp_path, monkeypatch):
    monkeypatch.setenv("SNCA_DATA_DIR", str(tmp_path / "data"))
    lines = hints.hints("photos", Path("runs/photos-lite0"), "127.0.0.1", 8000)
    assert lines[0].startswith("The gallery is empty")
    assert [ln.strip() for ln in lines[1:4]] == hints.photos_lines(
        "runs/photos-lite0/examples", URL
    )
