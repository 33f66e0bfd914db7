"""The actor's weights as they leave the trainer: for the rollout replicas (a push) and for checkpoints.

``PolicyExport`` gives them in the checkpoint layout (:mod:`rlhf.layout`: Hugging Face names and shapes as
``save_pretrained`` writes them, a tie's alias left out, fused tensors split back), in the push dtype (bf16 with
``actor_rollout.bf16``, whose default is ``training.bf16``), either whole (:meth:`PolicyExport.state_dict`) or, on
rank 0 of a trainer group, as a stream gathered bucket by bucket (:meth:`PolicyExport.stream`), so no rank ever
holds the whole model for a push.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from rlhf import distributed as dist
from rlhf.config import ExperimentConfig
from rlhf.layout import CheckpointLayout
from rlhf.lora import adapter_push_state_dict, merged_state_dict, pushes_adapter
from services.trainer.group import GATHER, Commands

if TYPE_CHECKING:
    from rlhf.transport.weights.pack import StreamedWeights


class PolicyExport:
    def __init__(self, cfg: ExperimentConfig, actor: torch.nn.Module, group: dist.Group | None, commands: Commands):
        self.cfg, self.actor, self.group, self.commands = cfg, actor, group, commands

    def state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The actor's weights, contiguous, on the CPU: what weight sync ships (it refuses non-finite tensors); a
        LoRA actor's adapter tensors only with ``actor_rollout.lora_sync`` adapter (rlhf.lora).
        With ``actor_rollout.bf16`` the fp32 master weights are cast to bf16 here, and only here: rollout serves
        bf16 and the transfer is half the bytes. On the CPU in fp32 these are the training weights' own memory, which
        the next step changes: copy them before it (the trainer's push: copy_weights).

        ``on_device`` (one process only; a group gathers to the CPU one tensor at a time) leaves them on the
        training device, for a caller that copies them into host buffers itself: copy_weights then moves each
        tensor once, device to bucket, instead of to pageable host memory and again into the bucket."""
        if self.group is not None:
            with self.commands.lead(GATHER):
                return dict(self.gather(keep=True))
        if pushes_adapter(self.cfg.actor):  # the adapter alone, under PEFT's names: no checkpoint layout
            return {k: self._push_tensor(v, on_device) for k, v in adapter_push_state_dict(self.actor).items()}
        weights = merged_state_dict(self.actor) if self.cfg.actor.lora_r else self.actor.state_dict()
        out = {}
        for k, v in self.layout.items(weights):
            out[k] = self._push_tensor(v, on_device)
        return out

    @functools.cached_property
    def layout(self):
        """Which live tensor of the actor becomes which checkpoint tensor (worked out once, on meta tensors)."""
        live = self.actor.state_dict()
        if self.cfg.actor.load_in_4bit:  # packed 4-bit tensors: the layout is the dequantized weights' (once)
            live = {k: v.to("meta") for k, v in merged_state_dict(self.actor).items()}
        elif self.cfg.actor.lora_r:  # the merged weights carry the base model's names
            live = {k.replace(".base_layer.", "."): v for k, v in live.items() if ".lora_" not in k}
        return CheckpointLayout(self.actor, live)

    def _push_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.cfg.actor.bf16 and dtype.is_floating_point else dtype

    def _push_tensor(self, v: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        v = v.detach().to(self._push_dtype(v.detach().dtype))
        return (v if on_device else v.to("cpu")).contiguous()

    def stream(self, version: int, bucket_bytes: int | None = None) -> StreamedWeights:
        """Rank 0 of a group: the policy (as :meth:`state_dict` gives it) as streamed weights, for a push that
        gathers it bucket by bucket and never holds the whole model (``push_weights_streamed``). The plan comes
        from the shards' metadata (a DTensor's shape is the global one); each of the stream's two passes is one
        gather command to the group. The weights must not change between the passes: the caller holds off steps,
        so in a group training waits for the push."""
        # Imported here: rlhf.transport brings Redis, which the engine (and the TRL parity environment) does not need.
        from rlhf.transport.weights.format import DEFAULT_BUCKET_BYTES  # noqa: PLC0415 - rlhf.transport needs Redis; the engine (parity venv) does not
        from rlhf.transport.weights.pack import StreamedWeights  # noqa: PLC0415 - rlhf.transport needs Redis; the engine (parity venv) does not

        if self.group is None or not self.group.is_driver:
            raise RuntimeError("policy_stream() is for rank 0 of a trainer group; at world size 1 pack the state dict")
        bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        specs = self.layout.specs(self._push_dtype)
        return StreamedWeights(specs, self._gather_pass, version, version - 1, bucket_bytes=bucket_bytes)

    def _gather_pass(self):
        """One gather of the whole policy, tensor by tensor: the command goes to the followers, which gather every
        parameter with rank 0. Closed early (a push that stopped), rank 0 still gathers the rest, or the followers
        would wait in a collective that never comes. The command is held for the pass, in the thread that runs it,
        so no other command can come between its gathers."""
        with self.commands.lead(GATHER):
            gathered = self.gather(keep=True)
            try:
                for item in gathered:  # not ``yield from``: that would close ``gathered`` undrained on close()
                    yield item
                    del item  # the tensor goes before the next gather, not after it
            finally:
                for _ in gathered:
                    pass

    def gather(self, keep: bool):
        """(name, full tensor) of the sharded actor in the checkpoint layout, gathered one parameter at a time on
        every rank (the gather is a collective); ranks that do not ``keep`` drop each tensor at once, so their extra
        memory is one tensor. A tie's alias is gathered like any parameter (every rank runs the same collectives)
        and yields nothing."""
        layout = self.layout if keep else None
        for k, v in self.actor.state_dict().items():
            v = dist.full_value(v.detach())
            if not keep:
                yield k, None
                continue
            parts = layout.convert(k, v)
            del v  # the gathered full-precision tensor goes before its cast copies are yielded
            while parts:
                name, part = parts.pop(0)
                out = self._push_tensor(part)
                del part
                yield name, out
