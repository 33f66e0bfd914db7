"""gRPC ``rlhf.v1.TrainerService``: status and token-protected admin calls, translated to the ``Trainer``."""

from __future__ import annotations

from rlhf.serving import ServiceMetrics, grpc_errors, require_grpc_token
from rlhf.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.loop import Trainer

SERVICE_NAME = "rlhf.v1.TrainerService"


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer, metrics: ServiceMetrics):
        self.trainer, self.metrics = trainer, metrics

    @grpc_errors("Status")
    async def Status(self, request, context):
        return await self.trainer.status()

    @grpc_errors("Checkpoint")
    async def Checkpoint(self, request, context):
        require_grpc_token(context, self.trainer.settings)
        path = await self.trainer.checkpoint()
        e = self.trainer.engine
        return trainer_pb2.CheckpointResponse(path=str(path), step=e.step_count, policy_version=e.policy_version)

    @grpc_errors("Pause")
    async def Pause(self, request, context):
        require_grpc_token(context, self.trainer.settings)
        self.trainer.paused.set()
        return trainer_pb2.AdminResponse(paused=True)

    @grpc_errors("Resume")
    async def Resume(self, request, context):
        require_grpc_token(context, self.trainer.settings)
        self.trainer.paused.clear()
        return trainer_pb2.AdminResponse(paused=False)
