"""The candidate vote (the service's path past exact_vote_max) against the exact dense vote on
a default-sized gallery: 55,000 real Fashion-MNIST training images embedded by a trained model,
5,000 test images as queries, the service's default K' (issue 20's parity targets)."""

import numpy as np

from benchmarks.gallery_scale import RULES, embed, fewshot_hm, make_gallery, predict
from embedding.datasets import load_raw
from embedding.rundir import RunDir
from service.gallery.gallery import CANDIDATES


def test_candidate_vote_keeps_the_exact_votes_labels_on_the_default_gallery(short_run):
    model = RunDir(short_run[0]).load_model()
    names = model.config.class_names
    train, test = load_raw("fashion-mnist", "train"), load_raw("fashion-mnist", "test")
    emb = embed(model, train.source.images[:55_000])
    y = np.asarray(train.targets[:55_000], dtype=np.int64)
    # 5,000 of the test images as queries (the gallery is the default size; what is compared is
    # each query's label under the two votes, so half the queries halve the time, not the check)
    q = embed(model, test.source.images[:5000])
    qy = np.asarray(test.targets[:5000], dtype=np.int64)
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
