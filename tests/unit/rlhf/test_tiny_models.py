"""rlhf.tiny builds a usable tiny policy / reward model / tokenizer locally; rlhf.models forward conventions."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf import models
from rlhf.tiny import CHAT_TEMPLATE, TinySpec, build_tiny


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return models.load_tokenizer(tiny_models.policy)


@pytest.fixture(scope="module")
def policy(tiny_models):
    return models.load_causal_lm(tiny_models.policy).eval()


@pytest.fixture(scope="module")
def reward_model(tiny_models):
    return models.load_sequence_classifier(tiny_models.reward).eval()


def test_layout(tiny_models):
    for d in (tiny_models.policy, tiny_models.reward):
        assert (d / "config.json").exists()
        assert (d / "model.safetensors").exists()
        assert (d / "tokenizer.json").exists()
    stamp = json.loads((tiny_models.root / "tiny.json").read_text())
    assert stamp["digest"] == TinySpec().digest()


def test_policy_config(policy):
    cfg = policy.config
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert getattr(cfg, "head_dim", 32) == 32
    assert not cfg.tie_word_embeddings


def test_tokenizer_special_tokens(tokenizer, policy):
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == ("<pad>", "</s>", "<s>")
    assert tokenizer.padding_side == "left"
    assert policy.config.pad_token_id == tokenizer.pad_token_id
    assert policy.config.eos_token_id == tokenizer.eos_token_id
    assert policy.generation_config.eos_token_id == tokenizer.eos_token_id
    assert policy.config.vocab_size == len(tokenizer)


@pytest.mark.parametrize("text", ["User: what is 12 plus 30?\nAssistant: 42", "hello world", "Ünïcödé ✓ ok 🙂"])
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 0
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == text


def test_chat_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 2 plus 2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "Be brief.\nUser: what is 2 plus 2?\nAssistant:"
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(convo, tokenize=False) == "User: hi\nAssistant: hello</s>\n"


def test_reward_model_one_label(reward_model, tokenizer):
    assert reward_model.config.num_labels == 1
    assert reward_model.config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer(["hello world", "the cat is red"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = reward_model(**ids)
    assert out.logits.shape == (2, 1)
    assert torch.isfinite(out.logits).all()


def test_build_is_deterministic_and_reused(tiny_models, tmp_path):
    again = build_tiny(tmp_path / "again")
    for sub in ("policy", "reward"):
        a = (getattr(tiny_models, sub) / "model.safetensors").read_bytes()
        b = (getattr(again, sub) / "model.safetensors").read_bytes()
        assert a == b, f"{sub} weights differ between two builds with the same seed"
        assert (getattr(tiny_models, sub) / "tokenizer.json").read_text() == (
            getattr(again, sub) / "tokenizer.json"
        ).read_text()
    # a current directory is reused, not rebuilt
    weights = again.policy / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny(tmp_path / "again") == again
    assert weights.stat().st_mtime_ns == before


def test_spec_digest_depends_on_fields():
    assert TinySpec().digest() == TinySpec().digest()
    assert TinySpec(seed=1).digest() != TinySpec().digest()
    assert TinySpec(hidden_size=128).digest() != TinySpec().digest()


def _random_ids(n, vocab, pad, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n,), generator=g)  # ids 0-2 are the special tokens
    assert (ids != pad).all()
    return ids


def test_causal_lm_logits_ignore_left_padding(policy, tokenizer):
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    short, full = _random_ids(5, vocab, pad, 0), _random_ids(8, vocab, pad, 1)
    batch = torch.stack([torch.cat([torch.full((3,), pad), short]), full])
    with torch.no_grad():
        padded = models.causal_lm_logits(policy, batch, pad)
        alone = models.causal_lm_logits(policy, short[None], pad)
        full_alone = models.causal_lm_logits(policy, full[None], pad)
    assert padded.shape == (2, 8, vocab)
    assert torch.allclose(padded[0, 3:], alone[0], atol=1e-5)
    assert torch.allclose(padded[1], full_alone[0], atol=1e-5)
    # sanity: the naive forward without the position/mask convention does differ
    with torch.no_grad():
        naive = policy(input_ids=batch).logits
    assert not torch.allclose(naive[0, 3:], alone[0], atol=1e-5)


def test_score_head_outputs(reward_model, tokenizer):
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    short, full = _random_ids(4, vocab, pad, 2), _random_ids(6, vocab, pad, 3)
    batch = torch.stack([torch.cat([torch.full((2,), pad), short]), full])
    with torch.no_grad():
        out = models.score_head_outputs(reward_model, batch, pad)
        alone = models.score_head_outputs(reward_model, short[None], pad)
        pooled = reward_model(input_ids=full[None]).logits
    assert out.shape == (2, 6)
    assert out.dtype == torch.float32
    assert torch.allclose(out[0, 2:], alone[0], atol=1e-5)
    # the head applied per position agrees with the model's own pooled output at the last token
    assert torch.allclose(out[1, -1], pooled[0, 0], atol=1e-5)


def test_resolve_dtype_and_device():
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype("float32") is torch.float32
    assert models.resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'fp8'"):
        models.resolve_dtype("fp8")
    assert models.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu'"):
        models.resolve_device("tpu")
