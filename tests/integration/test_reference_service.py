"""The reference service as a real process: log-probs equal a plain transformers log_softmax of each sequence
(unpadded, one at a time), over REST and gRPC; bad input is refused naming the field; fuzzing finds no 5xx."""

from __future__ import annotations

import re
import shutil

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlhf.config import parse_config
from rlhf.v1 import reference_pb2, reference_pb2_grpc
from services.reference.engine import ReferenceEngine
from tests.integration._fuzz import fuzz_openapi

# configs/demo.yaml (rollout temperature 1.0, ref micro_batch_size 32), shared with the docs/services.md examples
# (tests/integration/conftest.py SHARED_SERVICES), with a 300000-byte body limit and 1 MiB messages.
CONFIG = "configs/demo.yaml"
TEMPERATURE = 1.0
ITEMS = [
    {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]},
    {"prompt_ids": [11], "response_ids": [12, 13, 14, 15, 16, 1]},
    {"prompt_ids": [20, 21, 22, 23, 24, 25, 26], "response_ids": [30]},
    {"prompt_ids": [3, 4], "response_ids": [0, 50, 51]},  # a pad id inside a response: same convention as training
    {"prompt_ids": [7, 7, 7], "response_ids": [7, 7]},
]


@pytest.fixture(scope="module")
def ref_svc(shared_services):
    return shared_services.get("reference", CONFIG)


