"""The reward service as a real process: gRPC Score, REST /v1/score and /get_reward, bad input, metrics, fuzzing;
remote scorers against a real local HTTP server that fails or hangs (an error status, never a 0)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import sys
import time

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf.config import ConfigError, ScorerConfig, parse_config
from rlhf.procs import free_port as _free_port
from rlhf.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.reward import rules
from services.reward.engine import RewardEngine
from services.reward.scorers import Item, RuleScorer
from tests.integration._fuzz import fuzz_openapi
from tests.integration._http_stub import JSONHandler, score_and_close, serve

# configs/reward-tiny-model.yaml: the tiny reward model (weight 1.0) + math_answer (weight 0.5); shared with the
# docs/services.md examples (tests/integration/conftest.py SHARED_SERVICES), with a 300000-byte body limit and 1 MiB
# messages.
CONFIG = "configs/reward-tiny-model.yaml"
MODEL_WEIGHT, MATH_WEIGHT = 1.0, 0.5

ITEMS = [
    {"prompt": "what is 2 plus 3?", "response": " 5", "label": "5"},
    {"prompt": "what is 2 plus 3?", "response": " the answer is 7", "label": "5"},
    {"prompt": "say hello", "response": "hello world"},  # no label: math_answer cannot score it
]


@pytest.fixture(scope="module")
def reward_svc(shared_services):
    return shared_services.get("reward", CONFIG)


@pytest.fixture(scope="module")
def stub(reward_svc):
    ch = grpc.insecure_channel(reward_svc.grpc_addr)
    yield reward_pb2_grpc.RewardServiceStub(ch)
    ch.close()


def direct_model_score(tiny_models, prompt: str, response: str) -> float:
    """The tiny reward model run by transformers itself (its own last-token pooling), no padding."""
    tok = AutoTokenizer.from_pretrained(tiny_models.reward)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_models.reward).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_score_rest_matches_the_model_and_rules(reward_svc, tiny_models):
    r = httpx.post(reward_svc.http_url + "/v1/score", json={"items": ITEMS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["name"] for s in body["scorers"]] == ["model", "math_answer"]
    res = body["results"]
    for item, out in zip(ITEMS[:2], res[:2], strict=True):
        want_model = direct_model_score(tiny_models, item["prompt"], item["response"])
        assert out["status"] == "ok" and out["error"] is None
        assert out["components"]["model"] == pytest.approx(want_model, abs=1e-4)
        want = MODEL_WEIGHT * want_model + MATH_WEIGHT * out["components"]["math_answer"]
        assert out["score"] == pytest.approx(want, abs=1e-6)
    assert res[0]["components"]["math_answer"] == 1.0 and res[1]["components"]["math_answer"] == 0.0
    # the unlabeled item: an error status and no score (never a silent 0); the other scorer's value is kept
    assert res[2]["status"] == "invalid_input" and res[2]["score"] is None
    assert "label" in res[2]["error"] and "math_answer" in res[2]["error"]
    assert set(res[2]["components"]) == {"model"}


def test_score_grpc_agrees_with_rest(reward_svc, stub):
    rest = httpx.post(reward_svc.http_url + "/v1/score", json={"items": ITEMS}).json()["results"]
    req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(**it) for it in ITEMS])
    resp = stub.Score(req, timeout=30)
    assert len(resp.results) == len(ITEMS)
    for g, h in zip(resp.results, rest, strict=True):
        assert common_pb2.ItemStatus.Name(g.status) == "ITEM_STATUS_" + h["status"].upper()
        if h["score"] is not None:
            assert g.score == pytest.approx(h["score"], abs=1e-5)
            assert dict(g.components) == pytest.approx(h["components"], abs=1e-5)
        else:
            assert g.error == h["error"]


def test_get_reward_openrlhf_format(reward_svc):
    prompts = [it["prompt"] for it in ITEMS[:2]]
    body = {
        "query": [it["prompt"] + it["response"] for it in ITEMS[:2]],
        "prompts": prompts,
        "labels": [it["label"] for it in ITEMS[:2]],
    }
    r = httpx.post(reward_svc.http_url + "/get_reward", json=body)
    assert r.status_code == 200, r.text
    scores = [
        x["score"] for x in httpx.post(reward_svc.http_url + "/v1/score", json={"items": ITEMS[:2]}).json()["results"]
    ]
    assert r.json()["rewards"] == pytest.approx(scores)
    # one item cannot be scored: an HTTP error, not made-up rewards
    body["labels"][1] = None
    r = httpx.post(reward_svc.http_url + "/get_reward", json=body)
    assert r.status_code == 400 and r.json()["error"]["field"] == "query[1]"
    assert "rewards" not in r.json()
    r = httpx.post(reward_svc.http_url + "/get_reward", json={"query": ["a b"]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "prompts"
    r = httpx.post(reward_svc.http_url + "/get_reward", json={"query": ["a b"], "prompts": ["zz"]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "query[0]"


GOOD = {"prompt": "p", "response": "r", "label": "1"}
BAD_REST = [
    ({"items": []}, 422, "items"),
    ({"items": [{"prompt": "", "response": "x"}]}, 400, "items[0].prompt"),
    ({"items": [{"prompt": 5, "response": "x"}]}, 422, "items[0].prompt"),
    ({"items": [{"response": "x"}]}, 422, "items[0].prompt"),
    ({"items": [{**GOOD, "bogus": 1}]}, 422, "items[0].bogus"),
    ({"items": [GOOD], "extra": True}, 422, "extra"),
    ({"items": [GOOD, {**GOOD, "response_ids": [-1]}]}, 422, "items[1].response_ids[0]"),
    ({"items": [{**GOOD, "response_ids": ["7"]}]}, 422, "items[0].response_ids[0]"),
    ({"items": [{**GOOD, "finished": "yes"}]}, 422, "items[0].finished"),
    ({"items": [{**GOOD, "response": "seven " * 600}]}, 400, "items[0].response"),  # over the model's 512 positions
    ({"items": "all"}, 422, "items"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_REST, ids=[f"{b[2]}-{b[1]}" for b in BAD_REST])
def test_bad_input_rest(reward_svc, body, status, field):
    r = httpx.post(reward_svc.http_url + "/v1/score", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and field in err["message"]
    assert err["type"] in ("invalid_argument", "request_validation_failed")


def test_oversize_body_413_and_still_serving(reward_svc):
    r = httpx.post(reward_svc.http_url + "/v1/score", json={"items": [{**GOOD, "prompt": "x" * 400_000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
    assert "300000" in r.json()["error"]["message"]
    r = httpx.post(reward_svc.http_url + "/v1/score", json={"items": [GOOD]})
    assert r.status_code == 200 and r.json()["results"][0]["status"] == "ok"


def test_bad_input_grpc(stub):
    cases = [
        (reward_pb2.ScoreRequest(), grpc.StatusCode.INVALID_ARGUMENT, "items"),
        (
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="x")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].prompt",
        ),
        (
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p", response="seven " * 600)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].response",
        ),
        (
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p", response="r", response_ids=[-3])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].response_ids",
        ),
        (
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="x" * (2 << 20), response="r")]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
    ]
    for req, code, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(req, timeout=30)
        assert e.value.code() == code, e.value.details()
        assert field in e.value.details()
    ok = stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(**GOOD)]), timeout=30)
    assert ok.results[0].status == common_pb2.ITEM_STATUS_OK


def _model_fill_count(text: str) -> float:
    """rlhf_batch_fill_count of the reward model's batcher (method score:<its name>)."""
    (value,) = re.findall(r'^rlhf_batch_fill_count\{method="score:[^"]+",service="reward"\} (\S+)$', text, re.M)
    return float(value)


