"""Build a tiny random Llama policy, a reward model and a byte-level BPE tokenizer, locally (no download).

``python -m rlhf.tiny OUT_DIR`` writes ``OUT_DIR/policy`` (LlamaForCausalLM) and ``OUT_DIR/reward``
(LlamaForSequenceClassification, one label), each a Hugging Face directory (safetensors weights plus the tokenizer)
that transformers and vLLM load as is. The default shape keeps head_dim at 32, the smallest vLLM's CPU attention
accepts. Building is deterministic for a seed and takes about a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, EOS, BOS = "<pad>", "</s>", "<s>"
SPECIAL_TOKENS = [PAD, EOS, BOS]  # ids 0, 1, 2: pad differs from EOS, as the RL masks require

# A minimal chat template: the prompt text of each turn, then the generation prefix for the assistant.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

WORDS = (
    "the a one two three four five six seven eight nine ten zero plus minus times is what answer question "
    "yes no good bad cat dog sun moon red blue green happy sad number count add sum please say hello world "
    "model reward policy value learn train step token short long because and or not then"
).split()


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

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


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


def _llama_config(spec: TinySpec, tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **extra,
    )


def build_tiny(out_dir: str | Path, spec: TinySpec | None = None, force: bool = False) -> TinyPaths:
    """Write the tiny policy and reward model under ``out_dir``; reuse them when already built for the same spec."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM, LlamaForSequenceClassification

    spec = spec or TinySpec()
    root = Path(out_dir)
    paths = TinyPaths(root=root, policy=root / "policy", reward=root / "reward")
    stamp = root / "tiny.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("digest") == spec.digest():
        return paths

    tokenizer = build_tokenizer(spec)
    torch.manual_seed(spec.seed)
    policy = LlamaForCausalLM(_llama_config(spec, tokenizer)).eval()
    policy.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    torch.manual_seed(spec.seed + 1)
    reward = LlamaForSequenceClassification(_llama_config(spec, tokenizer, num_labels=1)).eval()
    for model, path in ((policy, paths.policy), (reward, paths.reward)):
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write policy/ and reward/ into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=TinySpec.hidden_size)
    parser.add_argument("--layers", type=int, default=TinySpec.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=TinySpec.num_attention_heads)
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory is current")
    args = parser.parse_args(argv)
    spec = TinySpec(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=2 * args.hidden_size,
        seed=args.seed,
    )
    paths = build_tiny(args.out_dir, spec, force=args.force)
    print(json.dumps({"policy": str(paths.policy), "reward": str(paths.reward)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
