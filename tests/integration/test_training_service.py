"""The training service (``rlhf serve training``) driven by the official tinker SDK (0.38.0) on loopback, over the
tiny policy: a LoRA training client, supervised steps that lower the loss, refusals at request time, two users'
runs on one base that do not touch each other, and checkpoints that survive a kill -9 of the service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
BASE = "tiny:policy"


def _config(tmp_path) -> dict:
    return {
        "run_id": "tinker",
        "training": {"save": str(tmp_path / "checkpoints"), "device": "cpu"},
        "actor_rollout_ref": {"actor_rollout": {"load": BASE}},
    }


def _start(start_service, tmp_path):
    env = {"RLHF_API_TOKEN": ALICE, "RLHF_TRAINING_TOKENS": BOB}
    return start_service("training", _config(tmp_path), env=env)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


STEPS = 10  # supervised steps toward TARGET before sampling
LR = 1e-2
BATCH = [_datum(list(range(5 + i, 25 + i))) for i in range(4)]


def _client(svc, token: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=svc.http_url, api_key=token)


def _step(tc, lr: float = 1e-2) -> float:
    fb = tc.forward_backward(BATCH, "cross_entropy")
    op = tc.optim_step(types.AdamParams(learning_rate=lr))
    loss = fb.result().metrics["loss:sum"]
    op.result()
    return loss


def _loss(tc) -> float:
    return tc.forward(BATCH, "cross_entropy").result().metrics["loss:sum"]


def _headers(token: str) -> dict:
    return {"X-API-Key": token}


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_models):
    """One service for the tests that do not restart it."""
    from tests.integration._procs import ServiceProc, write_config  # noqa: PLC0415 - test helper

    tmp = tmp_path_factory.mktemp("training")
    cfg = write_config(tmp / "training.yaml", _config(tmp))
    env = {"RLHF_API_TOKEN": ALICE, "RLHF_TRAINING_TOKENS": BOB}
    proc = ServiceProc("training", cfg, tmp / "logs", env=env).start(timeout=120)
    yield proc
    proc.stop()


def test_sdk_supervised_steps_lower_the_loss(shared):
    tc = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == BASE
    losses = [_step(tc) for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.7 * losses[0], losses
    out = tc.forward(BATCH, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == len(BATCH)
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp.shape == (19,) and (lp < 0).all()
    # loss:sum is -sum of the log-probs of the targets (weights 1): the outputs and the metric agree
    total = sum(-o["logprobs"].to_numpy().sum() for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    # top-K targets (19, 8), mostly 0: as torch tensors the SDK sends them as sparse CSR; column 0 is the datum's
    # own target
    top_k = torch.zeros((19, 8), dtype=torch.int64)
    top_k[:, 0] = BATCH[0].loss_fn_inputs["target_tokens"].to_torch()
    weights = torch.zeros((19, 8))
    weights[:, 0] = 1.0
    datum = types.Datum(model_input=BATCH[0].model_input, loss_fn_inputs={"target_tokens": top_k, "weights": weights})
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    k_out = tc.forward([datum], "cross_entropy").result()
    k_lp = k_out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert k_lp.shape == (19, 8)
    np.testing.assert_allclose(k_lp[:, 0], lp, rtol=1e-5)


def test_sdk_rl_step_with_importance_sampling(shared):
    tc = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
    good, bad = BATCH[0], BATCH[1]
    sampled = tc.forward([good, bad], "cross_entropy").result()
    q = [o["logprobs"].to_numpy() for o in sampled.loss_fn_outputs]  # the sampler's log-probs: this very policy

    def rl(datum, q_i, advantage):
        return types.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={
                "target_tokens": datum.loss_fn_inputs["target_tokens"],
                "logprobs": q_i.astype(np.float32),
                "advantages": np.full(q_i.shape, advantage, dtype=np.float32),
            },
        )

    data = [rl(good, q[0], 1.0), rl(bad, q[1], -1.0)]
    fb = tc.forward_backward(data, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # on-policy the ratio is 1: the loss is -sum(advantages) = -(19 - 19)
    assert fb.result().metrics["loss:sum"] == pytest.approx(0.0, abs=1e-3)
    after = [o["logprobs"].to_numpy() for o in tc.forward([good, bad], "cross_entropy").result().loss_fn_outputs]
    assert after[0].sum() > q[0].sum() and after[1].sum() < q[1].sum()


def test_losses_and_tokens_refused_at_request_time(shared):
    tc = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="not one of the tinker SDK's built-in losses"):
        tc.forward_backward(BATCH, "my_loss").result()
    # inputs the loss does not take: the future fails and names them
    with pytest.raises(tinker.RequestFailedError, match=r"ppo: datum 0: loss_fn_inputs \['weights'\] are not inputs"):
        tc.forward_backward(BATCH, "ppo").result()
    r = httpx.get(shared.http_url + "/api/v1/get_server_capabilities", headers=_headers("tml-nobody"))
    assert r.status_code == 401
    r = httpx.get(shared.http_url + "/api/v1/get_server_capabilities")
    assert r.status_code == 401
    caps = httpx.get(shared.http_url + "/api/v1/get_server_capabilities", headers=_headers(BOB)).json()
    assert caps["supported_models"][0]["model_name"] == BASE
    r = httpx.post(shared.http_url + "/api/v1/optim_step", headers=_headers(ALICE), json={"model_id": "x"})
    assert r.status_code == 404
    # a resent create_model (its answer lost) is the same future, not a second run
    session = httpx.post(shared.http_url + "/api/v1/create_session", headers=_headers(ALICE), json={}).json()
    create = {"session_id": session["session_id"], "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2}}
    ids = [
        httpx.post(shared.http_url + "/api/v1/create_model", headers=_headers(ALICE), json=create).json()["request_id"]
        for _ in range(2)
    ]
    assert ids[0] == ids[1]
    # a run id that would leave the checkpoint folder
    r = httpx.get(shared.http_url + "/api/v1/training_runs/../checkpoints", headers=_headers(ALICE))
    assert r.status_code in (400, 404)
    r = httpx.post(
        shared.http_url + "/api/v1/load_weights",
        headers=_headers(ALICE),
        json={"path": "tinker://../weights/x", "optimizer": False, "model_id": tc.model_id},
    )
    assert r.status_code == 400 and "is not a training run id" in r.text
    r = httpx.post(shared.http_url + "/api/v1/retrieve_future", headers=_headers(ALICE), json={"request_id": "nope"})
    assert r.status_code == 404 and "is not known" in r.text
    # calls not built here are a 404 that says so (the SDK retries 5xx, not 404)
    r = httpx.post(shared.http_url + "/api/v1/copy_weights", headers=_headers(ALICE), json={})
    assert r.status_code == 404 and "not built in this service" in r.text
    # seq_id: a resend of an accepted request is that request (one step, not two); going backwards is refused
    fresh = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    step = {"model_id": fresh.model_id, "seq_id": 7, "adam_params": {"learning_rate": 0.01}}
    first = httpx.post(shared.http_url + "/api/v1/optim_step", headers=_headers(ALICE), json=step).json()
    again = httpx.post(shared.http_url + "/api/v1/optim_step", headers=_headers(ALICE), json=step).json()
    assert first["request_id"] == again["request_id"]
    r = httpx.post(shared.http_url + "/api/v1/optim_step", headers=_headers(ALICE), json=step | {"seq_id": 6})
    assert r.status_code == 400 and "seq_id 6 comes after seq_id 7" in r.text


PROMPT = [7, 8, 9]
# A sequence the tiny policy learns in a few LoRA steps (it picks up which tokens, not yet their order)
TARGET = [42] * 8


def _target_logprob(sampler) -> float:
    """log p(TARGET | PROMPT) under a sampler, from its prompt log-probs."""
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + TARGET)).result()
    assert lps[0] is None and len(lps) == len(PROMPT + TARGET)
    return float(sum(lps[len(PROMPT) :]))


def test_sdk_sampling_from_saved_weights(shared):
    service = _client(shared, ALICE)
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result()
    base = service.create_sampling_client(base_model=BASE).result()
    assert base.get_base_model() == BASE
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = types.SamplingParams(max_tokens=len(TARGET), temperature=0.0, stop=[])
    before = _target_logprob(base)
    assert base.sample(prompt, 1, greedy).result().sequences[0].tokens != TARGET
    target = _datum(PROMPT + TARGET)
    for _ in range(STEPS):
        fb = tc.forward_backward([target], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        fb.result()
    v1 = tc.save_weights_and_get_sampling_client().result()
    # supervised steps toward TARGET: the saved weights give it more log-prob, and sample it
    after = _target_logprob(v1)
    assert after > before + 5, (before, after)
    assert v1.sample(prompt, 1, greedy).result().sequences[0].tokens == TARGET
    hot = types.SamplingParams(max_tokens=len(TARGET), temperature=1.0, seed=3, stop=[])
    hits = sum(s.tokens == TARGET for s in v1.sample(prompt, 16, hot).result().sequences)
    base_hits = sum(s.tokens == TARGET for s in base.sample(prompt, 16, hot).result().sequences)
    assert hits > base_hits, (hits, base_hits)

    # the log-probs of sampled tokens (and of the prompt) are those a forward of them under the same weights gives
    out = v1.sample(prompt, 4, hot, include_prompt_logprobs=True).result()
    assert len(out.sequences) == 4 and all(len(s.sequence_id) > 0 for s in out.sequences)
    assert len({s.sequence_id for s in out.sequences}) == 4
    data = [_datum(PROMPT + s.tokens) for s in out.sequences]
    fwd = tc.forward(data, "cross_entropy").result()
    for seq, o in zip(out.sequences, fwd.loss_fn_outputs, strict=True):
        assert seq.stop_reason == "length" and len(seq.tokens) == len(TARGET)
        lp = o["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=1e-4)
        np.testing.assert_allclose(out.prompt_logprobs[1:], lp[: len(PROMPT) - 1], atol=1e-4)
    # the same seed draws the same tokens
    again = v1.sample(prompt, 4, hot, include_prompt_logprobs=True).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]

    # a named sampler checkpoint, then more steps: v1 and the named sampler keep the weights they were made from
    path = tc.save_weights_for_sampler("v1").result().path
    assert path.endswith("/sampler_weights/v1")
    named = service.create_sampling_client(model_path=path).result()
    assert named.get_base_model() == BASE
    assert _target_logprob(named) == pytest.approx(after, abs=1e-4)
    away = _datum(PROMPT + [43] * 8)
    for _ in range(3):
        fb = tc.forward_backward([away], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        fb.result()
    v2 = tc.save_weights_and_get_sampling_client().result()
    moved = _target_logprob(v2)
    assert moved < after - 1, (after, moved)
    assert _target_logprob(v1) == pytest.approx(after, abs=1e-5)
    assert _target_logprob(named) == pytest.approx(after, abs=1e-4)
    later = v1.sample(prompt, 4, hot, include_prompt_logprobs=True).result()
    assert [s.tokens for s in later.sequences] == [s.tokens for s in out.sequences]
    # the path overwritten by a later save: the sampler made before keeps v1
    tc.save_weights_for_sampler("v1").result()
    assert _target_logprob(named) == pytest.approx(after, abs=1e-4)
    assert _target_logprob(service.create_sampling_client(model_path=path).result()) == pytest.approx(moved, abs=1e-4)
    # closing the client drops its samplers and their adapter copies (v1, v2, the named v1 and its rewrite)
    copies = httpx.get(shared.http_url + "/v1/info", headers=_headers(ALICE)).json()["sampler_adapters"]
    service.close("success").result()
    info = httpx.get(shared.http_url + "/v1/info", headers=_headers(ALICE)).json()
    assert info["sampler_adapters"] == copies - 4
    r = httpx.get(f"{shared.http_url}/api/v1/samplers/{v1._sampling_session_id}", headers=_headers(ALICE))
    assert r.status_code == 404


def test_sampling_params_refused_or_honoured(shared):
    service = _client(shared, ALICE)
    base = service.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    refused = [
        (types.SamplingParams(max_tokens=None), "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=4, top_k=0), "sampling_params.top_k"),
        (types.SamplingParams(max_tokens=4, top_p=0.0), "sampling_params.top_p"),
        (types.SamplingParams(max_tokens=4, temperature=-1.0), "sampling_params.temperature"),
        (types.SamplingParams(max_tokens=100_000), "exceeds the model's context"),
    ]
    for params, field in refused:
        with pytest.raises(tinker.BadRequestError, match=field):
            base.sample(prompt, 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        base.sample(prompt, 1, types.SamplingParams(max_tokens=4), topk_sample_logprobs=2).result()
    # stop token ids end a sequence at (and with) the first one drawn; top_k=1 is greedy
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    tokens = greedy.sequences[0].tokens
    assert len(tokens) == 6 and greedy.sequences[0].stop_reason == "length"
    top1 = base.sample(prompt, 3, types.SamplingParams(max_tokens=6, top_k=1, seed=1, stop=[])).result()
    assert all(s.tokens == tokens for s in top1.sequences)
    stopped = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[tokens[2]])).result()
    assert stopped.sequences[0].tokens == tokens[: tokens.index(tokens[2]) + 1]
    assert stopped.sequences[0].stop_reason == "stop"
    # another user's sampler is not found
    r = httpx.get(f"{shared.http_url}/api/v1/samplers/{base._sampling_session_id}", headers=_headers(BOB))
    assert r.status_code == 404
    # inflight samplers (mutable weights) are not built: a sampler keeps the weights it was made from
    tc = service.create_lora_training_client(base_model=BASE, rank=2, seed=0).result()
    with pytest.raises(tinker.BadRequestError, match="kind 'inflight'"):
        tc.save_weights_and_get_sampling_client(kind="inflight").result()
    # a training checkpoint is not a sampler checkpoint
    with pytest.raises(tinker.BadRequestError, match="sampler checkpoint"):
        service.create_sampling_client(model_path="tinker://x:train:0/weights/a").result()


def test_two_users_runs_on_one_base_are_isolated(shared):
    alice = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=2).result()
    bob_service = _client(shared, BOB)
    bob = bob_service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    before = bob.forward(BATCH, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    for _ in range(3):
        _step(alice, lr=5e-2)
    after = bob.forward(BATCH, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(before, after)  # alice's steps leave bob's run as it was
    assert _loss(alice) < _loss(bob)
    # bob cannot see or load alice's run
    path = alice.save_state("a1", ttl_seconds=7200, user_metadata={"step": "3"}).result().path
    h = _headers(BOB)
    r = httpx.post(shared.http_url + "/api/v1/get_info", headers=h, json={"model_id": alice.model_id})
    assert r.status_code == 404
    r = httpx.get(f"{shared.http_url}/api/v1/training_runs/{alice.model_id}/checkpoints", headers=h)
    assert r.status_code == 404
    with pytest.raises(tinker.NotFoundError, match="does not exist"):
        _client(shared, BOB).create_training_client_from_state(path).result()
    listed = httpx.get(f"{shared.http_url}/api/v1/training_runs/{alice.model_id}/checkpoints", headers=_headers(ALICE))
    assert [c["tinker_path"] for c in listed.json()["checkpoints"]] == [path]
    assert listed.json()["checkpoints"][0]["user_metadata"] == {"step": "3"}
    assert listed.json()["checkpoints"][0]["expires_at"] is not None
    # memory: every run is an adapter + its Adam moments beside the one base
    mem = httpx.get(shared.http_url + "/v1/info", headers=_headers(ALICE)).json()
    per_run = mem["run_bytes"][alice.model_id]
    assert 0 < per_run < mem["base_bytes"]
    print(f"\nbase {mem['base_bytes']} bytes; a rank-8 run after steps: {per_run} bytes")
    # bob closes his client: his run leaves the shared model, alice's stays
    bob_service.close("success").result()
    mem = httpx.get(shared.http_url + "/v1/info", headers=_headers(ALICE)).json()
    assert bob.model_id not in mem["run_bytes"] and alice.model_id in mem["run_bytes"]
    r = httpx.post(shared.http_url + "/api/v1/get_info", headers=_headers(BOB), json={"model_id": bob.model_id})
    assert r.status_code == 404 and "its session was closed (success)" in r.text


def test_two_concurrent_runs_train_as_each_would_alone(shared):
    """Issue 45: two users' runs on one base, their steps sent at the same time from two threads, train exactly as
    each would alone: run A's loss curve beside B equals A's curve with the service to itself."""

    def curve(tc) -> list[float]:
        return [_step(tc, lr=2e-2) for _ in range(4)]

    alone = curve(_client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=11).result())
    a = _client(shared, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=11).result()
    b = _client(shared, BOB).create_lora_training_client(base_model=BASE, rank=8, seed=12).result()
    with ThreadPoolExecutor(2) as pool:
        beside, other = pool.submit(curve, a), pool.submit(curve, b)
        beside, other = beside.result(), other.result()
    assert alone[-1] < alone[0]  # it learns
    np.testing.assert_allclose(beside, alone, rtol=1e-5)
    assert other != beside  # B is its own run (another seed), not a copy of A


def test_checkpoint_survives_kill9_and_in_flight_future_fails(start_service, tmp_path):
    svc = _start(start_service, tmp_path)
    tc = _client(svc, ALICE).create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    for _ in range(4):
        _step(tc)
    path = tc.save_state("before-crash").result().path
    saved = _loss(tc)
    next_loss = (_step(tc), _loss(tc))  # one more step from the saved state, as the original run took it
    # a forward_backward accepted but not retrieved when the service dies
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=BATCH, loss_fn="cross_entropy"),
        model_id=tc.model_id,
        seq_id=100,
    )
    r = httpx.post(
        svc.http_url + "/api/v1/forward_backward",
        headers=_headers(ALICE) | {"Content-Type": "application/x-protobuf"},
        content=forward_backward_request_to_proto(request).SerializeToString(),
    )
    assert r.status_code == 200, r.text
    in_flight = r.json()["request_id"]

    svc.stop(kill=True)
    svc.start(timeout=120)

    r = httpx.post(
        svc.http_url + "/api/v1/retrieve_future", headers=_headers(ALICE), json={"request_id": in_flight}, timeout=60
    )
    body = r.json()
    assert r.status_code == 200 and body["category"] == "server" and "earlier run" in body["error"]

    resumed = _client(svc, ALICE).create_training_client_from_state_with_optimizer(path).result()
    assert _loss(resumed) == pytest.approx(saved, rel=1e-5)
    assert (_step(resumed), _loss(resumed)) == pytest.approx(next_loss, rel=1e-4)
    # weights only: Adam starts afresh, so the same step lands elsewhere
    fresh = _client(svc, ALICE).create_training_client_from_state(path).result()
    assert _loss(fresh) == pytest.approx(saved, rel=1e-5)
    _step(fresh)
    assert _loss(fresh) != pytest.approx(next_loss[1], rel=1e-3)
