"""Cross-request micro-batching in the reference and reward engines (in-process, tiny models): concurrent requests of
mixed lengths are merged into one forward call (the merge metrics say so) and each gets exactly what it gets alone:
log-probs within 1e-5, reward-model scores within 1e-5, per request and in request order. A bad request is refused
on its own without touching the requests merged around it."""

from __future__ import annotations

import asyncio
import random

import pytest

import services.reference.engine as ref_mod
import services.reward.engine as rew_mod
from rlhf.config import parse_config
from rlhf.serving import InvalidArgument, ServiceMetrics
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.reward.engine import RewardEngine
from services.reward.scorers import Item


def _merged_max(metrics: ServiceMetrics, name: str) -> float:
    """The largest number of requests merged into one call (from the histogram's buckets)."""
    best = 0.0
    for fam in metrics.registry.collect():
        if fam.name != name:
            continue
        prev = 0.0
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                if s.value > prev:
                    best = max(best, le)
                prev = s.value
    return best


@pytest.fixture(scope="module")
def ref_engine(tiny_models):
    cfg = parse_config(
        {"actor_rollout_ref": {"actor_rollout": {"load": "tiny:policy"}, "ref": {"micro_batch_size": 4}}}
    )
    metrics = ServiceMetrics("reference")
    eng = ReferenceEngine(cfg, device="cpu", metrics=metrics)
    eng.load()
    return eng, metrics


def _requests(seed: int, n: int) -> list[list[LogProbsItem]]:
    rng = random.Random(seed)

    def item():
        # pad id 0 inside some sequences: masked the same way merged or alone
        return LogProbsItem(
            [rng.randrange(0, 512) for _ in range(rng.randint(1, 20))],
            [rng.randrange(0, 512) for _ in range(rng.randint(1, 24))],
        )

    return [[item() for _ in range(rng.randint(1, 6))] for _ in range(n)]


def test_reference_merged_equals_alone(ref_engine):
    eng, metrics = ref_engine
    reqs = _requests(0, 12)
    alone = [asyncio.run(eng.logprobs(r)) for r in reqs]  # one at a time: nothing to merge with

    async def together():
        return await asyncio.gather(*(eng.logprobs(r) for r in reqs))

    merged = asyncio.run(together())
    assert _merged_max(metrics, "rlhf_merged_requests") > 1  # requests were merged
    for req, (lp_a, t_a), (lp_m, t_m) in zip(reqs, alone, merged, strict=True):
        assert t_a == t_m
        assert len(lp_m) == len(req)
        for it, a, m in zip(req, lp_a, lp_m, strict=True):
            assert len(m) == len(it.response_ids)
            assert m == pytest.approx(a, abs=1e-5)


def test_reference_temperatures_are_not_mixed(ref_engine):
    eng, _ = ref_engine
    reqs = _requests(1, 6)
    temps = [0.5, 1.0, 2.0, 0.5, 1.0, 2.0]
    alone = [asyncio.run(eng.logprobs(r, t))[0] for r, t in zip(reqs, temps, strict=True)]

    async def together():
        return await asyncio.gather(*(eng.logprobs(r, t) for r, t in zip(reqs, temps, strict=True)))

    for (lp, t_used), t, a in zip(asyncio.run(together()), temps, alone, strict=True):
        assert t_used == t
        for x, y in zip(lp, a, strict=True):
            assert x == pytest.approx(y, abs=1e-5)


def test_reference_bad_request_does_not_affect_others(ref_engine):
    eng, _ = ref_engine
    good = _requests(2, 4)
    bad = [LogProbsItem([5], [6, 99999])]

    async def together():
        return await asyncio.gather(*(eng.logprobs(r) for r in [*good[:2], bad, *good[2:]]), return_exceptions=True)

    out = asyncio.run(together())
    assert isinstance(out[2], InvalidArgument) and out[2].field == "items[0].response_ids[1]"
    for r, o in zip(good, [*out[:2], *out[3:]], strict=True):
        for x, y in zip(o[0], asyncio.run(eng.logprobs(r))[0], strict=True):
            assert x == pytest.approx(y, abs=1e-5)


def test_reward_model_merged_equals_alone(tiny_models):
    cfg = parse_config(
        {
            "reward": {
                "micro_batch_size": 4,
                "scorers": [
                    {"type": "model", "load": "tiny:reward"},
                    {"type": "rule", "name": "math_answer", "weight": 0.5},
                ],
            }
        }
    )
    metrics = ServiceMetrics("reward")
    eng = RewardEngine(cfg, device="cpu", metrics=metrics)
    eng.load()
    rng = random.Random(3)
    words = ["two", "plus", "is", "4", "the", "answer", "\\boxed{7}", "seven", "hello"]

    def req():
        return [
            Item(
                prompt=" ".join(rng.choices(words, k=rng.randint(1, 12))),
                response=" ".join(rng.choices(words, k=rng.randint(1, 30))),
                label="7",
            )
            for _ in range(rng.randint(1, 5))
        ]

    reqs = [req() for _ in range(10)]
    alone = [[o.score for o in asyncio.run(eng.score(r))] for r in reqs]

    async def together():
        return await asyncio.gather(*(eng.score(r) for r in reqs))

    merged = asyncio.run(together())
    assert _merged_max(metrics, "rlhf_merged_requests") > 1
    for a, m in zip(alone, merged, strict=True):
        assert all(o.status == "ok" for o in m)
        assert [o.score for o in m] == pytest.approx(a, abs=1e-5)
    # one tokenizer call for a request's texts gives the ids of one call per text
    model = eng.scorers[0]
    for r in reqs:
        for it in r:
            assert it.cache[f"ids:{model.name}"] == model._encode(it)


def test_big_requests_validate_off_the_loop_with_the_same_results(ref_engine, tiny_models, monkeypatch):
    """Validation (and the reward model's tokenising) of big requests runs in a worker thread: same results, same
    errors naming the field (forced here by a threshold of 0)."""
    eng, _ = ref_engine
    reqs = _requests(4, 3)
    inline = [asyncio.run(eng.logprobs(r))[0] for r in reqs]
    monkeypatch.setattr(ref_mod, "OFFLOAD_IDS", 0)
    for r, a in zip(reqs, inline, strict=True):
        for x, y in zip(asyncio.run(eng.logprobs(r))[0], a, strict=True):
            assert x == pytest.approx(y, abs=1e-5)
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(eng.logprobs([LogProbsItem([5], [6, 99999])]))
    assert err.value.field == "items[0].response_ids[1]"

    cfg = parse_config({"reward": {"scorers": [{"type": "model", "load": "tiny:reward"}]}})
    rew = RewardEngine(cfg, device="cpu")
    rew.load()
    items = [Item(prompt="what is 2 plus 2?", response="4"), Item(prompt="name a colour", response="blue")]
    want = [o.score for o in asyncio.run(rew.score([Item(it.prompt, it.response) for it in items]))]
    monkeypatch.setattr(rew_mod, "OFFLOAD_CHARS", 0)
    assert [o.score for o in asyncio.run(rew.score(items))] == pytest.approx(want, abs=1e-6)
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(rew.score([Item(prompt="hi", response="x"), Item(prompt="", response="y")]))
    assert err.value.field == "items[1].prompt"
