"""The vote rules behind one interface (embedding.votes): each rule class gives what its
function gives on brute-force inputs, deleted rows never vote, and every part of the product
that offers a choice of rule takes it from the one registry."""

import pytest
import torch

from embedding.knn import knn_search
from embedding.votes import (
    RULES,
    VOTES,
    GalleryView,
    Neighbors,
    get_rule,
    kde_probs,
    knn_probs,
    prototype_probs,
)


def _gallery(n=300, d=16, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(c, d, generator=g), dim=1)
    y = torch.randint(0, c, (n,), generator=g)
    x = torch.nn.functional.normalize(centres[y] + 0.5 * torch.randn(n, d, generator=g), dim=1)
    q = torch.nn.functional.normalize(
        centres[y[:20]] + 0.5 * torch.randn(20, d, generator=g), dim=1
    )
    return x, y, q, c


def test_each_rule_matches_its_function():
    x, y, q, c = _gallery()
    view = GalleryView.of(x, y, c, 0.05)
    sims, idx = knn_search(q, x, 10)
    torch.testing.assert_close(get_rule("knn").probs(q, view, 10), knn_probs(sims, y[idx], c, 0.05))
    sums = torch.zeros(c, x.shape[1]).index_add_(0, y, x)
    torch.testing.assert_close(
        get_rule("prototype").probs(q, view, 10),
        prototype_probs(q, sums, torch.bincount(y, minlength=c), 0.05),
    )
    torch.testing.assert_close(get_rule("kde").probs(q, view, 10), kde_probs(q @ x.T, y, c, 0.05))


def test_given_neighbours_and_similarities_are_used_as_given():
    """The service passes its FAISS neighbours and its own products: the rule must use them."""
    x, y, q, c = _gallery()
    view = GalleryView.of(x, y, c, 0.05)
    fake = Neighbors(torch.ones(len(q), 1), torch.full((len(q), 1), 3))
    assert (get_rule("knn").probs(q, view, 1, neighbors=fake).argmax(1) == 3).all()
    sims = torch.full((len(q), len(x)), -1.0)
    sims[:, (y == 2).nonzero()[0]] = 1.0  # every query next to one item of label 2
    assert (get_rule("kde").probs(q, view, 1, similarities=sims).argmax(1) == 2).all()


def test_rows_left_out_never_vote_and_an_empty_view_gives_zeros():
    x, y, q, c = _gallery()
    gone = y.clone()
    gone[y == 1] = -1  # every item of label 1 deleted (its rows stay in the matrix)
    view = GalleryView.of(x, gone, c, 0.05)
    assert int(view.counts[1]) == 0
    for rule in VOTES:
        p = get_rule(rule).probs(q, view, 30)
        assert (p[:, 1] == 0).all() and torch.allclose(p.sum(1), torch.ones(len(q))), rule
    empty = GalleryView.of(x, torch.full_like(y, -1), c, 0.05)
    for rule in VOTES:
        assert (get_rule(rule).probs(q, empty, 30) == 0).all(), rule


def test_every_choice_of_rule_comes_from_the_registry():
    """A new rule is one file and one RULES entry: the settings, the CLI, the HTTP query, the
    web page and the few-shot evaluation all offer what RULES holds."""
    from fastapi.testclient import TestClient  # noqa: F401 (the serve extra is installed)

    from service.cli import build_parser
    from service.config import Settings
    from service.http.routes.classify import ClassifyQuery
    from service.http.routes.page import page

    assert set(VOTES) == set(RULES) == {"knn", "prototype", "kde", "kde_shrunk"}
    schema = ClassifyQuery.model_json_schema()["properties"]["vote"]
    assert set(schema["anyOf"][0]["enum"]) == set(VOTES)
    vote_flag = next(a for a in build_parser()._actions if a.dest == "vote")
    assert set(vote_flag.choices) == set(VOTES)
    for v in VOTES:
        assert Settings(vote=v).vote == v
        assert f"<option>{v}</option>" in page("kde")
    with pytest.raises(ValueError):
        Settings(vote="majority")
    with pytest.raises(ValueError):
        get_rule("majority")
