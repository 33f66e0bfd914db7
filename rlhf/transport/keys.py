"""Redis key names of one run: the only place they are spelt out.

Every key of a run starts with ``rlhf:{<run_id>}:``, braces included: the key of run ``demo`` is
``rlhf:{demo}:prompts``. The braces are a Redis Cluster hash tag: every key of a run hashes to the same slot, so the
Lua scripts and pipelines that touch several of them run on a cluster (no CROSSSLOT), and runs with different ids
spread over the slots. Deleting a run's state is ``DEL`` of :meth:`RunKeys.all`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Consumer groups: rollout replicas read prompt jobs through ROLLOUT_GROUP, the trainer reads experience through
# TRAINER_GROUP. A stream could carry more groups (a second trainer, an auditor): trimming honours all of them.
ROLLOUT_GROUP = "rollout"
TRAINER_GROUP = "trainer"

# The one field of every stream entry: a serialized protobuf message.
PAYLOAD_FIELD = b"pb"

_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")  # the config's run_id pattern, bounded


def check_run_id(run_id: str) -> str:
    """A run id is 1-200 characters of ``[A-Za-z0-9._-]`` (no ``:``, ``{``, ``}``, spaces): it names Redis keys."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"run_id {run_id!r} is not usable in Redis key names: use 1-200 characters of letters, digits, "
            "'.', '_' or '-'"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    def _k(self, name: str) -> str:
        return f"rlhf:{{{self.run_id}}}:{name}"

    @property
    def hash_tag(self) -> str:
        """``{run_id}``: the part of every key of the run that Redis Cluster hashes to pick the slot."""
        return f"{{{self.run_id}}}"

    @property
    def prompts(self) -> str:
        """Stream of PromptJob records (trainer -> rollout, group ``rollout``)."""
        return self._k("prompts")

    @property
    def experience(self) -> str:
        """Stream of Experience records (rollout -> trainer, group ``trainer``)."""
        return self._k("experience")

    @property
    def dead(self) -> str:
        """Dead-letter stream: malformed or poison records with the reason (fields source/id/reason/payload/...)."""
        return self._k("dead")

    @property
    def dead_count(self) -> str:
        """Hash: source stream key -> number of records dead-lettered from it (exact even if ``dead`` is capped)."""
        return self._k("dead_count")

    @property
    def jobs(self) -> str:
        """Hash: job_id -> prompts-stream entry id of every job issued (makes publishing idempotent)."""
        return self._k("jobs")

    @property
    def issued(self) -> str:
        """Counter: prompt jobs issued (first publish of a job_id)."""
        return self._k("issued")

    @property
    def trained(self) -> str:
        """Counter: jobs the trainer consumed (trained on, or dropped as stale); restored from its checkpoint."""
        return self._k("trained")

    @property
    def released(self) -> str:
        """Counter: issued jobs that will never reach the trainer (their record was dead-lettered). Records of jobs
        the trainer never issued release nothing, so foreign records cannot loosen the staleness bound."""
        return self._k("released")

    @property
    def released_jobs(self) -> str:
        """Hash: job_id -> 1 for each issued job whose slot a dead letter released (a job releases at most once)."""
        return self._k("released_jobs")

    @property
    def policy_version(self) -> str:
        """The newest policy version the trainer has published (an integer; only ever increases)."""
        return self._k("policy_version")

    @property
    def fence(self) -> str:
        """Counter bumped right before each ``WAIT`` (rlhf.transport.connection.WaitPolicy): WAIT covers the
        writes of the connection it is sent on, so a write on that connection first makes it cover everything the
        ring read or wrote before it, including a write that was a no-op (a duplicate publish)."""
        return self._k("fence")

    def all(self) -> list[str]:
        return [
            self.prompts,
            self.experience,
            self.dead,
            self.dead_count,
            self.jobs,
            self.issued,
            self.trained,
            self.released,
            self.released_jobs,
            self.policy_version,
            self.fence,
        ]
