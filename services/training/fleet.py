"""Sampling through the rollout fleet: a sampler's frozen adapter copy pushed to the replicas (``LoadAdapter``) and
its ``sample`` requests answered by ``Generate`` naming that adapter (``RLHF_ROLLOUT_ADDRS`` on the training
service; unset, the service samples in-process).

A replica holds an adapter until it evicts it (least recently used, ``RLHF_ROLLOUT_MAX_ADAPTERS``); a request that
finds it gone (NOT_FOUND) pushes it again and retries. A replica that refuses an adapter (an engine without named
adapters, LoRA it cannot apply, weights other than the base) is not asked for it again, and a request no replica
can serve (that, every replica unreachable, or parameters the replicas bound more tightly than the SDK) is sampled
in-process by ``fallback``, with a log line saying why. Design: docs/tinker.md (Sampling through the fleet).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch
from safetensors.torch import save

from rlhf.serving import ServiceSettings
from rlhf.serving.runner import client_credentials, grpc_options
from rlhf.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.training.sampling import SampleSpec, Sequence, encode_sample_response

log = logging.getLogger("rlhf.training.fleet")

MAX_TEMPERATURE = 2.0  # the replicas' bound (vLLM's)
MAX_STOP = 16  # stop ids / strings per replica request
MAX_STOP_LEN = 256  # characters per stop string
MAX_SEED = 9_200_000_000_000_000_000  # the replicas' bound on a request's seed
RPC_TIMEOUT_S = 600.0
# refusals of an adapter by a replica: it will not serve it (INVALID_ARGUMENT, FAILED_PRECONDITION, UNIMPLEMENTED)
_REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}


class FleetSampler:
    """Adapters pushed to the replicas at ``addrs`` and sample requests answered by them (thread-safe; the calls
    run on :attr:`pool`, never on the training model's thread)."""

    def __init__(self, addrs: list[str], settings: ServiceSettings, base_model: str):
        self.addrs = list(addrs)
        self.base_model = base_model
        self._meta = (("authorization", f"Bearer {settings.api_token}"),) if settings.api_token else ()
        creds, options = client_credentials(settings), grpc_options(settings)
        self._stubs = {
            a: rollout_pb2_grpc.RolloutServiceStub(
                grpc.secure_channel(a, creds, options) if creds else grpc.insecure_channel(a, options)
            )
            for a in self.addrs
        }
        self.pool = ThreadPoolExecutor(max(4, 2 * len(self.addrs)), thread_name_prefix="training-fleet")
        self._lock = threading.Lock()
        self._payloads: dict[str, rollout_pb2.LoadAdapterRequest] = {}
        self._loaded: dict[str, set[str]] = {a: set() for a in self.addrs}  # replica -> adapters it took
        self._refused: dict[str, dict[str, str]] = {a: {} for a in self.addrs}  # replica -> adapter -> why
        self._pushing: dict[tuple[str, str], threading.Lock] = {}
        self._turn = itertools.count()
        self.served = 0  # sample requests the fleet answered
        self.in_process = 0  # sample requests handed back to the fallback

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------------------------------- adapters

    def register(self, name: str, tensors: dict[str, torch.Tensor], rank: int, alpha: float, targets: list[str]):
        """Keep adapter ``name`` (PEFT state-dict keys, no adapter name) to push, and push it to every replica now,
        in the background (a failed push is retried by the first request that needs it)."""
        data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(targets),
                  "base_model_name_or_path": self.base_model}  # fmt: skip
        req = rollout_pb2.LoadAdapterRequest(
            name=name, adapter_safetensors=data, adapter_config_json=json.dumps(config),
            sha256=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
        with self._lock:
            self._payloads[name] = req
        for addr in self.addrs:
            self.pool.submit(self._push_quietly, addr, name)

    def forget(self, name: str) -> None:
        """Its last sampler is gone: no more pushes (the replicas evict it in their own time)."""
        with self._lock:
            self._payloads.pop(name, None)
            for names in self._loaded.values():
                names.discard(name)
            for key in [k for k in self._pushing if k[1] == name]:
                del self._pushing[key]

    def _push_quietly(self, addr: str, name: str) -> None:
        try:
            self._push(addr, name)
        except grpc.RpcError as err:
            log.warning("training: pushing adapter %s to %s failed (%s); retried when sampled", name, addr, err.code())

    def _push(self, addr: str, name: str) -> bool:
        """Load ``name`` on ``addr`` unless it is there; False when the replica refuses it (remembered, and logged
        once). One push of an adapter to a replica at a time: the background push and a
        request's would otherwise load it twice."""
        with self._lock:
            req = self._payloads.get(name)
            gate = self._pushing.setdefault((addr, name), threading.Lock())
        if req is None:
            return False
        with gate:
            if name in self._loaded[addr]:
                return True
            return self._load(addr, name, req)

    def _load(self, addr: str, name: str, req: rollout_pb2.LoadAdapterRequest) -> bool:
        try:
            resp = self._stubs[addr].LoadAdapter(req, metadata=self._meta, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            if err.code() not in _REFUSED:
                raise
            return self._refuse(addr, name, err.details() or str(err.code()))
        if resp.policy_version != 0:
            # the adapter was trained over the base; a replica whose policy moved on would apply it to other weights
            return self._refuse(addr, name, f"it serves policy version {resp.policy_version}, not the base model")
        with self._lock:
            self._loaded[addr].add(name)
        return True

    def _refuse(self, addr: str, name: str, why: str) -> bool:
        """Remember and log that ``addr`` will not serve ``name``; False (for :meth:`_push`)."""
        with self._lock:
            self._refused[addr][name] = why
        log.warning("training: replica %s does not serve sampler adapter %s (%s): sampled in-process", addr, name, why)
        return False

    # ---------------------------------------------------------------------------------------------- sampling

    def sample(self, name: str, spec: SampleSpec, eos_ids: set[int], fallback: Callable[[], dict]) -> dict:
        """The future's result of a sample request (as the in-process sampler's): from the first replica (round
        robin) that holds or takes adapter ``name``, else ``fallback()``."""
        why = _unservable(spec, eos_ids)
        start = next(self._turn)
        for k in range(len(self.addrs)):
            if why:
                break
            addr = self.addrs[(start + k) % len(self.addrs)]
            if name in self._refused[addr]:
                continue
            try:
                out = self._generate(addr, name, spec, eos_ids)
            except grpc.RpcError as err:
                log.warning(
                    "training: sampling adapter %s on %s failed (%s: %s)", name, addr, err.code(), err.details()
                )
                continue
            if out is not None:
                with self._lock:
                    self.served += 1
                return out
        log.info("training: sampler adapter %s sampled in-process (%s)", name, why or "no replica serves it")
        with self._lock:
            self.in_process += 1
        return fallback()

    def _generate(self, addr: str, name: str, spec: SampleSpec, eos_ids: set[int]) -> dict | None:
        """Generate on ``addr`` (pushing the adapter first, or again after an eviction); None: refused."""
        stub = self._stubs[addr]
        for attempt in range(2):
            if name not in self._loaded[addr] and not self._push(addr, name):
                return None
            try:
                resp = stub.Generate(generate_request(name, spec, eos_ids), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND or attempt:
                    raise
                with self._lock:
                    self._loaded[addr].discard(name)  # evicted by the replica: push it again
                continue
            if resp.policy_version != 0:  # a policy was pushed to the replica since it took the adapter
                self._refuse(addr, name, f"it serves policy version {resp.policy_version}, not the base model")
                return None
            return {"sample": sample_response(resp, spec)}
        return None


def _unservable(spec: SampleSpec, eos_ids: set[int]) -> str:
    """Why the replicas cannot take this request as the SDK asks it ('' when they can)."""
    if spec.temperature > MAX_TEMPERATURE:
        return f"temperature {spec.temperature} is over the replicas' {MAX_TEMPERATURE}"
    stops = eos_ids if spec.stop_tokens is None else spec.stop_tokens
    if len(stops) > MAX_STOP or len(spec.stop_strings) > MAX_STOP:
        return f"over {MAX_STOP} stop tokens or strings"
    if any(len(s) > MAX_STOP_LEN for s in spec.stop_strings):
        return f"a stop string over {MAX_STOP_LEN} characters"
    return ""


def generate_request(name: str, spec: SampleSpec, eos_ids: set[int]) -> rollout_pb2.GenerateRequest:
    """A SampleSpec as a rollout Generate request on adapter ``name``: the stop tokens given explicitly (the SDK's
    default is the training model's EOS ids), log-probs of the model's own distribution, as the in-process sampler."""
    stops = eos_ids if spec.stop_tokens is None else spec.stop_tokens
    params = common_pb2.SamplingParams(
        n=spec.num_samples, temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens,
        stop=spec.stop_strings, stop_token_ids=sorted(stops), ignore_eos=True,
    )  # fmt: skip
    if spec.top_k > 0:
        params.top_k = spec.top_k
    if spec.seed is not None:
        params.seed = spec.seed % (MAX_SEED + 1)  # sample j uses seed + j there
    return rollout_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=spec.prompt.tolist()))],
        params=params, adapter=name, raw_logprobs=True, prompt_logprobs=spec.prompt_logprobs,
    )  # fmt: skip


def sample_response(resp: rollout_pb2.GenerateResponse, spec: SampleSpec) -> bytes:
    """The replica's answer as the SDK's SampleResponse bytes (what the in-process sampler returns)."""
    result = resp.results[0]
    seqs = []
    for c in result.completions:
        if c.finish_reason == common_pb2.FINISH_REASON_ABORT:
            raise RuntimeError("the rollout replica aborted the sample")
        stop = "stop" if c.finish_reason == common_pb2.FINISH_REASON_STOP else "length"
        seqs.append(Sequence(list(c.token_ids), list(c.logprobs), stop))
    prompt_lps = None
    if spec.prompt_logprobs:
        prompt_lps = np.asarray([np.nan, *result.prompt_logprobs], dtype=np.float32)
        if spec.prompt_logprobs_last_n is not None:
            prompt_lps[: len(prompt_lps) - spec.prompt_logprobs_last_n] = np.nan
    return encode_sample_response(seqs, prompt_lps)
