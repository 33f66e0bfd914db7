"""Experience records as one update takes them: the padded tensors of a batch (:func:`collate` -> ``RolloutBatch``)
and what a batch's records say about their scoring and their replicas (for metrics and stop messages).

No model here: collation needs only the pad id and a device, so a batch can be built, checked and sent to the other
ranks of a trainer group before any forward pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rlhf.v1 import common_pb2, experience_pb2


class NoUsableSamples(ValueError):
    """Every sample of a batch failed scoring (or is empty): the scorers' fault, not the records'."""


@dataclass
class RolloutBatch:
    """Experience records collated into padded tensors. B rows = samples; C prompt width; L response width."""

    query_responses: torch.Tensor  # (B, C + L) left-padded prompt, right-padded response
    responses: torch.Tensor  # (B, L)
    sampling_logprobs: torch.Tensor  # (B, L) 0 on padding
    ref_logprobs: torch.Tensor  # (B, L)
    scores: torch.Tensor  # (B,)
    group: torch.Tensor  # (B,) index of the experience record (prompt) of each row
    policy_versions: torch.Tensor  # (B,) the oldest token's version (staleness counts a sample by it)
    has_sampling_logprobs: torch.Tensor  # (B,) bool: the engine reported sampling log-probs for this row
    context_length: int
    # Episodes (multi-turn): the (B, L) tokens the losses see (the model's own tokens; a single-turn row: every
    # response token), which rows are episodes, and which episodes the environment ended (done: as an EOS ends a
    # single turn). A batch without episodes trains exactly as before (the stages check ``episodes.any()``).
    loss_mask: torch.Tensor | None = None  # (B, L) bool
    episodes: torch.Tensor | None = None  # (B,) bool
    episode_done: torch.Tensor | None = None  # (B,) bool
    # (B, L) the weights version that sampled each response token: the record's version spans (partial rollouts),
    # else its policy_version throughout (padding too)
    token_versions: torch.Tensor | None = None

    # What crosses to the other ranks of a group (group.py): ``responses`` is a view of ``query_responses``.
    WIRE_FIELDS = (
        "query_responses",
        "sampling_logprobs",
        "ref_logprobs",
        "scores",
        "group",
        "policy_versions",
        "has_sampling_logprobs",
        "loss_mask",
        "episodes",
        "episode_done",
        "token_versions",
    )

    def wire_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.WIRE_FIELDS]

    @classmethod
    def from_wire(cls, context_length: int, tensors: list[torch.Tensor]) -> RolloutBatch:
        t = dict(zip(cls.WIRE_FIELDS, tensors, strict=True))
        return cls(responses=t["query_responses"][:, context_length:], context_length=context_length, **t)


def collate(experiences: list[experience_pb2.Experience], pad_id: int, device: torch.device) -> RolloutBatch:
    """Rows for every sample whose score is OK; samples with a failed score are dropped (never scored 0)."""
    rows = []
    for g, exp in enumerate(experiences):
        for s in exp.samples:
            if s.score_status != common_pb2.ITEM_STATUS_OK or len(s.response_ids) == 0:
                continue
            rows.append((g, list(exp.prompt_ids), s))
    if not rows:
        errors = sorted({s.score_error for exp in experiences for s in exp.samples if s.score_error})
        raise NoUsableSamples(
            "no usable sample in this batch (all scores failed or responses empty)"
            + (f"; score errors: {'; '.join(errors[:3])}" if errors else "")
        )
    context_length = max(len(p) for _, p, _ in rows)
    response_length = max(len(s.response_ids) for _, _, s in rows)
    n_rows = len(rows)
    qr = torch.full((n_rows, context_length + response_length), pad_id, dtype=torch.long)
    samp = torch.zeros(n_rows, response_length)
    has_samp = torch.zeros(n_rows, dtype=torch.bool)
    ref = torch.zeros(n_rows, response_length)
    loss_mask = torch.zeros(n_rows, response_length, dtype=torch.bool)
    episodes = torch.zeros(n_rows, dtype=torch.bool)
    done = torch.zeros(n_rows, dtype=torch.bool)
    versions = torch.zeros(n_rows, response_length, dtype=torch.long)
    for i, (_, prompt, s) in enumerate(rows):
        n = len(s.response_ids)
        versions[i] = token_versions(s, response_length, experiences[rows[i][0]].job_id)
        if len(s.loss_mask):
            if len(s.loss_mask) != n:
                raise ValueError(
                    f"job {experiences[rows[i][0]].job_id}: loss_mask has {len(s.loss_mask)} entries for {n} "
                    "response tokens"
                )
            loss_mask[i, :n] = torch.tensor(list(s.loss_mask), dtype=torch.bool)
            episodes[i] = True
            done[i] = s.ended_by == "done"
        else:
            loss_mask[i, :n] = True
        qr[i, context_length - len(prompt) : context_length] = torch.tensor(prompt)
        qr[i, context_length : context_length + n] = torch.tensor(list(s.response_ids))
        if len(s.sampling_logprobs) == n:
            samp[i, :n] = torch.tensor(list(s.sampling_logprobs))
            has_samp[i] = True
        if len(s.ref_logprobs) != n:
            raise ValueError(
                f"job {experiences[rows[i][0]].job_id}: ref_logprobs has {len(s.ref_logprobs)} "
                f"entries for {n} response tokens"
            )
        ref[i, :n] = torch.tensor(list(s.ref_logprobs))
    return RolloutBatch(
        query_responses=qr.to(device),
        responses=qr[:, context_length:].to(device),
        sampling_logprobs=samp.to(device),
        ref_logprobs=ref.to(device),
        scores=torch.tensor([s.score for _, _, s in rows], device=device),
        group=torch.tensor([g for g, _, _ in rows], device=device),
        policy_versions=torch.tensor([s.policy_version for _, _, s in rows]),
        has_sampling_logprobs=has_samp.to(device),
        context_length=context_length,
        loss_mask=loss_mask.to(device),
        episodes=episodes.to(device),
        episode_done=done.to(device),
        token_versions=versions,
    )


def token_versions(s: experience_pb2.Sample, width: int, job_id: str) -> torch.Tensor:
    """(width,) the version that sampled each response token of ``s``, from its version spans (experience.proto
    ``span_starts`` / ``span_versions``; none: ``policy_version`` throughout); positions past the response keep the
    last span's. Spans that do not cover the response in order raise ValueError naming the job."""
    out = torch.full((width,), s.policy_version, dtype=torch.long)
    starts, versions = list(s.span_starts), list(s.span_versions)
    if not starts and not versions:
        return out
    n = len(s.response_ids)
    ordered = all(a < b for a, b in zip(starts, starts[1:], strict=False))
    if len(starts) != len(versions) or starts[0] != 0 or not ordered or starts[-1] >= n:
        raise ValueError(
            f"job {job_id}: version spans {starts} / {versions} do not cover the {n} response tokens in order "
            "(one version per start, the first at 0, starts increasing and inside the response)"
        )
    if s.policy_version != min(versions):
        raise ValueError(
            f"job {job_id}: policy_version {s.policy_version} is not the oldest of the spans' versions {versions}"
        )
    for a, v in zip(starts, versions, strict=True):
        out[a:] = v
    return out


