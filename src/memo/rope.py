"""Rotary position embeddings: the frequencies (plain or stretched for a longer context) and the rotation.

Each scaling type computes what transformers' RoPE initialisers compute for it (`config.RopeScaling` names
the fields), so a checkpoint trained or extended with one has the same logits here; tests compare against
transformers. Every function is per token, so a token slice is rotated alone (the token-wise recompute).
Packed documents rotate each token by its position within its document (`rope_at`), as transformers does
with `position_ids`; the length-dependent (dynamic) scaling then sees the longest document, as there.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling


def _plain(theta: float, dim: int, device) -> torch.Tensor:
    """Returns the unscaled inverse frequencies theta^(-2i/dim), float32."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)


def _llama3(inv_freq: torch.Tensor, r: RopeScaling) -> torch.Tensor:
    """Keeps wavelengths below original/high_freq_factor, divides those above original/low_freq_factor by the
    factor, and blends linearly (in original/wavelength) between the two."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (r.original_max_positions / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * inv_freq / r.factor + smooth * inv_freq
    low = wavelen > r.original_max_positions / r.low_freq_factor
    high = wavelen < r.original_max_positions / r.high_freq_factor
    return torch.where(low, inv_freq / r.factor, torch.where(high, inv_freq, blended))


def _yarn(theta: float, dim: int, r: RopeScaling, device) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn more than beta_fast times over the original length keep
    their frequency, those under beta_slow are interpolated by the factor, a linear ramp in between."""

    def dimension_at(rotations: float) -> float:
        return dim * math.log(r.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_at(r.beta_fast), dimension_at(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low if high != low else 0.001)
    ).clamp(0, 1)
    extrapolated = _plain(theta, dim, device)
    return extrapolated / r.factor * ramp + extrapolated * (1 - ramp)


def inverse_frequencies(c: ModelConfig, seq_len: int, device=None) -> torch.Tensor:
    """Returns RoPE's inverse frequencies (head_dim/2,) float32 for a sequence of `seq_len` tokens (only the
    dynamic scaling depends on it: its base grows once the sequence passes max_position_embeddings)."""
    r, dim = c.rope_scaling, c.head_dim
    if r is None:
        return _plain(c.rope_theta, dim, device)
    if r.type == "linear":
        return _plain(c.rope_theta, dim, device) / r.factor
    if r.type == "llama3":
        return _llama3(_plain(c.rope_theta, dim, device), r)
    if r.type == "yarn":
        return _yarn(c.rope_theta, dim, r, device)
    length = max(seq_len, c.max_position_embeddings)
    theta = c.rope_theta * (r.factor * length / c.max_position_embeddings - (r.factor - 1)) ** (dim / (dim - 2))
    return _plain(theta, dim, device)


def attention_factor(c: ModelConfig) -> float:
    """Returns the factor cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    r = c.rope_scaling
    if r is None or r.type != "yarn":
        return 1.0
    if r.attention_factor is not None:
        return r.attention_factor
    return 0.1 * math.log(r.factor) + 1.0 if r.factor > 1 else 1.0


def rope_tables(c: ModelConfig, start: int, stop: int, seq_len: int, dtype, device):
    """Returns cos, sin of shape (rows, 1, d/2) for positions [start, stop) of a `seq_len`-token sequence."""
    return rope_at(c, torch.arange(start, stop, device=device, dtype=torch.float32), seq_len, dtype)


def rope_at(c: ModelConfig, positions: torch.Tensor, seq_len: int, dtype):
    """Returns cos, sin of shape (*positions.shape, 1, d/2) for the given positions (of packed documents: each
    token's own within its document, `seq_len` the longest document's)."""
    inv_freq = inverse_frequencies(c, seq_len, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    scale = attention_factor(c)
    return (angles.cos() * scale).to(dtype)[..., None, :], (angles.sin() * scale).to(dtype)[..., None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Returns x (b, r, heads, d) rotated pairwise (first half, second half), into `out` if given.

    With YaRN's attention factor m the tables hold m·cos, m·sin: the rotation also scales by m, and
    `unrotate` is its transpose (the backward), not its inverse."""
    x1, x2 = x.chunk(2, dim=-1)
    halves = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat(halves, dim=-1) if out is None else torch.cat(halves, dim=-1, out=out)


def unrotate(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Returns the gradient through `rotate` (its transpose: rotate by -angle, scaled by the same factor)."""
    return rotate(grad, cos, -sin)
