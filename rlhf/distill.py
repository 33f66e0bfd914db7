"""On-policy distillation's start-up check: the teacher (the reference model) must read token ids as the student does.

The reference service scores the student's sampled token ids with the teacher, so a teacher whose tokenizer maps ids
to other strings would grade tokens it never saw as such: the run would train towards noise. The trainer (and
``rlhf up``'s preflight) refuse that before any step, naming both models.
"""

from __future__ import annotations

from pathlib import Path

# Texts whose encodings must agree: ASCII words and digits, whitespace, non-Latin scripts and an emoji (byte-level
# fallbacks), and the tiny chat format's turn markers.
PROBES = (
    "The answer is 42, not 41.\n\nUser: what is 17 plus 25?\nAssistant:",
    "  indented\tand\ttabbed  ",
    "héllo wörld, 你好, привет 🙂",
)


def _tokenizer_path(spec: str) -> str:
    """Where to load a model reference's tokenizer from without loading (or downloading) its weights: a ``tiny:`` or
    local folder as it resolves, a Hugging Face id as it is (transformers fetches only the tokenizer files)."""
    if spec.startswith("tiny:") or Path(spec).expanduser().exists():
        from rlhf.models import resolve_model_path  # noqa: PLC0415 - torch: rlhf up's preflight imports this module

        return str(resolve_model_path(spec))
    return spec


def tokenizer_differences(student, teacher) -> list[str]:
    """What differs between two tokenizers in what token ids mean: vocabulary size, EOS / BOS ids, the id of any
    token string, the encodings of :data:`PROBES`. Empty when they match."""
    out = []
    if len(student) != len(teacher):
        out.append(f"vocabulary size {len(student)} vs {len(teacher)}")
    for name in ("eos_token_id", "bos_token_id"):
        a, b = getattr(student, name), getattr(teacher, name)
        if a != b:
            out.append(f"{name} {a} vs {b}")
    sv, tv = student.get_vocab(), teacher.get_vocab()
    moved = sorted(t for t in sv.keys() | tv.keys() if sv.get(t) != tv.get(t))
    if moved:
        first = moved[0]
        out.append(f"{len(moved)} token(s) with another id or absent, as {first!r}: {sv.get(first)} vs {tv.get(first)}")
    for text in PROBES:
        a = student.encode(text, add_special_tokens=False)
        b = teacher.encode(text, add_special_tokens=False)
        if a != b:
            out.append(f"{text!r} encodes as {a[:8]}... vs {b[:8]}...")
            break
    return out


def check_teacher_tokenizer(student_spec: str, teacher_spec: str, student_tokenizer=None) -> None:
    """Raise ValueError naming both models when the teacher's tokenizer does not read ids as the student's does."""
    from rlhf.models import load_tokenizer  # noqa: PLC0415 - torch: rlhf up's preflight imports this module

    student = student_tokenizer if student_tokenizer is not None else load_tokenizer(_tokenizer_path(student_spec))
    teacher = load_tokenizer(_tokenizer_path(teacher_spec))
    diffs = tokenizer_differences(student, teacher)
    if diffs:
        raise ValueError(
            f"on-policy distillation (algorithm.distill.coef > 0): the teacher actor_rollout_ref.ref.load "
            f"{teacher_spec} has another tokenizer than the student {student_spec} (student vs teacher: "
            f"{'; '.join(diffs)}); the teacher scores the student's token ids, so both must use one tokenizer: pick "
            "a teacher of the student's model family or a student with the teacher's tokenizer"
        )
