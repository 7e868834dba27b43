"""The web page at / (service/static/: plain HTML, CSS and JavaScript, no build step)."""

from __future__ import annotations

import functools
import html
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from embedding.votes import VOTES

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)


@functools.cache
def page(default_vote: str) -> str:
    """index.html with the vote rules of embedding.votes as the choices (default first)."""
    votes = [default_vote, *(v for v in VOTES if v != default_vote)]
    options = "".join(f"<option>{html.escape(v)}</option>" for v in votes)
    return (STATIC_DIR / "index.html").read_text().replace("<!--vote-options-->", options)


@router.get("/")
async def index(request: Request):
    settings = request.app.state.snca.settings
    return HTMLResponse(page(settings.vote), headers={"Cache-Control": "no-cache"})