def test_metrics(reward_svc):
    before = _model_fill_count(httpx.get(reward_svc.http_url + "/metrics").text)
    httpx.post(reward_svc.http_url + "/v1/score", json={"items": ITEMS})
    text = httpx.get(reward_svc.http_url + "/metrics").text
    # the scaling signals (docs/deploy.md#scaling-signals): the model's merged call is counted, nothing waits
    assert _model_fill_count(text) >= before + 1
    assert re.search(r'^rlhf_batcher_queued_rows\{method="score:[^"]+",service="reward"\} 0\.0$', text, re.M)
    assert 'rlhf_requests_total{code="200",method="/v1/score",protocol="http",service="reward"}' in text
    # the scaling signal: the call was in flight and is no more (the scrape itself is not counted)
    assert 'rlhf_requests_in_flight{method="/v1/score",protocol="http",service="reward"} 0.0' in text
    assert 'rlhf_batch_size_count{method="/v1/score",service="reward"}' in text
    assert 'rlhf_errors_total{kind="invalid_input",service="reward"}' in text
    assert 'rlhf_ready{service="reward"} 1.0' in text
    assert "rlhf_request_seconds_bucket" in text


def test_openapi_fuzz_finds_no_server_errors(reward_svc):
    n = fuzz_openapi(reward_svc.http_url, max_examples=30)
    assert n > 50
    assert httpx.get(reward_svc.http_url + "/readyz").status_code == 200


