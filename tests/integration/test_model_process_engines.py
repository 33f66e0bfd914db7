"""The reference and reward engines with RLHF_MODEL_PROCESS (the model in a child process, tiny models): the same
results as the model in the service's process, bit for bit (log-probs and scores cross as float32, as computed),
merged or alone, at several temperatures; requests the parent refuses never reach the child; close() ends it."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from rlhf.config import parse_config
from rlhf.serving import InvalidArgument
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.reward.engine import RewardEngine
from services.reward.scorers import Item


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # reaped or a zombie: gone either way
        return f.read().split(")")[-1].split()[0] != "Z"


def test_reference_in_a_model_process_equals_in_process(tiny_models):
    cfg = parse_config(
        {"actor_rollout_ref": {"actor_rollout": {"load": "tiny:policy"}, "ref": {"micro_batch_size": 4}}}
    )
    here, there = ReferenceEngine(cfg, device="cpu"), ReferenceEngine(cfg, device="cpu", model_process=True, threads=1)
    here.load()
    there.load()
    pid = there._proc.pid
    assert there.model is None and _alive(pid)  # the model lives in the child only
    assert there.loaded["torch_threads"] == 1  # RLHF_MODEL_THREADS reaches the child
    assert there._batcher.regather_s == 0 < here._batcher.regather_s  # the child computes while the loop works
    assert {k: there.loaded[k] for k in ("pad_token_id", "vocab_size", "max_len")} == {
        "pad_token_id": here.pad_token_id,
        "vocab_size": here.vocab_size,
        "max_len": here.max_len,
    }
    rng = random.Random(5)
    reqs = [
        [
            LogProbsItem(
                [rng.randrange(0, 512) for _ in range(rng.randint(1, 20))],
                [rng.randrange(0, 512) for _ in range(rng.randint(1, 24))],
            )
            for _ in range(rng.randint(1, 6))
        ]
        for _ in range(10)
    ]
    temps = [None, 0.7, 1.0, 2.0, None] * 2

    async def together(eng):
        return await asyncio.gather(*(eng.logprobs(r, t) for r, t in zip(reqs, temps, strict=True)))

    assert asyncio.run(together(there)) == asyncio.run(together(here))
    assert asyncio.run(there.logprobs(reqs[0])) == asyncio.run(here.logprobs(reqs[0]))
    with pytest.raises(InvalidArgument) as err:  # validated in the parent, as before
        asyncio.run(there.logprobs([LogProbsItem([5], [6, 99999])]))
    assert err.value.field == "items[0].response_ids[1]"
    asyncio.run(there.close())
    assert not _alive(pid)


def test_reward_model_in_a_model_process_equals_in_process(tiny_models):
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
    here, there = RewardEngine(cfg, device="cpu"), RewardEngine(cfg, device="cpu", model_process=True, threads=2)
    here.load()
    there.load()
    model = there.scorers[0]
    pid = model._proc.pid
    assert model.model is None and _alive(pid)
    assert model.loaded["torch_threads"] == 2
    assert model._batcher.regather_s == 0 < here.scorers[0]._batcher.regather_s
    assert (model.max_len, model.vocab) == (here.scorers[0].max_len, here.scorers[0].vocab)
    rng = random.Random(6)
    words = ["two", "plus", "is", "4", "the", "answer", "\\boxed{7}", "seven", "hello"]
    reqs = [
        [
            Item(
                prompt=" ".join(rng.choices(words, k=rng.randint(1, 12))),
                response=" ".join(rng.choices(words, k=rng.randint(1, 30))),
                label="7",
            )
            for _ in range(rng.randint(1, 5))
        ]
        for _ in range(8)
    ]

    async def together(eng):
        out = await asyncio.gather(*(eng.score([Item(it.prompt, it.response, it.label) for it in r]) for r in reqs))
        return [[(o.score, o.status, o.components) for o in req] for req in out]

    want = asyncio.run(together(here))
    assert all(s == "ok" for req in want for _, s, _ in req)
    assert asyncio.run(together(there)) == want
    asyncio.run(there.close())
    assert not _alive(pid)
