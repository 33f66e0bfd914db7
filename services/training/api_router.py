"""The training service's REST routes: ``router`` the tinker SDK's HTTP API (``/api/v1/...``, tinker 0.38.0),
``ours`` ``GET /v1/info``. Each checks the caller's token and hands the request to the :class:`TinkerServing` that
``build_app`` (services.training.http_app) puts on ``app.state.training`` (a :class:`TrainingServing`).

Every call and what is refused: docs/tinker.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from rlhf.serving.http import ContractRoute
from services.training.serving import TinkerServing, TokenAuth
from services.training.tinker_protocol import (
    CreateModelIn,
    CreateSamplingSessionIn,
    CreateSessionIn,
    FinishIn,
    LoadWeightsIn,
    ModelIn,
    OptimStepIn,
    RetrieveIn,
    SaveForSamplerIn,
    SaveWeightsIn,
    SessionIn,
)


@dataclass(frozen=True)
class TrainingServing:
    """What the routes call: the token check and the serving class over one engine."""

    auth: TokenAuth
    tinker: TinkerServing


def _state(request: Request) -> TrainingServing:
    return request.app.state.training


def _user(request: Request) -> str:
    return _state(request).auth.owner(request)


def _tinker(request: Request) -> TinkerServing:
    return _state(request).tinker


Owner = Annotated[str, Depends(_user)]  # every call but the health checks needs a token
Tinker = Annotated[TinkerServing, Depends(_tinker)]

# ContractRoute: the error statuses in OpenAPI, as on the routes create_app adds (include_router keeps the class)
router = APIRouter(route_class=ContractRoute, tags=["tinker"])  # the SDK's calls; the catch-all 404 last
ours = APIRouter(route_class=ContractRoute, tags=["training"])

# ---------------------------------------------------------------------------------------- client and session


@router.post("/api/v1/client/config", summary="the SDK's feature flags for this server")
async def client_config(tinker: Tinker, _owner: Owner) -> dict:
    return tinker.client_config()


@router.post("/api/v1/client/dynamic_config", summary="the SDK's periodically refreshed flags")
async def client_dynamic_config(_owner: Owner) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/api/v1/telemetry", summary="the SDK's telemetry: accepted and not kept")
async def telemetry(_owner: Owner) -> dict:
    return {"status": "accepted"}


@router.get("/api/v1/healthz", summary="alive")
async def api_healthz() -> dict:
    return {"status": "ok"}


@router.get("/api/v1/get_server_capabilities", summary="the base model this service trains")
async def capabilities(tinker: Tinker, _owner: Owner) -> dict:
    return tinker.capabilities()


@router.post("/api/v1/create_session", summary="a session (heartbeat it every 10 s)")
async def create_session(body: CreateSessionIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.create_session(owner, body)


@router.post("/api/v1/session_heartbeat", summary="keep a session alive")
async def heartbeat(body: SessionIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.heartbeat(owner, body)


@router.post("/api/v1/sessions/{session_id}/finish", summary="mark a session finished")
async def finish(session_id: str, body: FinishIn, tinker: Tinker, owner: Owner) -> Response:
    return tinker.finish_session(owner, session_id, body)


# ---------------------------------------------------------------------------------------- models and training


@router.post("/api/v1/create_model", summary="a LoRA training run over the base model (future)")
async def create_model(body: CreateModelIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.create_model(owner, body)


@router.post("/api/v1/get_info", summary="base model, LoRA rank and optimizer of a run")
async def get_info(body: ModelIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.get_info(owner, body)


@router.post("/api/v1/forward_backward", summary="forward (+ backward) on a batch (protobuf; future)")
async def forward_backward(request: Request, tinker: Tinker, owner: Owner) -> dict:
    return await tinker.forward_backward(owner, request)


@router.post("/api/v1/optim_step", summary="one Adam step with the given parameters (future)")
async def optim_step(body: OptimStepIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.optim_step(owner, body)


# ---------------------------------------------------------------------------------------- weights


@router.post("/api/v1/save_weights", summary="checkpoint adapter + optimizer (future)")
async def save_weights(body: SaveWeightsIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.save_weights(owner, body)


@router.post("/api/v1/save_weights_for_sampler", summary="the adapter as a PEFT folder (future)")
async def save_for_sampler(body: SaveForSamplerIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.save_for_sampler(owner, body)


# ---------------------------------------------------------------------------------------- sampling


@router.post("/api/v1/create_sampling_session", summary="a sampler over saved weights or the base")
async def create_sampling_session(body: CreateSamplingSessionIn, tinker: Tinker, owner: Owner) -> dict:
    return await tinker.create_sampling_session(owner, body)


@router.get("/api/v1/samplers/{sampler_id}", summary="a sampler's base model and weights")
async def get_sampler(sampler_id: str, tinker: Tinker, owner: Owner) -> dict:
    return tinker.get_sampler(owner, sampler_id)


@router.post("/api/v1/asample", summary="sample continuations of a prompt (future; protobuf result)")
async def asample(request: Request, tinker: Tinker, owner: Owner) -> dict:
    return await tinker.asample(owner, request)


@router.post("/api/v1/load_weights", summary="restore a checkpoint into a run, or a new run (future)")
async def load_weights(body: LoadWeightsIn, tinker: Tinker, owner: Owner) -> dict:
    return tinker.load_weights(owner, body)


@router.get("/api/v1/training_runs/{model_id}/checkpoints", summary="a run's checkpoints")
async def checkpoints(model_id: str, tinker: Tinker, owner: Owner) -> dict:
    return tinker.checkpoints(owner, model_id)


# ---------------------------------------------------------------------------------------- futures


@router.post("/api/v1/retrieve_future", summary="a future's result, error, or try_again")
async def retrieve_future(body: RetrieveIn, tinker: Tinker, owner: Owner) -> Response:
    return await tinker.retrieve_future(owner, body)


# ---------------------------------------------------------------------------------------- ours


@ours.get("/v1/info", summary="base model, runs, and memory per run")
async def info(tinker: Tinker, _owner: Owner) -> dict:
    return await tinker.info()


# Last: any other SDK call (sampling, REST listings, sharing) is a clear 404, which the SDK does not retry
@router.api_route(
    "/api/v1/{call:path}",
    methods=["GET", "POST", "PUT", "DELETE"],
    summary="tinker calls not built here",
    include_in_schema=False,
)
async def not_built(call: str, request: Request, _owner: Owner) -> dict:
    raise TinkerServing.not_built(request.method, call)
