"""rlhf.v1.RewardService over the engine: proto <-> engine types; errors and metrics through rlhf.serving."""

from __future__ import annotations

from rlhf.serving import ServiceMetrics, grpc_errors
from rlhf.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.reward.engine import RewardEngine
from services.reward.scorers import INVALID_INPUT, OK, SCORER_ERROR, TIMEOUT, Item

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name

STATUS_TO_PROTO = {
    OK: common_pb2.ITEM_STATUS_OK,
    INVALID_INPUT: common_pb2.ITEM_STATUS_INVALID_INPUT,
    SCORER_ERROR: common_pb2.ITEM_STATUS_SCORER_ERROR,
    TIMEOUT: common_pb2.ITEM_STATUS_TIMEOUT,
}


def item_from_proto(m: reward_pb2.ScoreItem) -> Item:
    return Item(
        prompt=m.prompt,
        response=m.response,
        label=m.label if m.HasField("label") else None,
        prompt_ids=list(m.prompt_ids),
        response_ids=list(m.response_ids),
        finished=m.finished,
    )


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, engine: RewardEngine, metrics: ServiceMetrics):
        self.engine = engine
        self.metrics = metrics

    @grpc_errors("Score")
    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        items = [item_from_proto(m) for m in request.items]
        self.metrics.observe_batch("Score", len(items))
        outcomes = await self.engine.score(items)
        resp = reward_pb2.ScoreResponse()
        for o in outcomes:
            r = resp.results.add(status=STATUS_TO_PROTO[o.status], error=o.error)
            if o.score is not None:
                r.score = o.score
            r.components.update(o.components)
        return resp
