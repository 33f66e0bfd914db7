"""TRL's ``PPOTrainer`` loop on this trainer, in one Python process: ``step(queries, responses, scores)`` with the
user's own generation and scores (seed 001's tutorial), and nothing else running (no Redis, no services).

:class:`InProcessTrainer` holds the trainer's engine (:class:`~services.trainer.engine.TrainerEngine`, the update
the ring runs) and a reference model loaded as the reference service loads it. :meth:`InProcessTrainer.step` builds
the experience records a rollout replica would publish for those samples (reference log-probs from
:func:`rlhf.reference_logprobs.response_logprobs`, the reference service's own computation; the scores as given;
the trainer's current policy version) and hands them to ``TrainerEngine.step``: the same update, losses and
metrics as a ring step on the same records. Design and the tutorial's steps: docs/in-process.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf.config import ExperimentConfig, parse_config
from rlhf.models import load_causal_lm, load_policy_base, resolve_model_path, serving_dtype
from rlhf.reference_logprobs import response_logprobs
from rlhf.transport.codec import LOGPROB_MAX, LOGPROB_MIN, MAX_ABS_SCORE
from rlhf.v1 import common_pb2, experience_pb2
from services.trainer.checkpoint import save_policy
from services.trainer.engine import TrainerEngine

TokenIds = torch.Tensor | Sequence[int]


class InProcessTrainer:
    """The trainer's update driven from Python: ``step(queries, responses, scores)`` as in TRL's PPOTrainer.

    ``cfg``: an experiment config (or its mapping). The stage, LoRA, QLoRA, KL, critic and optimizer settings are
    read as in a ring; the rollout, reward, data and service settings are not used (the caller generates and
    scores)."""

    def __init__(self, cfg: ExperimentConfig | dict[str, Any], device: str | None = None):
        self.cfg = cfg if isinstance(cfg, ExperimentConfig) else parse_config(cfg)
        self.engine = TrainerEngine(self.cfg, device)
        ref = self.cfg.actor_rollout_ref.ref
        # as the reference service loads it: ref.load, else the actor's initial weights as its base loads (4 bits
        # with QLoRA), in its serving dtype
        path = resolve_model_path(ref.load or self.cfg.actor.load)
        dtype = serving_dtype(self.cfg.training.bf16, self.engine.device)
        if ref.load is None:
            reference = load_policy_base(path, self.engine.device, dtype, self.cfg.actor)
        else:
            reference = load_causal_lm(path, self.engine.device, dtype)
        self.reference = reference.eval().requires_grad_(False)
        self.ref_micro_batch_size = ref.micro_batch_size
        # the rollout worker asks the reference at the stage's log-prob temperature (online DPO: 1), else at the
        # temperature the samples were drawn at (services/rollout/jobs.py)
        t = self.cfg.logprob_temperature
        self.ref_temperature = float(t if t is not None else self.cfg.sample_temperature)
        self._records = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The trained policy (with LoRA: the PEFT-wrapped model)."""
        return self.engine.actor

    def generate(self, queries: Sequence[TokenIds], max_new_tokens: int, **kwargs: Any) -> list[torch.Tensor]:
        """Sample a response to each query from the current policy (transformers' ``generate``, one query at a
        time: TRL's ``generate(..., return_prompt=False)``): the response ids up to and including the first EOS.
        ``kwargs`` go to ``generate`` (``do_sample``, ``temperature``, ``top_k``, ...)."""
        eos, out = self.engine.eos_id, []
        was_training = self.engine.actor.training
        self.engine.actor.eval()
        try:
            with torch.no_grad():
                for i, q in enumerate(queries):
                    ids = torch.tensor([_ids(q, f"queries[{i}]")], device=self.engine.device)
                    seq = self.engine.actor.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_new_tokens,
                        pad_token_id=self.engine.pad_id,
                        eos_token_id=eos,
                        **kwargs,
                    )[0, ids.shape[1] :].cpu()
                    stop = (seq == eos).nonzero()
                    out.append(seq[: int(stop[0]) + 1] if len(stop) else seq)
        finally:
            self.engine.actor.train(was_training)
        return out

    def experiences(
        self,
        queries: Sequence[TokenIds],
        responses: Sequence[TokenIds],
        scores: Sequence[float | torch.Tensor],
        logprobs: Sequence[Sequence[float]] | None = None,
    ) -> list[experience_pb2.Experience]:
        """The records a ring step on these samples trains on: one per run of equal consecutive queries (a prompt
        job's ``n`` samples), each sample with the reference's log-probs, its score and the current policy
        version. ``logprobs``: the sampling log-probs of each response, when the generation reported them (they
        feed truncated importance sampling and the ``mismatch/*`` metrics); without them the samples count as drawn
        by the current weights, as in TRL's step (the old log-probs are the trainer's own forward)."""
        n = len(queries)
        if not n or len(responses) != n or len(scores) != n or (logprobs is not None and len(logprobs) != n):
            lens = [len(queries), len(responses), len(scores)] + ([] if logprobs is None else [len(logprobs)])
            raise ValueError(f"step needs as many queries, responses and scores (and logprobs), at least one: {lens}")
        prompts = [_ids(q, f"queries[{i}]") for i, q in enumerate(queries)]
        outs = [_ids(r, f"responses[{i}]") for i, r in enumerate(responses)]
        values = [_score(s, i) for i, s in enumerate(scores)]
        vocab = self.engine.vocab_size
        for name, rows in (("queries", prompts), ("responses", outs)):
            for i, row in enumerate(rows):
                if min(row) < 0 or max(row) >= vocab:
                    bad = next(t for t in row if not 0 <= t < vocab)
                    raise ValueError(f"{name}[{i}] has token id {bad}, outside the vocabulary [0, {vocab})")
        ref = response_logprobs(
            self.reference,
            prompts,
            outs,
            self.engine.pad_id,
            self.ref_temperature,
            self.ref_micro_batch_size,
            self.cfg.training.padding_free,
        )
        records: list[experience_pb2.Experience] = []
        for i in range(n):
            if not records or prompts[i] != list(records[-1].prompt_ids):
                self._records += 1
                job = f"in-process-{self._records}"
                records.append(experience_pb2.Experience(job_id=job, run_id=self.cfg.run_id, prompt_ids=prompts[i]))
            sample = records[-1].samples.add(
                response_ids=outs[i],
                ref_logprobs=ref[i].tolist(),
                score=values[i],
                score_status=common_pb2.ITEM_STATUS_OK,
                finish_reason=common_pb2.FINISH_REASON_STOP
                if outs[i][-1] == self.engine.eos_id
                else common_pb2.FINISH_REASON_LENGTH,
                policy_version=self.engine.policy_version,
            )
            if logprobs is not None:
                if len(logprobs[i]) != len(outs[i]):
                    raise ValueError(f"logprobs[{i}] has {len(logprobs[i])} entries for {len(outs[i])} response tokens")
                lps = [float(x) for x in logprobs[i]]
                bad = next((j for j, v in enumerate(lps) if not LOGPROB_MIN <= v <= LOGPROB_MAX), None)
                if bad is not None:  # the queue's bounds (rlhf.transport.codec); NaN compares False
                    raise ValueError(
                        f"logprobs[{i}][{bad}] is {lps[bad]:g}, outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}]: not a "
                        "log-prob a model produces"
                    )
                sample.sampling_logprobs.extend(lps)
        return records

    def step(
        self,
        queries: Sequence[TokenIds],
        responses: Sequence[TokenIds],
        scores: Sequence[float | torch.Tensor],
        logprobs: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """One update on these samples, exactly as the ring's trainer steps on their records
        (:meth:`experiences`); returns the step's metrics (``loss/policy``, ``loss/value``, ``objective/kl``...)."""
        return self.engine.step(self.experiences(queries, responses, scores, logprobs))

    def save_pretrained(self, directory: str | Path) -> None:
        """The policy as a Hugging Face folder (a LoRA policy merged; a 4-bit base dequantized), with its
        tokenizer: what a checkpoint's ``policy`` folder holds."""
        save_policy(self.engine, Path(directory))


def _ids(x: TokenIds, where: str) -> list[int]:
    """Token ids of a 1-D tensor or a list, as ints; an error names the argument."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point:
            raise ValueError(f"{where}: a 1-D tensor of token ids, not shape {tuple(x.shape)} of {x.dtype}")
        x = x.tolist()
    ids = [int(t) for t in x]
    if not ids:
        raise ValueError(f"{where} is empty: send at least one token")
    return ids


def _score(s: float | torch.Tensor, i: int) -> float:
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ValueError(f"scores[{i}]: one number per response, not shape {tuple(s.shape)}")
        s = s.item()
    value = float(s)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"scores[{i}] is {value}: a score must be finite")
    if abs(value) > MAX_ABS_SCORE:  # the queue's bound: a larger score overflows the losses
        raise ValueError(f"scores[{i}] is {value:g}, outside [{-MAX_ABS_SCORE:g}, {MAX_ABS_SCORE:g}]")
    return value
