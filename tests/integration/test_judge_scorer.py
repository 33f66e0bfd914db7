"""The ``judge`` scorer (an LLM asked over an OpenAI-compatible chat API): against a local stub endpoint for the
parsers (numeric, yes/no, choice list, a pattern), the request it sends (template, system message, model, API key
from the environment), failures (unparsable reply, HTTP 500 retried, 400 not, timeout, unreachable: an error status,
never a score) and the concurrency bound; config errors naming the key; and end to end, a reward service whose judge
is this project's own rollout service (hf engine, tiny policy, greedy), both real processes."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.procs import free_port
from services.reward.engine import RewardEngine
from services.reward.scorers import Item
from tests.integration._http_stub import JSONHandler, score_and_close, serve
from tests.integration._procs import REPO, ServiceProc


class _Handler(JSONHandler):
    """``POST /{mode}/v1/chat/completions``; the reply is the user message (so a ``{response}`` template makes the
    item's response the judge's verdict). Modes: echo, fail (500), reject (400), flaky (503 once), slow (1.5 s),
    conc (held until 3 are in flight, counting them), empty (no choices)."""

    def do_POST(self):
        srv = self.server
        body = self.read_json()
        mode = self.path.split("/")[1]
        with srv.lock:
            srv.calls[mode] = srv.calls.get(mode, 0) + 1
            srv.bodies.append(body)
            srv.headers.append(dict(self.headers))
            srv.paths.append(self.path)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            if mode == "conc":  # held until 3 are in flight (or 2 s): a loaded machine cannot miss the overlap
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:
                    with srv.lock:
                        if srv.in_flight >= 3:
                            break
                    time.sleep(0.01)
                time.sleep(0.05)
            if mode == "slow":
                time.sleep(1.5)
            if mode == "fail":
                return self._send(500, {"error": {"message": "broken"}})
            if mode == "reject":
                return self._send(400, {"error": {"message": "bad request"}})
            if mode == "flaky" and srv.calls[mode] == 1:
                return self._send(503, {"error": {"message": "warming up"}})
            if mode == "empty":
                return self._send(200, {"choices": []})
            reply = body["messages"][-1]["content"]
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
        finally:
            with srv.lock:
                srv.in_flight -= 1


@pytest.fixture(scope="module")
def stub():
    with serve(_Handler) as srv:
        srv.lock = threading.Lock()
        yield srv


@pytest.fixture
def fresh(stub):
    stub.calls, stub.bodies, stub.headers, stub.paths = {}, [], [], []
    stub.in_flight = stub.max_in_flight = 0
    return stub


def _judge(stub, mode: str = "echo", scorer: dict | None = None, **judge) -> dict:
    j = {"base_url": f"http://127.0.0.1:{stub.server_port}/{mode}", "template": "{response}", **judge}
    return {"type": "judge", "judge": j, "timeout_s": 0.5, "retries": 1, **(scorer or {})}


def _score(scorers: list[dict], items: list[Item]):
    eng = RewardEngine(parse_config({"reward": {"scorers": scorers}}))
    eng.load()
    return score_and_close(eng, items)


def _outcomes(stub, responses: list[str], **judge):
    return _score([_judge(stub, **judge)], [Item("p", r) for r in responses])


@pytest.mark.parametrize(
    ("judge", "cases"),
    [
        ({"parser": "numeric"}, {"7": 7.0, "Score: 8/10": 8.0, "-0.5e1 points": -5.0, "none given": None}),
        (
            {"parser": "numeric", "range": [0, 10], "normalize": True},
            {"7": 0.7, "10 of 10": 1.0, "11": "outside the range [0, 10]", "-1": "outside"},
        ),
        ({"parser": "numeric", "pattern": r"Final: (\S+)"}, {"think 3, 4... Final: 9": 9.0, "Final: x": "'x'"}),
        (
            {"parser": "yes_no"},
            {"Yes.": 1.0, "**no**, because": 0.0, " NO": 0.0, "maybe": None, "yesterday": None, "": None},
        ),
        (
            {"parser": "choice", "choices": {"A": 1.0, "B": 0.5, "partly correct": 0.25, "partly": 0.1}},
            {
                "(B) it is fine": 0.5,
                "Partly correct.": 0.25,
                "partly wrong": 0.1,
                "a": 1.0,
                "C": "does not start with one of",
            },
        ),
        ({"parser": "yes_no", "pattern": r"(?i)verdict:\s*(\w+)"}, {"so... Verdict: yes": 1.0, "Verdict: ok": None}),
    ],
)
def test_parsers(fresh, judge, cases):
    out = _outcomes(fresh, list(cases), **judge)
    for (reply, want), o in zip(cases.items(), out, strict=True):
        if isinstance(want, float):
            assert o.status == "ok" and o.score == pytest.approx(want), (reply, o)
        else:  # an unparsable verdict: an error status quoting the reply, never a score
            assert o.status == "scorer_error" and o.score is None and o.components == {}, (reply, o)
            assert "unparsable verdict" in o.error and repr(reply) in o.error and o.failed_scorer == "judge"
            assert want is None or want in o.error, o.error
    assert fresh.calls["echo"] == len(cases)  # one request per item, unparsable replies not re-asked


def test_request_template_system_model_and_api_key(fresh, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "s3cret")
    judge = {
        "template": "Q: {prompt}\nA: {response}\nRef: {label}\nliteral {{braces}}",
        "system": "You grade answers. {not a field}",
        "model": "grader-1",
        "api_key_env": "JUDGE_TEST_KEY",
        "temperature": 0.5,
        "max_tokens": 5,
        "extra_body": {"seed": 3},
        "parser": "numeric",
    }
    weighted = [_judge(fresh, **judge, scorer={"weight": 0.5}), {"type": "rule", "name": "exact_match"}]
    (o,) = _score(weighted, [Item("what is 1+1?", "2", "2")])
    # the reply is the templated message; its first number is the 1 of "1+1"
    assert o.status == "ok" and o.components == {"judge": 1.0, "exact_match": 1.0} and o.score == 1.5
    (body,), (headers,), (path,) = fresh.bodies, fresh.headers, fresh.paths
    assert path == "/echo/v1/chat/completions"
    assert body == {
        "model": "grader-1",
        "messages": [
            {"role": "system", "content": "You grade answers. {not a field}"},
            {"role": "user", "content": "Q: what is 1+1?\nA: 2\nRef: 2\nliteral {braces}"},
        ],
        "temperature": 0.5,
        "max_tokens": 5,
        "seed": 3,
    }
    assert headers["Authorization"] == "Bearer s3cret"
    assert "s3cret" not in json.dumps(body)


def test_defaults_send_no_key_and_no_model(fresh):
    # an OpenAI client's base_url, ending in /v1, reaches the same route
    _outcomes(fresh, ["yes"], base_url=f"http://127.0.0.1:{fresh.server_port}/echo/v1/")
    (body,), (headers,), (path,) = fresh.bodies, fresh.headers, fresh.paths
    assert path == "/echo/v1/chat/completions"
    assert "Authorization" not in headers and "model" not in body
    assert body["temperature"] == 0.0 and body["max_tokens"] == 16


@pytest.mark.parametrize(
    ("mode", "status", "calls", "words"),
    [
        ("fail", "scorer_error", 2, "HTTP 500"),  # retried once (retries: 1), then an error
        ("reject", "scorer_error", 1, "HTTP 400"),  # a 4xx is not retried
        ("slow", "timeout", 2, "did not answer within 0.5s"),
        ("empty", "scorer_error", 1, "no choices[0].message.content"),
    ],
)
def test_failures_are_error_statuses(fresh, mode, status, calls, words):
    t0 = time.monotonic()
    (o,) = _outcomes(fresh, ["yes"], mode=mode)
    assert o.status == status and o.score is None and words in o.error and o.failed_scorer == "judge", o
    assert fresh.calls[mode] == calls
    assert time.monotonic() - t0 < 4


def test_retry_recovers(fresh):
    (o,) = _outcomes(fresh, ["no"], mode="flaky")
    assert o.status == "ok" and o.score == 0.0 and fresh.calls["flaky"] == 2


def test_unreachable():
    sc = {
        "type": "judge",
        "retries": 0,
        "judge": {"base_url": f"http://127.0.0.1:{free_port()}", "template": "{response}"},
    }
    (o,) = _score([sc], [Item("p", "yes")])
    assert o.status == "scorer_error" and "cannot reach" in o.error and o.score is None


def test_concurrency_bound(fresh):
    items = [Item("p", "yes") for _ in range(9)]
    out = _score([_judge(fresh, mode="conc", scorer={"timeout_s": 10.0}, concurrency=3)], items)
    assert [o.score for o in out] == [1.0] * 9
    assert fresh.max_in_flight == 3  # each request waits for 3 in flight: the bound is reached and never passed


def test_label_needed_by_the_template_and_text_prompts(fresh):
    items = [Item("p", "yes", None), Item("p", "yes", "x"), Item("", "yes", "x", prompt_ids=[1, 2])]
    out = _score([_judge(fresh, template="{label}: {response}", pattern=r": (\w+)")], items)
    assert out[0].status == "invalid_input" and "send a label" in out[0].error
    assert out[1].status == "ok" and out[1].score == 1.0
    assert out[2].status == "invalid_input" and "prompt as text" in out[2].error
    assert fresh.calls["echo"] == 1


def test_api_key_variable_must_be_set(fresh, monkeypatch):
    monkeypatch.delenv("JUDGE_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"reward.scorers\[0\]: judge.api_key_env names 'JUDGE_UNSET_KEY'"):
        RewardEngine(parse_config({"reward": {"scorers": [_judge(fresh, api_key_env="JUDGE_UNSET_KEY")]}}))


@pytest.mark.parametrize(
    ("judge", "key", "words"),
    [
        ({"template": "{prompt} {answer}"}, "reward.scorers.0.judge", "judge.template uses {answer}"),
        ({"template": "{0} {response}"}, "reward.scorers.0.judge", "judge.template uses {0}"),
        ({"template": "{response.upper}"}, "reward.scorers.0.judge", "judge.template uses {response.upper}"),
        ({"template": "{response"}, "reward.scorers.0.judge", "judge.template is not a str.format template"),
        ({"base_url": None}, "reward.scorers.0", "a scorer of type 'judge' needs judge.base_url"),
        ({"base_url": "localhost:8000"}, "reward.scorers.0.judge", "judge.base_url 'localhost:8000' must start"),
        ({"template": None}, "reward.scorers.0", "a scorer of type 'judge' needs judge.template"),
        ({"parser": "score"}, "reward.scorers.0.judge.parser", "'numeric', 'yes_no' or 'choice'"),
        ({"parser": "choice"}, "reward.scorers.0.judge", "judge.choices is required with parser choice"),
        ({"parser": "choice", "choices": {"A": 1, "a": 0}}, "reward.scorers.0.judge", "differ ignoring case"),
        ({"choices": {"A": 1}}, "reward.scorers.0.judge", "judge.choices is read by parser choice only"),
        ({"parser": "numeric", "normalize": True}, "reward.scorers.0.judge", "judge.normalize needs judge.range"),
        ({"parser": "numeric", "range": [5, 1]}, "reward.scorers.0.judge", "judge.range [5.0, 1.0] must be"),
        ({"range": [0, 1]}, "reward.scorers.0.judge", "read by parser numeric only, not yes_no"),
        ({"pattern": "(unclosed"}, "reward.scorers.0.judge", "judge.pattern is not a regular expression"),
        ({"temprature": 0}, "reward.scorers.0.judge.temprature", "did you mean 'temperature'?"),
    ],
)
def test_config_errors_name_the_key(judge, key, words):
    j = {"base_url": "http://127.0.0.1:1", "template": "{response}", **judge}
    with pytest.raises(ConfigError) as err:
        parse_config({"reward": {"scorers": [{"type": "judge", "judge": j}]}})
    assert f"{key}: " in str(err.value) and words in str(err.value), str(err.value)


def test_judge_section_belongs_to_type_judge():
    with pytest.raises(ConfigError, match="needs judge.base_url"):
        parse_config({"reward": {"scorers": [{"type": "judge"}]}})
    with pytest.raises(ConfigError, match="'judge' is read by scorers of type judge only"):
        j = {"base_url": "http://x", "template": "{response}"}
        parse_config({"reward": {"scorers": [{"type": "rule", "name": "exact_match", "judge": j}]}})


# ------------------------------------------------------------------------------- the rollout service as the judge

TEMPLATE = "Q: {prompt} A: {response} ok?"
ROLLOUT_ITEMS = [{"prompt": "1+1", "response": "2"}, {"prompt": "say hi", "response": "bye"}]


@pytest.fixture(scope="module")
def rollout(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("judge-rollout")
    with ServiceProc("rollout", REPO / "configs/demo.yaml", logs, env={"RLHF_ROLLOUT_ENGINE": "hf"}) as proc:
        yield proc


def _greedy_reply(rollout, item: dict) -> str:
    messages = [{"role": "user", "content": TEMPLATE.format(**item)}]
    body = {"messages": messages, "temperature": 0.0, "max_tokens": 6}
    r = httpx.post(rollout.http_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_rollout_service_as_judge(rollout, start_service):
    """The reward service asks the rollout service (greedy, so each reply is known): the first item's reply is made
    a choice worth 0.25, the second's is not a choice and comes back as an error status quoting the reply."""
    first, second = (_greedy_reply(rollout, it) for it in ROLLOUT_ITEMS)
    assert first.strip() and first.strip().casefold() != second.strip().casefold(), (first, second)
    judge = {
        "base_url": rollout.http_url,
        "model": "tiny:policy",
        "api_key_env": "JUDGE_ROLLOUT_KEY",  # the rollout service takes no key: sent and ignored
        "template": TEMPLATE,
        "max_tokens": 6,
        "concurrency": 1,  # one at a time: the replies are exactly the single-request greedy ones above
        "parser": "choice",
        "pattern": r"(?s)^(.*)$",  # the whole reply is the verdict
        "choices": {first: 0.25},
    }
    cfg = {"reward": {"scorers": [{"type": "judge", "judge": judge, "timeout_s": 60, "retries": 0}]}}
    svc = start_service("reward", cfg, env={"JUDGE_ROLLOUT_KEY": "unused"})
    r = httpx.post(svc.http_url + "/v1/score", json={"items": ROLLOUT_ITEMS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["type"] for s in body["scorers"]] == ["judge"]
    ok, bad = body["results"]
    assert ok["status"] == "ok" and ok["score"] == 0.25, ok
    assert bad["status"] == "scorer_error" and bad["score"] is None, bad
    assert "unparsable verdict" in bad["error"] and repr(second) in bad["error"], bad
