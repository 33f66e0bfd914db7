"""Any ``verifiers`` (0.4, ``verifiers.v1``) environment as an :class:`~rlhf.environments.base.Environment`:
``verifiers:<taskset-id>`` in the environment registry.

The rollout replica is the model and the harness: the adapter runs the env's own ``run()`` with agents whose every
model call waits for the replica's next :meth:`step`, serves the task's tools through its in-process ``mcp`` server,
and scores with the library's own ``Task.score`` / ``Env.finalize`` (a hook that raises is an
:class:`EnvironmentFailure`, never a reward 0). Nothing here imports ``verifiers`` until an environment is built.
Design (options, how a job names its task, what is not covered):
docs/environments.md#library-environments-verifiers-and-openenv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import itertools
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rlhf.environments.base import Environment, EnvironmentFailure, Message, Opening, Outcome
from rlhf.tool_calls import check_parser, parse_tool_calls

IDX_KEY = "verifiers_idx"
DEFAULT_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------------------------- one asyncio loop
# verifiers is asyncio throughout; Environment is synchronous. One daemon loop thread serves every episode of the
# process (each episode is one task on it), so a service thread calling reset/step never blocks another episode.
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers-episodes", daemon=True).start()
            _loop = loop
        return _loop


def _run(coro, timeout: float):
    return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result(timeout)


# ------------------------------------------------------------------------------------------------- the library side
def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as err:  # the optional extra is missing: say what to install
        raise EnvironmentFailure(f"verifiers environments need `pip install verifiers==0.4.0` ({err})") from None
    return vf


def _freeze(options: dict[str, Any] | None) -> str:
    return json.dumps(options or {}, sort_keys=True)


@functools.lru_cache(maxsize=32)
def _load(taskset_id: str, taskset_options: str):
    """The verifiers Env for a taskset id (its bundled Env class, else SingleAgentEnv), built once per process: it
    holds the loaded taskset, which episodes only read."""
    vf = _vf()
    config = vf.resolve_env_config({"taskset": {**json.loads(taskset_options), "id": taskset_id}})
    return vf.load_environment(config)


def _tasks(env, limit: int | None = None) -> Iterator[Any]:
    tasks = iter(env.taskset)
    return tasks if limit is None else itertools.islice(tasks, limit)


def _task_at(env, idx: int):
    cache = env.__dict__.setdefault("_rlhf_tasks", {})
    if idx not in cache and idx >= 0:
        # a bounded taskset is read whole once; an infinite one as far as the task asked for
        for task in _tasks(env, None if env.taskset.bounded else idx + 1):
            cache[task.data.idx] = task
    if idx not in cache:
        raise EnvironmentFailure(f"the taskset has no task {idx} (it has {len(cache)})")
    return cache[idx]


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content)


def _wire(message: Any) -> Message:
    """A verifiers message -> the project's dict shape (text content; assistant tool calls in OpenAI form)."""
    out: Message = {"role": message.role, "content": _text(message.content) if message.content is not None else ""}
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return out


def _opening(task) -> list[Any]:
    """The messages a harness that emits the system prompt as a message (verifiers' chat program) starts from."""
    vf = _vf()
    data = task.data
    messages: list[Any] = []
    if data.system_prompt:
        messages.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


def _row_text(task) -> tuple[str | None, str]:
    """(system prompt, prompt text) of a task, as a prompt job carries them (``system`` metadata, ``prompt_text``)."""
    return task.data.system_prompt or None, task.data.prompt_text


