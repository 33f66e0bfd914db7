"""The OpenAI / vLLM wire models of the rollout service's REST API (requests validated here, responses and stream
chunks as OpenAI shapes them), kept apart from the routes (services.rollout.api_router) and the serving classes
(services.rollout.serving*) as vLLM keeps its protocol module apart."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, field_validator

from rlhf.serving import InvalidArgument
from rlhf.serving.http import Declared, JsonInt, TokenId, Utf8Text, json_int
from services.rollout.options import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_ROWS,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SamplingOptions,
    resolve_options,
)

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
SampleCount = json_int(ge=1, le=MAX_N)
TopLogprobs = json_int(ge=0, le=MAX_TOP_LOGPROBS)

# What the engine refuses with a 400 naming the field, stated in the schema. Token ids must also be below the served
# model's vocabulary size, a prompt must leave room in its context for one new token, and max_tokens must be below
# its context length: those depend on the model (400 otherwise).
PromptText = Annotated[Utf8Text, Declared(minLength=1)]
PromptIds = Annotated[list[Annotated[JsonInt, Declared(minimum=0)]], Declared(minItems=1)]
StopText = Annotated[Utf8Text, Declared(minLength=1, maxLength=MAX_STOP_LEN)]
Prompts = Annotated[list[PromptText], Declared(minItems=1, maxItems=MAX_ROWS)]
TokenPrompts = Annotated[list[PromptIds], Declared(minItems=1, maxItems=MAX_ROWS)]


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integral(x: Any) -> Any:
    """7.0 -> 7 (a JSON Schema integer), anything else as it is."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Model):
    n: SampleCount = Field(1, description=f"samples per prompt (prompts x n at most {MAX_ROWS})")
    max_tokens: json_int(ge=1) | None = Field(
        None, description="new tokens per sample, below the model's context length (default: the service's)"
    )
    temperature: StrictFloat | None = Field(
        None, ge=0, le=MAX_TEMPERATURE, description="0: greedy (default: the service's)"
    )
    top_p: StrictFloat | None = Field(None, gt=0, le=1, description="nucleus sampling (default: the service's)")
    top_k: json_int(ge=-1) | None = Field(None, description="-1 or 0: off (default: the service's)")
    stop: StopText | Annotated[list[StopText], Declared(maxItems=MAX_STOP)] | None = Field(
        None, description="stop string(s); not included in the text"
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_STOP, description="token ids that end a sample (below the model's vocabulary size)"
    )
    seed: json_int(ge=0, le=MAX_SEED) | None = Field(None, description="sample j uses seed + j: reproducible")
    ignore_eos: StrictBool = Field(False, description="keep generating after EOS")
    frequency_penalty: StrictFloat | None = Field(
        None, ge=-2, le=2, description="minus penalty x the token's count so far"
    )
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2, description="minus penalty once the token appeared")
    repetition_penalty: StrictFloat | None = Field(
        None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="vLLM's: > 1 discourages prompt and output tokens, < 1 encourages them",
    )

    def options(
        self, defaults: dict[str, Any], *, n: int | None = None, max_tokens: int | None = None, top_logprobs: int = 0
    ) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return resolve_options(
            defaults,
            n=n or self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens or self.max_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            top_logprobs=top_logprobs,
        )


class StreamOptions(_Model):
    include_usage: StrictBool = Field(False, description="a last chunk with the usage of the whole request")


class _OpenAIRequest(_Sampling):
    model: str | None = Field(None, description="accepted for OpenAI compatibility; the served model answers")
    stream: StrictBool = Field(False, description="Server-Sent Events (OpenAI chunks), ending with data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="with stream: include_usage")
    user: str | None = Field(None, description="accepted and ignored: OpenAI uses it for abuse monitoring")

    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument(
                "stream_options applies to streams only: set stream: true or drop it", field="stream_options"
            )
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAIRequest):
    """Text prompts are tokenized as given (no chat template); token ids must be below the model's vocabulary size
    and a prompt must leave room in its context for one new token (400 otherwise). ``best_of`` is at least ``n``
    and not streamed with ``best_of > n``; ``max_tokens: 0`` needs ``echo`` and is not streamed; ``stream_options``
    needs ``stream`` (400 otherwise)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"prompt": "User: what is 1 plus 2?\nAssistant:", "max_tokens": 8, "seed": 1}]},
    )

    prompt: PromptText | Prompts | PromptIds | TokenPrompts = Field(description="the prompt(s): " + PROMPT_SHAPES)
    logprobs: TopLogprobs | None = Field(
        None, description="the sampled tokens' log-probs and this many alternatives each"
    )
    best_of: SampleCount | None = Field(
        None, description="samples generated per prompt; the n most probable are returned"
    )
    # 0 (vLLM's and OpenAI's legacy API): no new token, only the echoed prompt and, with logprobs, its log-probs
    max_tokens: json_int(ge=0) | None = Field(
        None,
        description="new tokens per sample, below the model's context length (default: the service's); 0 with echo: "
        "score the prompt only",
    )
    echo: StrictBool = Field(
        False,
        description="prepend the prompt to the text; with logprobs also its tokens' log-probs (the first is null) "
        "before the generated ones, as vLLM returns them (what lm-eval's loglikelihood requests read)",
    )
    return_token_ids: StrictBool = Field(False, description="return prompt and completion token ids (vLLM)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            v = [[_integral(t) for t in x] if isinstance(x, list) else _integral(x) for x in v]
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v) or all(is_int(x) for x in v):
                return v
            if all(isinstance(x, list) and all(is_int(t) for t in x) for x in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty: send at least one prompt")
        raise ValueError(f"must be {PROMPT_SHAPES}")


class TextPart(_Model):
    type: Literal["text"] = Field(description="only text parts: the served models are text-only")
    text: Utf8Text


class FunctionCallIn(_Model):
    name: Utf8Text
    arguments: Utf8Text = Field(description="the arguments as a JSON string (OpenAI's shape)")


class ToolCallIn(_Model):
    id: Utf8Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Utf8Text | list[TextPart] | None = Field(None, description="text, or a list of text parts")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant messages: the tool calls it made")
    tool_call_id: Utf8Text | None = Field(None, description="tool messages: the call this is the result of")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Model):
    name: Annotated[Utf8Text, Field(min_length=1)]
    description: Utf8Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema object, rendered for the model")
    strict: StrictBool | None = Field(
        None, description="rendered with the schema; not enforced (the service does not constrain decoding)"
    )


class ToolIn(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: Utf8Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAIRequest):
    """The messages (and ``tools``) are rendered by the served tokenizer's chat template, which may refuse them
    (400), as ``top_logprobs`` without ``logprobs``, ``stream_options`` without ``stream``, ``tool_choice``
    ``required`` or a named function, and ``tool_calls`` on a message that is not the assistant's are."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"messages": [{"role": "user", "content": "what is 1 plus 2?"}], "max_completion_tokens": 8}]
        },
    )

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, rendered by the chat template")
    max_completion_tokens: json_int(ge=1) | None = Field(
        None, description="new tokens per choice (OpenAI's newer name for max_tokens; wins when both are set)"
    )
    logprobs: StrictBool = Field(False, description="return the sampled tokens' log-probs")
    top_logprobs: TopLogprobs | None = Field(None, description="alternatives per token (needs logprobs: true)")
    tools: Annotated[list[ToolIn], Field(min_length=1)] | None = Field(
        None, description="functions the model may call: rendered by the chat template, calls parsed from the text"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools): the model may call tools; none: tools are neither rendered "
        "nor parsed; required and a named function are refused (400): decoding is not constrained",
    )
    parallel_tool_calls: StrictBool | None = Field(
        None, description="false: at most one tool call per choice, the first (as vLLM does); default true"
    )
    return_token_ids: StrictBool = Field(
        False,
        description="vLLM's: prompt_token_ids in the response and token_ids in each choice (streamed: "
        "prompt_token_ids in the first chunk, each chunk's token_ids)",
    )


