"""Environments for tests/integration/test_environment_service.py, named as python:_environments:<Class> (this folder
is on the import path of the tests and of the services they start)."""

from __future__ import annotations

import time

from rlhf.environments.base import Environment, Opening, Outcome

CLOSED: list[str] = []  # in-process servers: the close hooks that ran


class Echo(Environment):
    """Answers each turn with a user message repeating it; done after ``turns`` steps (reward = turns made)."""

    def __init__(self, turns: int = 3):
        self.turns, self.made = turns, 0

    def reset(self, prompt, label, info, seed):
        return Opening(messages=list(prompt), info={"seed": str(seed), **info})

    def step(self, action):
        self.made += 1
        done = self.made >= self.turns
        return Outcome(
            messages=[{"role": "user", "content": f"echo {self.made}: {action}"}], reward=self.made, done=done
        )

    def close(self):
        CLOSED.append("echo")


class FailingStep(Echo):
    """Resets fine; every step raises."""

    def step(self, action):
        raise ValueError(f"cannot handle {action!r}")


class HangingStep(Echo):
    """Each step sleeps ``hang_s`` (longer than the service's timeout, short enough for the test's threads to end)."""

    def __init__(self, hang_s: float = 2.0):
        super().__init__()
        self.hang_s = hang_s

    def step(self, action):
        time.sleep(self.hang_s)
        return super().step(action)


class BadOutcome(Echo):
    """Returns something that is not an Outcome."""

    def step(self, action):
        return {"reward": 1.0}
