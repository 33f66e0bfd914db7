"""One prompt job -> one experience record: :class:`JobRunner`, built by :class:`services.rollout.worker.RolloutWorker`.

Single-turn (:meth:`JobRunner.process`): generate ``job.params.n`` samples with the weights served now, then call
``RewardService.Score`` and ``ReferenceService.LogProbs`` concurrently (a deadline per call, a few retries of
UNAVAILABLE / DEADLINE_EXCEEDED with backoff: :meth:`JobRunner._call`). Multi-turn (:meth:`process_episodes`):
episodes against the environment service named in the job's metadata (:mod:`services.rollout.episodes`). A failure
raises :class:`JobFailed`, and the worker leaves the job pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from rlhf.environments.base import EPISODE_ENVIRONMENT_KEY, EPISODE_MAX_TOKENS_KEY, EPISODE_MAX_TURNS_KEY
from rlhf.retry import retry
from rlhf.serving.errors import InvalidArgument
from rlhf.v1 import common_pb2, experience_pb2, reference_pb2, reward_pb2
from services.rollout import episodes
from services.rollout.engine import version_span_fields
from services.rollout.options import SamplingOptions, finish_reason_proto, options_from_proto

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.environments.client import EnvironmentClient
    from rlhf.serving import ServiceMetrics
    from rlhf.v1.reference_pb2_grpc import ReferenceServiceStub
    from rlhf.v1.reward_pb2_grpc import RewardServiceStub
    from services.rollout.engine_types import RolloutEngine, Sample

log = logging.getLogger("rlhf.rollout.worker")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def sample_record(
    s: Sample, text: str, score: reward_pb2.ScoreResult, ref_logprobs: Sequence[float]
) -> experience_pb2.Sample:
    """A single-turn sample's record: the engine's tokens, log-probs, finish, version (and version spans, when a
    swap split it), the reward's score, the reference's log-probs."""
    return experience_pb2.Sample(
        response_ids=s.token_ids,
        sampling_logprobs=s.logprobs,
        ref_logprobs=ref_logprobs,
        score=score.score,  # meaningful only with score_status OK (the trainer checks)
        score_status=score.status,
        score_error=score.error,
        score_components=dict(score.components),
        finish_reason=finish_reason_proto(s.finish_reason),
        policy_version=s.policy_version,
        response_text=text,
        **version_span_fields(s.spans),
    )


def episode_record(
    r: episodes.EpisodeResult, ref_logprobs: Sequence[float], environment: str, *, text: str, version: int
) -> experience_pb2.Sample:
    """An episode's record: every turn's tokens (``text``: their decoded text), the loss mask, each model turn's
    version and reward, and the version spans over the whole response (none when one version sampled every model
    token, so such a record is byte for byte what it was before episodes had spans); ``policy_version`` is the
    oldest model token's (``version``, the version served now, when the episode has none). A failed episode (an
    error, or no model tokens) is a scorer error."""
    failed = r.error is not None or not r.response_ids
    oldest = r.turn_versions[0] if r.turn_versions else version
    if r.spans:
        oldest = min(v for _, v in r.spans)
    return experience_pb2.Sample(
        response_ids=r.response_ids,
        sampling_logprobs=r.logprobs or [],
        ref_logprobs=ref_logprobs,
        score=0.0 if failed else r.score,  # meaningful only with score_status OK (the trainer checks)
        score_status=common_pb2.ITEM_STATUS_SCORER_ERROR if failed else common_pb2.ITEM_STATUS_OK,
        score_error=f"environment {environment!r}: {r.error or 'no model tokens'}" if failed else "",
        score_components={} if failed else {"environment": r.score},
        finish_reason=finish_reason_proto(r.finish_reason),
        policy_version=oldest,
        response_text=text,
        loss_mask=r.loss_mask,
        turn_policy_versions=r.turn_versions,
        turn_rewards=r.turn_rewards,
        ended_by=r.ended_by or ("error" if failed else ""),
        episode_metrics=r.metrics,
        **version_span_fields(r.spans),
    )


class JobFailed(Exception):
    """A job could not be completed now; ``kind`` labels the failure (metrics). The job stays pending."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class JobSettings:
    """What every job of one replica runs with (the :class:`~services.rollout.worker.RolloutWorker` arguments of the
    same names)."""

    replica_id: str
    run_id: str  # the Experience's run when its job names none
    defaults: Mapping[str, Any]  # sampling values for fields a job leaves unset (from the experiment config)
    ref_temperature: float | None  # None: the sampling temperature (ExperimentConfig.logprob_temperature)
    rpc_timeout_s: float  # deadline of one reward / reference call
    rpc_retries: int
    rpc_backoff_s: float
    episode_attempts: int  # plays of one episode whose environment service lost it


