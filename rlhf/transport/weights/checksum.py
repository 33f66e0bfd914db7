"""A bucket digest the accelerator computes: what a collective push over nccl/hccl checks instead of sha256, so a
bucket that arrived in device memory is checked where it landed.

Little-endian 16-bit words ``w_i`` (an odd last byte is one more word), in two lanes with different position
weights: ``sum_i w_i * c_i mod P``, ``P = 2**31 - 1``, ``c_i = (a * i + b) mod (P - 1) + 1``; exact integer
arithmetic, the same on a GPU, an NPU or a CPU. It detects corruption and misdelivery, not a forger: the paths whose
bytes cross an untrusted network keep sha256. Design: docs/weight-sync.md#backends-gloo-nccl-hccl.
"""

from __future__ import annotations

import torch

PREFIX = "wsum1"  # the digest's name and version: a later algorithm gets another
_P = (1 << 31) - 1
_LANES = ((48271, 12345), (65539, 67890))  # (a, b): multipliers prime and coprime with P - 1
_CHUNK = 1 << 21  # words per pass: its int64 temporaries take 16-32 MiB each, whatever the bucket's size


def device_digest(data: torch.Tensor) -> str:
    """The digest of ``data``'s bytes (a contiguous uint8 tensor on any device), computed on its device; one
    host sync at the end."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("device_digest takes a contiguous 1-D uint8 tensor")
    n = data.numel()
    acc = torch.zeros(len(_LANES), dtype=torch.int64, device=data.device)
    lanes = torch.tensor(_LANES, dtype=torch.int64, device=data.device)  # [lanes, (a, b)]
    for start in range(0, n, 2 * _CHUNK):
        part = data[start : start + 2 * _CHUNK].to(torch.int64)
        if part.numel() % 2:  # the odd last byte: a word of its own
            part = torch.cat([part, part.new_zeros(1)])
        words = part[0::2] + part[1::2] * 256  # little-endian, exact whatever the device's byte order
        index = torch.arange(start // 2, start // 2 + words.numel(), dtype=torch.int64, device=data.device)
        weights = (index[None, :] * lanes[:, :1] + lanes[:, 1:]) % (_P - 1) + 1  # < 2**31: products stay < 2**47
        acc = (acc + (words[None, :] * weights % _P).sum(dim=1)) % _P  # each sum < 2**52
    a, b = (int(v) for v in acc.tolist())
    return f"{PREFIX}:{n:x}:{a:08x}{b:08x}"


def is_device_digest(text: str) -> bool:
    """``text`` has the form :func:`device_digest` writes."""
    parts = text.split(":")
    return (
        len(parts) == 3
        and parts[0] == PREFIX
        and 0 < len(parts[1]) <= 16
        and len(parts[2]) == 16
        and all(c in "0123456789abcdef" for c in parts[1] + parts[2])
    )
