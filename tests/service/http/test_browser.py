"""The web page in a real browser: Debian's Chromium (/usr/bin/chromium, installed by `make
test`) driven by Playwright, against a real snca-serve process on loopback with thumbnails."""

import base64
import os
import shutil

import httpx
import pytest

from tests.helpers import run_cli

from ..helpers import Server, of_class, png


@pytest.fixture(scope="module")
def server(base_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    p = run_cli("index_builder", base_run, "--out", tmp / "index", "--thumbnails", "--no-progress")
    assert p.returncode == 0, p.stderr
    s = Server(base_run, tmp / "serve", None, "--index", str(tmp / "index"), "--thumbnails")
    yield s
    s.kill(15)


@pytest.mark.slow
def test_classify_register_labels_search_in_the_browser(
    server, browser, tmp_path, fmnist_test, artifacts
):
    from playwright.sync_api import expect

    files = {}
    for name, i in (
        ("sneaker", of_class(fmnist_test, 7, 1)[0]),
        ("tee1", of_class(fmnist_test, 0, 1)[0]),
        ("tee2", of_class(fmnist_test, 0, 1, 1)[0]),
        ("tee3", of_class(fmnist_test, 0, 1, 2)[0]),
    ):
        files[name] = tmp_path / f"{name}.png"
        files[name].write_bytes(png(fmnist_test, i))
    (tmp_path / "notes.png").write_text("this is text, not an image")
    expected = httpx.post(
        server.url + "/classify", files={"image": ("q.png", files["sneaker"].read_bytes())}
    ).json()["nearest_label"]

    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # a Content-Security-Policy violation is a console error: the page must need none (the
    # deliberate 415 below logs "Failed to load resource", which is not one)
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    sent = []  # (method, path, X-Min-Gallery-Version) of every API request the page makes
    page.on(
        "request",
        lambda r: sent.append(
            (r.method, r.url.split(server.url, 1)[-1], r.headers.get("x-min-gallery-version"))
        ),
    )
    page.goto(server.url + "/")
    expect(page.locator("#status")).to_contain_text("items")
    expect(page.locator("#classify-result")).to_be_hidden()  # no empty box on first load

    # classify: the label the API gives, and a row of neighbour thumbnails
    page.set_input_files("#classify-file", str(files["sneaker"]))
    expect(page.locator("#classify-label")).to_have_text(expected)
    expect(page.locator("#classify-neighbours .cell img")).to_have_count(10)
    page.screenshot(path=str(artifacts / "classify.png"), full_page=True)

    # several images at once: a row each, the unreadable one with the service's reason
    page.set_input_files(
        "#classify-file", [str(files["sneaker"]), str(files["tee1"]), str(tmp_path / "notes.png")]
    )
    expect(page.locator("#classify-batch-progress")).to_contain_text("3 classified", timeout=30_000)
    expect(page.locator("#classify-batch-progress")).to_contain_text("1 could not be read")
    rows = page.locator("#classify-batch-table tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_contain_text(expected)
    expect(rows.nth(2)).to_contain_text("415")
    expect(page.locator("#classify-result")).to_be_hidden()
    page.screenshot(path=str(artifacts / "classify-batch.png"), full_page=True)
    # a pasted image is classified (Ctrl+V: a paste event carrying the image file)
    page.evaluate(
        """async (b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
            document.body.dispatchEvent(new ClipboardEvent("paste", { clipboardData: dt, bubbles: true }));
        }""",
        base64.b64encode(files["sneaker"].read_bytes()).decode(),
    )
    expect(page.locator("#classify-label")).to_have_text(expected)
    expect(page.locator("#classify-batch")).to_be_hidden()

    # a 4xx from the service is shown as a readable message, not a crash
    page.set_input_files("#classify-file", str(tmp_path / "notes.png"))
    expect(page.locator("#message")).to_contain_text("415")
    # ... and the previous prediction does not stay beside the new (broken) preview
    expect(page.locator("#classify-result")).to_be_hidden()
    # the API key lives for the tab's session, never in localStorage
    page.fill("#apikey", "not-a-real-key")
    page.dispatch_event("#apikey", "change")
    assert page.evaluate("localStorage.getItem('snca-api-key')") is None
    assert page.evaluate("sessionStorage.getItem('snca-api-key')") == "not-a-real-key"
    page.fill("#apikey", "")
    page.dispatch_event("#apikey", "change")

    # register a label from three images; the page classifies the first one right away
    page.click("nav button[data-tab=register]")
    page.fill("#register-label", "my-tee")
    page.set_input_files("#register-files", [str(files[n]) for n in ("tee1", "tee2", "tee3")])
    page.click("#register-submit")
    expect(page.locator("#register-check")).to_contain_text("my-tee")
    expect(page.locator("#message")).to_contain_text("is in the gallery")
    # read-your-writes behind a load balancer: after its add, the page's reads carry the
    # gallery_version the add answered
    add_at = next(i for i, r in enumerate(sent) if r[0] == "POST" and r[1] == "/gallery/add")
    after = [r for r in sent[add_at + 1 :] if not r[1].startswith("/gallery/items/")]
    assert after and all(r[2] is not None and int(r[2]) >= 1 for r in after), after
    assert all(r[2] is None for r in sent[:add_at]), sent[:add_at]

    # the label list shows it with its count and what the service knows of each label (a
    # label of one image of a known kind is told it competes with that kind); delete asks
    # first, then removes it
    one = httpx.post(server.url + "/gallery/add", data={"label": "one-sneaker"},
                     files={"images": ("s.png", files["sneaker"].read_bytes())})  # fmt: skip
    assert one.status_code == 201, one.text
    page.click("nav button[data-tab=labels]")
    row = page.locator("#labels-table tr[data-label='my-tee']")
    expect(row).to_contain_text("3")
    checks = page.locator("#labels-table tr[data-label='one-sneaker'] td.checks")
    expect(checks.locator("li.warning")).to_contain_text(f"as '{expected}'", timeout=30_000)
    expect(row.locator("td.checks")).not_to_have_text("…")
    page.screenshot(path=str(artifacts / "labels.png"), full_page=True)
    assert httpx.delete(server.url + "/gallery/labels/one-sneaker").status_code == 200
    # retrieval: the registered images come back first for one of them
    page.click("nav button[data-tab=search]")
    page.set_input_files("#search-file", str(files["tee2"]))
    expect(page.locator("#search-results .cell").first).to_contain_text("my-tee")
    expect(page.locator("#search-results .cell img").first).to_be_visible()
    page.screenshot(path=str(artifacts / "search.png"), full_page=True)

    page.click("nav button[data-tab=labels]")
    page.once("dialog", lambda d: d.accept())
    row.locator("button", has_text="delete").click()
    expect(row).to_have_count(0)
    labels = httpx.get(server.url + "/gallery/labels").json()["labels"]
    assert "my-tee" not in {x["label"] for x in labels}

    # phone width: nothing wider than the screen
    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.goto(server.url + "/")
    phone.set_input_files("#classify-file", str(files["sneaker"]))
    expect(phone.locator("#classify-label")).to_have_text(expected)
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    phone.screenshot(path=str(artifacts / "phone.png"), full_page=True)
    assert errors == []
    if os.environ.get("SNCA_SCREENSHOT_DIR"):  # for docs/serving.md: SNCA_SCREENSHOT_DIR=docs
        shutil.copy(
            artifacts / "classify.png", os.path.join(os.environ["SNCA_SCREENSHOT_DIR"], "page.png")
        )
    for shot in ("classify", "search", "phone"):
        assert (artifacts / f"{shot}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_an_unknown_image_is_offered_for_registration(
    server, browser, tmp_path, fmnist_test, artifacts
):
    """Classify an image the gallery has no label for: the page says "unknown" and offers to
    register it; the image goes to the registration tab, and the registration's diagnostics
    are shown."""
    from playwright.sync_api import expect

    pick = None  # a T-shirt (never trained on) that the service calls unknown
    for i in of_class(fmnist_test, 0, 30):
        r = httpx.post(server.url + "/classify", files={"image": ("t.png", png(fmnist_test, i))})
        if r.json()["unknown"]:
            pick = i
            break
    assert pick is not None, "no T-shirt among 30 is unknown"
    path = tmp_path / "new-thing.png"
    path.write_bytes(png(fmnist_test, pick))

    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    expect(page.locator("#status")).to_contain_text("items")
    page.set_input_files("#classify-file", str(path))
    expect(page.locator("#classify-unknown-box")).to_be_visible()
    expect(page.locator("#classify-unknown")).to_be_visible()
    expect(page.locator("#classify-score")).to_contain_text("threshold")
    # (issue 53) the reason in words on the first screen, the numbers behind "details", and
    # no confidence beside a label that is only the nearest one
    expect(page.locator("#classify-explanation")).to_contain_text("only a guess")
    expect(page.locator("#classify-score")).to_be_hidden()
    expect(page.locator("#classify-confidence")).to_have_text("")
    page.click("#classify-register")
    expect(page.locator("#tab-register")).to_be_visible()
    expect(page.locator("#register-carried")).to_contain_text("carried over")
    assert page.evaluate("document.getElementById('register-files').files.length") == 1
    assert page.evaluate("document.getElementById('register-files').files[0].name") == path.name
    page.fill("#register-label", "new-thing")
    page.click("#register-submit")
    expect(page.locator("#register-check")).to_contain_text("new-thing")
    expect(page.locator("#register-facts")).to_contain_text("leave-one-out agreement")
    expect(page.locator("#register-warnings li").first).to_be_visible()
    page.screenshot(path=str(artifacts / "unknown.png"), full_page=True)
    labels = httpx.get(server.url + "/gallery/labels").json()["labels"]
    assert {"label": "new-thing", "count": 1, "source": "added"} in labels
    httpx.delete(server.url + "/gallery/labels/new-thing")
    assert errors == []


@pytest.mark.slow
def test_a_read_key_turns_the_pages_write_controls_off(base_run, browser, tmp_path):
    """With scoped keys (SNCA_API_KEYS), the page asks /readyz what the typed key may do: a read
    key disables Register and every label's delete button, saying why; a write key enables them."""
    from playwright.sync_api import expect

    keys = "read:page-read-key-1, write:page-write-key-2"
    s = Server(base_run, tmp_path / "serve", {"SNCA_API_KEYS": keys})
    try:
        page = browser.new_page()
        page.goto(s.url + "/")
        expect(page.locator("#status")).to_contain_text("API key needed")  # reads need a key
        page.fill("#apikey", "page-read-key-1")
        page.dispatch_event("#apikey", "change")
        expect(page.locator("#status")).to_contain_text("read-only key")
        page.click("nav button[data-tab=register]")
        expect(page.locator("#register-submit")).to_be_disabled()
        expect(page.locator("#register-readonly")).to_contain_text("may only read")
        page.click("nav button[data-tab=labels]")
        for name in ("delete", "rename"):  # (suggestions only read: they stay on)
            button = page.locator("#labels-table tbody button", has_text=name).first
            expect(button).to_be_disabled()
        expect(
            page.locator("#labels-table tbody button", has_text="suggestions").first
        ).to_be_enabled()
        page.fill("#apikey", "page-write-key-2")
        page.dispatch_event("#apikey", "change")
        expect(page.locator("#status")).not_to_contain_text("read-only")
        page.click("nav button[data-tab=register]")
        expect(page.locator("#register-submit")).to_be_enabled()
        expect(page.locator("#register-readonly")).to_be_hidden()
        page.close()
    finally:
        s.kill(15)


@pytest.mark.slow
def test_the_review_flow_in_the_browser(base_run, browser, tmp_path, fmnist_test, artifacts):
    """Issue 43's page: with the review queue on, a read key sees the Review tab's groups with
    Name and Dismiss off; a write key names the biggest group (its queries become items of the
    label), takes a label's suggestions and accepts them, renames a label, and edits an item's
    label in place from Search."""
    from playwright.sync_api import expect

    keys = "read:review-read-key-1, write:review-write-key-2"
    env = {"SNCA_API_KEYS": keys, "SNCA_REVIEW_QUEUE": "1"}
    s = Server(base_run, tmp_path / "serve", env, "--thumbnails")
    w = {"X-API-Key": "review-write-key-2"}
    try:
        with httpx.Client(base_url=s.url, headers=w, timeout=30) as c:
            assert c.delete("/gallery/labels/Bag").status_code == 200
            for i in of_class(fmnist_test, 8, 25):
                c.post("/classify", files={"image": ("q.png", png(fmnist_test, i))})
            for _ in range(50):  # (the queue's writer runs every half second)
                if c.get("/review").json()["queued"] >= 15:
                    break
                import time

                time.sleep(0.2)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + "/")
        page.fill("#apikey", "review-read-key-1")
        page.dispatch_event("#apikey", "change")
        expect(page.locator("#status")).to_contain_text("read-only key")
        page.click("nav button[data-tab=review]")
        expect(page.locator("#review-summary")).to_contain_text("queries the service could not")
        expect(page.locator(".group").first).to_be_visible()
        expect(page.locator(".group .review-name").first).to_be_disabled()
        expect(page.locator(".group .review-dismiss").first).to_be_disabled()
        expect(page.locator("#review-readonly")).to_contain_text("may only read")
        expect(page.locator(".group .cell img").first).to_be_visible()  # the thumbnails
        # a write key: name the biggest group
        page.fill("#apikey", "review-write-key-2")
        page.dispatch_event("#apikey", "change")
        expect(page.locator("#status")).not_to_contain_text("read-only")
        with page.expect_response(lambda r: "/review?" in r.url):  # (the groups drawn again:
            page.click("nav button[data-tab=review]")  # a field filled before is replaced)
        page.wait_for_load_state("networkidle")
        first = page.locator(".group").first
        expect(first.locator(".review-name")).to_be_enabled()
        # (issue 53) a queued query's answer is not an editable item label, with a write key too
        # (it was turned on and its click sent the query's id to PATCH /gallery/items: 404)
        expect(first.locator(".cell-label").first).to_be_disabled()
        size = int(first.locator("h3").inner_text().split()[0])
        # a label over the limit: the API's words, not a silent cut
        first.locator(".actions input").fill("x" * 300)
        first.locator(".review-name").click()
        expect(page.locator("#message")).to_contain_text("300 characters; the limit is 100")
        # a member that does not belong, unticked: left out, still queued
        ticks = first.locator("input.member")
        assert size >= 2 and ticks.count() >= 2, size
        left = int(ticks.nth(1).get_attribute("data-id"))
        ticks.nth(1).uncheck()
        first.locator(".actions input").fill("new bag")
        first.locator(".review-name").click()
        expect(page.locator("#message")).to_contain_text('are now items of "new bag"')
        page.screenshot(path=str(artifacts / "review-named.png"), full_page=True)
        queued = httpx.get(s.url + "/review?limit=2000", headers=w).json()["groups"]
        assert any(left in g["ids"] for g in queued), left
        size -= 1
        # the label's suggestions, accepted
        page.click("nav button[data-tab=labels]")
        row = page.locator('#labels-table tr[data-label="new bag"]')
        expect(row.locator("td").nth(1)).to_have_text(str(size))
        row.locator("button", has_text="suggestions").click()
        expect(page.locator("#suggest-label")).to_have_text("new bag")
        expect(page.locator("#suggest-list .cell").first).to_be_visible()
        page.click("#suggest-accept")
        expect(page.locator("#message")).to_contain_text('are now "new bag"')
        # rename it (a prompt)
        page.once("dialog", lambda d: d.accept("bags"))
        page.locator('#labels-table tr[data-label="new bag"] button', has_text="rename").click()
        expect(page.locator('#labels-table tr[data-label="bags"]')).to_be_visible()
        # (issue 53) the label's items as thumbnails: one removed, one moved, in place
        n_bags = int(page.locator('#labels-table tr[data-label="bags"] td').nth(1).inner_text())
        page.locator('#labels-table tr[data-label="bags"] button', has_text="items").click()
        expect(page.locator("#items-label")).to_have_text("bags")
        expect(page.locator("#items-list .cell")).to_have_count(min(n_bags, 48))
        expect(page.locator("#items-list .cell img").first).to_be_visible()
        page.screenshot(path=str(artifacts / "label-items.png"), full_page=True)
        gone = int(page.locator("#items-list .cell").first.get_attribute("data-id"))
        page.once("dialog", lambda d: d.accept())
        page.locator("#items-list .cell").first.locator(".item-remove").click()
        expect(page.locator("#message")).to_contain_text(f"item #{gone} removed")
        expect(page.locator("#items-list .cell")).to_have_count(min(n_bags, 48) - 1)
        moved = page.locator("#items-list .cell").first
        moved_id = int(moved.get_attribute("data-id"))
        page.once("dialog", lambda d: d.accept("tote"))
        moved.locator(".cell-label").click()
        expect(page.locator("#message")).to_contain_text(f'item #{moved_id} is now "tote"')
        assert httpx.get(f"{s.url}/gallery/items/{gone}", headers=w).status_code == 404
        assert httpx.get(f"{s.url}/gallery/items/{moved_id}", headers=w).json()["label"] == "tote"
        # an item's label edited in place from Search
        page.click("nav button[data-tab=search]")
        q = tmp_path / "bag.png"
        q.write_bytes(png(fmnist_test, of_class(fmnist_test, 8, 1, 30)[0]))
        page.set_input_files("#search-file", str(q))
        cell = page.locator("#search-results .cell").first
        expect(cell).to_be_visible()
        item = cell.get_attribute("data-id")
        page.once("dialog", lambda d: d.accept("handbag"))
        cell.locator(".cell-label").click()
        expect(page.locator("#message")).to_contain_text(f'item #{item} is now "handbag"')
        got = httpx.get(f"{s.url}/gallery/items/{item}", headers=w).json()
        assert got["label"] == "handbag"
        assert not errors, errors
        page.close()
    finally:
        s.kill(15)


@pytest.mark.slow
def test_learn_from_the_labels_tab(base_run, browser, tmp_path, fmnist_train):
    """Issue 52's page: the Labels tab says how many items the model has not learned from, a
    write key starts snca-gallery learn as one background job (a second start is refused while
    it runs) and its output follows on the page until it is done."""
    from playwright.sync_api import expect

    key = "learn-write-key-1"
    run = tmp_path / "run"  # (the learned run dir goes beside the served one: not the shared one)
    shutil.copytree(base_run, run)
    s = Server(run, tmp_path / "serve", {"SNCA_API_KEY": key})
    try:
        with httpx.Client(base_url=s.url, headers={"X-API-Key": key}, timeout=60) as c:
            for label, cls in (("top", 0), ("pullover", 2)):
                files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png"))
                         for i in of_class(fmnist_train, cls, 30)]  # fmt: skip
                assert c.post("/gallery/add", data={"label": label}, files=files).status_code == 201
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + "/")
        page.click("nav button[data-tab=labels]")
        expect(page.locator("#learn-summary")).to_contain_text("60 items the model has not learned")
        expect(page.locator("#learn-start")).to_be_disabled()  # (no key yet)
        page.fill("#apikey", key)
        page.dispatch_event("#apikey", "change")
        page.click("nav button[data-tab=labels]")
        expect(page.locator("#learn-start")).to_be_enabled()
        page.click("#learn-start")
        expect(page.locator("#learn-summary")).to_contain_text("Learning", timeout=30_000)
        expect(page.locator("#learn-start")).to_be_disabled()
        r = httpx.post(s.url + "/admin/learn", headers={"X-API-Key": key}, timeout=30)
        assert r.status_code == 409 and r.json()["code"] == "learn_running", r.text
        expect(page.locator("#learn-log")).to_contain_text("learn 1/4", timeout=60_000)
        expect(page.locator("#learn-log")).to_contain_text("learn: ", timeout=300_000)
        expect(page.locator("#learn-summary")).not_to_contain_text("Learning")
        assert not errors, errors
    finally:
        s.kill(15)