# ------------------------------------------------------------------------------------- remote scorer (real HTTP server)


class _Handler(JSONHandler):
    def do_POST(self):
        body = self.read_json()
        self.server.calls[self.path] = self.server.calls.get(self.path, 0) + 1
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path == "/fail":
            return self._send(500, {"detail": "broken"})
        if self.path == "/reject":
            return self._send(400, {"detail": "bad request"})
        if self.path == "/short":
            return self._send(200, {"rewards": [1.0]})
        if self.path == "/nan":
            return self._send(200, {"rewards": ["x"] * len(body["query"])})
        if self.path == "/flaky" and self.server.calls[self.path] == 1:
            return self._send(503, {"detail": "warming up"})
        # echo: reward = len(response) where response = query minus prompt
        self._send(
            200, {"rewards": [float(len(q) - len(p)) for q, p in zip(body["query"], body["prompts"], strict=True)]}
        )


@pytest.fixture(scope="module")
def remote():
    with serve(_Handler) as srv:
        srv.calls = {}
        yield srv


def _engine(url: str, **kw) -> RewardEngine:
    sc = {"type": "remote", "url": url, "timeout_s": 0.4, "retries": 1, **kw}
    eng = RewardEngine(parse_config({"reward": {"scorers": [sc, {"type": "rule", "name": "exact_match"}]}}))
    eng.load()
    return eng


def _score(eng: RewardEngine, items: list[Item]):
    return score_and_close(eng, items)


ITEMS2 = [Item("what is 1 plus 1?", " 2", "2"), Item("say hi", "hi there", "hi there")]


def test_remote_scorer_ok_combines_with_rules(remote):
    out = _score(_engine(f"http://127.0.0.1:{remote.server_port}/echo", weight=0.1), ITEMS2)
    assert [o.status for o in out] == ["ok", "ok"]
    assert out[0].components == {"remote": 2.0, "exact_match": 1.0}
    assert out[0].score == pytest.approx(0.1 * 2.0 + 1.0)


@pytest.mark.parametrize(
    ("path", "status", "attempts", "words"),
    [
        ("/fail", "scorer_error", 2, "HTTP 500"),  # retried once, then an error
        ("/reject", "scorer_error", 1, "HTTP 400"),  # a 4xx is not retried
        ("/slow", "timeout", 2, "did not answer"),
        ("/short", "scorer_error", 2, "1 rewards for 2 items"),
        ("/nan", "scorer_error", 1, "not a number"),
    ],
)
def test_remote_scorer_failure_is_an_error_status_not_zero(remote, path, status, attempts, words):
    remote.calls.clear()
    t0 = time.monotonic()
    out = _score(_engine(f"http://127.0.0.1:{remote.server_port}{path}"), ITEMS2)
    for o in out:
        assert o.status == status and o.score is None, o
        assert words in o.error and o.failed_scorer == "remote"
        assert o.components == {"exact_match": 1.0}  # the rule still ran
    assert remote.calls.get(path) == attempts
    assert time.monotonic() - t0 < 3


