"""A data row's own length cap (data.map_keys.max_tokens) becomes its prompt job's max_tokens (bench.long_tail's
long-tailed workload); rows without one get actor_rollout.max_new_tokens; a cap above it is refused."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from rlhf.config import ConfigError, parse_config
from rlhf.models import load_tokenizer
from services.trainer.publisher import Publisher


def _config(tiny_models, data, max_new_tokens=32):
    return parse_config(
        {
            "actor_rollout_ref": {
                "actor_rollout": {"load": str(tiny_models.policy), "max_new_tokens": max_new_tokens, "engine": "hf"}
            },
            "data": {"path": str(data), "shuffle": False, "map_keys": {"prompt": "prompt", "max_tokens": "n"}},
        }
    )


def test_each_job_carries_its_rows_length_cap(tmp_path, tiny_models, redis_server):
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "n": n}) + "\n" for i, n in enumerate([3, 32, 7])))
    tok = load_tokenizer(tiny_models.policy)
    redis = aioredis.from_url(redis_server.url)
    try:
        pub = Publisher(_config(tiny_models, data), "run", redis, tok, asyncio.Event())
        assert [pub._job(0).params.max_tokens for _ in range(3)] == [3, 32, 7]
        plain = tmp_path / "plain.jsonl"
        plain.write_text(json.dumps({"prompt": "p"}) + "\n")
        cfg = _config(tiny_models, plain)
        cfg.data.map_keys.pop("max_tokens")
        assert Publisher(cfg, "run", redis, tok, asyncio.Event())._job(0).params.max_tokens == 32
        with pytest.raises(ConfigError, match=r"data.map_keys.max_tokens: row 1 .* 32 new tokens, more than .*\(16\)"):
            Publisher(_config(tiny_models, data, max_new_tokens=16), "run", redis, tok, asyncio.Event())
    finally:
        asyncio.run(redis.aclose())
