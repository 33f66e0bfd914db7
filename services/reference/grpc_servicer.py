"""rlhf.v1.ReferenceService over the engine."""

from __future__ import annotations

from rlhf.serving import ServiceMetrics, grpc_errors
from rlhf.v1 import reference_pb2, reference_pb2_grpc
from services.reference.engine import LogProbsItem, ReferenceEngine

SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"].full_name


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    def __init__(self, engine: ReferenceEngine, metrics: ServiceMetrics):
        self.engine = engine
        self.metrics = metrics

    @grpc_errors("LogProbs")
    async def LogProbs(self, request: reference_pb2.LogProbsRequest, context) -> reference_pb2.LogProbsResponse:
        items = [LogProbsItem(list(m.prompt_ids), list(m.response_ids)) for m in request.items]
        self.metrics.observe_batch("LogProbs", len(items))
        temperature = request.temperature if request.HasField("temperature") else None
        results, t = await self.engine.logprobs(items, temperature)
        resp = reference_pb2.LogProbsResponse(temperature=t)
        for lp in results:
            resp.results.add().logprobs.extend(lp)
        return resp
