"""The training engine's batching on the tiny policy: padded micro-batches give what one forward per datum gives, and
a batch that fails part-way leaves the run's gradients as they were."""

from __future__ import annotations

import pytest
import torch

from services.training import engine as engine_mod
from services.training.engine import TrainingEngine, combine_metrics, micro_batches
from services.training.sessions import owner_of
from services.training.shared_model import LoraSpec
from services.training.wire import Datum, ForwardBackwardCall

OWNER = owner_of("tml-test")


def _data(lengths):
    return [
        Datum(torch.arange(5, 5 + n), {"target_tokens": torch.arange(6, 6 + n), "weights": torch.ones(n)})
        for n in lengths
    ]


def test_micro_batches_bound_the_padded_size():
    data = _data([3, 11, 7, 2, 20])
    pieces = micro_batches(data, 24)
    assert [[d.tokens.numel() for d in p] for p in pieces] == [[3, 11], [7, 2], [20]]
    assert all(len(p) * max(d.tokens.numel() for d in p) <= 24 for p in pieces)
    assert [len(p) for p in micro_batches(data, 1)] == [1] * 5


def test_metrics_combine_as_the_sdk_combines_chunks():
    parts = [({"loss:sum": 1.0, "kl:mean": 0.2, "r:max": 3.0}, 1), ({"loss:sum": 2.0, "kl:mean": 0.5, "r:max": 1.0}, 2)]
    assert combine_metrics(parts) == pytest.approx({"loss:sum": 3.0, "kl:mean": 0.4, "r:max": 3.0})


@pytest.fixture
def engine(tiny_models, tmp_path):
    e = TrainingEngine("tiny:policy", tmp_path, "cpu")
    e._load()
    run = e._new_run(OWNER, "s:train:0", LoraSpec(4, 0, True, True, True), None)
    e._write_run_json(run)
    with torch.no_grad():  # B away from zero, so that A gets gradients too
        for p in run.params.values():
            p.add_(0.01 * torch.randn_like(p))
    yield e
    e.close()


def _grads(e):
    return {k: p.grad.clone() for k, p in e.runs["s:train:0"].params.items()}


def test_padded_micro_batches_equal_one_forward_per_datum(engine, monkeypatch):
    call = ForwardBackwardCall("s:train:0", 1, "cross_entropy", None, False, _data([3, 11, 7]))
    together = engine._fwd_bwd_job(OWNER, call)
    grads = _grads(engine)
    engine.runs["s:train:0"].optimizer.zero_grad(set_to_none=True)
    monkeypatch.setattr(engine_mod, "MICRO_BATCH_TOKENS", 1)
    alone = engine._fwd_bwd_job(OWNER, call)
    assert together["metrics"]["loss:sum"] == pytest.approx(alone["metrics"]["loss:sum"], rel=1e-5)
    for a, b in zip(together["outputs"], alone["outputs"], strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=1e-5)
    for k, g in _grads(engine).items():
        torch.testing.assert_close(g, grads[k], atol=1e-5, rtol=1e-4)


def test_a_batch_failing_part_way_leaves_the_gradients_as_they_were(engine, monkeypatch):
    call = ForwardBackwardCall("s:train:0", 1, "cross_entropy", None, False, _data([4, 6]))
    engine._fwd_bwd_job(OWNER, call)
    before = _grads(engine)
    monkeypatch.setattr(engine_mod, "MICRO_BATCH_TOKENS", 1)  # two micro-batches; the second one fails
    real = engine.model.target_logprobs
    calls = []

    def failing(batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(batch)

    monkeypatch.setattr(engine.model, "target_logprobs", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine._fwd_bwd_job(OWNER, call)
    assert calls == [1, 1]
    for k, g in _grads(engine).items():
        torch.testing.assert_close(g, before[k], atol=0, rtol=0)


def test_inputs_the_loss_refuses_fail_before_any_gradient(engine):
    data = _data([4, 6])
    data[1].inputs["advantages"] = torch.ones(6)  # not an input of cross_entropy
    call = ForwardBackwardCall("s:train:0", 1, "cross_entropy", None, False, data)
    with pytest.raises(engine_mod.RequestFailed, match=r"datum 1: loss_fn_inputs \['advantages'\]"):
        engine._fwd_bwd_job(OWNER, call)
    assert all(p.grad is None for p in engine.runs["s:train:0"].params.values())


def test_sessions_without_heartbeats_have_their_runs_unloaded(tiny_models, tmp_path):
    e = TrainingEngine("tiny:policy", tmp_path, "cpu", session_ttl_s=60)
    e._load()
    e.ready = True
    try:
        quiet, alive = e.create_session(OWNER, {}), e.create_session(OWNER, {})
        for sid in (quiet, alive):
            e._new_run(OWNER, f"{sid}:train:0", LoraSpec(4, 0, True, True, True), None)
        kept = e.runs[f"{alive}:train:0"].adapter
        start = e.sessions.by_id[quiet].last_heartbeat
        assert e.expire(now=start + 30) is None  # within the TTL: nothing goes
        e.heartbeat(OWNER, alive)
        e.sessions.by_id[alive].last_heartbeat = start + 50
        e.expire(now=start + 61).result()
        assert list(e.runs) == [f"{alive}:train:0"]
        left = {n.split(".")[-2] for n, _ in e.model.peft.named_parameters() if ".lora_" in n}
        assert left == {kept}  # the quiet run's adapter left the shared model
        with pytest.raises(engine_mod.NotFound, match="was unloaded .*sent no heartbeat for 60 s"):
            e.run(OWNER, f"{quiet}:train:0")
        with pytest.raises(engine_mod.NotFound, match="is over"):
            e.create_model(OWNER, quiet, 1, "tiny:policy", LoraSpec(4, 0, True, True, True), None)
        # closing a session unloads its runs at once
        e.finish_session(OWNER, alive, "success")
        e._worker.submit(lambda: None).result()
        assert e.runs == {}
        with pytest.raises(engine_mod.NotFound, match=r"its session was closed \(success\)"):
            e.run(OWNER, f"{alive}:train:0")
    finally:
        e.close()


def test_checkpoints_expire_after_their_ttl(engine, tmp_path):
    record = engine_mod.checkpoint_record({"note": "a"}, 3600)
    engine._save_job(OWNER, "s:train:0", "keep-an-hour", False, record)
    engine._save_job(OWNER, "s:train:0", "forever", False, engine_mod.checkpoint_record(None, None))
    listed = {c["checkpoint_id"]: c for c in engine.list_checkpoints(OWNER, "s:train:0")}
    assert listed["weights/keep-an-hour"]["user_metadata"] == {"note": "a"}
    assert listed["weights/keep-an-hour"]["expires_at"] is not None and listed["weights/forever"]["expires_at"] is None
    assert engine.store.sweep(record["expires_unix"] - 1) == []
    gone = engine.store.sweep(record["expires_unix"] + 1)
    assert [p.name for p in gone] == ["keep-an-hour"]
    assert [c["checkpoint_id"] for c in engine.list_checkpoints(OWNER, "s:train:0")] == ["weights/forever"]
    with pytest.raises(engine_mod.NotFound, match="does not exist"):
        engine.store.training_checkpoint(OWNER, "tinker://s:train:0/weights/keep-an-hour")
    with pytest.raises(engine_mod.InvalidArgument, match="ttl_seconds 60 must be from 3600"):
        engine_mod.checkpoint_record(None, 60)
