"""rlhf.v1.RolloutService over the engine: proto <-> engine types; errors and metrics through rlhf.serving.

``Generate`` (prompts as text, no chat template, or token ids), ``GetWeightsVersion`` (the engine's
:class:`~rlhf.transport.weights.ServedVersion`), and the token-protected weight calls: ``UpdateWeights`` (a stream)
and ``OpenWeightsTransfer`` / ``CommitWeights`` / ``AbortWeightsTransfer`` (the TCP data plane). Register with
:func:`add_to_server`, not the generated function: its request decoder leaves each chunk's bytes in gRPC's buffer
instead of copying them twice through protobuf.

Design: docs/weight-sync.md; an update's path: docs/code-tour.md#2-a-weight-update-to-the-replica-serving-it.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass

from rlhf.serving import (
    FailedPrecondition,
    InvalidArgument,
    ServiceMetrics,
    ServiceSettings,
    grpc_errors,
    require_grpc_token,
)
from rlhf.v1 import rollout_pb2, rollout_pb2_grpc, weights_pb2
from services.rollout.engine import EngineBase, version_span_fields
from services.rollout.options import finish_reason_proto, options_from_proto

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


async def prompt_ids_from_proto(engine: EngineBase, prompts: Any) -> list[list[int]]:
    engine.check_ready()  # the tokenizer comes with the model
    texts = []
    for i, p in enumerate(prompts):
        kind = p.WhichOneof("content")
        if kind == "text":
            if not p.text:
                raise InvalidArgument("the prompt text is empty", field=f"prompts[{i}].text")
            texts.append(p.text)
        elif kind != "token_ids":
            raise InvalidArgument("the prompt has neither text nor token_ids: set one", field=f"prompts[{i}]")
    encoded = iter(await engine.encode_texts(texts) if texts else [])
    return [next(encoded) if p.WhichOneof("content") == "text" else list(p.token_ids.ids) for p in prompts]


def add_to_server(servicer: RolloutServicer, server: Any) -> None:
    """``rollout_pb2_grpc.add_RolloutServiceServicer_to_server`` with one change: ``UpdateWeights`` requests are
    decoded by ``rlhf.transport.weights.format.decode_update``, which leaves each chunk's bytes where gRPC put them
    (protobuf's deserializer copies every weight byte twice more)."""
    from rlhf.transport.weights.format import decode_update

    # Built from the service descriptor, so a method added to rollout.proto is served without another edit here.
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for name, m in rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name.items():
        handlers[name] = kinds[(m.client_streaming, m.server_streaming)](
            getattr(servicer, name),
            request_deserializer=decode_update if name == "UpdateWeights" else GetMessageClass(m.input_type).FromString,
            response_serializer=GetMessageClass(m.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, engine: EngineBase, settings: ServiceSettings, metrics: ServiceMetrics):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        from rlhf.transport.weights.dataplane import WeightDataServer
        from rlhf.transport.weights.receive import WeightReceiver  # imports torch: not at module import (main.py)

        self.receiver = WeightReceiver(engine.served)  # asks the engine's version owner; the swap advances it
        # tickets for the data plane and the collective path; it listens on a port only after start_data_plane
        self.data = WeightDataServer(self.receiver)

    async def start_data_plane(self, host: str, port: int) -> int:
        """Listen for weight data on ``port`` (0: any free port); returns the port."""
        self.data.host, self.data.port = host, port
        return await self.data.start()

    async def close_data_plane(self) -> None:
        await self.data.close()

    @grpc_errors("Generate")
    async def Generate(self, request: rollout_pb2.GenerateRequest, context) -> rollout_pb2.GenerateResponse:
        prompts = await prompt_ids_from_proto(self.engine, request.prompts)
        opts = options_from_proto(request.params, self.engine.defaults)
        if request.adapter or request.raw_logprobs or request.prompt_logprobs:
            opts = replace(
                opts,
                adapter=request.adapter or None,
                raw_logprobs=request.raw_logprobs,
                prompt_logprobs=0 if request.prompt_logprobs else None,
            )
        self.metrics.observe_batch("Generate", len(prompts) * max(1, opts.n))
        results = await self.engine.generate(prompts, opts, field="prompts")
        resp = rollout_pb2.GenerateResponse(
            request_id=request.request_id or f"gen-{uuid.uuid4().hex}", policy_version=self.engine.weights_version
        )
        for r in results:
            pr = resp.results.add(prompt_token_ids=r.prompt_token_ids)
            if request.prompt_logprobs and r.prompt_logprobs:
                pr.prompt_logprobs.extend(r.prompt_logprobs[1:])  # the first prompt token has none
            for s in r.samples:
                pr.completions.add(
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    finish_reason=finish_reason_proto(s.finish_reason),
                    text=s.text,
                    policy_version=s.policy_version,
                    **version_span_fields(s.spans),
                )
        return resp

    @grpc_errors("UpdateWeights")
    async def UpdateWeights(self, request_iterator, context) -> weights_pb2.UpdateWeightsResponse:
        require_grpc_token(context, self.settings)
        self._sync_receiver()
        # raises: nothing staged, the old weights serve (an update installed as it arrived: see install_streamed)
        staged = await self.receiver.receive(request_iterator, install=self._installer)
        return await self._swap(staged)

    def _installer(self, header: weights_pb2.WeightHeader) -> Any:
        """The engine's installer when it takes this update bucket by bucket as it arrives (vLLM, updates of at least
        RLHF_WEIGHTS_INPLACE_LOAD_BYTES: in place, a bucket or two of memory), else None (received whole, swapped)."""
        streams = getattr(self.engine, "streams_update", None)
        if streams is not None and streams(header.total_bytes):
            return self.engine.install_streamed
        return None

    @grpc_errors("OpenWeightsTransfer")
    async def OpenWeightsTransfer(self, request, context) -> weights_pb2.OpenWeightsTransferResponse:
        require_grpc_token(context, self.settings)
        group = None
        if request.HasField("group"):
            if self.settings.tls:
                raise FailedPrecondition(
                    "collective weight transfer is plaintext and this replica serves TLS; push "
                    "over UpdateWeights (RLHF_WEIGHTS_TRANSPORT=grpc)",
                    field="group",
                )
            from rlhf.transport.weights.collective import GroupSpec  # torch: not at module import (main.py)

            try:
                group = GroupSpec.from_proto(request.group)
            except ValueError as err:
                raise InvalidArgument(str(err), field="group") from None
        elif not self.data.listening:
            return weights_pb2.OpenWeightsTransferResponse(data_port=0)  # the client streams over UpdateWeights
        self._sync_receiver()
        if group is not None:
            from rlhf.transport.weights.collective import check_backend

            check_backend(group.backend, self.engine.device_type)  # CollectiveUnavailable; nothing reserved yet
        receive = getattr(self.engine, "receive_collective", None) if group is not None else None
        stream = self._installer(request.header) if group is None else None
        # the processes this replica joins the push's group from (vLLM: one per worker under tensor parallelism)
        ranks = self._collective_ranks() if group is not None else 0
        ticket, ttl = await self.data.open(request.header, group, receive, stream)  # raises like UpdateWeights
        port = self.data.port if group is None else 0
        return weights_pb2.OpenWeightsTransferResponse(
            ticket=ticket, data_port=port, ticket_ttl_seconds=ttl, ranks=ranks
        )

    def _collective_ranks(self) -> int:
        """How many ranks this replica takes in a collective push's group: the engine's ``collective_ranks`` (the
        processes that receive the buckets), one by default (an engine that receives in this process)."""
        ranks = int(getattr(self.engine, "collective_ranks", 1))
        if ranks < 1:
            raise FailedPrecondition(f"the engine reports {ranks} collective ranks", field="group")
        return ranks

    @grpc_errors("CommitWeights")
    async def CommitWeights(self, request, context) -> weights_pb2.UpdateWeightsResponse:
        require_grpc_token(context, self.settings)
        staged = await self.data.take(request.ticket)  # raises: nothing staged, the old weights serve
        return await self._swap(staged)

    @grpc_errors("AbortWeightsTransfer")
    async def AbortWeightsTransfer(self, request, context) -> weights_pb2.AbortWeightsTransferResponse:
        require_grpc_token(context, self.settings)
        aborted = self.data.abort(request.ticket)
        return weights_pb2.AbortWeightsTransferResponse(aborted=aborted)

    def _sync_receiver(self) -> None:
        """The parameters an update must match (names and shapes, checked before any buffer is allocated) are the
        engine's, known once its model is loaded; the version comes from the engine's owner, read at each check."""
        self.receiver.expected = self.engine.weight_manifest()

    async def _swap(self, staged) -> weights_pb2.UpdateWeightsResponse:
        result = staged.installed  # an update the engine installed as it arrived is serving already
        if result is None:
            result = await self.engine.swap_weights(
                staged.tensors, staged.version, staged.checksum, staged.parent_version
            )
        if result.swapped and result.version == staged.version:  # the base of the next delta push, if it asked
            self.receiver.keep_base(staged if staged.installed is None else None)
        return weights_pb2.UpdateWeightsResponse(
            version=result.version,
            swapped=result.swapped,
            bytes_received=staged.nbytes,
            checksum=result.checksum,
            stage_seconds=staged.seconds,
            swap_seconds=result.swap_seconds,
        )

    @grpc_errors("LoadAdapter")
    async def LoadAdapter(self, request, context) -> rollout_pb2.LoadAdapterResponse:
        require_grpc_token(context, self.settings)
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors  # torch: not at module import (main.py)

        data = request.adapter_safetensors
        if request.sha256 and hashlib.sha256(data).hexdigest() != request.sha256.lower():
            raise InvalidArgument("adapter_safetensors does not match its sha256", field="sha256")
        try:
            tensors = load_safetensors(bytes(data))
        except (SafetensorError, ValueError) as err:
            raise InvalidArgument(
                f"adapter_safetensors is not a safetensors file: {err}", field="adapter_safetensors"
            ) from None
        try:
            config = json.loads(request.adapter_config_json)
        except ValueError:
            config = None
        if not isinstance(config, dict):
            raise InvalidArgument("adapter_config_json is not a JSON object", field="adapter_config_json")
        held = await self.engine.load_adapter(request.name, tensors, config)
        return rollout_pb2.LoadAdapterResponse(name=request.name, held=held, policy_version=self.engine.served.version)

    @grpc_errors("GetWeightsVersion")
    async def GetWeightsVersion(self, request, context) -> weights_pb2.WeightsVersion:
        return weights_pb2.WeightsVersion(
            version=self.engine.served.version,
            parent_version=self.engine.served.parent_version,
            checksum=self.engine.served.checksum,
            loaded_at_unix_ms=self.engine.served.loaded_at_unix_ms,
            model=self.engine.model_name,
        )