@dataclass(frozen=True)
class _EpisodeSpec:
    """What every episode of one multi-turn job plays with, from the job and its metadata."""

    opts: SamplingOptions
    prompt: list[dict[str, str]]  # chat messages: the metadata's system prompt, if any, then the job's prompt
    info: dict[str, str]  # the job's metadata but the episode.* keys, for the environment
    max_turns: int
    max_tokens: int | None
    seed: int
    label: str | None

    @classmethod
    def of(cls, job: experience_pb2.PromptJob, opts: SamplingOptions) -> _EpisodeSpec:
        meta = dict(job.metadata)
        system = [{"role": "system", "content": meta["system"]}] if meta.get("system") else []
        return cls(
            opts=opts,
            prompt=[*system, {"role": "user", "content": job.prompt_text}],
            info={k: v for k, v in meta.items() if not k.startswith("episode.")},
            max_turns=int(meta.get(EPISODE_MAX_TURNS_KEY, "4")),
            max_tokens=int(meta[EPISODE_MAX_TOKENS_KEY]) if meta.get(EPISODE_MAX_TOKENS_KEY) else None,
            # every sample of a job opens the same episode (one prompt, a group of answers): one seed per data row
            seed=(job.data_index * 1_000_003 + job.epoch) % (2**31),
            label=job.label if job.HasField("label") else None,
        )


