"""The web page at / (service/http/static/: plain HTML, CSS and JavaScript, no build step), the
API docs at /docs with Swagger UI served from this server (no CDN: it works offline), and
/favicon.ico."""

from __future__ import annotations

import functools
import html
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from embedding.votes import VOTES

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)

# The page loads only its own script, style and images (thumbnails, previews as blob: URLs),
# may not be framed (clickjacking) and sends no referrer.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def docs_assets() -> Path:
    """Swagger UI's files, from the fastapi-offline package (a dependency of the serve extra)."""
    return Path(str(resources.files("fastapi_offline") / "static"))


@functools.cache
def page(default_vote: str) -> str:
    """index.html with the vote rules of embedding.votes as the choices (default first)."""
    votes = [default_vote, *(v for v in VOTES if v != default_vote)]
    options = "".join(f"<option>{html.escape(v)}</option>" for v in votes)
    return (STATIC_DIR / "index.html").read_text().replace("<!--vote-options-->", options)


@router.get("/")
async def index(request: Request):
    settings = request.app.state.snca.settings
    return HTMLResponse(page(settings.vote), headers=PAGE_HEADERS)


@router.get("/docs")
async def docs():
    r = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="snca — API",
        swagger_js_url="/docs-assets/swagger-ui-bundle.js",
        swagger_css_url="/docs-assets/swagger-ui.css",
        swagger_favicon_url="/favicon.ico",
    )
    r.headers["X-Frame-Options"] = "DENY"
    return r


@router.get("/favicon.ico")
async def favicon():
    return FileResponse(
        STATIC_DIR / "favicon.svg",
        media_type="image/svg+xml",
        headers={"Cache-Control": "public, max-age=86400"},
    )
