"""The service's fast votes against the exact step-by-step vote on a default-sized gallery:
55,000 real Fashion-MNIST training images embedded by a trained model, 5,000 test images as
queries. The candidate vote (the path past exact_vote_max) at the default K' (issue 20's parity
targets); the compiled dense vote (service.gallery.compiled) to within float rounding."""

import numpy as np
import pytest

from benchmarks.gallery_scale import RULES, embed, fewshot_hm, make_gallery, predict
from embedding.datasets import load_raw
from embedding.rundir import RunDir
from service.gallery.gallery import CANDIDATES


@pytest.fixture(scope="module")
def default_gallery(short_run):
    """(emb, y, names, q, qy): the 55,000 training images and 5,000 test queries, embedded."""
    model = RunDir(short_run[0]).load_model()
    names = model.config.class_names
    train, test = load_raw("fashion-mnist", "train"), load_raw("fashion-mnist", "test")
    emb = embed(model, train.source.images[:55_000])
    y = np.asarray(train.targets[:55_000], dtype=np.int64)
    # 5,000 of the test images as queries (the gallery is the default size; what is compared is
    # each query's label under the two votes, so half the queries halve the time, not the check)
    q = embed(model, test.source.images[:5000])
    qy = np.asarray(test.targets[:5000], dtype=np.int64)
    return emb, y, names, q, qy


def test_compiled_dense_vote_is_the_step_by_step_vote_on_the_default_gallery(default_gallery):
    """Every answer field the compiled call makes (label, top-5 probabilities, best similarity,
    open-set score) against the rule run step by step (neighbours asked force that path), for
    both fused rules, with all rows live and after deletes (deleted rows left in the matrix)."""
    emb, y, names, q, _ = default_gallery
    g = make_gallery(emb, y, names, exact_max=10**12)
    q = q[:512]  # 8 batches of 64 per vote

    def check(vote):
        for s in range(0, len(q), 64):
            fast = g.classify(q[s : s + 64], vote, 30)
            slow = g.classify(q[s : s + 64], vote, 30, neighbors=True)
            for f, w in zip(fast, slow, strict=True):
                assert f.label == w.label, vote
                assert f.best_similarity == pytest.approx(w.best_similarity, abs=1e-5)
                assert f.unknown_score == pytest.approx(w.unknown_score, abs=1e-5)
                pf, pw = dict(f.probabilities), dict(w.probabilities)
                assert pf.keys() == pw.keys(), vote
                assert all(abs(pf[k] - pw[k]) <= 1e-5 for k in pf), vote

    for vote in ("kde", "kde_shrunk"):
        check(vote)
    gone = [(int(i), names[y[i]], emb[i], "trained") for i in range(0, 55_000, 7)]
    g.apply_delete(gone, seq=1)
    assert g.rows.n == 55_000  # deleted rows kept in place (1/7 < compaction's quarter)
    check("kde")


def test_candidate_vote_keeps_the_exact_votes_labels_on_the_default_gallery(default_gallery):
    emb, y, names, q, qy = default_gallery
    exact = make_gallery(emb, y, names, exact_max=10**12)
    cand = make_gallery(emb, y, names, exact_max=0, candidates=CANDIDATES)
    assert exact.rows.dense and not cand.rows.dense
    for vote in RULES:
        ref, got = predict(exact, q, vote), predict(cand, q, vote)
        top_ref, top_got = (ref == qy).mean() * 100, (got == qy).mean() * 100
        assert abs(top_got - top_ref) <= 0.2, (vote, top_got, top_ref)
        # (the candidate vote approximates kde's tail: labels agree on 99.47-99.8% of the test
        # images across the models this fixture has trained; 99.5% held for some only, so
        # the bar is where every one measured clears it with margin: RESULTS.md has the
        # figures of the demo model)
        assert (got == ref).mean() >= 0.99, (vote, (got == ref).mean())
    # generalized 5-shot (3 labels registered from 5 images each): the default rule
    hm_exact = fewshot_hm(emb, y, q, qy, names, "kde", 10**12, 0, draws=2)
    hm_cand = fewshot_hm(emb, y, q, qy, names, "kde", 0, CANDIDATES, draws=2)
    assert abs(hm_cand - hm_exact) <= 0.01, (hm_cand, hm_exact)
