"""REST for the environment service: the gRPC calls as JSON (``POST /v1/episodes/reset``, ``/step``, ``/close``) and
``GET /v1/environments``; every route but health needs the token. Unknown episode: 404; the environment failed: 500
with its message; timeout: 504; bad input: 422 (schema) or 400."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field

from rlhf.serving import (
    ServiceMetrics,
    ServiceSettings,
    create_app,
    http_error_responses,
    http_token_dependency,
    json_response,
)
from rlhf.serving.http import Declared, Utf8Text, json_int
from services.environment.engine import (
    MAX_EPISODE_ID_CHARS,
    MAX_INFO_ENTRIES,
    MAX_PROMPT_MESSAGES,
    MAX_TEXT_CHARS,
    EnvironmentEngine,
)

EpisodeId = Annotated[Utf8Text, Field(min_length=1, max_length=MAX_EPISODE_ID_CHARS)]
Text = Annotated[Utf8Text, Declared(maxLength=MAX_TEXT_CHARS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageIn(BaseModel):
    """A chat message in OpenAI's shape; other keys (an assistant's tool_calls) are kept as they are."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[Utf8Text, Field(min_length=1, max_length=64)] = Field(description="system, user, assistant, tool")
    content: Text | None = Field(None, description="the message text")
    name: str | None = Field(None, description="the tool's name (role tool) or the speaker's")
    tool_call_id: str | None = Field(None, description="role tool: the call this message answers")


class ResetIn(_Model):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "episode_id": "job-1/0/0",
                    "environment": "builtin:calculator",
                    "prompt": [{"role": "user", "content": "what is 2 plus 3?"}],
                    "label": "5",
                }
            ]
        },
    )

    episode_id: EpisodeId = Field(description="the caller's name for the episode; a repeated reset is idempotent")
    environment: str = Field("", description="a hosted environment; empty when the service hosts one")
    prompt: list[MessageIn] = Field([], max_length=MAX_PROMPT_MESSAGES, description="the task's chat messages")
    label: Text | None = Field(None, description="the reference answer, when there is one")
    info: dict[str, str] = Field({}, max_length=MAX_INFO_ENTRIES, description="the prompt's metadata")
    # JSON's safe integers: a wider bound is rounded by clients that read numbers as doubles
    seed: json_int(ge=-(2**53 - 1), le=2**53 - 1) | None = Field(None, description="seed of the episode's randomness")


class ResetOut(BaseModel):
    messages: list[dict[str, Any]] = Field(description="the conversation the model answers first")
    tools: list[dict[str, Any]] = Field(description="OpenAI function-tool schemas the model may call")
    info: dict[str, str]


class StepIn(_Model):
    episode_id: EpisodeId = Field(description="an episode reset before")
    action: Text = Field(description="the model's turn as decoded text")
    turn: json_int(ge=0, le=2**31 - 1) | None = Field(
        None, description="steps made before this one: a repeat of the last step answers it again (safe retries)"
    )


class StepOut(BaseModel):
    messages: list[dict[str, Any]] = Field(description="what follows the model's turn (tool results, observations)")
    reward: float
    done: bool
    info: dict[str, str]
    metrics: dict[str, float] = Field(description="counters of this step (tool_calls, tool_errors, ...)")


class CloseIn(_Model):
    episode_id: EpisodeId


class CloseOut(BaseModel):
    existed: bool = Field(description="false: the episode was not open (closed, expired or lost in a restart)")


class EnvironmentsOut(BaseModel):
    environments: list[str]
    open_episodes: int


def build_app(engine: EnvironmentEngine, settings: ServiceSettings, metrics: ServiceMetrics) -> FastAPI:
    app = create_app(
        "environment",
        settings,
        metrics,
        title="rlhf environment service",
        description="Episodes of multi-turn tasks: reset, step and close, one environment instance per episode. "
        "Every call needs 'Authorization: Bearer <RLHF_API_TOKEN>'.",
    )
    auth = [Depends(http_token_dependency(settings))]

    @app.post(
        "/v1/episodes/reset",
        response_model=None,
        dependencies=auth,
        responses={
            200: {"model": ResetOut, "description": "the episode's opening"},
            **http_error_responses(409, 429, 503, 504),
        },
        tags=["environment"],
        summary="start an episode (a repeated reset of the same id answers the same opening)",
    )
    async def reset(body: ResetIn) -> Response:
        prompt = [m.model_dump(exclude_none=True) for m in body.prompt]
        opening = await engine.reset(body.episode_id, body.environment, prompt, body.label, body.info, body.seed)
        return json_response({"messages": opening.messages, "tools": opening.tools, "info": opening.info})

    @app.post(
        "/v1/episodes/step",
        response_model=None,
        dependencies=auth,
        responses={
            200: {"model": StepOut, "description": "the outcome of the model's turn"},
            **http_error_responses(404, 409, 503, 504),
        },
        tags=["environment"],
        summary="one model turn; 404: the episode is not open here (start it again)",
    )
    async def step(body: StepIn) -> Response:
        o = await engine.step(body.episode_id, body.action, body.turn)
        out = {"messages": o.messages, "reward": o.reward, "done": o.done, "info": o.info, "metrics": o.metrics}
        return json_response(out)

    @app.post(
        "/v1/episodes/close",
        response_model=CloseOut,
        dependencies=auth,
        responses=http_error_responses(503),
        tags=["environment"],
        summary="release an episode (closing one that is not open is not an error)",
    )
    async def close(body: CloseIn) -> CloseOut:
        return CloseOut(existed=await engine.close_episode(body.episode_id))

    @app.get(
        "/v1/environments",
        response_model=EnvironmentsOut,
        dependencies=auth,
        tags=["environment"],
        summary="the hosted environments and the number of open episodes",
    )
    async def environments() -> EnvironmentsOut:
        return EnvironmentsOut(**engine.describe())

    return app