def verifiers_rows(
    taskset_id: str, split: str | None = None, limit: int | None = None, taskset: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The taskset's rows as prompt data: ``{"prompt": text, "system": str | None, "messages": [...], "label": str,
    "info": {"verifiers_idx": "<idx>"}}``, one per task. ``prompt`` / ``system`` are what ``data.path`` rows hold
    (written as JSON lines they are a data set: ``data.map_keys.system: system``), ``messages`` the opening the
    episode starts from. ``label`` is the row's ``answer`` field when it has one (verifiers scores with its own hooks,
    so it is only informative), else ``""``. ``split`` sets the taskset config's ``split`` field; an infinite
    taskset needs ``limit``."""
    options = dict(taskset or {})
    if split is not None:
        options["split"] = split
    env = _load(taskset_id, _freeze(options))
    if not env.taskset.bounded and limit is None:
        raise ValueError(f"taskset {taskset_id!r} is infinite: pass limit")
    rows = []
    for task in _tasks(env, limit):
        answer = getattr(task.data, "answer", None)
        system, text = _row_text(task)
        rows.append(
            {
                "prompt": text,
                "system": system,
                "messages": [_wire(m) for m in _opening(task)],
                "label": "" if answer is None else str(answer),
                "info": {IDX_KEY: str(task.data.idx)},
            }
        )
    return rows


def _find_task(env, prompt: list[Message], label: str | None):
    """The task a prompt job without ``info["verifiers_idx"]`` is about (the trainer's data rows carry prompt text,
    system and label only): the tasks whose prompt text is the job's user text, narrowed by the system prompt and
    then the label when several match; several tasks left that differ is an error, never a guess."""
    if not env.taskset.bounded:
        raise EnvironmentFailure(f"an infinite taskset needs info[{IDX_KEY!r}] to name the task")
    index = env.__dict__.get("_rlhf_by_text")
    if index is None:
        index = {}
        for task in _tasks(env):
            env.__dict__.setdefault("_rlhf_tasks", {})[task.data.idx] = task
            index.setdefault(_row_text(task)[1], []).append(task)
        env.__dict__["_rlhf_by_text"] = index
    system = prompt[0].get("content") if prompt and prompt[0].get("role") == "system" else None
    text = "\n\n".join(str(m.get("content") or "") for m in prompt if m.get("role") != "system" and m.get("content"))
    found = index.get(text, [])
    for keep in (lambda t: _row_text(t)[0] == system, lambda t: str(getattr(t.data, "answer", "")) == (label or "")):
        narrowed = [t for t in found if keep(t)]
        found = narrowed if narrowed else found
    if not found:
        raise EnvironmentFailure(f"no task of the taskset opens with this prompt (pass info[{IDX_KEY!r}])")
    first = found[0].data.model_dump(exclude={"idx"})
    if any(t.data.model_dump(exclude={"idx"}) != first for t in found[1:]):
        raise EnvironmentFailure(f"{len(found)} different tasks open with this prompt: pass info[{IDX_KEY!r}]")
    return found[0]


# ------------------------------------------------------------------------------------------- the stepped episode
class _Channel:
    """Between the episode (on the loop) and the service's thread: the episode posts each model request (or its
    end) to ``events``; :meth:`VerifiersEnvironment.step` answers a request with the model's text."""

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.pending: asyncio.Future | None = None
        self.sent: list[Message] | None = None  # the conversation the replica holds, as last sent

    async def ask(self, messages: list[Message], tools: list[dict[str, Any]]) -> str:
        self.pending = asyncio.get_running_loop().create_future()
        self.events.put(("turn", (messages, tools)))
        return await self.pending


