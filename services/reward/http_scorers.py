"""The reward scorers that ask a server over HTTP: ``remote`` (OpenRLHF's ``/get_reward``) and ``judge`` (an LLM over
an OpenAI-compatible chat API, its verdict parsed into a score), on one client with a timeout, a concurrency bound
and bounded retries. A failed, timed-out or unparsable answer is an error status, never a score."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from rlhf.config import ScorerConfig
from rlhf.config_sections import template_fields
from rlhf.retry import retry
from services.reward.scorers import INVALID_INPUT, SCORER_ERROR, TIMEOUT, Failure, Item, Scorer

log = logging.getLogger("rlhf.reward")
T = TypeVar("T")


class HTTPScorer(Scorer):
    """The HTTP plumbing of the ``remote`` and ``judge`` scorers: one pooled client, a timeout per call, failures
    classified into error statuses, bounded retries of what another attempt may fix."""

    def __init__(self, cfg: ScorerConfig, name: str, url: str, max_connections: int = 100):
        super().__init__(cfg, name)
        self.url = url
        self.timeout = cfg.timeout_s
        self.retries = cfg.retries
        self.headers: dict[str, str] = {}
        self._max_connections = max_connections
        self._client = None

    def _http(self):
        if self._client is None:
            # a pool smaller than the concurrency would turn queueing for a connection into timeouts
            limits = httpx.Limits(max_connections=self._max_connections)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), limits=limits)
        return self._client

    async def _post(self, body: dict[str, Any], attempt: int) -> Any:
        """One POST of ``body`` as JSON; the decoded answer, or :class:`_AttemptError` saying what went wrong."""
        who = f"scorer {self.name!r}: {self.url}"
        try:
            resp = await asyncio.wait_for(
                self._http().post(self.url, json=body, headers=self.headers), timeout=self.timeout
            )
        except (TimeoutError, httpx.TimeoutException):
            raise _AttemptError(
                TIMEOUT, f"{who} did not answer within {self.timeout}s ({attempt} attempt(s))"
            ) from None
        except (httpx.HTTPError, OSError) as err:
            raise _AttemptError(
                SCORER_ERROR, f"scorer {self.name!r}: cannot reach {self.url}: {type(err).__name__}"
            ) from None
        if resp.status_code >= 400:
            # 4xx other than 429: the request itself is wrong, and retrying will not help
            again = resp.status_code >= 500 or resp.status_code == 429
            raise _AttemptError(SCORER_ERROR, f"{who} answered HTTP {resp.status_code}: {resp.text[:200]}", again)
        try:
            return resp.json()
        except ValueError as err:
            raise _AttemptError(SCORER_ERROR, f"scorer {self.name!r}: bad answer from {self.url}: {err}") from None

    async def _retrying(self, attempt: Callable[[int], Awaitable[T]]) -> T:
        """``attempt(n)`` (n: 1, 2, ...) until it returns, retrying a retryable :class:`_AttemptError` at most
        ``retries`` times; the last failure is raised."""
        made = 0

        async def once() -> T:
            nonlocal made
            made += 1
            return await attempt(made)

        return await retry(
            once,
            lambda err: isinstance(err, _AttemptError) and err.retry,
            what=f"scorer {self.name!r}",
            log=log,
            attempts=self.retries + 1,
            initial_s=0.1,
            max_s=2.0,
            level=logging.INFO,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class RemoteScorer(HTTPScorer):
    """OpenRLHF's remote reward protocol: POST ``{"query", "prompts", "labels"}`` -> ``{"rewards": [...]}``."""

    type = "remote"

    def __init__(self, cfg: ScorerConfig, name: str):
        super().__init__(cfg, name, cfg.url or "")

    async def score(self, items: list[Item]) -> list[float | Failure]:
        body = {
            "query": [it.prompt + it.response for it in items],
            "prompts": [it.prompt for it in items],
            "labels": [it.label for it in items],
        }
        who = f"scorer {self.name!r}: {self.url}"

        async def attempt(n: int) -> list[float | Failure]:
            data = await self._post(body, n)
            rewards = data.get("rewards") if isinstance(data, dict) else data
            if not isinstance(rewards, list):
                raise _AttemptError(
                    SCORER_ERROR, f"scorer {self.name!r}: bad answer from {self.url}: no 'rewards' list"
                )
            if len(rewards) != len(items):
                raise _AttemptError(SCORER_ERROR, f"{who} returned {len(rewards)} rewards for {len(items)} items")
            out: list[float | Failure] = []
            for r in rewards:
                try:
                    v = float(r)
                except (TypeError, ValueError):
                    out.append(Failure(SCORER_ERROR, f"scorer {self.name!r}: reward {r!r} is not a number"))
                    continue
                out.append(v if math.isfinite(v) else Failure(SCORER_ERROR, f"scorer {self.name!r}: reward {v}"))
            return out

        try:
            return await self._retrying(attempt)
        except _AttemptError as err:
            self.report_failure(err.failure.message)
            return [err.failure] * len(items)