class GenerateRequest(_Sampling):
    """Token ids below the model's vocabulary size; each prompt leaves room in its context for one new token (400
    otherwise, naming the prompt)."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"prompt_token_ids": [[2, 5, 6]], "max_tokens": 8, "seed": 1}]}
    )

    prompt_token_ids: Annotated[list[Annotated[list[TokenId], Declared(minItems=1)]], Declared(maxItems=MAX_ROWS)] = (
        Field(min_length=1, description="one list of token ids per prompt")
    )


class LogprobsOut(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null only for the first prompt token under echo")
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None = Field(
        None, description="with logprobs > 0: alternatives per token (null at the first prompt token under echo)"
    )


class ChoiceOut(BaseModel):
    index: int
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: LogprobsOut | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobsOut(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object as a string")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the text; outside the tool-call blocks when tools were parsed")
    tool_calls: list[ToolCallOut] | None = Field(None, description="with tools: the calls parsed from the text")


class ChatChoiceOut(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobsOut | None = None
    finish_reason: str = Field(description="stop, length, or tool_calls when the text held tool calls")
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated token ids")
    policy_version: int


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[ChoiceOut]
    usage: UsageOut
    policy_version: int = Field(description="the weights version serving when the request finished")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoiceOut]
    usage: UsageOut
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: the rendered prompt's ids")
    policy_version: int = Field(description="the weights version serving when the request finished")


# Stream chunks. A chunk is rendered with exclude_unset (as vLLM renders its chunks): a field left out of the
# constructor is left out of the JSON, so a choice carries stop_reason and policy_version only on its last chunk.


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: LogprobsOut | None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: this chunk's tokens (vLLM's)")
    prompt_token_ids: list[int] | None = Field(
        None, description="with return_token_ids: the prompt's ids, in the choice's first chunk (vLLM's)"
    )
    stop_reason: int | str | None = None
    policy_version: int | None = None


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatDeltaOut(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDeltaOut
    logprobs: ChatLogprobsOut | None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: this chunk's tokens (vLLM's)")
    stop_reason: int | str | None = None
    policy_version: int | None = None


class StreamChunk(BaseModel):
    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    prompt_token_ids: list[int] | None = Field(None, description="chat with return_token_ids: in the first chunk")
    choices: list[CompletionStreamChoice | ChatStreamChoice]
    usage: UsageOut | None = Field(None, description="with include_usage: the last chunk, with no choices")
    policy_version: int | None = None


class CompletionOut(BaseModel):
    token_ids: list[int]
    logprobs: list[float] = Field(description="log-prob of each generated token under the sampling distribution")
    finish_reason: str = Field(description="stop (EOS, stop id or stop string) or length")
    stop_reason: int | str | None = None
    text: str
    policy_version: int = Field(description="the weights version that sampled it (version spans: the oldest span's)")
    span_starts: list[int] = Field(
        description="partial rollouts: the first token of each stretch one version sampled (the first 0); empty "
        "when one version sampled every token"
    )
    span_versions: list[int] = Field(description="the version that sampled each stretch of span_starts")


class PromptResultOut(BaseModel):
    prompt_token_ids: list[int]
    completions: list[CompletionOut]


class GenerateResponse(BaseModel):
    request_id: str
    policy_version: int
    results: list[PromptResultOut]


class WeightsVersionOut(BaseModel):
    version: int
    checksum: str
    loaded_at_unix_ms: int
    model: str
    engine: str
