"""The reward service's state: the scorers of ``reward.scorers`` (:mod:`services.reward.scorers`), combined by
weight, behind the request limits. Every item gets a score or an error status, never a score of 0 for a failure."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from rlhf.config import ConfigError, ExperimentConfig
from rlhf.serving import InvalidArgument, NotReady, ServiceMetrics
from services.reward import rules
from services.reward.http_scorers import JudgeScorer, RemoteScorer
from services.reward.scorers import (
    INVALID_INPUT,
    OK,
    SCORER_ERROR,
    TIMEOUT,
    Failure,
    Item,
    ModelScorer,
    RuleScorer,
    ScoreOutcome,
    Scorer,
)

log = logging.getLogger("rlhf.reward")

# When several scorers fail for one item, the item reports the most telling status.
_SEVERITY = {OK: 0, TIMEOUT: 1, SCORER_ERROR: 2, INVALID_INPUT: 3}
MAX_ITEMS = 4096
MAX_TEXT_CHARS = 1_000_000
MAX_IDS = 131_072
# Requests with more text than this are validated (chat template + tokeniser) in a worker thread, not on the loop.
OFFLOAD_CHARS = 1 << 16


class RewardEngine:
    """Scores batches of (prompt, response[, label]) with the configured scorers."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        device: str | None = None,
        metrics: ServiceMetrics | None = None,
        max_items: int = MAX_ITEMS,
        max_text_chars: int = MAX_TEXT_CHARS,
        model_process: bool = False,
        threads: int | None = None,
    ):
        self.cfg = cfg
        self.metrics = metrics
        self.max_items = max_items
        self.max_text_chars = max_text_chars
        self.device = device or "auto"
        self._policy_tokenizer = None
        self._tokenizer_error = ""
        self._tok_lock = threading.Lock()
        self.scorers: list[Scorer] = []
        seen: dict[str, int] = {}
        for i, sc in enumerate(cfg.reward.scorers):
            base = {
                "rule": (sc.name or "rule").rsplit(":", 1)[-1],
                "model": "model",
                "remote": "remote",
                "judge": "judge",
            }[sc.type]
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}#{seen[base]}"
            try:
                if sc.type == "rule":
                    self.scorers.append(RuleScorer(sc, name, count_tokens=self.count_policy_tokens))
                elif sc.type == "model":
                    t = cfg.training
                    scorer = ModelScorer(
                        sc,
                        name,
                        self.device,
                        cfg.reward.micro_batch_size,
                        metrics,
                        t.padding_free,
                        cfg.reward.bf16,
                        model_process,
                        threads,
                        cfg.reward.seq_length,
                    )
                    self.scorers.append(scorer)
                elif sc.type == "judge":
                    self.scorers.append(JudgeScorer(sc, name))
                else:
                    self.scorers.append(RemoteScorer(sc, name))
            except ValueError as err:
                raise ConfigError(f"reward.scorers[{i}]: {err}") from None
        if not self.scorers:
            raise ConfigError("reward.scorers is empty: configure at least one scorer")
        self.ready = False

    # -- life cycle

    def load(self) -> None:
        for s in self.scorers:
            s.load()
        if any(isinstance(s, RuleScorer) and s.wants_sample for s in self.scorers):
            try:  # load the policy tokenizer now rather than inside the first request
                self.count_policy_tokens("warm up")
            except Exception as err:  # noqa: BLE001 - rules then need response_ids (or another unit)
                log.warning("no policy tokenizer for token-counting rules (%s); send response_ids", err)
        self.ready = True

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    async def close(self) -> None:
        for s in self.scorers:
            await s.close()

    def count_policy_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the policy's tokenizer (what rollout response_ids count)."""
        if self._policy_tokenizer is None:
            with self._tok_lock:
                if self._policy_tokenizer is None:
                    if self._tokenizer_error:
                        raise rules.RuleInputError(self._tokenizer_error)
                    from rlhf.models import load_tokenizer, resolve_model_path  # noqa: PLC0415 - loads torch; a model process keeps it out of here

                    src = self.cfg.training.tokenizer_name_or_path or self.cfg.actor.load
                    try:
                        self._policy_tokenizer = load_tokenizer(resolve_model_path(src))
                    except Exception as err:  # noqa: BLE001 - remembered: not retried per request
                        self._tokenizer_error = (
                            f"cannot load the policy tokenizer {src!r} to count tokens ({err}); send response_ids"
                        )
                        raise rules.RuleInputError(self._tokenizer_error) from None
        return len(self._policy_tokenizer(text, add_special_tokens=False)["input_ids"])

    def describe(self) -> list[dict[str, Any]]:
        return [s.describe() for s in self.scorers]

    # -- scoring

    def validate(self, items: list[Item]) -> None:
        if not items:
            raise InvalidArgument("items is empty: send at least one {prompt, response} item", "items")
        if len(items) > self.max_items:
            raise InvalidArgument(f"items has {len(items)} entries; send at most {self.max_items} per request", "items")
        for i, it in enumerate(items):
            if not it.prompt and not it.prompt_ids:
                raise InvalidArgument(
                    f"items[{i}].prompt is empty: send the prompt text (or prompt_ids)", f"items[{i}].prompt"
                )
            for fname in ("prompt", "response", "label"):
                v = getattr(it, fname)
                if v is not None and len(v) > self.max_text_chars:
                    raise InvalidArgument(
                        f"items[{i}].{fname} is {len(v)} characters; the limit is {self.max_text_chars}: shorten it",
                        f"items[{i}].{fname}",
                    )
            for fname in ("prompt_ids", "response_ids"):
                ids = getattr(it, fname)
                if len(ids) > MAX_IDS:
                    raise InvalidArgument(
                        f"items[{i}].{fname} has {len(ids)} ids; the limit is {MAX_IDS}", f"items[{i}].{fname}"
                    )
                neg = next((t for t in ids if t < 0), None) if ids and min(ids) < 0 else None
                if neg is not None:
                    raise InvalidArgument(
                        f"items[{i}].{fname} contains {neg}: token ids are >= 0", f"items[{i}].{fname}"
                    )
        for s in self.scorers:
            s.validate(items)

    async def score(self, items: list[Item]) -> list[ScoreOutcome]:
        if not self.ready:
            raise NotReady("the reward service is still loading its scorers; retry when /readyz answers 200")
        if sum(len(it.prompt) + len(it.response) for it in items) > OFFLOAD_CHARS:
            await asyncio.to_thread(self.validate, items)  # templating + tokenising: ms of CPU, off the event loop
        else:
            self.validate(items)  # a few short texts: less work than the thread hop
        per_scorer = await asyncio.gather(*(s.score(items) for s in self.scorers))
        outcomes = []
        for i in range(len(items)):
            comps: dict[str, float] = {}
            total = 0.0
            worst: Failure | None = None
            failed_by = ""
            for s, results in zip(self.scorers, per_scorer, strict=True):
                r = results[i]
                if isinstance(r, Failure):
                    if worst is None or _SEVERITY[r.status] > _SEVERITY[worst.status]:
                        worst, failed_by = r, s.name
                    continue
                comps[s.name] = r
                total += s.weight * r
            if worst is not None:
                outcomes.append(ScoreOutcome(None, worst.status, worst.message, comps, failed_by))
            else:
                outcomes.append(ScoreOutcome(total, OK, "", comps))
        if self.metrics is not None:
            for o in outcomes:
                if o.status != OK:
                    self.metrics.count_error(o.status)
        return outcomes