@pytest.fixture(scope="module")
def stub(ref_svc):
    ch = grpc.insecure_channel(ref_svc.grpc_addr)
    yield reference_pb2_grpc.ReferenceServiceStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def direct(tiny_models):
    """log_softmax(logits / T) of each sequence alone, with transformers directly."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models.policy).eval()

    def logprobs(prompt_ids, response_ids, temperature=TEMPERATURE):
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / temperature
        lp = torch.log_softmax(logits, -1)
        p = len(prompt_ids)
        return [float(lp[p - 1 + t, tok]) for t, tok in enumerate(response_ids)]

    return logprobs


def test_logprobs_rest_match_transformers(ref_svc, direct):
    r = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": ITEMS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["temperature"] == pytest.approx(TEMPERATURE)
    assert len(body["results"]) == len(ITEMS)
    for it, res in zip(ITEMS, body["results"], strict=True):
        want = direct(it["prompt_ids"], it["response_ids"])
        if 0 in it["response_ids"]:  # the pad convention masks pad tokens; check only the positions before it
            k = it["response_ids"].index(0)
            want, got = want[: k + 1], res["logprobs"][: k + 1]
        else:
            got = res["logprobs"]
        assert len(res["logprobs"]) == len(it["response_ids"])
        assert got == pytest.approx(want, abs=2e-5)


def test_temperature_override_and_grpc_agree(ref_svc, stub, direct):
    r = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": ITEMS[:3], "temperature": 0.7})
    rest = [x["logprobs"] for x in r.json()["results"]]
    assert r.json()["temperature"] == pytest.approx(0.7)
    for it, got in zip(ITEMS[:3], rest, strict=True):
        assert got == pytest.approx(direct(it["prompt_ids"], it["response_ids"], 0.7), abs=2e-5)
    req = reference_pb2.LogProbsRequest(items=[reference_pb2.LogProbsItem(**it) for it in ITEMS[:3]], temperature=0.7)
    resp = stub.LogProbs(req, timeout=30)
    assert resp.temperature == pytest.approx(0.7)
    for g, h in zip(resp.results, rest, strict=True):
        assert list(g.logprobs) == pytest.approx(h, abs=1e-6)
    # unset temperature: the configured one
    resp = stub.LogProbs(reference_pb2.LogProbsRequest(items=[reference_pb2.LogProbsItem(**ITEMS[0])]), timeout=30)
    assert resp.temperature == pytest.approx(TEMPERATURE)


def test_configured_temperature():
    arr = {"actor_rollout": {"temperature": 0.8}}
    assert ReferenceEngine(parse_config({"actor_rollout_ref": arr})).temperature == 0.8
    assert ReferenceEngine(parse_config({"actor_rollout_ref": {**arr, "ref": {"temperature": 0.5}}})).temperature == 0.5


def test_batch_composition_does_not_change_results(ref_svc):
    alone = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": [ITEMS[1]]}).json()["results"][0]
    # 45 items: two micro-batches of the configured 32, sorted by length, each padded
    many = (ITEMS * 9)[::-1]
    batched = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": many}).json()["results"]
    for it, res in zip(many, batched, strict=True):
        assert len(res["logprobs"]) == len(it["response_ids"])
        if it is ITEMS[1]:
            assert res["logprobs"] == pytest.approx(alone["logprobs"], abs=1e-5)


OK = {"prompt_ids": [5], "response_ids": [6]}
BAD_REST = [
    ({"items": []}, 422, "items"),
    ({"items": [{"prompt_ids": [5], "response_ids": []}]}, 422, "items[0].response_ids"),
    ({"items": [{"prompt_ids": [], "response_ids": [5]}]}, 422, "items[0].prompt_ids"),
    ({"items": [OK, {"prompt_ids": [5], "response_ids": [6, 99999]}]}, 400, "items[1].response_ids[1]"),
    ({"items": [{"prompt_ids": [512], "response_ids": [6]}]}, 400, "items[0].prompt_ids[0]"),
    ({"items": [{"prompt_ids": [5] * 500, "response_ids": [6] * 20}]}, 400, "items[0].response_ids"),
    ({"items": [{"prompt_ids": ["5"], "response_ids": [6]}]}, 422, "items[0].prompt_ids[0]"),
    ({"items": [{"prompt_ids": [5.5], "response_ids": [6]}]}, 422, "items[0].prompt_ids[0]"),
    ({"items": [{"prompt_ids": [-1], "response_ids": [6]}]}, 422, "items[0].prompt_ids[0]"),
    ({"items": [{**OK, "labels": 1}]}, 422, "items[0].labels"),
    ({"items": [OK], "temperature": 0}, 422, "temperature"),
    ({"items": [OK], "temperature": "hot"}, 422, "temperature"),
    ({"items": [OK], "model": "x"}, 422, "model"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_REST, ids=[f"{b[2]}-{b[1]}" for b in BAD_REST])
def test_bad_input_rest(ref_svc, body, status, field):
    r = httpx.post(ref_svc.http_url + "/v1/logprobs", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and field in err["message"], err


def test_oversize_body_and_still_serving(ref_svc):
    r = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": [OK] * 20_000})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
    assert httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": [OK]}).status_code == 200


def test_bad_input_grpc(stub):
    it = reference_pb2.LogProbsItem
    cases = [
        (reference_pb2.LogProbsRequest(), grpc.StatusCode.INVALID_ARGUMENT, "items"),
        (
            reference_pb2.LogProbsRequest(items=[it(prompt_ids=[5])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].response_ids",
        ),
        (
            reference_pb2.LogProbsRequest(items=[it(response_ids=[5])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].prompt_ids",
        ),
        (
            reference_pb2.LogProbsRequest(items=[it(prompt_ids=[5], response_ids=[6, -2])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].response_ids[1]",
        ),
        (
            reference_pb2.LogProbsRequest(items=[it(prompt_ids=[5] * 600, response_ids=[6])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items[0].response_ids",
        ),
        (
            reference_pb2.LogProbsRequest(items=[it(prompt_ids=[5], response_ids=[6])], temperature=0.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            reference_pb2.LogProbsRequest(items=[it(prompt_ids=[5] * 1_200_000, response_ids=[6])]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
    ]
    for req, code, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.LogProbs(req, timeout=30)
        assert e.value.code() == code, e.value.details()
        assert field in e.value.details()
    ok = stub.LogProbs(reference_pb2.LogProbsRequest(items=[it(**OK)]), timeout=30)
    assert len(ok.results[0].logprobs) == 1


def _fill_count(text: str, method: str) -> float:
    m = re.search(rf'^rlhf_batch_fill_count\{{method="{re.escape(method)}",service="\w+"\}} (\S+)$', text, re.M)
    assert m, f"no rlhf_batch_fill_count for {method}"
    return float(m.group(1))


def test_metrics(ref_svc):
    before = _fill_count(httpx.get(ref_svc.http_url + "/metrics").text, "logprobs")
    httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": ITEMS})
    text = httpx.get(ref_svc.http_url + "/metrics").text
    # the scaling signals (docs/deploy.md#scaling-signals): one more merged call, nothing left queued or running
    assert _fill_count(text, "logprobs") >= before + 1
    assert 'rlhf_batcher_queued_rows{method="logprobs",service="reference"} 0.0' in text
    assert 'rlhf_batcher_running_rows{method="logprobs",service="reference"} 0.0' in text
    assert 'rlhf_batcher_max_rows{method="logprobs",service="reference"}' in text
    assert 'rlhf_requests_total{code="200",method="/v1/logprobs",protocol="http",service="reference"}' in text
    # the scaling signal: the call was in flight and is no more (the scrape itself is not counted)
    assert 'rlhf_requests_in_flight{method="/v1/logprobs",protocol="http",service="reference"} 0.0' in text
    assert 'rlhf_tokens_total{kind="response",service="reference"}' in text
    assert 'rlhf_requests_total{code="OK",method="LogProbs",protocol="grpc",service="reference"}' in text
    assert 'rlhf_errors_total{kind="invalid_argument",service="reference"}' in text


def test_openapi_fuzz_finds_no_server_errors(ref_svc):
    assert fuzz_openapi(ref_svc.http_url, max_examples=30) > 50
    assert httpx.get(ref_svc.http_url + "/readyz").status_code == 200


# ------------------------------------------------------------------------------------------------ issue 17.10


def test_tiny_temperature_is_refused_not_nan(ref_svc, stub):
    """Temperature 1e-300 is 0 in float32: the answer was NaN / -inf log-probs with 200. Now a clear 4xx."""
    item = {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}
    r = httpx.post(ref_svc.http_url + "/v1/logprobs", json={"items": [item], "temperature": 1e-300})
    assert r.status_code == 422 and r.json()["error"]["field"] == "temperature", r.text
    with pytest.raises(grpc.RpcError) as e:
        stub.LogProbs(reference_pb2.LogProbsRequest(items=[reference_pb2.LogProbsItem(**item)], temperature=1e-300))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()
    # a small accepted temperature still gives finite log-probs
    resp = stub.LogProbs(reference_pb2.LogProbsRequest(items=[reference_pb2.LogProbsItem(**item)], temperature=1e-4))
    assert all(v == v and abs(v) != float("inf") for v in resp.results[0].logprobs)


def test_non_finite_log_probs_are_an_error_not_a_result(tiny_models, start_service, tmp_path):
    """A model that computes NaN (here: a reference model with a NaN weight) gets a 500 naming the item, never NaN
    log-probs with 200 (JSON would even show them as null)."""
    model = tmp_path / "nan-policy"
    shutil.copytree(tiny_models.policy, model)
    weights = load_file(str(model / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][8] = float("nan")  # the logit of token 8 is NaN, so is every log-softmax of that row
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    svc = start_service("reference", {"actor_rollout_ref": {"ref": {"load": str(model)}}})
    r = httpx.post(svc.http_url + "/v1/logprobs", json={"items": [{"prompt_ids": [5, 6], "response_ids": [7, 8]}]})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "non_finite_output" and err["field"] == "items[0].response_ids[0]", err
    with grpc.insecure_channel(svc.grpc_addr) as ch, pytest.raises(grpc.RpcError) as e:
        reference_pb2_grpc.ReferenceServiceStub(ch).LogProbs(
            reference_pb2.LogProbsRequest(items=[reference_pb2.LogProbsItem(prompt_ids=[5], response_ids=[9])])
        )
    assert e.value.code() == grpc.StatusCode.INTERNAL and "non-finite log-prob" in e.value.details()


def test_undecodable_request_is_invalid_argument(ref_svc):
    with grpc.insecure_channel(ref_svc.grpc_addr) as ch:
        raw = ch.unary_unary("/rlhf.v1.ReferenceService/LogProbs", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\x0a\xff\xff\xff\xff\x0f")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
