"""The training service's request handling: :class:`TokenAuth` (a request's token -> its user) and
:class:`TinkerServing`, one method per tinker SDK call over an injected :class:`TrainingEngine`. Each method checks
what the engine cannot (a refused option names its field) and shapes the SDK's answer; errors are the
rlhf.serving errors, which the app turns into statuses through their one table. The routes:
services.training.api_router. Design: docs/tinker.md.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request, Response

from rlhf.serving import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServiceSettings,
    Unauthenticated,
    json_response,
    parse_bearer,
)
from services.training.engine import AdamStep, TrainingEngine
from services.training.futures import Outcome
from services.training.sampling import parse_sample_request
from services.training.sessions import owner_of
from services.training.shared_model import LoraSpec
from services.training.tinker_protocol import (
    PROTO,
    AdamIn,
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
from services.training.wire import decode_forward_backward, encode_forward_backward_output


def refuse(cond: bool, message: str, field: str) -> None:
    if cond:
        raise InvalidArgument(message, field=field)


class TokenAuth:
    """The SDK's ``X-API-Key`` (or ``Authorization: Bearer``) checked against the service's tokens; each token is
    one user, known by :func:`owner_of` (a digest)."""

    def __init__(self, tokens: list[str]):
        self.accepted = [t.encode() for t in tokens if t]

    def owner(self, request: Request) -> str:
        if not self.accepted:
            raise PermissionDenied("this server has no token configured (RLHF_API_TOKEN), so training calls are off")
        presented = request.headers.get("x-api-key") or parse_bearer(request.headers.get("authorization"))
        if not presented:
            raise Unauthenticated("missing token: send 'X-API-Key: <token>' (TINKER_API_KEY)", field="x-api-key")
        if not any(hmac.compare_digest(presented.encode(), t) for t in self.accepted):
            raise Unauthenticated("invalid token: it is not one of this server's tokens", field="x-api-key")
        return owner_of(presented)


class TinkerServing:
    """The tinker SDK's calls over one engine, each for the user ``owner`` (:meth:`TokenAuth.owner`)."""

    def __init__(self, engine: TrainingEngine, settings: ServiceSettings):
        self.engine = engine
        self.max_body_bytes = settings.max_body_bytes

    # ---------------------------------------------------------------------------------------- client and session

    def client_config(self) -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False,  # plain API keys, no JWT exchange
            "parallel_fwdbwd_chunks": False,  # chunks arrive in seq_id order, which is the order they are run in
            "proto_compress_fwdbwd": False,  # no zstd bodies
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, self.max_body_bytes // 2),
            "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    def capabilities(self) -> dict[str, Any]:
        model = {
            "model_name": self.engine.base_model,
            "max_context_length": self.engine.model.max_length or None,
            "trainable": True,
            "sampleable": True,  # by this service's own model (docs/tinker.md, Sampling)
        }
        return {"supported_models": [model]}

    def create_session(self, owner: str, body: CreateSessionIn) -> dict[str, Any]:
        session_id = self.engine.create_session(owner, {"tags": body.tags, "user_metadata": body.user_metadata})
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, owner: str, body: SessionIn) -> dict[str, Any]:
        self.engine.heartbeat(owner, body.session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, owner: str, session_id: str, body: FinishIn) -> Response:
        self.engine.finish_session(owner, session_id, str(body.reason.get("type", "")))
        return Response(status_code=200)

    # ---------------------------------------------------------------------------------------- models and training

    def create_model(self, owner: str, body: CreateModelIn) -> dict[str, Any]:
        refuse(body.lora_config is None, "lora_config is required: this service trains LoRA adapters", "lora_config")
        refuse(
            body.optimizer_config.type != "adamw",
            f"optimizer_config.type {body.optimizer_config.type!r}: only adamw is built",
            "optimizer_config",
        )
        lc = body.lora_config
        lora = LoraSpec(lc.rank, lc.seed, lc.train_mlp, lc.train_attn, lc.train_unembed)
        rid = self.engine.create_model(
            owner, body.session_id, body.model_seq_id, body.base_model, lora, body.user_metadata
        )
        return {"request_id": rid}

    def get_info(self, owner: str, body: ModelIn) -> dict[str, Any]:
        return self.engine.info(owner, body.model_id)

    async def forward_backward(self, owner: str, request: Request) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "")
        refuse(PROTO not in ctype, f"send the body as {PROTO} (the tinker SDK's encoding)", "content-type")
        refuse(
            bool(request.headers.get("content-encoding")),
            "compressed bodies are not accepted (this server asks the SDK for plain ones)",
            "content-encoding",
        )
        call = decode_forward_backward(await request.body())
        return {"request_id": self.engine.forward_backward(owner, call), "model_id": call.model_id}

    def optim_step(self, owner: str, body: OptimStepIn) -> dict[str, Any]:
        refuse(body.optimizer_params is not None, "only Adam is built: send adam_params", "optimizer_params")
        adam = body.adam_params or AdamIn()
        rid = self.engine.optim_step(owner, body.model_id, AdamStep(**adam.model_dump()), body.seq_id)
        return {"request_id": rid, "model_id": body.model_id}

    # ---------------------------------------------------------------------------------------- weights

    def save_weights(self, owner: str, body: SaveWeightsIn) -> dict[str, Any]:
        rid = self.engine.save_weights(
            owner, body.model_id, body.path, body.overwrite, body.user_metadata, body.seq_id, body.ttl_seconds
        )
        return {"request_id": rid, "model_id": body.model_id}

    def save_for_sampler(self, owner: str, body: SaveForSamplerIn) -> dict[str, Any]:
        refuse(
            body.path is None and body.sampling_session_seq_id is None,
            "give path (save_weights_for_sampler(name)) or sampling_session_seq_id "
            "(save_weights_and_get_sampling_client)",
            "path",
        )
        refuse(
            body.kind != "snapshot",
            f"kind {body.kind!r}: only snapshot saves are built (a sampler keeps the weights it was created from)",
            "kind",
        )
        rid = self.engine.save_for_sampler(
            owner,
            body.model_id,
            body.path,
            body.seq_id,
            body.ttl_seconds,
            body.user_metadata,
            body.sampling_session_seq_id if body.path is None else None,
        )
        return {"request_id": rid, "model_id": body.model_id}

    def load_weights(self, owner: str, body: LoadWeightsIn) -> dict[str, Any]:
        refuse(
            body.weights_access_token is not None, "weights_access_token: sharing is not built", "weights_access_token"
        )
        refuse(
            body.base_model is not None and body.base_model != self.engine.base_model,
            f"base_model {body.base_model!r} is not served here ({self.engine.base_model!r})",
            "base_model",
        )
        refuse(
            body.optimizer_config is not None and body.optimizer_config.type != "adamw",
            "optimizer_config: only adamw is built",
            "optimizer_config",
        )
        rid = self.engine.load_weights(
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

    def checkpoints(self, owner: str, model_id: str) -> dict[str, Any]:
        return {"checkpoints": self.engine.list_checkpoints(owner, model_id), "cursor": None}

    # ---------------------------------------------------------------------------------------- sampling

    async def create_sampling_session(self, owner: str, body: CreateSamplingSessionIn) -> dict[str, Any]:
        refuse(body.model_path is None and body.base_model is None, "give model_path or base_model", "model_path")
        sampler_id = await self.engine.create_sampling_session(
            owner, body.session_id, body.sampling_session_seq_id, body.model_path, body.base_model
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, owner: str, sampler_id: str) -> dict[str, Any]:
        return self.engine.get_sampler(owner, sampler_id)

    async def asample(self, owner: str, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidArgument("the body is not JSON (a tinker SampleRequest)") from None
        refuse(not isinstance(body, dict), "the body must be a JSON object (a tinker SampleRequest)", "body")
        sampler_id = body.get("sampling_session_id")
        refuse(
            not isinstance(sampler_id, str),
            "sampling_session_id is required: create a sampling client first (create_sampling_client)",
            "sampling_session_id",
        )
        self.engine.sampler(owner, sampler_id)
        spec = parse_sample_request(body, self.engine.model.vocab_size, self.engine.model.max_length)
        seq_id = body.get("seq_id")
        rid, sequence_ids = self.engine.sample(owner, sampler_id, seq_id if isinstance(seq_id, int) else None, spec)
        return {"request_id": rid, "sample_sequence_ids": sequence_ids}

    # ---------------------------------------------------------------------------------------- futures and ours

    async def retrieve_future(self, owner: str, body: RetrieveIn) -> Response:
        return render_outcome(body.request_id, await self.engine.retrieve(owner, body.request_id))

    async def info(self) -> dict[str, Any]:
        memory = await self.engine.memory_report()
        return {"base_model": self.engine.base_model, "runs": len(self.engine.runs), **memory}

    @staticmethod
    def not_built(method: str, call: str) -> NotFound:
        return NotFound(
            f"{method} /api/v1/{call}: this tinker SDK call is not built in this service "
            "(docs/tinker.md lists what is)",
            field="path",
        )


def render_outcome(request_id: str, outcome: Outcome) -> Response:
    """A future as the SDK reads it: try_again, ``{"error", "category"}`` (200: the call was answered, the request
    failed), or its result (protobuf for a sample and for forward / forward_backward, JSON for the rest)."""
    if outcome.state == "pending":
        return json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if outcome.state == "failed":
        return json_response({"error": outcome.error, "category": outcome.category})
    value = outcome.result
    if "sample" in value:  # a SampleResponse: protobuf only, as the SDK reads it
        return Response(value["sample"], media_type=PROTO)
    if "outputs" in value:  # a forward / forward_backward result: protobuf, as the SDK asks for it
        return Response(encode_forward_backward_output(value["outputs"], value["metrics"]), media_type=PROTO)
    return json_response(value)
