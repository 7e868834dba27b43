"""The records between the front and its model process (service/model/wire.py): every record
crosses a frame by name and comes back equal, however the bytes arrive; what is not a record
is refused as a corrupt stream; a classification comes back as the model process made it,
with the verdict judged on the front as in one process."""

import json

import numpy as np
import pytest

from service.config import Settings
from service.gallery.gallery import Classification
from service.gallery.query import VoteQuery
from service.gallery.world import WorldVerdict
from service.model.remote import _answer
from service.model.runtime import Answer
from service.model.wire import (
    HEAD,
    RECORDS,
    Batch,
    ClassifyAnswer,
    ClassifyJob,
    Embedded,
    EmbedJob,
    Failed,
    FrameReader,
    ModelUnavailable,
    Synced,
    SyncJob,
    frame,
)

C = Classification(
    "Sandal",
    0.75,
    [("Sandal", 0.75), ("Sneaker", 0.25)],
    0.9,
    [(4, "Sandal", 0.9), (7, "Sneaker", 0.8)],
    0.6,
    3,
    WorldVerdict(1.5, 2.0, True, "training"),
)

SAMPLES = [
    ClassifyJob(1, 10, VoteQuery("kde", 30, ("Sandal", "é"), True), 0.95),
    ClassifyJob(2, 0, VoteQuery("knn", 5), None),
    EmbedJob(3, 7),
    SyncJob(4, 0),
    Batch(
        3,
        0.002,
        [
            ClassifyAnswer(1, "A", 0.5, [["A", 0.5]], 0.9, None, 0, [[2, "A", 0.9]], {}, None, 3),
            Embedded(3, 0, 4),
            Synced(4, 12),
            Failed(5, 503, "x"),
        ],
        {"decode": 0.0001, "forward": 0.001, "vote": 0.0005, "other": 0.0002},
    ),
]


def test_every_record_crosses_by_name_and_comes_back_equal():
    inside = {type(r).__name__ for r in SAMPLES[-1].results}
    assert {type(r).__name__ for r in SAMPLES} | inside == set(RECORDS)  # every record
    stream = b"".join(frame(r, bytes([i]) * i) for i, r in enumerate(SAMPLES))
    reader, got = FrameReader(), []
    for i in range(0, len(stream), 7):  # the bytes arrive in small pieces
        got += reader.feed(stream[i : i + 7])
    assert [r for r, _ in got] == SAMPLES
    assert [p for _, p in got] == [bytes([i]) * i for i in range(len(SAMPLES))]
    n = HEAD.unpack_from(frame(SAMPLES[0]))[0]
    header = json.loads(frame(SAMPLES[0])[HEAD.size : HEAD.size + n])
    assert header["type"] == "ClassifyJob" and header["query"]["labels"] == ["Sandal", "é"]


def test_what_only_json_writes_reads_back():
    """Headers are read (and jobs written) by orjson, but what orjson refuses or would write as
    null goes through json as before: -inf (an empty label's similarity), NaN, integers past
    64 bits."""
    nan, inf = float("nan"), float("inf")
    a = ClassifyAnswer(1, "A", 0.5, [["A", nan]], -inf, None, 0, [], {}, None, 12)
    big = ClassifyAnswer(2, "A", 0.5, [], 0.5, None, 0, [], {}, None, 2**70)
    stream = frame(a) + frame(Batch(1, 0.0, [a], {})) + frame(Batch(1, 0.0, [big], {}))
    ((back, _), (batch, _), (batch_big, _)) = FrameReader().feed(stream)
    for b in (back, batch.results[0]):
        assert b.best_similarity == -inf and b.version == 12
        assert b.probabilities[0][1] != b.probabilities[0][1]  # NaN
    assert batch_big.results == [big]
    job = ClassifyJob(2**70, 0, VoteQuery("kde", 30), 0.5)  # (orjson refuses it: json writes it)
    assert FrameReader().feed(frame(job))[0][0] == job


@pytest.mark.parametrize(
    "header",
    [{"type": "Nope"}, {"type": "Synced", "id": 1}, {"id": 1, "version": 2}, [1, 2], 3],
)
def test_what_is_not_a_record_is_a_corrupt_stream(header):
    h = json.dumps(header).encode()
    with pytest.raises(ValueError, match="not a record"):
        FrameReader().feed(HEAD.pack(len(h), 0) + h)


def test_results_give_the_waiting_job_its_value():
    rows = np.arange(8, dtype="<f4").tobytes()
    assert Embedded(1, 2, 3).value(rows).tolist() == [2.0, 3.0, 4.0]
    assert Synced(1, 9).value(b"") == 9
    with pytest.raises(ModelUnavailable, match="down"):
        Failed(1, 503, "down").value(b"")
    with pytest.raises(RuntimeError, match="bug"):
        Failed(1, 500, "bug").value(b"")


def test_a_classification_comes_back_as_made_and_judged_as_in_one_process():
    s = Settings(unknown_similarity=0.0, unknown_probability=0.0)
    for tpr, threshold in ((0.95, 0.5), (0.95, 0.7), (None, 0.7)):
        answer = ClassifyAnswer.of(1, C, threshold, 12)
        ((back, _),) = FrameReader().feed(frame(answer))
        remote = _answer(back, tpr, s)
        assert remote == Answer.judged(C, threshold, 12, tpr, s)
    assert _answer(back, 0.95, s).c == C  # every field, tuples included
    # the verdict moves with the threshold: score 0.6 is under 0.7, not under 0.5
    judged = [
        _answer(FrameReader().feed(frame(ClassifyAnswer.of(1, C, t, 1)))[0][0], 0.95, s)
        for t in (0.5, 0.7)
    ]
    assert [a.unknown_reason for a in judged] == [None, "no_label_accepts"]


def test_a_frame_that_arrives_in_pieces_waits_for_the_rest(monkeypatch):
    """A job larger than one read (a 224 px photo's pixels, 150 KB) arrives in pieces: the job
    loop waits for the whole frame. It ran a batch of none, whose answer crashed the model
    process (ValueError), found by benchmarks/engine_ab.py's photo load (every request 503)."""
    import socket
    import threading
    import time
    from types import SimpleNamespace

    from service import model_process

    front, model = socket.socketpair()
    settings = SimpleNamespace(max_wait_ms=0.0)
    embedder = SimpleNamespace(pixel_shape=(3, 224, 224))
    runtime = SimpleNamespace(embedder=embedder, info=SimpleNamespace(max_batch=8))
    state = SimpleNamespace(runtime=runtime, settings=settings)
    server = model_process.Server(state, model)
    batches = []

    def answer(batch):
        batches.append(len(batch))
        return b"x"

    monkeypatch.setattr(server, "answer", answer)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    whole = frame(EmbedJob(1, 0), bytes(3 * 224 * 224))
    front.sendall(whole[:1000])  # the header and a little of the pixels
    time.sleep(0.3)
    front.sendall(whole[1000:])
    assert front.recv(1) == b"x"
    front.close()  # EOF: the loop returns
    loop.join(timeout=5)
    assert not loop.is_alive() and batches == [1]
