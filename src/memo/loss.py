"""Next-token cross-entropy computed in token chunks, never materialising the full (tokens × vocab) logits, nor
the final norm's output: the norm runs chunk by chunk inside the loss.

When several ranks hold parts of one batch (data or sequence parallel), the loss is the mean over the target
tokens of all of them: each rank divides its own sum by the global count, and a `TokenReduction` (given by
`memo.parallel`) sums the count and the partial losses across those ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .matmul import accumulating_mm, add_to
from .norms import norm_backward, norm_forward

ONE_BACKWARD = "memo runs one backward per forward: a second backward of a graph (retain_graph=True) is not supported"
IGNORE_INDEX = -100  # a label no loss is taken on: padding, document starts, unlabelled tokens (torch's default)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Returns targets where position t predicts labels[t+1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat((labels[:, 1:], pad), dim=1)


class TokenReduction(Protocol):
    """Sums over the ranks that share a batch; `sum_loss` passes its gradient through unchanged."""

    def sum_count(self, count: torch.Tensor) -> torch.Tensor: ...

    def sum_loss(self, loss: torch.Tensor) -> torch.Tensor: ...


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (norm(x) · Wᵀ) against targets summed and divided by `count`, chunk by chunk.

    The final norm (optional), the logits and every gradient are computed during forward, one chunk of tokens
    at a time (logits in float32), and only the (tokens × hidden) input gradient and the (vocab × hidden) and
    norm gradients are kept: the normalised hidden states and the logits never exist whole, and memory beyond
    the input and its gradient stays O(chunk × vocab).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_tokens: int, count: torch.Tensor, norm, *norm_params):
        flat = x.reshape(-1, x.shape[-1])
        y = targets.reshape(-1)
        grad_x = torch.empty_like(flat)
        train_w = weight.requires_grad  # a frozen head (LoRA) costs no weight-gradient product
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if train_w else None
        grad_norm: dict[str, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, flat.shape[0], chunk_tokens):
            xc, yc = flat[lo : lo + chunk_tokens], y[lo : lo + chunk_tokens]
            hc, stats = (xc, None) if norm is None else norm_forward(norm, xc)
            hc = hc.to(weight.dtype)
            logits = accumulating_mm(hc, weight.t())  # (chunk, V), float32
            valid = yc != IGNORE_INDEX
            safe = yc.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, safe[:, None]).squeeze(1)) * valid).sum()
            grad_logits = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
            grad_logits[torch.arange(len(yc), device=yc.device), safe] -= 1.0
            grad_logits *= valid[:, None] / count
            g = grad_logits.to(weight.dtype)
            del logits, grad_logits
            grad_h = g @ weight
            if train_w:
                grad_w += accumulating_mm(g.t(), hc)
            if norm is not None:
                grad_h, grads = norm_backward(norm, grad_h.to(xc.dtype), xc, stats)
                for name, value in grads.items():
                    add_to(grad_norm, name, value)
            grad_x[lo : lo + chunk_tokens] = grad_h
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        ctx.grads = (grad_x.view_as(x), grad_w, *(grad_norm[n].to(p.dtype) for n, p in _named(norm)))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        if not hasattr(ctx, "grads"):
            raise RuntimeError(ONE_BACKWARD)
        grad_x, grad_w, *grad_norm = ctx.grads  # made in forward, for one backward: scaled in place
        del ctx.grads
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in (grad_x, grad_w, *grad_norm)]
        return scaled[0], scaled[1], None, None, None, None, *scaled[2:]


def _named(norm) -> list[tuple[str, torch.Tensor]]:
    """Returns the norm's parameters in the order `norm_backward` names them (none without a norm)."""
    if norm is None:
        return []
    return [(n, p) for n in ("weight", "bias") if (p := getattr(norm, n, None)) is not None]


def chunked_cross_entropy(hidden, weight, labels, chunk_tokens: int = 4096) -> torch.Tensor:
    """Returns the mean next-token loss of `labels` (b, s) given final hidden states (b, s, h) and head W."""
    return target_cross_entropy(hidden, weight, shift_labels(labels), chunk_tokens)


def target_cross_entropy(
    x, weight, targets, chunk_tokens: int = 4096, across: TokenReduction | None = None, norm=None
) -> torch.Tensor:
    """Returns the mean cross-entropy over the target tokens (already shifted: position t predicts
    targets[t]) of this rank, or of every rank `across` spans, of the head W over norm(x) (x itself without a
    `norm`, an nn.LayerNorm or nn.RMSNorm applied chunk by chunk); the gradient is this rank's share."""
    count = (targets != IGNORE_INDEX).sum()
    if across is not None:
        count = across.sum_count(count)
    if not x.is_meta and int(count) == 0:
        raise ValueError("no target tokens: every label is ignored")
    params = [p for _, p in _named(norm)]
    loss = ChunkedCrossEntropy.apply(x, weight, targets, chunk_tokens, count, norm, *params)
    return loss if across is None else across.sum_loss(loss)
