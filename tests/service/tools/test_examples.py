"""The example `make run` prints registers a label that does not take images away from a trained
class. The old example, a test-set sandal registered as "my-shoe", took 48 of 60 held-out
sandals on the default model (the default vote gives a one-image label the prior of a
five-thousand-image one); on the short model below it takes 13% of them, over the 2% bound."""

import io

import numpy as np
import pytest

from index_builder.build import BuildConfig, build
from service.tools.examples import logo, write_examples

from ..helpers import make_client

BOUND = 0.02  # at most this share of any class's test images may go to the new label


@pytest.fixture(scope="module")
def short_index(short_run):
    run, _ = short_run
    out = run.parent / "short-index"
    build(BuildConfig(run, out, progress=False), log=lambda m: None)
    return run, out


def _png(img) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def _shares(client, label: str, test) -> dict[str, float]:
    """Share of each class's test images that /classify/batch labels `label` (all 10,000)."""
    got = []
    for s in range(0, len(test.targets), 64):
        files = [
            ("images", (f"{i}.png", _png(_img(test, i)), "image/png"))
            for i in range(s, min(s + 64, len(test.targets)))
        ]
        got += [
            r["label"] == label
            for r in client.post("/classify/batch", files=files).json()["results"]
        ]
    got = np.array(got)
    return {n: float(got[test.targets == c].mean()) for c, n in enumerate(test.class_names)}


def _img(test, i):
    from PIL import Image

    return Image.fromarray(test.source.get(int(i))[0].numpy())


@pytest.mark.slow
def test_the_example_label_is_recognised_and_takes_no_trained_class(
    short_index, tmp_path, fmnist_test
):
    paths = write_examples(tmp_path / "examples")
    assert {"logo.png", "logo-2.png", "sneaker.png", "sandal.png"} <= {p.name for p in paths}
    run, index = short_index
    with make_client(run, tmp_path / "data", index=index) as c:
        files = {
            "images": ("logo.png", (tmp_path / "examples" / "logo.png").read_bytes(), "image/png")
        }
        assert c.post("/gallery/add", data={"label": "my-logo"}, files=files).status_code == 201
        # another drawing of it (the README's next command) finds it first and is voted to it.
        # Whether the one-image label also *accepts* it is the open-set rule's call on a
        # similarity near its threshold (0.861 against 0.866 on one CPU's short model, over it
        # on another): not asserted.
        q = {"image": ("l.png", _png(logo(1)), "image/png")}
        second = c.post("/classify", files=q).json()
        assert second["nearest_label"] == "my-logo", second
        assert second["nearest_probability"] > 0.9, second
        found = c.post("/search", params={"k": 5}, files=q).json()["items"]
        assert found[0]["label"] == "my-logo", found
        shares = _shares(c, "my-logo", fmnist_test)
    worst = max(shares, key=shares.get)
    assert shares[worst] <= BOUND, f"my-logo took {100 * shares[worst]:.1f}% of {worst}"
