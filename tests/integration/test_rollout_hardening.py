"""The rollout service (hf engine, tiny policy) as a real process against hostile or careless clients (issue 17):
a client that disconnects cancels its generation (8); a lone surrogate is a 422 (10); a 7 MB prompt is tokenised
off the event loop (10); undecodable protobuf and weight headers announcing absurd sizes are refused before
anything is allocated (10)."""

from __future__ import annotations

import re
import threading
import time

import grpc
import httpx
import pytest

from rlhf.transport.weights import manifest_checksum
from rlhf.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2
from tests.integration._procs import REPO, ServiceProc

TOKEN = "hardening-token"


@pytest.fixture(scope="module")
def hf_svc(tiny_models, tmp_path_factory):
    env = {"RLHF_API_TOKEN": TOKEN, "RLHF_ROLLOUT_ENGINE": "hf", "RLHF_MAX_BODY_BYTES": str(16 << 20)}
    svc = ServiceProc("rollout", REPO / "configs" / "demo.yaml", tmp_path_factory.mktemp("hardening"), env=env)
    svc.start(timeout=240)
    yield svc
    svc.stop()


def _engine_tokens(url: str) -> float:
    """Tokens the engine has decoded so far: the sum of ``rlhf_batch_size{method="engine_step"}`` (rows per step)."""
    text = httpx.get(url + "/metrics").text
    m = re.search(r'^rlhf_batch_size_sum\{[^}]*method="engine_step"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnected_client_cancels_its_generation(hf_svc):
    """25,600 tokens were generated for a request closed after 1 s: now decoding stops when the client leaves."""
    n, max_tokens = 256, 400
    body = {"prompt_token_ids": [[2, 5, 6]], "n": n, "max_tokens": max_tokens, "ignore_eos": True, "seed": 1}
    before = _engine_tokens(hf_svc.http_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(hf_svc.http_url + "/v1/generate", json=body, timeout=httpx.Timeout(5.0, read=1.0))
    time.sleep(1.5)  # the disconnect is noticed at once; the step in progress finishes
    settled = _engine_tokens(hf_svc.http_url)
    time.sleep(1.5)
    after = _engine_tokens(hf_svc.http_url)
    assert after == settled, (before, settled, after)  # nothing decodes for the departed client
    assert after - before < n * max_tokens / 2, (before, after)
    # the same for a gRPC call the client cancels

    with grpc.insecure_channel(hf_svc.grpc_addr) as ch:
        req = rollout_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[2, 5, 6]))],
            params=common_pb2.SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=2),
        )
        call = rollout_pb2_grpc.RolloutServiceStub(ch).Generate.future(req)
        time.sleep(1.0)
        assert call.cancel()
    time.sleep(1.5)
    settled = _engine_tokens(hf_svc.http_url)
    time.sleep(1.5)
    assert _engine_tokens(hf_svc.http_url) == settled and settled - after < n * max_tokens / 2, (after, settled)
    # and the service serves the next request normally
    r = httpx.post(hf_svc.http_url + "/v1/generate", json={"prompt_token_ids": [[2, 5]], "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and len(r.json()["results"][0]["completions"][0]["token_ids"]) >= 1


def test_lone_surrogate_is_422_not_500(hf_svc):
    bodies = ('{"prompt": "hi \\ud800 there"}', '{"prompt": ["ok", "\\udfff"]}', '{"prompt": "a", "stop": "\\ud800"}')
    for body in bodies:
        r = httpx.post(
            hf_svc.http_url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert "surrogate" in r.text


def test_big_prompt_is_tokenised_off_the_event_loop(hf_svc):
    """A 7 MB prompt: health checks kept waiting 2.4 s while it was tokenised on the loop."""
    result: dict = {}

    def big():
        r = httpx.post(
            hf_svc.http_url + "/v1/completions", json={"prompt": "what is 1 plus 2? " * 390_000}, timeout=120
        )
        result["status"] = r.status_code

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(hf_svc.http_url + "/healthz", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    assert result["status"] == 400  # longer than the context: refused, naming the prompt
    assert worst < 1.0, worst


def test_update_weights_refuses_garbage_and_absurd_sizes_before_allocating(hf_svc):
    meta = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(hf_svc.grpc_addr) as ch:
        raw = ch.stream_unary(
            "/rlhf.v1.RolloutService/UpdateWeights", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as e:
            raw(iter([b"\x0a\xff\xff\xff\xff\x0f"]), metadata=meta, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "not a valid protobuf message" in e.value.details()

        # a header naming the model's own tensors but announcing 2^40 bytes for a bucket
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        version = stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest()).version
        header = weights_pb2.WeightHeader(version=version + 1, parent_version=version, format="safetensors")
        header.tensors.add(name="model.embed_tokens.weight", dtype="F32", shape=[512, 64], bucket=0)
        header.buckets.add(index=0, nbytes=1 << 40, sha256="0" * 64)
        header.total_bytes = 1 << 40

        header.checksum = manifest_checksum(["0" * 64])
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(iter([weights_pb2.WeightUpdate(header=header)]), metadata=meta, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        # a full-size model with one tensor announced huge: refused by the served model's shapes
        header.tensors[0].shape[:] = [1 << 20, 1 << 20]
        header.buckets[0].nbytes = header.total_bytes = 8 + 4 * (1 << 40)
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(iter([weights_pb2.WeightUpdate(header=header)]), metadata=meta, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in e.value.details(), e.value
        assert stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest()).version == version