def test_remote_scorer_retry_recovers(remote):
    remote.calls.clear()
    out = _score(_engine(f"http://127.0.0.1:{remote.server_port}/flaky"), ITEMS2)
    assert [o.status for o in out] == ["ok", "ok"] and remote.calls["/flaky"] == 2


def test_remote_scorer_unreachable(remote):
    out = _score(_engine(f"http://127.0.0.1:{_free_port()}/x", retries=0), ITEMS2)
    assert all(o.status == "scorer_error" and "cannot reach" in o.error for o in out)


def test_remote_failures_through_the_service(remote, start_service):
    cfg = {
        "reward": {
            "scorers": [
                {"type": "remote", "url": f"http://127.0.0.1:{remote.server_port}/slow", "timeout_s": 0.3, "retries": 0}
            ]
        }
    }
    svc = start_service("reward", cfg)
    r = httpx.post(svc.http_url + "/v1/score", json={"items": [GOOD]})
    res = r.json()["results"][0]
    assert r.status_code == 200 and res["status"] == "timeout" and res["score"] is None
    r = httpx.post(svc.http_url + "/get_reward", json={"query": ["p r"], "prompts": ["p"]})
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded"
    with grpc.insecure_channel(svc.grpc_addr) as ch:
        resp = reward_pb2_grpc.RewardServiceStub(ch).Score(
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(**GOOD)])
        )
    assert resp.results[0].status == common_pb2.ITEM_STATUS_TIMEOUT and "did not answer" in resp.results[0].error


# ------------------------------------------------------------------------------------------------ rules


