"""Shared pieces of the TRL parity tests: the in-memory tiny models, fixed responses and the comparison table.

Everything is built locally (no hub access): a WordLevel tokenizer with ``[PAD]=0``, ``[EOS]=1``, ``[BOS]=2`` and
tiny random Llama models as in ALGORITHMS.md section 6.1. All of it is float32 on the CPU.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from bench._trl_learning import CPU_ARGS
from rlhf.algo import logprobs_from_logits
from rlhf.models import causal_lm_logits
from tests.support import make_experiences, make_sample

PAD, EOS, BOS, UNK = 0, 1, 2, 3
VOCAB = 32
FIRST_WORD = 4  # ids 4..31 are plain words; responses draw from them (and EOS), never from PAD


# The TRL config arguments every parity test shares with the learning comparison's TRL side: fp32 on the CPU,
# nothing saved, reported or printed
TRL_CPU_ARGS = CPU_ARGS


def build_tokenizer():
    """A PreTrainedTokenizerFast over a 32-entry WordLevel vocabulary, left padding, pad != eos."""
    vocab = {"[PAD]": PAD, "[EOS]": EOS, "[BOS]": BOS, "[UNK]": UNK}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        eos_token="[EOS]",
        bos_token="[BOS]",
        unk_token="[UNK]",
        padding_side="left",
        model_max_length=128,
    )
    assert (fast.pad_token_id, fast.eos_token_id, fast.bos_token_id) == (PAD, EOS, BOS)
    return fast


def llama_config(**extra):
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        **extra,
    )


@dataclass
class TinyModels:
    """Initial weights. Every run (TRL's and ours) gets its own deep copy, so neither sees the other's updates."""

    policy: torch.nn.Module  # LlamaForCausalLM, the trained policy's starting point
    ref: torch.nn.Module  # copy of the initial policy
    behaviour: torch.nn.Module  # perturbed policy that "sampled" the responses: old logprobs != new, ratio != 1
    value: torch.nn.Module  # LlamaForSequenceClassification(num_labels=1), the critic's starting point
    reward: torch.nn.Module  # LlamaForSequenceClassification(num_labels=1)

    def fresh(self) -> TinyModels:
        return copy.deepcopy(self)


def build_models(seed: int, behaviour_noise: float = 0.02) -> TinyModels:
    torch.manual_seed(seed)
    policy = LlamaForCausalLM(llama_config()).eval()
    policy.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD, bos_token_id=BOS)
    ref = copy.deepcopy(policy)
    behaviour = copy.deepcopy(policy)
    with torch.no_grad():
        for p in behaviour.parameters():
            p.add_(behaviour_noise * torch.randn_like(p))
    value = LlamaForSequenceClassification(llama_config(num_labels=1)).eval()
    reward = LlamaForSequenceClassification(llama_config(num_labels=1)).eval()
    return TinyModels(policy=policy, ref=ref, behaviour=behaviour, value=value, reward=reward)


def make_prompts(gen: torch.Generator, n: int, min_len: int, max_len: int) -> list[list[int]]:
    """``n`` distinct prompts (BOS + words) with lengths in [min_len, max_len], so left padding gets exercised."""
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < n:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        body = torch.randint(FIRST_WORD, VOCAB, (length - 1,), generator=gen).tolist()
        prompt = [BOS, *body]
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            prompts.append(prompt)
    return prompts


# The response shapes of ALGORITHMS.md section 6.1, cycled over the rows; rows past the fourth repeat them with other
# EOS positions. "garbage" after an EOS may contain more EOS tokens (TRL counts those in val/num_eos_tokens).
RESPONSE_CASES = ("eos_mid_garbage", "eos_last", "no_eos", "eos_first", "eos_mid_garbage", "no_eos")


def make_responses(gen: torch.Generator, n: int, length: int) -> tuple[torch.Tensor, list[str]]:
    """(n, length) raw responses without any pad token, covering every case of RESPONSE_CASES."""
    rows, cases = [], []
    for i in range(n):
        case = RESPONSE_CASES[i % len(RESPONSE_CASES)]
        row = torch.randint(FIRST_WORD, VOCAB, (length,), generator=gen)
        if case == "eos_mid_garbage":
            at = int(torch.randint(1, length - 1, (1,), generator=gen))
            row[at] = EOS
            if i % 2 == 0 and at + 2 < length:
                row[at + 2] = EOS  # a second EOS inside the garbage: it must be blanked too
        elif case == "eos_last":
            row[-1] = EOS
        elif case == "eos_first":
            row[0] = EOS
        rows.append(row)
        cases.append(case)
    responses = torch.stack(rows)
    assert not (responses == PAD).any(), "a pad id inside a response would be read as padding by TRL"
    return responses, cases


def left_pad(prompts: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    return torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])


def permutations(seed: int, n: int, epochs: int) -> list[list[int]]:
    """The minibatch shuffles both runs use, one per PPO epoch (TRL draws them from np.random.permutation)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randperm(n, generator=gen).tolist() for _ in range(epochs)]


# ---------------------------------------------------------------------------------------------------------------------
# comparison table


@dataclass
class Row:
    metric: str
    ours: str
    trl: str
    max_diff: float
    tolerance: str
    ok: bool


def _fmt(x: float) -> str:
    return f"{x:.9g}"


