"""The tinker SDK's request bodies (tinker/types, 0.38.0) as the training service reads them, and the one protobuf
media type. The routes: services.training.api_router; what each call does: services.training.serving.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PROTO = "application/x-protobuf"  # forward_backward's request and result, and asample's result


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
