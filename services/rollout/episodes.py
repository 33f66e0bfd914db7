"""Episodes: a rollout replica's model turns alternating with an environment's steps (multi-turn prompt jobs).

One episode per sample, token in, token out: the engine generates from the ids so far, the turn's text goes to the
environment's ``step``, and the messages it answers are rendered with the chat template and appended (context, never
actions: ``loss_mask`` false, sampling log-probs 0), until ``done``, ``max_turns`` or the token budget.

Design (the record, how environment tokens are made, failures): docs/environments.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf.environments.base import EnvironmentFailure, Message
from rlhf.environments.tokens import encode, environment_tokens, render
from rlhf.serving.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from services.rollout.engine_types import RolloutEngine
    from services.rollout.options import SamplingOptions

log = logging.getLogger("rlhf.rollout.episodes")


class EpisodeLost(Exception):
    """The environment service no longer knows the episode (it restarted): play it again from its start."""


class EnvironmentUnreachable(Exception):
    """The environment service cannot be reached (or refuses the request itself: a wrong token, an environment it
    does not host): the job fails and stays pending, re-run later or dead-lettered after its deliveries."""


@dataclass
class EpisodeResult:
    """One played episode, as a :class:`~rlhf.v1.experience_pb2.Sample` records it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)  # None: the engine reported none
    turn_versions: list[int] = field(default_factory=list)  # each model turn's oldest token's version
    # (first response index, version) of each stretch of one version over the whole response, each model token at
    # the version that sampled it (a turn a push stopped and resumed has several), environment tokens at the
    # version of the model token before them (they are never trained: the trainer only needs a version there that
    # is not older than the record's oldest trained token's); empty until the first model token
    spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    ended_by: str = ""
    finish_reason: str = "stop"  # of the last model turn
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the environment failed: the sample is an error, not a score

    @property
    def score(self) -> float:
        return float(sum(self.turn_rewards))


async def play(
    engine: RolloutEngine,
    env: Any,
    *,
    episode_id: str,
    environment: str,
    prompt: list[Message],
    label: str | None,
    info: dict[str, str],
    seed: int | None,
    opts: SamplingOptions,
    sample_index: int = 0,
    max_turns: int,
    max_tokens: int | None,
) -> EpisodeResult:
    """Play one episode against ``env`` (an :class:`~rlhf.environments.client.EnvironmentClient`). Raises
    :class:`EpisodeLost`, :class:`EnvironmentUnreachable` or (the environment refused the job's label, prompt...)
    :class:`~rlhf.serving.errors.InvalidArgument`; any other environment failure is in ``error``."""
    tok = engine.tokenizer
    try:
        opening = await env.reset(episode_id, environment, prompt, label, info, seed)
    except EnvironmentFailure as err:
        _raise_for_transport(err)
        return EpisodeResult(prompt_ids=encode(tok, render(tok, prompt, None, True)), error=f"reset: {err}")
    messages: list[Message] = list(opening.messages)
    tools = list(opening.tools) or None
    r = EpisodeResult(prompt_ids=encode(tok, render(tok, messages, tools, True)))
    counts: dict[str, float] = defaultdict(float)
    budget = max_tokens if max_tokens is not None else opts.max_tokens * max_turns
    try:
        for turn in range(max_turns):
            left = budget - len(r.response_ids)
            if left <= 0:
                r.ended_by = "max_tokens"
                break
            # one sample per episode: a job's seed (if any) must give each sample and turn its own stream
            seed_t = None if opts.seed is None else opts.seed + 7919 * sample_index + turn
            turn_opts = dataclasses.replace(opts, n=1, max_tokens=min(opts.max_tokens, left), seed=seed_t)
            (out,) = await engine.generate([r.prompt_ids + r.response_ids], turn_opts)
            s = out.samples[0]
            ids = list(s.token_ids)
            _add_spans(r, s.spans or [(0, s.policy_version)], len(ids))
            r.response_ids += ids
            r.loss_mask += [True] * len(ids)
            if r.logprobs is not None and len(s.logprobs) == len(ids):
                r.logprobs += list(s.logprobs)
            else:
                r.logprobs = None
            r.turn_versions.append(s.policy_version)
            r.finish_reason = s.finish_reason
            counts["turns"] += 1
            if s.finish_reason == "length" and len(r.response_ids) >= budget:
                r.ended_by = "max_tokens"  # cut mid-turn: not an answer the environment should judge
                break
            text = s.text or tok.decode(ids, skip_special_tokens=True)
            try:
                outcome = await env.step(episode_id, text)
            except EnvironmentFailure as err:
                _raise_for_transport(err)
                r.error = f"step {turn + 1}: {err}"
                break
            r.turn_rewards.append(float(outcome.reward))
            for k, v in outcome.metrics.items():
                counts[k] += float(v)
            if outcome.done:
                r.ended_by = "done"
                break
            if turn == max_turns - 1:
                r.ended_by = "max_turns"
                break
            env_ids = environment_tokens(tok, messages, tools, ids, list(outcome.messages))
            messages += [{"role": "assistant", "content": text}, *outcome.messages]
            r.response_ids += env_ids
            r.loss_mask += [False] * len(env_ids)
            if r.logprobs is not None:
                r.logprobs += [0.0] * len(env_ids)
    except EnvironmentFailure as err:  # the template could not take the environment's answer
        r.error = str(err)
    finally:
        with contextlib.suppress(Exception):  # best effort: the service expires episodes it is not told about
            await env.close(episode_id)
    r.metrics = dict(counts)
    return r


def _add_spans(r: EpisodeResult, spans: list[tuple[int, int]], n: int) -> None:
    """Extend ``r.spans`` with a model turn of ``n`` tokens starting at ``len(r.response_ids)`` and its own spans
    (starts relative to the turn). A turn without tokens adds nothing; the first span always starts at 0 (any
    environment tokens before the first model token take its version)."""
    at = len(r.response_ids)
    for start, version in spans:
        if start >= n:
            break
        if not r.spans:
            r.spans.append((0, version))
        elif r.spans[-1][1] != version:
            r.spans.append((at + start, version))


# Reset fields that come from the prompt job: the environment refusing one refuses the job, which no replay fixes.
_JOB_FIELDS = ("label", "prompt", "info", "seed")


def _raise_for_transport(err: EnvironmentFailure) -> None:
    """Failures that are the service's (lost episode, unreachable) or the job's (the environment refused its input:
    InvalidArgument, which dead-letters the job at once) rather than the environment's."""
    kind = getattr(err, "kind", "failed")
    if kind == "episode_lost":
        raise EpisodeLost(str(err)) from err
    blamed = getattr(err, "field", "")
    if getattr(err, "code", "") == "INVALID_ARGUMENT" and re.split(r"[\[.]", blamed)[0] in _JOB_FIELDS:
        raise InvalidArgument(f"the environment refused the job's {blamed}: {err}", blamed) from err
    if kind in ("unavailable", "invalid"):  # unreachable, or a request no retry of the episode fixes
        raise EnvironmentUnreachable(str(err)) from err