# the first number of a reply: 7, -2, 0.5, .5, 1e3
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeScorer(HTTPScorer):
    """An LLM as judge over any OpenAI-compatible chat endpoint (``POST {base_url}/v1/chat/completions``): the item
    rendered into the configured template is the user message; the reply's verdict, read by the configured parser,
    is the score. One request per item, at most ``judge.concurrency`` in flight over all requests. A reply the parser
    cannot read is an error status quoting the reply, and is not asked again (at temperature 0 the same reply would
    come back); timeouts, HTTP 5xx/429 and unreachable servers are retried ``retries`` times."""

    type = "judge"

    def __init__(self, cfg: ScorerConfig, name: str):
        j = cfg.judge
        base = (j.base_url or "").rstrip("/")
        base = base.removesuffix("/v1")  # an OpenAI client's base_url (".../v1") works here as well
        super().__init__(cfg, name, base + "/v1/chat/completions", max_connections=j.concurrency)
        self.j = j
        self.uses_label = "label" in template_fields(j.template or "")
        if j.api_key_env:
            key = os.environ.get(j.api_key_env)
            if not key:  # refused at start: every request would fail with 401 otherwise
                raise ValueError(f"judge.api_key_env names {j.api_key_env!r}, which is not set in the environment")
            self.headers["Authorization"] = f"Bearer {key}"
        if j.parser == "numeric":
            self.verdicts: dict[str, float] = {}
            self.pattern = re.compile(j.pattern) if j.pattern else _NUMBER
        else:
            choices = {"yes": 1.0, "no": 0.0} if j.parser == "yes_no" else dict(j.choices or {})
            self.verdicts = {k.strip().casefold(): float(v) for k, v in choices.items()}
            if j.pattern:
                self.pattern = re.compile(j.pattern)
            else:
                # a verdict at the start of the reply, after any markup ("**Yes**", "(B) because ..."); longest
                # first, so "partly correct" is not read as "partly"
                alts = "|".join(re.escape(k.strip()) for k in sorted(choices, key=lambda k: -len(k.strip())))
                self.pattern = re.compile(rf"^\W*?({alts})(?!\w)", re.IGNORECASE)
        self._sem: asyncio.Semaphore | None = None

    def _body(self, it: Item) -> dict[str, Any]:
        j = self.j
        user = (j.template or "").format(prompt=it.prompt, response=it.response, label=it.label or "")
        messages = ([{"role": "system", "content": j.system}] if j.system else []) + [{"role": "user", "content": user}]
        body: dict[str, Any] = {"messages": messages, "temperature": j.temperature, "max_tokens": j.max_tokens}
        if j.model is not None:
            body["model"] = j.model
        return {**body, **j.extra_body}

    def parse(self, reply: str) -> float | str:
        """The score in ``reply``, or why there is none."""
        m = self.pattern.search(reply)
        if m is None:
            if self.j.pattern:
                return f"the pattern {self.j.pattern!r} does not match"
            if self.j.parser == "numeric":
                return "no number in it"
            return f"it does not start with one of {sorted(self.verdicts)}"
        text = (m.group(1) if m.groups() else m.group(0)) or ""
        if self.j.parser == "numeric":
            try:
                v = float(text.strip())
            except ValueError:
                return f"{text!r} is not a number"
            if not math.isfinite(v):
                return f"{v} is not a finite number"
            if self.j.range is not None:
                lo, hi = self.j.range
                if not lo <= v <= hi:
                    return f"{v:g} is outside the range [{lo:g}, {hi:g}]"
                if self.j.normalize:
                    v = (v - lo) / (hi - lo)
            return v
        v = self.verdicts.get(text.strip().casefold())
        return v if v is not None else f"{text!r} is not one of {sorted(self.verdicts)}"

    async def _one(self, it: Item) -> float | Failure:
        if not it.prompt:
            return Failure(INVALID_INPUT, f"scorer {self.name!r} needs the prompt as text, not token ids")
        if self.uses_label and it.label is None:
            return Failure(INVALID_INPUT, f"scorer {self.name!r}: the judge template uses {{label}}; send a label")
        body = self._body(it)

        async def attempt(n: int) -> Any:
            async with self._sem:  # held for the call only, not during a retry's back-off
                return await self._post(body, n)

        try:
            data = await self._retrying(attempt)
        except _AttemptError as err:
            self.report_failure(err.failure.message)
            return err.failure
        try:
            reply = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            reply = None
        if not isinstance(reply, str):
            message = f"scorer {self.name!r}: {self.url} answered no choices[0].message.content: {str(data)[:200]}"
            self.report_failure(message)
            return Failure(SCORER_ERROR, message)
        v = self.parse(reply)
        if isinstance(v, str):
            shown = reply if len(reply) <= 300 else reply[:300] + "..."
            message = f"scorer {self.name!r}: unparsable verdict ({v}; parser {self.j.parser}) in the reply {shown!r}"
            self.report_failure(message)
            return Failure(SCORER_ERROR, message)
        return v

    async def score(self, items: list[Item]) -> list[float | Failure]:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.j.concurrency)
        return list(await asyncio.gather(*(self._one(it) for it in items)))


class _AttemptError(Exception):
    """One failed attempt of an HTTP scorer: the Failure its items get if it is the last, and whether another
    attempt may succeed."""

    def __init__(self, status: str, message: str, retry: bool = True):
        super().__init__(message)
        self.failure, self.retry = Failure(status, message), retry
