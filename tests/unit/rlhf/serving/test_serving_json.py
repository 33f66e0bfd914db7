"""rlhf.serving.json_response: plain data rendered once as JSON; non-finite floats become null (as pydantic's
serialisation of the former response_model did), nested too; the body is valid JSON in every case."""

from __future__ import annotations

import json
import math

from rlhf.serving import json_response


def test_renders_plain_data():
    data = {"results": [{"score": 0.25, "status": "ok", "error": None, "components": {"model": 0.25}}], "n": 3}
    r = json_response(data)
    assert r.status_code == 200
    assert r.media_type == "application/json"
    assert json.loads(r.body) == data
    assert r.headers["content-length"] == str(len(r.body))


def test_non_finite_floats_become_null():
    r = json_response({"a": [1.0, math.nan, -math.inf], "b": {"c": math.inf}, "t": (2.0, math.nan)}, status_code=201)
    assert r.status_code == 201
    assert json.loads(r.body) == {"a": [1.0, None, None], "b": {"c": None}, "t": [2.0, None]}


def test_non_ascii_text_is_valid_json():
    r = json_response({"error": "é 中文 \ud800"})  # a lone surrogate is escaped, not an encoding error
    assert json.loads(r.body)["error"].startswith("é 中文")