class _ToolBox:
    """The taskset's and the task's toolsets served in-process through an ``mcp`` server, as a harness reaches them:
    tool names ``<server>_<tool>``, schemas as MCP derives them, and ``trace.state`` shared with the tools the way
    verifiers' state channel shares it (pulled into the toolset's State type before a call, pushed back after)."""

    def __init__(self, shared: list[Any], per_task: list[Any]) -> None:
        self.shared = shared  # taskset-scoped: setup() only, as verifiers does
        self.per_task = per_task  # rollout-scoped: setup() and setup_task(task)
        self.server = None
        self.schemas: list[dict[str, Any]] = []
        self.tools: list[Any] = []

    def _with_trace_state(self, toolset, fn, trace):
        from verifiers.v1.mcp.server import _call_state
        from verifiers.v1.state import State

        @functools.wraps(fn)
        async def call(*args, **kwargs):
            if toolset._state_cls is State:  # the base State has no fields: nothing to share (verifiers skips too)
                return await _maybe_await(fn(*args, **kwargs))
            state = toolset._state_adapter.validate_json(trace.state.model_dump_json())
            token = _call_state.set(state)
            try:
                result = await _maybe_await(fn(*args, **kwargs))
            finally:
                _call_state.reset(token)
            trace.state = type(trace.state).model_validate_json(toolset._state_adapter.dump_json(state))
            return result

        call.__signature__ = inspect.signature(fn)  # MCP advertises the tool's own parameters
        return call

    async def start(self, task, trace) -> None:
        if not self.shared and not self.per_task:
            return
        from mcp.server.mcpserver import MCPServer

        vf = _vf()
        self.server = MCPServer("rlhf-verifiers")
        for toolset in [*self.shared, *self.per_task]:
            await toolset.setup()
            if toolset in self.per_task:
                await toolset.setup_task(task)
            prefix = toolset.server_name
            for fn in _decorated(toolset):
                name = getattr(fn, "tool_name", None) or fn.__name__
                self.server.add_tool(
                    self._with_trace_state(toolset, fn, trace),
                    name=f"{prefix}_{name}" if prefix else name,
                    description=(fn.__doc__ or "").strip() or None,
                )
        for tool in await self.server.list_tools():
            self.schemas.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description or "",
                        "parameters": tool.input_schema,
                    },
                }
            )
            self.tools.append(vf.Tool(name=tool.name, description=tool.description or "", parameters=tool.input_schema))

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        """(the tool message's text, whether it is an error): a bad call is the model's error, told to the model."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            return "error: the arguments are not JSON", True
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object", True
        try:
            result = await self.server.call_tool(name, args)
        except Exception as err:  # noqa: BLE001 - MCP reports unknown tools and bad arguments as exceptions
            return f"error: {err}", True
        texts = [getattr(block, "text", None) for block in getattr(result, "content", None) or []]
        text = "\n".join(t for t in texts if t is not None)
        failed = bool(getattr(result, "is_error", False))
        return (f"error: {text}" if failed and not text.startswith("error") else text), failed


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _decorated(toolset) -> list[Any]:
    from verifiers.v1.utils.decorators import discover_decorated

    return discover_decorated(toolset, "tool")


class _Seat:
    """One seat of the env (``agents.<name>``): it plays the harness, the replica plays the model."""

    def __init__(self, episode: _Episode, name: str, spec: Any) -> None:
        self.episode = episode
        self.name = name
        self.config = spec
        self.trainable = True  # Env.setup may mark a seat (a judge) not trainable; every seat is the policy here

    def _trace(self, task):
        vf = _vf()
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=self.config),
        )
        self.episode.traces.append(trace)
        return trace

    async def run(self, task, **_: Any):
        """One segment on the task's prompt (a single-agent episode)."""
        if task.data.prompt is None:
            raise ValueError("a prompt-less task needs an interaction (its env's run() opens the conversation)")
        run = _SeatRun(self, task)
        try:
            await run.segment(_opening(task))
        except BaseException:
            run.closed = True  # a failed run is not scored (verifiers skips scoring after a failure too)
            raise
        run.trace.stop("agent_completed")
        return await run.close()

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_: Any):
        run = _SeatRun(self, task)
        try:
            yield run
        except BaseException:
            run.closed = True
            raise
        await run.close()


