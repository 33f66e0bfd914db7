"""The one base model of the training service and the LoRA adapters over it: :class:`SharedModel`.

The base is loaded once and frozen; every adapter (a run's trainable one, a sampler's frozen copy) lives in one PEFT
model over it (``add_adapter`` / ``set_adapter`` / ``delete_adapter``). Only the worker thread that runs the
engine's jobs touches it. Design: docs/tinker.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf.serving import InvalidArgument
from services.training.futures import RequestFailed
from services.training.sampling import SampleSpec, Sequence, generate

log = logging.getLogger("rlhf.training")

# Module names of a Llama-style decoder that the SDK's train_attn / train_mlp / train_unembed select.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0  # fixed: the SDK's LoraConfig has no alpha


@dataclass
class LoraSpec:
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _lora_config(rank: int, alpha: float, targets: list[str]) -> Any:
    from peft import LoraConfig  # noqa: PLC0415 - the lora extra, needed by this service only

    return LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM"
    )


class SharedModel:
    """``base_model`` on ``device`` (after :meth:`load`) and the PEFT model that holds every adapter over it."""

    def __init__(self, base_model: str, device: str):
        self.base_model = base_model
        self.device = device
        self.base: Any = None
        self.peft: Any = None  # made with the first adapter
        self.vocab_size = 0
        self.max_length = 0
        self.arch = ""
        self.present_modules: set[str] = set()
        self.eos_ids: set[int] = set()
        self.base_bytes = 0
        self._adapters = 0  # adapters made so far: each gets a new name
        self._tokenizer: Any = None

    def load(self) -> None:
        from rlhf.models import load_causal_lm, resolve_model_path  # noqa: PLC0415 - torch/transformers at start-up

        model = load_causal_lm(resolve_model_path(self.base_model), device=self.device)
        model.eval()  # no dropout: two passes over the same tokens give the same log-probs
        for p in model.parameters():
            p.requires_grad_(False)
        self.base = model
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_length = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.arch = str(getattr(cfg, "model_type", ""))
        self.present_modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        self.base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for source in (cfg, getattr(model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            self.eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        log.info("training: base %s loaded (%s, vocab %d)", self.base_model, self.arch, self.vocab_size)

    # ------------------------------------------------------------------------------------------------ adapters

    def targets(self, lora: LoraSpec) -> list[str]:
        wanted = (
            (ATTN_MODULES if lora.train_attn else ())
            + (MLP_MODULES if lora.train_mlp else ())
            + (UNEMBED_MODULES if lora.train_unembed else ())
        )
        targets = [m for m in wanted if m in self.present_modules]
        if not targets:
            raise InvalidArgument(
                "lora_config selects no module of the base model: set train_attn, train_mlp or train_unembed",
                field="lora_config",
            )
        return targets

    def _add(self, prefix: str, config: Any) -> str:
        from peft import get_peft_model  # noqa: PLC0415 - the lora extra

        self._adapters += 1
        name = f"{prefix}{self._adapters}"
        if self.peft is None:
            self.peft = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.peft.add_adapter(name, config)
        return name

    def add_trainable(self, lora: LoraSpec) -> tuple[str, dict[str, torch.nn.Parameter]]:
        """A new run's adapter; returns its name and its parameters by canonical name (adapter name removed)."""
        config = _lora_config(lora.rank, LORA_ALPHA, self.targets(lora))
        # seed None: a fresh random init, as the SDK documents; B starts at zero either way (the base model's outputs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little"))
            adapter = self._add("run", config)
        marker = f".{adapter}."
        params = {}
        for name, p in self.peft.named_parameters():
            if marker in name:
                p.requires_grad_(True)
                params[name.replace(marker, ".")] = p
        return adapter, params

    def add_frozen(self, tensors: dict[str, torch.Tensor], rank: int, alpha: float, targets: list[str]) -> str:
        """A frozen copy of an adapter (PEFT state-dict keys) in the shared model; returns its adapter name."""
        from peft import set_peft_model_state_dict  # noqa: PLC0415 - the lora extra

        name = self._add("snap", _lora_config(rank, alpha, targets))
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=name)
        if getattr(result, "unexpected_keys", None):
            self.peft.delete_adapter(name)
            raise RequestFailed(
                f"the adapter holds tensors the base model has no place for: {result.unexpected_keys[:3]}"
            )
        for pname, p in self.peft.named_parameters():
            if f".{name}." in pname:
                p.requires_grad_(False)
        return name

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        """An adapter's tensors by PEFT state-dict key: the adapter only, not the base's embedding / lm_head weights,
        which PEFT adds when lm_head is adapted."""
        from peft import get_peft_model_state_dict  # noqa: PLC0415 - the lora extra

        return get_peft_model_state_dict(self.peft, adapter_name=adapter, save_embedding_layers=False)

    def delete(self, adapter: str) -> None:
        self.peft.delete_adapter(adapter)

    # ------------------------------------------------------------------------------------------------ passes

    def target_logprobs(self, batch: list) -> list[torch.Tensor]:
        """log p(target_tokens) of each datum in one right-padded forward through the active adapter: (N,), or
        (N, K) for top-K targets."""
        device = next(self.peft.parameters()).device
        lengths = [d.tokens.numel() for d in batch]
        ids = torch.zeros((len(batch), max(lengths)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, d in enumerate(batch):
            ids[i, : lengths[i]] = d.tokens
            mask[i, : lengths[i]] = 1
        logits = self.peft(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        out = []
        for i, d in enumerate(batch):
            row = logits[i, : lengths[i]]
            target = d.inputs["target_tokens"].to(device).long()
            index = target if target.dim() == 2 else target[:, None]
            # gather - logsumexp: no second [T, vocab] tensor as log_softmax would make
            lp = row.gather(-1, index) - torch.logsumexp(row, dim=-1, keepdim=True)
            out.append(lp if target.dim() == 2 else lp.squeeze(-1))
        return out

    def sample(self, adapter: str | None, spec: SampleSpec) -> tuple[list[Sequence], np.ndarray | None]:
        """Sample ``spec`` through ``adapter``, or (None) the base model alone."""
        decode = self.decoder() if spec.stop_strings else None
        if adapter is not None:
            self.peft.set_adapter(adapter)
            return generate(self.peft, spec, self.eos_ids, decode)
        if self.peft is None or self.peft.active_adapter not in self.peft.peft_config:
            # no adapter in the shared model (PEFT keeps the name of the last one deleted, and its LoRA layers skip
            # adapters they no longer hold): the base alone
            return generate(self.base, spec, self.eos_ids, decode)
        with self.peft.disable_adapter():
            return generate(self.peft, spec, self.eos_ids, decode)

    def decoder(self) -> Callable[[list[int]], str]:
        if self._tokenizer is None:
            from rlhf.models import load_tokenizer, resolve_model_path  # noqa: PLC0415 - only for stop strings

            self._tokenizer = load_tokenizer(resolve_model_path(self.base_model))
        return self._tokenizer.decode