# ------------------------------------------------------------------ what the records say
_SCORER_NAME = re.compile(r"scorer '([^']+)'")


def score_stats(experiences: list[experience_pb2.Experience]) -> dict[str, float]:
    """``reward/failed_fraction`` (samples whose score failed) and ``reward/<scorer>`` (each scorer's mean component
    over the samples scored OK) of a batch."""
    total = failed = 0
    sums: dict[str, list[float]] = {}
    for exp in experiences:
        for s in exp.samples:
            total += 1
            if s.score_status != common_pb2.ITEM_STATUS_OK:
                failed += 1
                continue
            for name, v in s.score_components.items():
                sums.setdefault(name, []).append(v)
    out = {"reward/failed_fraction": failed / total if total else 0.0}
    for name, vs in sums.items():
        key = f"reward/{name}" if name not in ("mean", "std", "failed_fraction") else f"reward/scorer_{name}"
        out[key] = sum(vs) / len(vs)
    return out


def episode_stats(experiences: list[experience_pb2.Experience]) -> dict[str, float]:
    """Per-episode means of a batch of multi-turn records (none for single-turn ones): ``episode/<counter>`` for
    each of the environment's counters (``turns``, ``tool_calls``, ``tool_errors``, ...), ``episode/model_tokens``
    and ``episode/environment_tokens``, and ``episode/ended_by_<why>``, the fraction ended each way."""
    episodes = [s for exp in experiences for s in exp.samples if len(s.loss_mask)]
    if not episodes:
        return {}
    n = len(episodes)
    out: dict[str, float] = {}
    for s in episodes:
        for k, v in s.episode_metrics.items():
            out[f"episode/{k}"] = out.get(f"episode/{k}", 0.0) + v / n
        model = sum(s.loss_mask)
        out["episode/model_tokens"] = out.get("episode/model_tokens", 0.0) + model / n
        out["episode/environment_tokens"] = out.get("episode/environment_tokens", 0.0) + (len(s.loss_mask) - model) / n
        key = f"episode/ended_by_{s.ended_by or 'unknown'}"
        out[key] = out.get(key, 0.0) + 1 / n
    return out


def score_failures(experiences: list[experience_pb2.Experience]) -> str:
    """Which scorers failed on a batch's samples, most often first, with one error of each: for a message."""
    by_scorer: dict[str, list[str]] = {}
    for exp in experiences:
        for s in exp.samples:
            if s.score_status != common_pb2.ITEM_STATUS_OK:
                m = _SCORER_NAME.search(s.score_error)
                by_scorer.setdefault(m.group(1) if m else "?", []).append(s.score_error or "no error text")
    ranked = sorted(by_scorer.items(), key=lambda kv: -len(kv[1]))
    return "; ".join(f"scorer {name!r} failed {len(errs)} time(s), e.g. {errs[0]}" for name, errs in ranked[:3])


def mismatch_by_replica(
    experiences: list[experience_pb2.Experience], rows: tuple[torch.Tensor, ...] | None
) -> dict[str, tuple[float, int, list[int]]]:
    """Replica id -> (mean k3, tokens, versions) of a step's mismatch (the engine's per-row part of it: batch rows'
    records, versions, k3 sums, tokens): which replica made the samples that disagree with the trainer, for a
    message that names it."""
    if rows is None:
        return {}
    acc: dict[str, list] = {}
    for g, v, kl_sum, n in zip(*(t.tolist() for t in rows), strict=True):
        if n:
            a = acc.setdefault(experiences[g].replica_id or "?", [0.0, 0, set()])
            a[0] += kl_sum
            a[1] += int(n)
            a[2].add(v)
    return {r: (s / n, n, sorted(vs)) for r, (s, n, vs) in acc.items()}


def has_episodes(b: RolloutBatch) -> bool:
    """Whether a batch holds multi-turn episodes: then the stages train on each row's loss mask (the model's own
    tokens) instead of "every token through the first EOS", which would cut an episode after its first turn."""
    return b.episodes is not None and bool(b.episodes.any())