class _SeatRun:
    """A seat's rollout, held open turn by turn (verifiers' ``Interaction`` surface: ``turn``, ``trace``, ``close``)."""

    def __init__(self, seat: _Seat, task) -> None:
        self.seat = seat
        self.task = task
        self.trace = seat._trace(task)
        self.history: list[Any] = []
        self.started = False
        self.over = False
        self.closed = False
        taskset = seat.episode.env.taskset
        self.toolbox = _ToolBox(type(taskset).toolsets(taskset.config), type(task).toolsets(task.config))
        self.tools_ready = False
        limits = [m for m in (seat.config.max_turns, seat.episode.max_turns) if m is not None]
        self.max_turns = min(limits) if limits else None

    async def _stopped(self) -> bool:
        """The framework's checks before a model call: the turn limit, then the task's ``@vf.stop`` hooks."""
        from verifiers.v1.session import call_hook, hook_boundary

        vf = _vf()
        if self.max_turns is not None and self.trace.num_turns >= self.max_turns:
            self.trace.stop("max_turns")
            return True
        for hook in self.task.hooks("stop"):
            if hook_boundary(hook, allow_trace=True) is not vf.Trace:
                continue  # a stop on the raw request / response belongs to the interception server, absent here
            result = await call_hook(hook, {vf.Trace: self.trace})
            if not isinstance(result, bool):
                raise TypeError(f"@stop {hook.__name__} must return bool, got {type(result).__name__}")
            if result:
                self.trace.stop(hook.__name__)
                return True
        return self.trace.stop_condition is not None

    async def _model_turn(self):
        """One model call: the replica gets the conversation, its text comes back as the assistant message."""
        vf = _vf()
        from verifiers.v1.graph import prepare_turn

        if not self.tools_ready:
            await self.toolbox.start(self.task, self.trace)
            self.tools_ready = True
        episode = self.seat.episode
        messages = [_wire(m) for m in self.history]
        action = await episode.channel_ask(messages, self.toolbox.schemas)
        content, calls = parse_tool_calls(action, parser=episode.parser) if self.toolbox.schemas else (action, [])
        message = vf.AssistantMessage(
            content=content,
            tool_calls=[
                vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in calls
            ]
            or None,
        )
        response = vf.Response(
            id=f"rlhf-{uuid.uuid4().hex[:12]}",
            created=int(time.time()),
            model="policy",
            message=message,
            finish_reason="tool_calls" if calls else "stop",
        )
        prepare_turn(self.trace, list(self.history), self.toolbox.tools or None).commit(response)
        self.history.append(message)
        return message

    async def segment(self, messages: list[Any]) -> bool:
        """Run one harness segment: model turns, with the tool results between them, until a reply without tool
        calls. False when a limit or ``@stop`` refused the first model call (the message goes unconsumed)."""
        vf = _vf()
        answered = False
        pending = list(messages)
        while True:
            if await self._stopped():
                return answered
            self.history.extend(pending)
            message = await self._model_turn()
            answered = True
            if not message.tool_calls:
                return True
            pending = []
            for call in message.tool_calls:
                text, failed = await self.toolbox.call(call.name, call.arguments)
                self.seat.episode.metrics["tool_calls"] += 1
                self.seat.episode.metrics["tool_errors"] += failed
                pending.append(vf.ToolMessage(tool_call_id=call.id, name=call.name, content=text))

    async def turn(self, message: Any = None):
        """verifiers' ``Interaction.turn``: a user turn in, one segment out (``terminated`` when the run ended)."""
        vf = _vf()
        from verifiers.v1.dialects.chat import parse_message

        if self.closed or self.over:
            raise RuntimeError("this interaction is over")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("a bare turn() takes a prompted task's opening reply only")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if isinstance(message, str):
            incoming = [vf.UserMessage(content=message)]
        elif message is not None:
            incoming = [parse_message(m) if isinstance(m, dict) else m for m in message]
        else:
            incoming = []
        if not self.started:
            system = [vf.SystemMessage(content=self.task.data.system_prompt)] if self.task.data.system_prompt else []
            incoming = _opening(self.task) if prompted else [*system, *incoming]
        self.started = True
        before = len(self.trace.nodes)
        if not await self.segment(incoming):
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        out, saw = [], False
        for node in self.trace.nodes[before:]:
            if node.sampled:
                out.append(node.message)
                saw = True
            elif saw and isinstance(node.message, vf.ToolMessage):
                out.append(node.message)
        # tool results are not graph nodes until the next call commits them; the history has them
        return vf.Segment(messages=out)

    async def close(self):
        """Finish the seat's run: the task's scoring (runtime-free signals, as verifiers scores without a box)."""
        if self.closed:
            return self.trace
        self.closed = True
        self.trace.stop("user_closed")
        await self.task.score(self.trace)  # raises (TaskError) when a hook fails: the episode fails
        missing = [name for name, r in self.trace.rewards.items() if r is None]
        if missing:
            raise RuntimeError(f"rewards {missing} were not scored")
        self.trace.is_completed = True
        self.trace.ok = True
        return self.trace