@dataclass
class Comparison:
    """Collects every ours-vs-TRL difference of one run, prints them as a table, then asserts them all at once."""

    title: str
    prefix: str = ""  # "ppo " / "online_dpo ": keeps the two trainers' same-named metrics apart in the report
    report: dict | None = None  # session collector: metric -> largest difference seen over all runs
    rows: list[Row] = field(default_factory=list)

    def add(self, metric: str, ours, trl, atol: float, rtol: float = 0.0, mask: torch.Tensor | None = None) -> None:
        """``|ours - trl| <= atol + rtol * |trl|`` elementwise (over ``mask`` when given); exact when both are 0."""
        o = torch.as_tensor(ours, dtype=torch.float64).detach().clone()
        t = torch.as_tensor(trl, dtype=torch.float64).detach().clone()
        if o.shape != t.shape:
            self.rows.append(Row(metric, f"shape {tuple(o.shape)}", f"shape {tuple(t.shape)}", math.inf, "-", False))
            return
        if mask is not None:
            mask = mask.bool()
            o, t = o[mask], t[mask]
        o, t = o.flatten(), t.flatten()
        diff = (o - t).abs()
        finite = bool(torch.isfinite(o).all() and torch.isfinite(t).all())
        ok = finite and bool((diff <= atol + rtol * t.abs()).all()) if diff.numel() else True
        worst = int(diff.argmax()) if diff.numel() else 0
        max_diff = float(diff.max()) if diff.numel() else 0.0
        if not finite:
            max_diff = math.inf
        if o.numel() == 1:
            ours_s, trl_s = _fmt(float(o[0])), _fmt(float(t[0]))
        elif o.numel():
            ours_s, trl_s = f"[{worst}]={_fmt(float(o[worst]))}", f"[{worst}]={_fmt(float(t[worst]))}"
        else:
            ours_s = trl_s = "(empty)"
        tol = f"{atol:g}" + (f" + {rtol:g}*|trl|" if rtol else "")
        self.rows.append(Row(metric, ours_s, trl_s, max_diff, tol, ok))

    def exact(self, metric: str, ours, trl) -> None:
        """Integer or boolean quantities: must be identical."""
        self.add(metric, torch.as_tensor(ours).long(), torch.as_tensor(trl).long(), atol=0.0)

    def table(self) -> str:
        width = max([len(r.metric) for r in self.rows] + [6])
        lines = [
            f"{self.title}",
            f"{'metric':<{width}}  {'ours':>22}  {'TRL':>22}  {'max abs diff':>12}  tolerance",
        ]
        for r in self.rows:
            flag = "" if r.ok else "   <-- MISMATCH"
            lines.append(f"{r.metric:<{width}}  {r.ours:>22}  {r.trl:>22}  {r.max_diff:12.3e}  {r.tolerance}{flag}")
        return "\n".join(lines)

    def check(self) -> None:
        if self.report is not None:
            for r in self.rows:
                key = self.prefix + r.metric.split("[")[0]  # "pg_loss[e1 mb0]" -> "pg_loss": one entry per quantity
                prev = self.report.get(key)
                if prev is None or r.max_diff > prev["max_abs_diff"]:
                    self.report[key] = {"max_abs_diff": r.max_diff, "tolerance": r.tolerance, "run": self.title}
        bad = [r.metric for r in self.rows if not r.ok]
        text = self.table()
        print("\n" + text)
        assert not bad, f"{len(bad)} quantities differ from TRL beyond tolerance: {bad}\n{text}"


# ---------------------------------------------------------------------------------------------------------------------
# driving the trainer's real update path (services.trainer.engine.TrainerEngine) on fixed completions


def save_pretrained(model, path) -> str:
    """The model (safetensors) and the parity tokenizer in one directory: what ``actor.load`` and TRL both read."""
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer().save_pretrained(str(path))
    return str(path)


def truncate_after_eos(row: list[int]) -> list[int]:
    """What generation returns: the tokens through the first EOS (all of them when there is none)."""
    return row[: row.index(EOS) + 1] if EOS in row else list(row)


@torch.no_grad()
def reference_logprobs(ref_model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The reference service's math: log_softmax(logits / T) of the reference model at the completion tokens."""
    ids = torch.tensor([prompt + completion])
    logits = causal_lm_logits(ref_model, ids, PAD)[:, len(prompt) - 1 : -1]
    return logprobs_from_logits(logits, ids[:, len(prompt) :], temperature)[0].tolist()


def experiences(prompts: list[list[int]], completions: list[list[int]], scores: list[float], refs: list[list[float]]):
    """Experience records as the rollout worker publishes them: one per prompt, its ``n`` samples in order."""
    samples = [
        make_sample(c, ref_logprobs=r, score=s, policy_version=0)
        for c, s, r in zip(completions, scores, refs, strict=True)
    ]
    return make_experiences(prompts, samples, job_prefix="job")


def capture_optimizer_grads(engine) -> list[dict[str, torch.Tensor]]:
    """Record the actor's gradients at every optimizer step of ``engine`` (the step itself is unchanged)."""
    grads: list[dict[str, torch.Tensor]] = []
    step = engine.actor_opt.step

    def recording_step(*args, **kwargs):
        grads.append({n: p.grad.detach().clone() for n, p in engine.actor.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    engine.actor_opt.step = recording_step
    return grads


def worst_grad(
    cmp: Comparison, tag: str, ours: dict[str, torch.Tensor], trl: dict[str, torch.Tensor], atol: float, rtol: float
) -> None:
    """Compare the parameter whose gradient differs most (by name: both are the same LlamaForCausalLM)."""
    assert set(ours) == set(trl), set(ours) ^ set(trl)
    worst = max(trl, key=lambda n: float(((ours[n] - trl[n]).abs() - rtol * trl[n].abs()).max()))
    cmp.add(f"grad (worst parameter){tag}", ours[worst], trl[worst], atol, rtol=rtol)
