"""Next-token cross-entropy computed in token chunks, never materialising the full (tokens × vocab) logits.

When several ranks hold parts of one batch (data or sequence parallel), the loss is the mean over the target
tokens of all of them: each rank divides its own sum by the global count, and a `TokenReduction` (given by
`memo.parallel`) sums the count and the partial losses across those ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .matmul import accumulating_mm

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Returns targets where position t predicts labels[t+1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat((labels[:, 1:], pad), dim=1)


class TokenReduction(Protocol):
    """Sums over the ranks that share a batch; `sum_loss` passes its gradient through unchanged."""

    def sum_count(self, count: torch.Tensor) -> torch.Tensor: ...

    def sum_loss(self, loss: torch.Tensor) -> torch.Tensor: ...


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (hidden · Wᵀ) against targets summed and divided by `count`, chunk by chunk.

    The gradients are computed during forward, one chunk of logits at a time (float32), and only the
    (tokens × hidden) and (vocab × hidden) gradients are kept: memory stays O(chunk × vocab).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, count: torch.Tensor):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, h.shape[0], chunk_tokens):
            hc, yc = h[lo : lo + chunk_tokens], y[lo : lo + chunk_tokens]
            logits = (hc @ weight.t()).float()  # (chunk, V)
            valid = yc != IGNORE_INDEX
            safe = yc.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, safe[:, None]).squeeze(1)) * valid).sum()
            grad_logits = torch.softmax(logits, dim=-1)
            grad_logits[torch.arange(len(yc), device=yc.device), safe] -= 1.0
            grad_logits *= valid[:, None] / count
            g = grad_logits.to(weight.dtype)
            grad_h[lo : lo + chunk_tokens] = (g @ weight).to(h.dtype)
            grad_w += accumulating_mm(g.t(), hc.to(weight.dtype))
        ctx.save_for_backward(grad_h.view_as(hidden), grad_w.to(weight.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None, None


def chunked_cross_entropy(hidden, weight, labels, chunk_tokens: int = 4096) -> torch.Tensor:
    """Returns the mean next-token loss of `labels` (b, s) given final hidden states (b, s, h) and head W."""
    return target_cross_entropy(hidden, weight, shift_labels(labels), chunk_tokens)


def target_cross_entropy(
    hidden, weight, targets, chunk_tokens: int = 4096, across: TokenReduction | None = None
) -> torch.Tensor:
    """Returns the mean cross-entropy over the target tokens (already shifted: position t predicts
    targets[t]) of this rank, or of every rank `across` spans; the gradient is this rank's share."""
    count = (targets != IGNORE_INDEX).sum()
    if across is not None:
        count = across.sum_count(count)
    if not hidden.is_meta and int(count) == 0:
        raise ValueError("no target tokens: every label is ignored")
    loss = ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens, count)
    return loss if across is None else across.sum_loss(loss)