class _Episode:
    """One verifiers episode on the loop: the env's setup, run and finalize, with the seats above."""

    def __init__(self, env, task, max_turns: int | None, parser: str) -> None:
        self.env = env
        self.task = task
        self.max_turns = max_turns
        self.parser = parser
        self.channel = _Channel()
        self.traces: list[Any] = []
        self.metrics: dict[str, float] = {"tool_calls": 0.0, "tool_errors": 0.0}
        self.runner: asyncio.Task | None = None

    async def channel_ask(self, messages: list[Message], tools: list[dict[str, Any]]) -> str:
        return await self.channel.ask(messages, tools)

    async def main(self) -> None:
        vf = _vf()
        from verifiers.v1.episode import EnvInfo
        from verifiers.v1.trace import TraceTask

        try:
            agents = vf.Agents(self.env.config, lambda name, spec: _Seat(self, name, spec))
            await self.env.setup(agents)
            await self.env.run(self.task, agents)
            if not self.traces:
                raise RuntimeError(f"{type(self.env).__name__}.run() ran no agent")
            episode = vf.Episode(
                env=EnvInfo(id=self.env.config.env_id),
                task=TraceTask(
                    type=type(self.task).__name__, data=self.task.data, key=self.task.key, hash=self.task.hash
                ),
            )
            episode.traces.extend(self.traces)
            await self.env.finalize(self.task, episode)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - every failure of the episode reaches the caller
            self.channel.events.put(("error", err))
            return
        self.channel.events.put(("done", None))

    def start(self) -> None:
        async def spawn():
            self.runner = asyncio.get_running_loop().create_task(self.main())

        _run(spawn(), 30)

    def stop(self) -> None:
        if self.runner is not None and not self.runner.done():
            _background_loop().call_soon_threadsafe(self.runner.cancel)


