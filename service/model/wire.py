"""Frames between a worker's front process and its model process (service/model/remote.py,
service/model_process.py), over one Unix stream socket.

A frame is two lengths, a JSON header and a binary payload: images cross as their raw uint8
pixels and embeddings as raw float32 rows, never pickled; everything else (the vote's
parameters, the answers) is a few hundred bytes of JSON.

    front -> model   ["c", id, min_version, vote, k, labels|null, neighbors, tpr|null] + pixels
                     ["e", id, min_version] + pixels                (an embedding: adds, search)
                     ["s", id, seq]                                 (apply the log up to seq)
    model -> front   ["b", size, queue wait s, [[id, kind, data], ...]] + float32 rows
                     one frame per batch; kind "c" (a classification), "e" (data: the row's
                     offset and length in floats in the payload), "s" (data: the version),
                     "x" (data: [status, why]: this job failed)

`min_version`: the front's own gallery version when it sent the job; the model process applies
the log up to it before voting, so an answer never reads an older gallery than the front had
(a write the front acknowledged, or waited for with X-Min-Gallery-Version, is seen).
"""

from __future__ import annotations

import json
import struct

HEAD = struct.Struct("<II")  # header bytes, payload bytes
# a frame's header is small; a payload is a batch's pixels or rows (64 x 224 x 224 x 3 = 9.6 MB)
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 1 << 30

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def frame(header, payload=b"") -> bytes:
    h = _dumps(header).encode()
    return b"".join((HEAD.pack(len(h), len(payload)), h, payload))


class FrameReader:
    """Bytes as they arrive -> whole frames (header, payload bytes)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[object, bytes]]:
        buf = self._buf
        buf += data
        out, at = [], 0
        while len(buf) - at >= HEAD.size:
            nh, npl = HEAD.unpack_from(buf, at)
            if nh > MAX_HEADER or npl > MAX_PAYLOAD:
                raise ValueError(f"a frame of {nh} + {npl} bytes: the stream is corrupt")
            end = at + HEAD.size + nh + npl
            if len(buf) < end:
                break
            h0 = at + HEAD.size
            out.append((json.loads(buf[h0 : h0 + nh]), bytes(buf[h0 + nh : end])))
            at = end
        if at:
            del buf[:at]
        return out
