"""REST of the training service: the tinker SDK's HTTP API (``/api/v1/...``, tinker 0.38.0), plus ``GET /v1/info``.

Shapes are the SDK's (tinker/types): JSON bodies, except forward_backward's request and its result, which are
protobuf (proto/rlhf/v1/tinker.proto). Long-running calls answer ``{"request_id": ...}`` at once and the client polls
``/api/v1/retrieve_future``. Every call but the health checks needs a token: the SDK's ``X-API-Key`` header
(``TINKER_API_KEY``) or ``Authorization: Bearer``, one of the service's tokens (``RLHF_API_TOKEN``,
``RLHF_TRAINING_TOKENS``); each token is one user. The compatibility table: docs/tinker.md.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from rlhf.serving import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServiceMetrics,
    ServiceSettings,
    Unauthenticated,
    create_app,
    json_response,
    parse_bearer,
)
from services.training.engine import AdamStep, LoraSpec, TrainingEngine, owner_of
from services.training.sampling import parse_sample_request
from services.training.wire import decode_forward_backward, encode_forward_backward_output

PROTO = "application/x-protobuf"


class _Req(BaseModel):
    # The SDK adds fields of its own (a "type" tag, project and display names): unknown keys are left to it, and
    # the fields below that change behaviour are either implemented or refused.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionIn(_Req):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""


class SessionIn(_Req):
    session_id: str


class LoraIn(_Req):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerIn(_Req):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelIn(_Req):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraIn | None = None
    optimizer_config: OptimizerIn = OptimizerIn()


class ModelIn(_Req):
    model_id: str


class AdamIn(_Req):
    model_config = ConfigDict(extra="forbid")
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepIn(_Req):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamIn | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsIn(_Req):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveForSamplerIn(_Req):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class CreateSamplingSessionIn(_Req):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class LoadWeightsIn(_Req):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerIn | None = None
    weights_access_token: str | None = None


class RetrieveIn(_Req):
    request_id: str
    allow_metadata_only: bool = False


class FinishIn(_Req):
    reason: dict[str, Any] = Field(default_factory=dict)
    detail: str | None = None


def _refuse(cond: bool, message: str, field: str) -> None:
    if cond:
        raise InvalidArgument(message, field=field)


def build_app(engine: TrainingEngine, settings: ServiceSettings, metrics: ServiceMetrics, tokens: list[str]) -> FastAPI:
    app = create_app(
        "training",
        settings,
        metrics,
        title="rlhf training service",
        description="Client-driven LoRA training over one base model: the tinker SDK's HTTP API.",
    )
    accepted = [t.encode() for t in tokens if t]

    def user(request: Request) -> str:
        if not accepted:
            raise PermissionDenied("this server has no token configured (RLHF_API_TOKEN), so training calls are off")
        presented = request.headers.get("x-api-key") or parse_bearer(request.headers.get("authorization"))
        if not presented:
            raise Unauthenticated("missing token: send 'X-API-Key: <token>' (TINKER_API_KEY)", field="x-api-key")
        if not any(hmac.compare_digest(presented.encode(), t) for t in accepted):
            raise Unauthenticated("invalid token: it is not one of this server's tokens", field="x-api-key")
        return owner_of(presented)

    owner_dep = Depends(user)

    # ---------------------------------------------------------------------------------------- client and session

    @app.post("/api/v1/client/config", tags=["tinker"], summary="the SDK's feature flags for this server")
    async def client_config(_owner: str = owner_dep) -> dict:
        return {
            "pjwt_auth_enabled": False,  # plain API keys, no JWT exchange
            "parallel_fwdbwd_chunks": False,  # chunks arrive in seq_id order, which is the order they are run in
            "proto_compress_fwdbwd": False,  # no zstd bodies
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, settings.max_body_bytes // 2),
            "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    @app.post("/api/v1/client/dynamic_config", tags=["tinker"], summary="the SDK's periodically refreshed flags")
    async def client_dynamic_config(_owner: str = owner_dep) -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry", tags=["tinker"], summary="the SDK's telemetry: accepted and not kept")
    async def telemetry(_owner: str = owner_dep) -> dict:
        return {"status": "accepted"}

    @app.get("/api/v1/healthz", tags=["tinker"], summary="alive")
    async def api_healthz() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities", tags=["tinker"], summary="the base model this service trains")
    async def capabilities(_owner: str = owner_dep) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": engine.base_model,
                    "max_context_length": engine.max_length or None,
                    "trainable": True,
                    "sampleable": True,  # by this service's own model (docs/tinker.md, Sampling)
                }
            ]
        }

    @app.post("/api/v1/create_session", tags=["tinker"], summary="a session (heartbeat it every 10 s)")
    async def create_session(body: CreateSessionIn, owner: str = owner_dep) -> dict:
        session_id = engine.create_session(owner, {"tags": body.tags, "user_metadata": body.user_metadata})
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat", tags=["tinker"], summary="keep a session alive")
    async def heartbeat(body: SessionIn, owner: str = owner_dep) -> dict:
        engine.heartbeat(owner, body.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish", tags=["tinker"], summary="mark a session finished")
    async def finish(session_id: str, body: FinishIn, owner: str = owner_dep) -> Response:
        engine.finish_session(owner, session_id, str(body.reason.get("type", "")))
        return Response(status_code=200)

    # ---------------------------------------------------------------------------------------- models

    @app.post("/api/v1/create_model", tags=["tinker"], summary="a LoRA training run over the base model (future)")
    async def create_model(body: CreateModelIn, owner: str = owner_dep) -> dict:
        _refuse(body.lora_config is None, "lora_config is required: this service trains LoRA adapters", "lora_config")
        _refuse(
            body.optimizer_config.type != "adamw",
            f"optimizer_config.type {body.optimizer_config.type!r}: only adamw is built",
            "optimizer_config",
        )
        lc = body.lora_config
        lora = LoraSpec(lc.rank, lc.seed, lc.train_mlp, lc.train_attn, lc.train_unembed)
        rid = engine.create_model(owner, body.session_id, body.model_seq_id, body.base_model, lora, body.user_metadata)
        return {"request_id": rid}

    @app.post("/api/v1/get_info", tags=["tinker"], summary="base model, LoRA rank and optimizer of a run")
    async def get_info(body: ModelIn, owner: str = owner_dep) -> dict:
        return engine.info(owner, body.model_id)

    @app.post("/api/v1/forward_backward", tags=["tinker"], summary="forward (+ backward) on a batch (protobuf; future)")
    async def forward_backward(request: Request, owner: str = owner_dep) -> dict:
        ctype = request.headers.get("content-type", "")
        _refuse(PROTO not in ctype, f"send the body as {PROTO} (the tinker SDK's encoding)", "content-type")
        _refuse(
            bool(request.headers.get("content-encoding")),
            "compressed bodies are not accepted (this server asks the SDK for plain ones)",
            "content-encoding",
        )
        call = decode_forward_backward(await request.body())
        return {"request_id": engine.forward_backward(owner, call), "model_id": call.model_id}

    @app.post("/api/v1/optim_step", tags=["tinker"], summary="one Adam step with the given parameters (future)")
    async def optim_step(body: OptimStepIn, owner: str = owner_dep) -> dict:
        _refuse(body.optimizer_params is not None, "only Adam is built: send adam_params", "optimizer_params")
        adam = body.adam_params or AdamIn()
        rid = engine.optim_step(owner, body.model_id, AdamStep(**adam.model_dump()), body.seq_id)
        return {"request_id": rid, "model_id": body.model_id}

    # ---------------------------------------------------------------------------------------- weights

    @app.post("/api/v1/save_weights", tags=["tinker"], summary="checkpoint adapter + optimizer (future)")
    async def save_weights(body: SaveWeightsIn, owner: str = owner_dep) -> dict:
        rid = engine.save_weights(
            owner, body.model_id, body.path, body.overwrite, body.user_metadata, body.seq_id, body.ttl_seconds
        )
        return {"request_id": rid, "model_id": body.model_id}

    @app.post("/api/v1/save_weights_for_sampler", tags=["tinker"], summary="the adapter as a PEFT folder (future)")
    async def save_for_sampler(body: SaveForSamplerIn, owner: str = owner_dep) -> dict:
        _refuse(
            body.path is None and body.sampling_session_seq_id is None,
            "give path (save_weights_for_sampler(name)) or sampling_session_seq_id "
            "(save_weights_and_get_sampling_client)",
            "path",
        )
        _refuse(
            body.kind != "snapshot",
            f"kind {body.kind!r}: only snapshot saves are built (a sampler keeps the weights it was created from)",
            "kind",
        )
        rid = engine.save_for_sampler(
            owner,
            body.model_id,
            body.path,
            body.seq_id,
            body.ttl_seconds,
            body.user_metadata,
            body.sampling_session_seq_id if body.path is None else None,
        )
        return {"request_id": rid, "model_id": body.model_id}

    # ---------------------------------------------------------------------------------------- sampling

    @app.post("/api/v1/create_sampling_session", tags=["tinker"], summary="a sampler over saved weights or the base")
    async def create_sampling_session(body: CreateSamplingSessionIn, owner: str = owner_dep) -> dict:
        _refuse(body.model_path is None and body.base_model is None, "give model_path or base_model", "model_path")
        sampler_id = await engine.create_sampling_session(
            owner, body.session_id, body.sampling_session_seq_id, body.model_path, body.base_model
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}", tags=["tinker"], summary="a sampler's base model and weights")
    async def get_sampler(sampler_id: str, owner: str = owner_dep) -> dict:
        return engine.get_sampler(owner, sampler_id)

    @app.post("/api/v1/asample", tags=["tinker"], summary="sample continuations of a prompt (future; protobuf result)")
    async def asample(request: Request, owner: str = owner_dep) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidArgument("the body is not JSON (a tinker SampleRequest)") from None
        _refuse(not isinstance(body, dict), "the body must be a JSON object (a tinker SampleRequest)", "body")
        sampler_id = body.get("sampling_session_id")
        _refuse(
            not isinstance(sampler_id, str),
            "sampling_session_id is required: create a sampling client first (create_sampling_client)",
            "sampling_session_id",
        )
        engine.sampler(owner, sampler_id)
        spec = parse_sample_request(body, engine.vocab_size, engine.max_length)
        seq_id = body.get("seq_id")
        rid, sequence_ids = engine.sample(owner, sampler_id, seq_id if isinstance(seq_id, int) else None, spec)
        return {"request_id": rid, "sample_sequence_ids": sequence_ids}

    @app.post("/api/v1/load_weights", tags=["tinker"], summary="restore a checkpoint into a run, or a new run (future)")
    async def load_weights(body: LoadWeightsIn, owner: str = owner_dep) -> dict:
        _refuse(
            body.weights_access_token is not None, "weights_access_token: sharing is not built", "weights_access_token"
        )
        _refuse(
            body.base_model is not None and body.base_model != engine.base_model,
            f"base_model {body.base_model!r} is not served here ({engine.base_model!r})",
            "base_model",
        )
        _refuse(
            body.optimizer_config is not None and body.optimizer_config.type != "adamw",
            "optimizer_config: only adamw is built",
            "optimizer_config",
        )
        rid = engine.load_weights(
            owner,
            body.path,
            body.optimizer,
            body.model_id,
            body.session_id,
            body.model_seq_id,
            body.user_metadata,
            body.seq_id,
        )
        return {"request_id": rid, "model_id": body.model_id}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints", tags=["tinker"], summary="a run's checkpoints")
    async def checkpoints(model_id: str, owner: str = owner_dep) -> dict:
        return {"checkpoints": engine.list_checkpoints(owner, model_id), "cursor": None}

    # ---------------------------------------------------------------------------------------- futures

    @app.post("/api/v1/retrieve_future", tags=["tinker"], summary="a future's result, error, or try_again")
    async def retrieve_future(body: RetrieveIn, request: Request, owner: str = owner_dep) -> Response:
        state, value = await engine.retrieve(owner, body.request_id)
        if state == "pending":
            return json_response({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        if state == "failed":
            message, category = value
            return json_response({"error": message, "category": category})
        if "sample" in value:  # a SampleResponse: protobuf only, as the SDK reads it
            return Response(value["sample"], media_type=PROTO)
        if "outputs" in value:  # a forward / forward_backward result: protobuf, as the SDK asks for it
            return Response(encode_forward_backward_output(value["outputs"], value["metrics"]), media_type=PROTO)
        return json_response(value)

    # ---------------------------------------------------------------------------------------- ours

    @app.get("/v1/info", tags=["training"], summary="base model, runs, and memory per run")
    async def info(_owner: str = owner_dep) -> dict:
        return {"base_model": engine.base_model, "runs": len(engine.runs), **await engine.memory_report()}

    # Last: any other SDK call (sampling, REST listings, sharing) is a clear 404, which the SDK does not retry
    @app.api_route(
        "/api/v1/{call:path}",
        methods=["GET", "POST", "PUT", "DELETE"],
        tags=["tinker"],
        summary="tinker calls not built here",
        include_in_schema=False,
    )
    async def not_built(call: str, request: Request, _owner: str = owner_dep) -> dict:
        raise NotFound(
            f"{request.method} /api/v1/{call}: this tinker SDK call is not built in this service "
            "(docs/tinker.md lists what is)",
            field="path",
        )

    return app