class VerifiersEnvironment(Environment):
    """One episode of a verifiers taskset (see the module docstring)."""

    def __init__(
        self,
        taskset_id: str,
        max_turns: int | None = None,
        taskset: dict[str, Any] | None = None,
        parser: str = "hermes",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not taskset_id:
            raise ValueError("verifiers:<taskset-id>: the taskset id (an importable module) is missing")
        self.taskset_id = taskset_id
        self.taskset_options = _freeze(taskset)
        self.max_turns = None if max_turns is None else int(max_turns)
        self.parser = check_parser(parser)
        self.timeout_s = float(timeout_s)
        self.episode: _Episode | None = None
        self.done = False

    def _next(self) -> tuple[str, Any]:
        assert self.episode is not None
        try:
            return self.episode.channel.events.get(timeout=self.timeout_s)
        except queue.Empty:
            raise EnvironmentFailure(f"the verifiers episode did not answer within {self.timeout_s:g}s") from None

    def _advance(self) -> tuple[list[Message] | None, list[dict[str, Any]], float, dict[str, float]]:
        """Wait for the episode's next model request (its messages and tools) or its end (None, reward)."""
        kind, value = self._next()
        episode = self.episode
        if kind == "error":
            self.done = True
            raise EnvironmentFailure(f"verifiers episode failed: {type(value).__name__}: {value}") from value
        if kind == "done":
            self.done = True
            reward = 0.0
            metrics = dict(episode.metrics)
            for trace in episode.traces:
                reward += trace.reward
                for name, r in trace.rewards.items():
                    metrics[f"reward_{name}"] = float(r.score)
                metrics.update({k: float(v) for k, v in trace.metrics.items() if v is not None})
            return None, [], float(reward), metrics
        messages, tools = value
        return messages, tools, 0.0, {}

    def reset(self, prompt: list[Message], label: str | None, info: dict[str, str], seed: int | None) -> Opening:
        if self.episode is not None:
            raise EnvironmentFailure("reset twice: one instance is one episode")
        try:
            env = _load(self.taskset_id, self.taskset_options)
        except EnvironmentFailure:
            raise
        except Exception as err:  # an import or config error of the taskset: the sample cannot run
            raise EnvironmentFailure(f"cannot load verifiers taskset {self.taskset_id!r}: {err}") from err
        raw = (info or {}).get(IDX_KEY)
        if raw is None:
            task = _find_task(env, prompt, label)
        else:
            try:
                task = _task_at(env, int(raw))
            except ValueError:
                raise EnvironmentFailure(f"info[{IDX_KEY!r}] must be an integer, not {raw!r}") from None
        idx = task.data.idx
        self.episode = _Episode(env, task, self.max_turns, self.parser)
        self.episode.start()
        messages, tools, _, _ = self._advance()
        if messages is None:
            raise EnvironmentFailure("the verifiers episode ended before the model's first turn")
        self.episode.channel.sent = messages
        return Opening(messages=messages, tools=tools, info={"verifiers_task": str(idx)})

    def step(self, action: str) -> Outcome:
        episode = self.episode
        if episode is None or self.done:
            raise EnvironmentFailure("step outside an episode (before reset or after done)")
        pending = episode.channel.pending
        _background_loop().call_soon_threadsafe(lambda: pending.done() or pending.set_result(action))
        messages, _, reward, metrics = self._advance()
        if messages is None:
            return Outcome(messages=[], reward=reward, done=True, metrics=metrics, info=self._stop_info())
        sent = episode.channel.sent or []
        # The replica holds sent + its reply; the next request must extend exactly that (one conversation).
        if len(messages) < len(sent) + 1 or messages[: len(sent)] != sent or messages[len(sent)]["role"] != "assistant":
            raise EnvironmentFailure(
                "the verifiers episode asked for a turn on another conversation (more than one seat, or rewritten "
                "history): only one conversation per episode can be played by the replica"
            )
        episode.channel.sent = messages
        return Outcome(messages=messages[len(sent) + 1 :], metrics=dict(episode.metrics))

    def _stop_info(self) -> dict[str, str]:
        traces = self.episode.traces if self.episode else []
        return {"stop_condition": str(traces[-1].stop_condition)} if traces else {}

    def close(self) -> None:
        if self.episode is not None:
            self.episode.stop()


def factory(rest: str):
    """The registry's resolver for ``verifiers:<taskset-id>``."""
    if not rest:
        raise ValueError("write verifiers:<taskset-id> (an importable module exporting a vf.Taskset subclass)")
    return functools.partial(VerifiersEnvironment, rest)


def main(argv: list[str] | None = None) -> int:
    """``python -m rlhf.environments.adapters.verifiers_env <taskset-id> --out rows.jsonl``: the taskset's rows as a
    ``data.path`` file (run where verifiers is installed; the trainer reads the file with ``data.map_keys.system:
    system``, no verifiers needed there)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("taskset_id")
    parser.add_argument("--out", required=True, help="the JSON lines file to write")
    parser.add_argument("--split", default=None, help="the taskset config's split field")
    parser.add_argument("--limit", type=int, default=None, help="rows at most (needed for an infinite taskset)")
    parser.add_argument("--taskset", default="{}", help="taskset config fields as a JSON object")
    args = parser.parse_args(argv)
    rows = verifiers_rows(args.taskset_id, args.split, args.limit, json.loads(args.taskset))
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} rows of {args.taskset_id} -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