def test_rules():
    assert rules.math_answer("", "so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert rules.math_answer("", "1,234 apples", "1234") == 1.0
    assert rules.math_answer("", "I think 12 or 13", "12") == 0.0
    assert rules.math_answer("", "no number", "12") == 0.0
    with pytest.raises(rules.RuleInputError):
        rules.math_answer("", "12", None)
    assert rules.exact_match("", "  Paris. ", "paris") == 1.0
    assert rules.regex("", "answer: 42", None, pattern=r"answer: \d+") == 1.0
    assert rules.format_check("", "<think>hmm</think> 4", None, kind="think") == 1.0
    assert rules.format_check("", "4", None, kind="boxed") == 0.0
    # length: smooth, in (0, 1], 1 exactly at the target, increasing towards it from both sides
    vals = [rules.length("", "w " * n, None, target=16, unit="words") for n in range(0, 40)]
    assert all(0 < v <= 1 for v in vals) and vals[16] == 1.0
    assert all(a < b for a, b in zip(vals[:16], vals[1:17], strict=True))
    assert all(a > b for a, b in zip(vals[16:-1], vals[17:], strict=True))
    assert not math.isclose(vals[0], vals[1])
    # char_fraction (the demo's reward): digits among non-space characters
    assert rules.char_fraction("", " 12 ab", None) == 0.5
    assert rules.char_fraction("", "   ", None) == 0.0
    assert rules.char_fraction("", "xyz", None, chars="xy") == 2 / 3


def test_user_rule_and_bad_rule_config(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(
        "def longer(prompt, response, label, bonus=0.0):\n    return len(response) + bonus\n"
        "def broken(prompt, response, label):\n    raise KeyError('oops')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {
        "reward": {
            "scorers": [
                {"type": "rule", "name": "my_rules:longer", "kwargs": {"bonus": 1}},
                {"type": "rule", "name": "my_rules:broken", "weight": 0},
            ]
        }
    }
    eng = RewardEngine(parse_config(cfg))
    eng.load()
    out = _score(eng, [Item("p", "abc")])
    assert out[0].status == "scorer_error" and "KeyError" in out[0].error and out[0].components == {"longer": 4.0}

    bad_cases = [
        ({"type": "rule", "name": "nope"}, "unknown rule"),
        ({"type": "rule", "name": "my_rules:missing"}, "has no function"),
        ({"type": "rule", "name": "length"}, "needs kwargs ['target']"),
        ({"type": "rule", "name": "length", "kwargs": {"target": 3, "tgt": 1}}, "does not take"),
    ]
    for bad, msg in bad_cases:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            RewardEngine(parse_config({"reward": {"scorers": [bad]}}))


# ------------------------------------------------------------------------------------------------ regex (issue 17.7)

EVIL = "^(a+)+$"  # catastrophic backtracking: ~6 s on 28 characters, doubling per character


def test_regex_pattern_comes_from_the_config_only():
    # without a pattern the label used to be compiled as one: now the scorer is refused at start-up
    with pytest.raises(ConfigError, match=r"needs kwargs \['pattern'\]"):
        RewardEngine(parse_config({"reward": {"scorers": [{"type": "rule", "name": "regex"}]}}))
    for kwargs, msg in [
        ({"pattern": "("}, "does not compile"),
        ({"pattern": "a", "flags": "x"}, "unknown flags"),
        ({"pattern": "a", "mode": "find"}, "mode must be"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            RewardEngine(parse_config({"reward": {"scorers": [{"type": "rule", "name": "regex", "kwargs": kwargs}]}}))
    eng = RewardEngine(
        parse_config(
            {
                "reward": {
                    "scorers": [{"type": "rule", "name": "regex", "kwargs": {"pattern": r"answer: \d+", "flags": "i"}}]
                }
            }
        )
    )
    eng.load()
    assert isinstance(eng.scorers[0].kwargs["pattern"], __import__("re").Pattern)  # compiled once, at load
    t0 = time.perf_counter()
    out = _score(eng, [Item("p", "ANSWER: 42", label=EVIL), Item("p", "a" * 28 + "!", label=EVIL)])
    assert time.perf_counter() - t0 < 1.0
    assert [o.score for o in out] == [1.0, 0.0]


def test_regex_without_pattern_refused_by_the_service(start_service):
    svc = start_service("reward", {"reward": {"scorers": [{"type": "rule", "name": "regex"}]}}, wait_ready=False)
    assert svc.wait(timeout=120) != 0
    assert "needs kwargs ['pattern']" in svc.log_text()


def test_a_raising_user_scorer_is_logged_with_its_traceback_rate_limited(tmp_path, monkeypatch, caplog):
    """A user's function that raises shows in the reward service's log (once per window, with the count left out),
    not only as an error status in the samples."""
    (tmp_path / "brokenscorer.py").write_text("def score(prompt, response, label, **kw):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("brokenscorer", None)
    scorer = RuleScorer(ScorerConfig(type="rule", name="brokenscorer:score"), "mine")
    items = [Item(prompt="p", response="r") for _ in range(5)]
    with caplog.at_level(logging.WARNING, logger="rlhf.reward"):
        out = asyncio.run(scorer.score(items))
        assert all(o.status == "scorer_error" and "ZeroDivisionError" in o.message for o in out)
        scorer._logged_at -= scorer.LOG_EVERY_S  # the window passed
        asyncio.run(scorer.score(items[:1]))
    records = [r for r in caplog.records if "scorer 'mine' raised ZeroDivisionError" in r.getMessage()]
    assert len(records) == 2, [r.getMessage() for r in caplog.records]
    assert records[0].exc_info is not None and "1 / 0" in caplog.text  # the traceback, with the user's line
    assert "(4 more failure(s) since the last report)" in records[1].getMessage()
