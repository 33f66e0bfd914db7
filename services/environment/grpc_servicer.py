"""rlhf.v1.EnvironmentService over the engine: proto <-> engine types; every call needs the token; errors and metrics
through rlhf.serving (unknown episode NOT_FOUND, environment failure INTERNAL, timeout DEADLINE_EXCEEDED)."""

from __future__ import annotations

import json

from rlhf.environments.wire import message_from_proto, message_to_proto
from rlhf.serving import InvalidArgument, ServiceMetrics, ServiceSettings, grpc_errors, require_grpc_token
from rlhf.v1 import environment_pb2, environment_pb2_grpc
from services.environment.engine import EnvironmentEngine

SERVICE_NAME = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, engine: EnvironmentEngine, settings: ServiceSettings, metrics: ServiceMetrics):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics

    @grpc_errors("Reset")
    async def Reset(self, request: environment_pb2.ResetRequest, context) -> environment_pb2.ResetResponse:
        require_grpc_token(context, self.settings)
        prompt = []
        for i, m in enumerate(request.prompt):
            try:
                prompt.append(message_from_proto(m))
            except ValueError as err:
                raise InvalidArgument(f"prompt[{i}].extra_json: {err}", f"prompt[{i}].extra_json") from None
        opening = await self.engine.reset(
            request.episode_id,
            request.environment,
            prompt,
            request.label if request.HasField("label") else None,
            dict(request.info),
            request.seed if request.HasField("seed") else None,
        )
        resp = environment_pb2.ResetResponse(
            messages=[message_to_proto(m) for m in opening.messages], tools_json=json.dumps(opening.tools)
        )
        resp.info.update(opening.info)
        return resp

    @grpc_errors("Step")
    async def Step(self, request: environment_pb2.StepRequest, context) -> environment_pb2.StepResponse:
        require_grpc_token(context, self.settings)
        outcome = await self.engine.step(
            request.episode_id, request.action, request.turn if request.HasField("turn") else None
        )
        resp = environment_pb2.StepResponse(
            messages=[message_to_proto(m) for m in outcome.messages], reward=outcome.reward, done=outcome.done
        )
        resp.info.update(outcome.info)
        resp.metrics.update(outcome.metrics)
        return resp

    @grpc_errors("Close")
    async def Close(self, request: environment_pb2.CloseRequest, context) -> environment_pb2.CloseResponse:
        require_grpc_token(context, self.settings)
        return environment_pb2.CloseResponse(existed=await self.engine.close_episode(request.episode_id))
