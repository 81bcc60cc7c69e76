"""Mixture-of-experts arithmetic of a decoder layer's MLP (Qwen3-MoE, Mixtral): routing, the experts' products
over a tile's tokens in expert-major order through `F.grouped_mm`, and both backwards.

Notation: T tokens of a tile (b·r), k experts per token, E experts, h hidden, f an expert's FFN width.
The routing (top-k indices and weights, T×k) is computed once, in the forward, and kept: the token-wise recompute
and the backward read it and never route again, so a recomputed router can never flip a near-tie and send a
token's gradient to an expert its forward did not use. Only continuous values (the router's logits, the experts'
products) are recomputed. The layer keeps its skeletal tensors token-major; expert-major order exists only here,
inside a tile (`Groups`).

Routing as transformers' Qwen3MoeTopKRouter and MixtralTopKRouter compute it: logits in the hidden states'
dtype, softmax in float32, top-k, renormalised to sum to 1 where the config says, cast back to the logits' dtype.
The load-balancing loss (transformers' `load_balancing_loss_func`) is E·Σ_e F_e·P_e over every layer's tokens,
F_e the share of routed (token, slot) pairs sent to e and P_e the mean router probability of e: each layer sums
its probabilities (`RouterTotals`) and the model combines them (`router_aux_loss`); F is a count, so the loss's
gradient reaches each layer as one number per expert, added to every token's probability gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .device import kernel_device_type


class Experts(nn.Module):
    """E SwiGLU experts without biases, stacked: gate and up (E, f, h), down (E, h, f) (transformers' per-expert
    `gate_proj`, `up_proj`, `down_proj` weights)."""

    def __init__(self, n_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.up = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, ffn))


@dataclass(frozen=True)
class Groups:
    """A tile's routed (token, slot) pairs in expert-major order: pair j of the sorted list is flat pair order[j]
    of the token-major (T·k) list, of token `token[j]`, at `pair[j]` (sequence, row, slot) of a (b, r, k, ...)
    tensor; expert e's rows end at offs[e]."""

    order: torch.Tensor  # (T·k,) int64
    token: torch.Tensor  # (T·k,) int64
    pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (T·k,) each
    offs: torch.Tensor  # (E,) int32, cumulative counts

    @classmethod
    def of(cls, idx: torch.Tensor, n_experts: int) -> "Groups":
        """Returns the groups of the routing `idx` (b, r, k)."""
        _, r, k = idx.shape
        flat = idx.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(_counts(flat, n_experts), 0, dtype=torch.int32)
        token = order // k
        return cls(order, token, (token // r, token % r, order % k), offs)

    def expert_major(self, t: torch.Tensor) -> torch.Tensor:
        """Returns the routed rows of a token-major (b, r, k, f) tensor in expert-major order (T·k, f)."""
        return t[self.pair]

    def token_major(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes expert-major `rows` (T·k, f) into the token-major (b, r, k, f) `out`, in place (a view or not)."""
        out.index_put_(self.pair, rows)


def _counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Returns how many of the expert indices `flat` name each expert (E,): a scatter, which `meta` traces too."""
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Returns the grouped product of `a` and the stacked `b` over the experts' row groups: a (R, m) by b (E, m, n)
    gives (R, n), row group e times b[e]; a (m, R) by b (R, n) gives (E, m, n), each expert's rows summed (the
    weight gradient). PyTorch's grouped kernel runs on CPU in every float dtype and on CUDA (Hopper) in bf16;
    elsewhere (fp32 on CUDA) one product per expert."""
    if a.is_meta and a.dtype != torch.bfloat16:  # the meta kernel takes bf16 alone; a trace needs only the shape
        shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (groups.offs.shape[0], a.shape[0], b.shape[-1])
        return a.new_empty(shape)
    if a.dtype == torch.bfloat16 or kernel_device_type(a.device) == "cpu":
        return F.grouped_mm(a, b, offs=groups.offs)
    ends = [0, *groups.offs.tolist()]
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[-1])
        for e, (lo, hi) in enumerate(zip(ends, ends[1:])):
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
        return out
    return torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(ends, ends[1:])])


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (weights (T, k) in the logits' dtype, expert indices (T, k), the probabilities (T, E) in float32) of
    the router's `logits` (T, E)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, k, dim=-1)
    if renormalise:
        top = top / top.sum(-1, keepdim=True)
    return top.to(logits.dtype), idx, probs


def route_backward(
    dweights: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, renormalise: bool, dprob: torch.Tensor | None
) -> torch.Tensor:
    """Returns the gradient of the router's logits (T, E), in their dtype, from that of the routing weights (T, k)
    with the routing `idx` kept from the forward, plus `dprob` (E,) added to every token's probabilities (the
    load-balancing loss's)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.gather(-1, idx.long())
    dtop = dweights.float()
    if renormalise:  # w = p / Σp: dp_j = (dw_j - Σ_i dw_i w_i) / Σp
        total = top.sum(-1, keepdim=True)
        dtop = (dtop - (dtop * (top / total)).sum(-1, keepdim=True)) / total
    dprobs = torch.zeros_like(probs).scatter_(-1, idx.long(), dtop)
    if dprob is not None:
        dprobs += dprob.float()
    return (probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))).to(logits.dtype)


@dataclass(eq=False)
class RouterTotals:
    """One layer's routing over a forward: Σ_t p_{t,e} (E,) in float32 (differentiable through the layer's
    output) and the routed pairs per expert (E,)."""

    prob_sum: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def zeros(cls, n_experts: int, device) -> "RouterTotals":
        return cls(torch.zeros(n_experts, device=device), torch.zeros(n_experts, dtype=torch.int64, device=device))

    def add(self, probs: torch.Tensor, idx: torch.Tensor) -> None:
        """Adds a tile's router probabilities (T, E) and routed pairs."""
        self.prob_sum += probs.sum(0)
        self.counts += _counts(idx.reshape(-1).long(), self.counts.shape[0])


def router_aux_loss(totals: list[RouterTotals], tokens: int, coef: float, across=None) -> torch.Tensor:
    """Returns coef · transformers' load-balancing loss, E·Σ_e F_e·P_e over every layer's `tokens` (and, `across`
    the ranks that share a batch, theirs: counts all-reduced, each rank's part of the probabilities its own
    gradient, the parts summed like the loss's, memo.loss.TokenReduction)."""
    counts = torch.stack([t.counts for t in totals]).sum(0)
    n = torch.tensor(tokens * len(totals), device=counts.device)
    if across is not None:
        counts, n = across.sum_count(counts), across.sum_count(n)
    prob_sum = torch.stack([t.prob_sum for t in totals]).sum(0)
    n_experts = counts.shape[0]
    aux = coef * n_experts * (counts.float() * prob_sum).sum() / (n.float() ** 2)
    return aux if across is None else across.sum_loss(aux)


pytree.register_dataclass(RouterTotals)  # the phase planner traces a phase's tensors, these among them
