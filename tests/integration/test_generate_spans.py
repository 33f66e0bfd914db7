"""Partial rollouts through the rollout's ``Generate`` answers: the rollout servicer and HTTP app on real gRPC and HTTP
servers on loopback over the hf engine (tiny policy, ``partial_rollouts`` on). A push while a request decodes stops
it and resumes it under the new weights; gRPC ``Generate`` (rollout.proto ``Completion.span_starts`` /
``span_versions``) and ``/v1/generate`` (the same names in JSON) report its version spans, ``policy_version`` the
oldest; a request of one version reports none (the proto fields empty, the JSON lists empty).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import httpx
import torch
from safetensors.torch import load_file

from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.rollout.engine_types import EngineHooks
from services.rollout.grpc_servicer import SERVICE_NAME, RolloutServicer, add_to_server
from services.rollout.hf_engine import HFEngine
from services.rollout.http_app import build_app

PROMPT = [2, 5, 6, 7]
TOKENS = 120


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_generate_answers_report_the_spans_of_a_resumed_request(tiny_models):
    path = Path(os.environ["RLHF_CACHE_DIR"]) / "tiny" / "policy"
    state = load_file(str(path / "model.safetensors"))
    steps: list[int] = []

    async def push_while_decoding(engine: HFEngine, request, version: int):
        """``request`` (an awaitable: a gRPC call, an HTTP post) under way, a push of ``version`` five decode steps
        in; -> its answer."""
        steps.clear()
        task = asyncio.ensure_future(request)
        while len(steps) < 5 and not task.done():
            await asyncio.sleep(0.002)
        swap = await engine.swap_weights(_perturbed(state, version), version, f"c{version}")
        assert swap.swapped
        return await task

    async def main():
        engine = HFEngine(
            path, "tiny:policy", device="cpu", partial_rollouts=True, hooks=EngineHooks(on_step=steps.append)
        )
        await engine.start()
        settings = ServiceSettings.from_env({}, host="127.0.0.1", grpc_port=0, http_port=0, api_token="t")
        metrics = ServiceMetrics("rollout")
        runner = ServiceRunner("rollout", settings, metrics)
        runner.add_grpc(add_to_server, [SERVICE_NAME], RolloutServicer(engine, settings, metrics))
        runner.set_http_app(build_app(engine, settings, metrics))
        served = asyncio.create_task(runner.run(shutdown=engine.close, install_signal_handlers=False))
        await asyncio.wait_for(runner.started.wait(), 10)
        try:
            params = common_pb2.SamplingParams(n=2, max_tokens=TOKENS, temperature=1.0, seed=3, ignore_eos=True)
            prompt = common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPT))
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}") as channel,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{runner.http_port}", timeout=60) as http,
            ):
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                call = stub.Generate(rollout_pb2.GenerateRequest(prompts=[prompt], params=params), timeout=60)
                grpc_resp = await push_while_decoding(engine, call, 1)
                body = {"prompt_token_ids": [PROMPT], "n": 2, "max_tokens": TOKENS, "seed": 3, "ignore_eos": True}
                http_resp = await push_while_decoding(engine, http.post("/v1/generate", json=body), 2)
                short = {**body, "max_tokens": 4}
                grpc_one = await stub.Generate(
                    rollout_pb2.GenerateRequest(prompts=[prompt], params=common_pb2.SamplingParams(max_tokens=4)),
                    timeout=60,
                )
                http_one = await http.post("/v1/generate", json=short)
        finally:
            runner.request_stop()
            await asyncio.wait_for(served, 30)
        return grpc_resp, http_resp, grpc_one, http_one

    grpc_resp, http_resp, grpc_one, http_one = asyncio.run(main())

    assert grpc_resp.policy_version == 1  # the response's field: the version serving when the request finished
    (result,) = grpc_resp.results
    assert len(result.completions) == 2
    for c in result.completions:
        assert len(c.token_ids) == len(c.logprobs) == TOKENS
        assert list(c.span_versions) == [0, 1] and c.policy_version == 0  # the oldest span's, as before
        assert c.span_starts[0] == 0 and 0 < c.span_starts[1] < TOKENS

    assert http_resp.status_code == 200, http_resp.text
    answer = http_resp.json()
    assert answer["policy_version"] == 2
    (result,) = answer["results"]
    assert len(result["completions"]) == 2
    for c in result["completions"]:
        assert len(c["token_ids"]) == len(c["logprobs"]) == TOKENS
        assert c["span_versions"] == [1, 2] and c["policy_version"] == 1
        assert c["span_starts"][0] == 0 and 0 < c["span_starts"][1] < TOKENS

    # one version sampled every token: no spans, policy_version that version
    (c,) = grpc_one.results[0].completions
    assert not c.span_starts and not c.span_versions and c.policy_version == 2 and len(c.token_ids) == 4
    assert http_one.status_code == 200, http_one.text
    c = http_one.json()["results"][0]["completions"][0]
    assert (c["span_starts"], c["span_versions"], c["policy_version"]) == ([], [], 2)