class JobRunner:
    """One prompt job -> one Experience: samples from ``engine``, scores from ``reward``, reference log-probs from
    ``reference``, multi-turn episodes against ``environment`` (None: this replica refuses episode jobs).
    ``count_failure(kind)`` counts a failure that does not fail the job (the worker's stats and metrics)."""

    def __init__(
        self,
        engine: RolloutEngine,
        reward: RewardServiceStub,
        reference: ReferenceServiceStub,
        environment: EnvironmentClient | None,
        settings: JobSettings,
        *,
        count_failure: Callable[[str], None],
        metrics: ServiceMetrics | None = None,
    ):
        self.engine = engine
        self.reward = reward
        self.reference = reference
        self.environment = environment
        self.settings = settings
        self.metrics = metrics
        self._count_failure = count_failure

    def sampling_options(self, p: common_pb2.SamplingParams) -> SamplingOptions:
        return options_from_proto(p, self.settings.defaults)

    async def process(self, job: experience_pb2.PromptJob) -> experience_pb2.Experience:
        """Generate, score and get reference log-probs for one job; returns its Experience (not yet written)."""
        environment = job.metadata.get(EPISODE_ENVIRONMENT_KEY)
        if environment:
            return await self.process_episodes(job, environment)
        tok = self.engine.tokenizer
        prompt_ids = list(job.prompt_ids)
        if not prompt_ids:
            (prompt_ids,) = await self.engine.encode_texts([job.prompt_text])
        prompt_text = job.prompt_text or tok.decode(prompt_ids, skip_special_tokens=True)
        opts = self.sampling_options(job.params)
        (result,) = await self.engine.generate([prompt_ids], opts)
        samples = result.samples
        texts = [s.text or tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        label = job.label if job.HasField("label") else None

        score_req = reward_pb2.ScoreRequest(
            items=[
                reward_pb2.ScoreItem(
                    prompt=prompt_text,
                    response=text,
                    label=label,
                    prompt_ids=prompt_ids,
                    response_ids=s.token_ids,
                    finished=s.finish_reason == "stop",
                )
                for s, text in zip(samples, texts, strict=True)
            ]
        )
        ref_req = reference_pb2.LogProbsRequest(
            items=[reference_pb2.LogProbsItem(prompt_ids=prompt_ids, response_ids=s.token_ids) for s in samples]
        )
        ref_req.temperature = self._ref_temperature_for(opts)
        scores, refs = await asyncio.gather(
            self._call("reward", self.reward.Score, score_req),
            self._call("reference", self.reference.LogProbs, ref_req),
        )
        if len(scores.results) != len(samples) or len(refs.results) != len(samples):
            raise JobFailed(
                "bad_response",
                f"{len(samples)} samples, {len(scores.results)} scores, {len(refs.results)} reference results",
            )

        exp = self._experience(job, prompt_ids, prompt_text, label)
        for s, text, sc, ref in zip(samples, texts, scores.results, refs.results, strict=True):
            if len(ref.logprobs) != len(s.token_ids):
                raise JobFailed(
                    "bad_response",
                    f"reference gave {len(ref.logprobs)} log-probs for {len(s.token_ids)} response tokens",
                )
            exp.samples.append(sample_record(s, text, sc, ref.logprobs))
            if sc.status != common_pb2.ITEM_STATUS_OK and self.metrics is not None:
                self.metrics.count_error("rollout_score_item_not_ok")
        return exp

    def _ref_temperature_for(self, opts: SamplingOptions) -> float:
        """The temperature the sampling log-probs are at (greedy ones are at 1.0), so the two line up; online DPO's
        reference log-probs are at 1.0 whatever the sampling temperature (TRL), as the trainer's are."""
        if self.settings.ref_temperature is not None:
            return self.settings.ref_temperature
        return 1.0 if opts.greedy else opts.temperature

    async def process_episodes(self, job: experience_pb2.PromptJob, environment: str) -> experience_pb2.Experience:
        """A multi-turn job: ``n`` episodes against the environment service (:mod:`services.rollout.episodes`),
        their reference log-probs, one Experience. The environment's rewards are the samples' scores."""
        if self.environment is None:
            raise InvalidArgument(
                f"job {job.job_id} is an episode of environment {environment!r}, but this replica has no "
                "environment service (RLHF_ENVIRONMENT_ADDR)"
            )
        spec = _EpisodeSpec.of(job, self.sampling_options(job.params))
        results = await asyncio.gather(*(self._play(job, environment, spec, i) for i in range(spec.opts.n)))
        first = next((r for r in results if r.error is None), results[0])
        for r in results:  # the group shares one prompt: an environment must open a seeded episode the same way
            if r.error is None and r.prompt_ids != first.prompt_ids:
                r.error = "the environment opened this episode differently from the job's other samples"
        ref_of = await self._episode_ref_logprobs(results, spec.opts)
        exp = self._experience(job, first.prompt_ids, job.prompt_text, spec.label)
        for r in results:
            exp.samples.append(self._episode_sample(r, ref_of.get(id(r), []), environment))
        return exp

    async def _play(
        self, job: experience_pb2.PromptJob, environment: str, spec: _EpisodeSpec, i: int
    ) -> episodes.EpisodeResult:
        """Sample ``i`` of ``job``: one episode, played again (up to ``episode_attempts`` times) when the environment
        service lost it; an environment service that cannot be reached fails the job."""
        assert self.environment is not None
        for attempt in range(self.settings.episode_attempts):
            try:
                return await episodes.play(
                    self.engine,
                    self.environment,
                    episode_id=f"{job.job_id}/{i}/{attempt}",
                    environment=environment,
                    prompt=spec.prompt,
                    label=spec.label,
                    info=spec.info,
                    seed=spec.seed,
                    opts=spec.opts,
                    sample_index=i,
                    max_turns=spec.max_turns,
                    max_tokens=spec.max_tokens,
                )
            except episodes.EpisodeLost as err:
                self._count_failure("environment_episode_lost")
                log.info("%s: job %s sample %d: %s; playing it again", self.settings.replica_id, job.job_id, i, err)
            except episodes.EnvironmentUnreachable as err:
                raise JobFailed("environment_unavailable", f"environment service: {err}") from None
        raise JobFailed(
            "environment_episode_lost",
            f"the environment service lost the episode {self.settings.episode_attempts} times",
        )

    async def _episode_ref_logprobs(
        self, results: list[episodes.EpisodeResult], opts: SamplingOptions
    ) -> dict[int, list[float]]:
        """The reference log-probs of the episodes that played without error and produced model tokens, by
        ``id(result)`` (one reference call for them all; none when there are none)."""
        ok = [r for r in results if r.error is None and r.response_ids]
        if not ok:
            return {}
        ref_req = reference_pb2.LogProbsRequest(
            items=[reference_pb2.LogProbsItem(prompt_ids=r.prompt_ids, response_ids=r.response_ids) for r in ok],
            temperature=self._ref_temperature_for(opts),
        )
        refs = list((await self._call("reference", self.reference.LogProbs, ref_req)).results)
        if len(refs) != len(ok) or any(len(x.logprobs) != len(r.response_ids) for x, r in zip(refs, ok, strict=False)):
            raise JobFailed("bad_response", "reference log-probs do not match the episodes' tokens")
        return {id(r): list(x.logprobs) for r, x in zip(ok, refs, strict=True)}

    def _episode_sample(
        self, r: episodes.EpisodeResult, ref_logprobs: list[float], environment: str
    ) -> experience_pb2.Sample:
        """One episode as an experience sample; a failed episode (an error, or no model tokens) is a scorer error."""
        rec = episode_record(
            r,
            ref_logprobs,
            environment,
            text=self.engine.tokenizer.decode(r.response_ids, skip_special_tokens=True),
            version=self.engine.weights_version,
        )
        if rec.score_status != common_pb2.ITEM_STATUS_OK and self.metrics is not None:
            self.metrics.count_error("rollout_environment_failed")
        return rec

    def _experience(
        self, job: experience_pb2.PromptJob, prompt_ids: list[int], prompt_text: str, label: str | None
    ) -> experience_pb2.Experience:
        """The job's Experience, its samples still to add."""
        exp = experience_pb2.Experience(
            job_id=job.job_id,
            run_id=job.run_id or self.settings.run_id,
            data_index=job.data_index,
            epoch=job.epoch,
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            replica_id=self.settings.replica_id,
            created_at_unix_ms=int(time.time() * 1000),
            issued_policy_version=job.issued_policy_version,
        )
        if label is not None:
            exp.label = label
        return exp

    async def _call(self, what: str, method: Any, request: Any) -> Any:
        """One unary call with a deadline; UNAVAILABLE / DEADLINE_EXCEEDED are retried with backoff."""
        try:
            return await retry(
                lambda: method(request, timeout=self.settings.rpc_timeout_s, wait_for_ready=False),
                lambda err: isinstance(err, grpc.aio.AioRpcError) and err.code() in RETRYABLE,
                what=f"{self.settings.replica_id}: {what} call failed",
                log=log,
                attempts=self.settings.rpc_retries + 1,
                initial_s=self.settings.rpc_backoff_s,
                level=logging.INFO,
            )
        except grpc.aio.AioRpcError as err:
            code = err.code()
            raise JobFailed(
                f"{what}_{code.name.lower()}", f"{what} call failed: {code.name}: {err.details()}"
            ) from None
