"""service/http/encode.py: the responses' JSON (orjson) reads back as Starlette's json.dumps
encoding did, including what orjson refuses (integers past 64 bits in stored metadata, keys
that are not strings)."""

import json

from starlette.responses import JSONResponse as StarletteJSON

from service.http.encode import JSONResponse, dumps


def test_what_orjson_refuses_is_still_encoded_as_before():
    bodies = [
        {"label": "T-shirt/top", "confidence": 0.875, "probabilities": [{"label": "é", "p": 1e-7}]},
        {"metadata": {"big": 2**70, "neg": -(2**80), "nested": [[1, 2.5, None, True]]}},
        {1: "an int key", "x": [0.1, 1e300]},
        [],
    ]
    for body in bodies:
        got = JSONResponse(body).body
        want = StarletteJSON(body).body
        assert json.loads(got) == json.loads(want), body
        assert dumps(body) == got
