"""The training service's samplers: :class:`Samplers`, each a sampling client's session bound to the weights it was
created from (a frozen adapter copy in the :class:`SharedModel`, shared by the samplers over one checkpoint version,
or the base model), pinned for its life: a later save of the run makes a new copy, never changes this one.
Design: docs/tinker.md (Sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rlhf.serving import NotFound
from services.training.checkpoints import CheckpointStore
from services.training.fleet import FleetSampler
from services.training.sampling import SampleSpec, encode_sample_response
from services.training.shared_model import SharedModel


@dataclass
class Sampler:
    sampler_id: str
    owner: str
    model_path: str | None  # None: the base model, or an unnamed save (save_weights_and_get_sampling_client)
    snapshot: str | None  # the key of its adapter copy in Samplers.snapshots; None: the base model


@dataclass
class Snapshot:
    adapter: str  # the PEFT adapter name in the shared model
    samplers: set[str] = field(default_factory=set)


class Samplers:
    """Every sampler of this process, over ``model``; sampler checkpoints are read from ``store``. Binding,
    releasing and sampling run on the engine's worker thread (they change or use the shared model)."""

    def __init__(self, model: SharedModel, store: CheckpointStore, fleet: FleetSampler | None = None, boot: str = ""):
        self.model = model
        self.store = store
        self.fleet = fleet  # rollout replicas that answer the samplers over an adapter (None: all in-process)
        self.boot = boot
        self.by_id: dict[str, Sampler] = {}
        self.snapshots: dict[str, Snapshot] = {}

    def get(self, owner: str, sampler_id: str) -> Sampler:
        s = self.by_id.get(sampler_id)
        if s is None or s.owner != owner:
            raise NotFound(
                f"sampling session {sampler_id!r} does not exist (or is not yours, or its session was closed)",
                field="sampling_session_id",
            )
        return s

    def describe(self, owner: str, sampler_id: str) -> dict:
        s = self.get(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": self.model.base_model, "model_path": s.model_path}

    def of_session(self, session_id: str) -> list[str]:
        return [s for s in list(self.by_id) if s.startswith(f"{session_id}:sample:")]

    def bind(
        self, owner: str, sampler_id: str, model_path: str | None, key: str | None, make: Callable[[], str] | None
    ) -> dict:
        """Register sampler ``sampler_id`` on adapter copy ``key`` (made by ``make()``, which returns its adapter
        name, unless it exists; None: the base model)."""
        if sampler_id in self.by_id:  # a resend of the request that made it (its session is the caller's)
            return {"sampling_session_id": sampler_id}
        if key is not None:
            if key not in self.snapshots:
                self.snapshots[key] = Snapshot(make())
                self._to_fleet(self.snapshots[key])
            self.snapshots[key].samplers.add(sampler_id)
        self.by_id[sampler_id] = Sampler(sampler_id, owner, model_path, key)
        return {"sampling_session_id": sampler_id}

    def release(self, sampler_id: str) -> None:
        """Forget a sampler; the last one over an adapter copy takes the copy out of the shared model."""
        sampler = self.by_id.pop(sampler_id, None)
        snap = self.snapshots.get(sampler.snapshot) if sampler and sampler.snapshot else None
        if snap is not None:
            snap.samplers.discard(sampler_id)
            if not snap.samplers:
                del self.snapshots[sampler.snapshot]
                self.model.delete(snap.adapter)
                if self.fleet is not None:
                    self.fleet.forget(self._fleet_name(snap))

    def load_checkpoint(self, folder: Path) -> str:
        """A sampler checkpoint's adapter as a frozen copy in the shared model; returns its adapter name."""
        adapter = self.store.read_sampler(folder, self.model.device)
        return self.model.add_frozen(adapter.tensors, adapter.rank, adapter.alpha, adapter.targets)

    # ------------------------------------------------------------------------------------------------ the fleet

    def _fleet_name(self, snap: Snapshot) -> str:
        return f"tinker-{self.boot}-{snap.adapter}"

    def _to_fleet(self, snap: Snapshot) -> None:
        """Hand a new adapter copy to the fleet, which pushes it to the replicas (on the model's thread)."""
        if self.fleet is None:
            return
        config = self.model.peft.peft_config[snap.adapter]
        tensors = self.model.adapter_tensors(snap.adapter)
        targets = sorted(config.target_modules)
        self.fleet.register(self._fleet_name(snap), tensors, int(config.r), float(config.lora_alpha), targets)

    def fleet_job(
        self, owner: str, sampler_id: str, spec: SampleSpec, in_process: Callable[[], dict]
    ) -> Callable[[], dict] | None:
        """The job that samples on the fleet (``in_process()`` where it cannot), for :attr:`fleet`'s pool; None when
        this sampler samples in-process: no fleet, or the base model (a replica's policy is not known to be it)."""
        snap = self.snapshots.get(self.get(owner, sampler_id).snapshot or "")
        if self.fleet is None or snap is None:
            return None
        return partial(self.fleet.sample, self._fleet_name(snap), spec, self.model.eos_ids, in_process)

    def sample_job(self, owner: str, sampler_id: str, spec: SampleSpec) -> dict:
        sampler = self.get(owner, sampler_id)
        adapter = None if sampler.snapshot is None else self.snapshots[sampler.snapshot].adapter
        seqs, prompt_lps = self.model.sample(adapter, spec)
        return {"sample": encode_sample_response(seqs, prompt_lps)}
