"""Build tiny random policies, a reward model and a byte-level BPE tokenizer, locally (no download).

``python -m rlhf.tiny OUT_DIR [--arch ARCH] [--dtype bfloat16]`` writes ``OUT_DIR/policy`` and ``OUT_DIR/reward``,
Hugging Face directories that transformers and vLLM load as is; the architectures are :data:`ARCHS`, one table. In
experiment configs (:func:`rlhf.models.resolve_model_path`): ``tiny:policy`` / ``tiny:reward`` (the default) or
``tiny:<arch>[-bf16]/policy``.

Design (the architectures, shapes, dtypes, cache folders): docs/training.md#models-the-architectures-checked.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PAD, EOS, BOS = "<pad>", "</s>", "<s>"
SPECIAL_TOKENS = [PAD, EOS, BOS]  # ids 0, 1, 2: pad differs from EOS, as the RL masks require

# A minimal chat template: the prompt text of each turn, then the generation prefix for the assistant. With
# ``tools`` their schemas come first, one JSON line; an assistant's tool calls are hermes blocks (rlhf.tool_calls),
# a tool's result is a ``Tool:`` line.
CHAT_TEMPLATE = (
    # (a newline right after a block tag is trimmed by transformers' template settings: written as an expression)
    "{% if tools %}Tools:{% for tool in tools %} {{ tool | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'tool' %}Tool: {{ message['content'] }}\n"
    "{% else %}Assistant: {% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

WORDS = (
    "the a one two three four five six seven eight nine ten zero plus minus times is what answer question "
    "yes no good bad cat dog sun moon red blue green happy sad number count add sum please say hello world "
    "model reward policy value learn train step token short long because and or not then"
).split()


@dataclass(frozen=True)
class Arch:
    """A policy architecture: transformers config and model class names, and the config values it sets over the
    common shape (:func:`_common`)."""

    config_cls: str
    model_cls: str
    extra: dict


ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": Arch("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    # Qwen2's attention always has q/k/v biases (no config switch); they get random values below
    "qwen2-tied": Arch("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    # no sliding window, as Mistral-7B-v0.2+: the window would exceed the context anyway
    "mistral": Arch("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen3-moe": Arch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    ),
}
POLICY_DTYPES = ("float32", "bfloat16")
# the tasks of rlhf.learning_tasks, whose warm-started policies are tiny:<task> (named here: rlhf.tiny imports no task)
WARM_TASKS = ("reverse_words", "addition")


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2  # head_dim 32: vLLM's CPU attention needs head_dim in {32, 64, 80, ...}
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0
    arch: str = "llama"  # a key of ARCHS
    dtype: str = "float32"  # the policy's saved dtype: float32 or bfloat16

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown tiny architecture {self.arch!r}: one of {', '.join(ARCHS)}")
        if self.dtype not in POLICY_DTYPES:
            raise ValueError(f"tiny policy dtype must be one of {', '.join(POLICY_DTYPES)}, got {self.dtype!r}")

    def _fields(self) -> dict:
        # arch and dtype only when not the default: the default spec keeps the digest (and stamp) it had before them
        d = asdict(self)
        for f in fields(self):
            if f.name in ("arch", "dtype") and d[f.name] == f.default:
                del d[f.name]
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self._fields(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """The folder (and ``tiny:`` prefix) name: ``tiny`` for the default, else ``tiny-<arch>[-bf16]``."""
        if (self.arch, self.dtype) == ("llama", "float32"):
            return "tiny"
        return f"tiny-{self.arch}" + ("-bf16" if self.dtype == "bfloat16" else "")


def parse_ref(ref: str) -> tuple[TinySpec, str]:
    """``tiny:`` model reference (without the prefix) -> (spec, ``policy`` | ``reward`` | ``tools``): ``policy``,
    ``reward``, ``tools`` (the policy warm-started on calculator episodes, rlhf.tiny_tools), a task of
    :data:`WARM_TASKS` (the policy warm-started on it, rlhf.learning_tasks), ``<arch>/policy``,
    ``<arch>-bf16/reward``..."""
    name, _, which = ref.rpartition("/")
    if which not in ("policy", "reward", "tools", *WARM_TASKS):
        raise ValueError(
            f"unknown tiny model tiny:{ref}: use tiny:policy, tiny:reward, tiny:tools, "
            + ", ".join(f"tiny:{t}" for t in WARM_TASKS)
            + " or tiny:<arch>[-bf16]/policy"
        )
    if which in WARM_TASKS and name:
        raise ValueError(f"tiny:{ref}: a warm-started task policy has one size and architecture; use tiny:{which}")
    arch, dtype = name or "llama", "float32"
    if arch.endswith("-bf16"):
        arch, dtype = arch[: -len("-bf16")], "bfloat16"
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture in tiny:{ref}: {arch!r}; one of {', '.join(ARCHS)}")
    return TinySpec(arch=arch, dtype=dtype), which


@dataclass(frozen=True)
class TinyPaths:
    root: Path
    policy: Path
    reward: Path


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(f"User: what is {a} plus {b}?\nAssistant: {a + b}")
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return out


def build_tokenizer(spec: TinySpec):
    """Train a byte-level BPE tokenizer on a generated corpus; any text encodes (bytes are in the alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, padding_side="left", model_max_length=512
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(spec: TinySpec, tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        # explicit: some configs default to another (Qwen3: 128), and vLLM's CPU attention accepts only some
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def _llama_config(spec: TinySpec, tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(spec, tokenizer), **extra)


def _policy_model(spec: TinySpec, tokenizer):
    import torch
    import transformers

    arch = ARCHS[spec.arch]
    config = getattr(transformers, arch.config_cls)(**{**_common(spec, tokenizer), **arch.extra})
    torch.manual_seed(spec.seed)
    model = getattr(transformers, arch.model_cls)(config).eval()
    # transformers initialises biases to zero, where a checkpoint's (Qwen2's qkv) are not: random ones make a loader
    # that drops or misplaces them visible. Bias-free models (llama) draw nothing here, so they stay as they were.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
    return model.to(getattr(torch, spec.dtype))


def _template_digest() -> str:
    return hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16]


def build_tiny(out_dir: str | Path, spec: TinySpec | None = None, force: bool = False) -> TinyPaths:
    """Write the tiny policy and reward model under ``out_dir``; reuse them when already built for the same spec.

    Safe to call from several processes at once (services resolving the same ``tiny:`` model): one builds, under a
    file lock next to ``out_dir``, and the others then find its stamp."""
    spec = spec or TinySpec()
    root = Path(out_dir)
    paths = TinyPaths(root=root, policy=root / "policy", reward=root / "reward")
    stamp = root / "tiny.json"

    def current() -> bool:
        if force or not stamp.exists():
            return False
        built = json.loads(stamp.read_text())
        # the chat template is saved with the tokenizer: a cache built with another template is rebuilt (the weights
        # come out the same; the spec digest stays as it was, so caches keep their folders)
        return built.get("digest") == spec.digest() and built.get("chat_template") == _template_digest()

    if current():
        return paths
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if current():  # another process built it while this one waited
            return paths
        _build(spec, paths)
        stamp.write_text(
            json.dumps({"digest": spec.digest(), "chat_template": _template_digest(), "spec": spec._fields()}, indent=2)
        )
    return paths


def cached_build(root: Path, name: str, meta: dict, build: Callable[[Path], None], force: bool = False) -> Path:
    """``root/name`` made by ``build(out)`` once and stamped with ``meta`` (``root/name.json``; ``meta["digest"]``
    says what it was built from), reused while the stamp's digest matches; one builder at a time across processes
    (a lock file beside ``root``). The warm-started policies (``tiny:tools``, ``tiny:<task>``) are built this way."""
    out, stamp = root / name, root / f"{name}.json"

    def current() -> bool:
        return not force and stamp.exists() and json.loads(stamp.read_text()).get("digest") == meta["digest"]

    if current():
        return out
    with open(root.parent / f".{root.name}-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if current():
            return out
        build(out)
        stamp.write_text(json.dumps(meta, indent=2))
    return out


def warm_start(policy: Path, out: Path, batch: Callable, steps: int, lr: float, seed: int) -> None:
    """A short supervised warm start of a tiny policy, saved to ``out``: ``steps`` AdamW steps of the token NLL on
    ``batch(tokenizer)``, a list of (ids, loss mask) over whole sequences (prompt included, masked out)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = batch(tok)
        width = max(len(ids) for ids, _ in rows)
        x = torch.full((len(rows), width), tok.pad_token_id)
        m = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (ids, mask) in enumerate(rows):
            x[i, : len(ids)] = torch.tensor(ids)
            m[i, : len(mask)] = torch.tensor(mask)
        logits = model(x, attention_mask=(x != tok.pad_token_id).long()).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(logp * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build(spec: TinySpec, paths: TinyPaths) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForSequenceClassification

    tokenizer = build_tokenizer(spec)
    policy = _policy_model(spec, tokenizer)
    policy.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    torch.manual_seed(spec.seed + 1)
    reward = LlamaForSequenceClassification(_llama_config(spec, tokenizer, num_labels=1)).eval()
    for model, path in ((policy, paths.policy), (reward, paths.reward)):
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write policy/ and reward/ into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=TinySpec.hidden_size)
    parser.add_argument("--layers", type=int, default=TinySpec.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=TinySpec.num_attention_heads)
    parser.add_argument("--arch", choices=list(ARCHS), default="llama", help="policy architecture (default llama)")
    parser.add_argument("--dtype", choices=POLICY_DTYPES, default="float32", help="the policy's saved dtype")
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory is current")
    args = parser.parse_args(argv)
    spec = TinySpec(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=2 * args.hidden_size,
        seed=args.seed,
        arch=args.arch,
        dtype=args.dtype,
    )
    paths = build_tiny(args.out_dir, spec, force=args.force)
    print(json.dumps({"policy": str(paths.policy), "reward": str(paths.reward)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
