"""What an environment is to this project: one episode of a multi-turn task, driven by text.

The rollout replica owns the tokens; an environment only ever sees and returns chat messages (OpenAI's shape). One
instance is one episode (the service makes a fresh one per ``Reset``), so an implementation may keep episode state
on ``self``. Implementations raise :class:`EnvironmentFailure` (or any exception) on bad actions they cannot turn
into an observation; the sample then fails as an error, never a reward 0. Input the caller should have sent
differently (a reset without the label the task needs) is :class:`EpisodeInputInvalid`: the caller's mistake, not
the environment's. Design: docs/environments.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]

# PromptJob.metadata keys of a multi-turn job: the trainer's publisher writes them from the config's environment
# section, the rollout replica plays the episode by them. Other metadata keys reach the environment as its info.
EPISODE_ENVIRONMENT_KEY = "episode.environment"
EPISODE_MAX_TURNS_KEY = "episode.max_turns"
EPISODE_MAX_TOKENS_KEY = "episode.max_tokens"


class EnvironmentFailure(RuntimeError):
    """The environment cannot go on (a crash, garbage from a remote environment): the sample is an error."""


class EpisodeInputInvalid(EnvironmentFailure):
    """The caller's input cannot start or drive this environment (a reset without the label the task is scored
    against): the environment service answers INVALID_ARGUMENT / 400 naming ``field``, not an internal error. A
    subclass of EnvironmentFailure, so code that calls an environment directly still sees a failure."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class Opening:
    """What ``reset`` returns: the conversation so far (system / user messages), and the tools the model may call
    (OpenAI function-tool schemas, rendered by the chat template; empty when the task has none)."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """What ``step`` returns: the messages that follow the model's turn (role ``tool`` or ``user``), the reward of
    this step, whether the episode is over, and counters for metrics (``tool_calls``, ``tool_errors``, ...)."""

    messages: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """One episode. ``reset`` once, then ``step`` with each model turn's text until an outcome says ``done``."""

    @abstractmethod
    def reset(self, prompt: list[Message], label: str | None, info: dict[str, str], seed: int | None) -> Opening:
        """Start the episode from the prompt job (its chat messages, reference label and metadata)."""

    @abstractmethod
    def step(self, action: str) -> Outcome:
        """The model's turn, as decoded text (tool calls included as the model wrote them)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most environments hold nothing to release)
        """Release what the episode holds (a sandbox, a connection); called once, also after a failure."""
