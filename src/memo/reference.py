"""A plain `torch.nn` + autograd transformer with the same arithmetic as `memo.Transformer`.

It shares no code with the MEMO layer: the tests use it as the independent oracle for loss and gradients,
and the benchmarks wrap it with `torch.utils.checkpoint` / `save_on_cpu` as the alternatives users have.
It takes the frequencies of scaled RoPE from `memo.rope` (transformers is the oracle for those).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import attention_factor, inverse_frequencies


class GemmaNorm(nn.Module):
    """RMSNorm scaling by offset + weight in float32, then cast (transformers' Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float, offset: float):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight.float())).to(
            x.dtype
        )


def _norm(c: ModelConfig, size: int) -> nn.Module:
    if c.arch == "gpt":
        return nn.LayerNorm(size, eps=c.norm_eps)
    return GemmaNorm(size, c.norm_eps, c.norm_offset) if c.norm_offset else nn.RMSNorm(size, eps=c.norm_eps)


class RotaryEmbedding(nn.Module):
    """HF-style rotary embedding: q·cos + rotate_half(q)·sin with the frequency table repeated twice."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:  # x (b, heads, s, d)
        s, d = x.shape[2], self.c.head_dim
        if positions is None:
            freqs = inverse_frequencies(self.c, s, x.device)
            pos = torch.arange(s, dtype=torch.float32, device=x.device)
        else:  # packed documents: (b, s) positions within each, broadcast over heads
            freqs = inverse_frequencies(self.c, int(positions.max()) + 1, x.device)
            pos = positions[:, None].to(x.device, torch.float32)
        emb = torch.cat([pos[..., None] * freqs] * 2, dim=-1)
        m = attention_factor(self.c)
        cos, sin = (emb.cos() * m).to(x.dtype), (emb.sin() * m).to(x.dtype)
        half = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        return x * cos + half * sin


class ReferenceExperts(nn.Module):
    """A mixture of SwiGLU experts computed densely, every expert over every token, masked by the top-k routing
    (slow and simple: transformers' Qwen3-MoE / Mixtral arithmetic); keeps its router logits for the aux loss."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        e, h, f = c.n_experts, c.hidden_size, c.expert_ffn
        self.router = nn.Linear(h, e, bias=False)
        self.gate, self.up, self.down = (nn.Parameter(torch.zeros(e, *shape)) for shape in ((f, h), (f, h), (h, f)))
        self.logits = None

    def forward(self, n: torch.Tensor) -> torch.Tensor:
        self.logits = self.router(n)  # (b, s, E)
        probs = torch.softmax(self.logits.float(), dim=-1)
        top, idx = probs.topk(self.c.experts_per_token, dim=-1)
        if self.c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(n.dtype)
        out = torch.zeros_like(n)
        for e in range(self.c.n_experts):
            weight = (top * (idx == e)).sum(-1, keepdim=True)  # (b, s, 1): 0 where e is not routed
            out = out + weight * F.linear(F.silu(F.linear(n, self.gate[e])) * F.linear(n, self.up[e]), self.down[e])
        return out


def load_balancing_loss(logits: list[torch.Tensor], k: int) -> torch.Tensor:
    """Returns E·Σ_e F_e·P_e over every layer's router logits (transformers' `load_balancing_loss_func`, without a
    mask): F_e the share of the top-k choices that name e, P_e its mean probability."""
    probs = torch.softmax(torch.cat([x.reshape(-1, x.shape[-1]) for x in logits]).float(), dim=-1)
    chosen = F.one_hot(probs.topk(k, dim=-1).indices, probs.shape[-1]).float()  # (N, k, E)
    return probs.shape[-1] * (chosen.mean(0) * probs.mean(0)).sum()


class ReferenceBlock(nn.Module):
    def __init__(self, c: ModelConfig, attention: str, index: int = 0):
        super().__init__()
        self.c, self.attention = c, attention
        self.window = c.window(index)  # None: every token before; w: itself and the w - 1 before it
        gpt = c.arch == "gpt"
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.attn_norm, self.mlp_norm = _norm(c, c.hidden_size), _norm(c, c.hidden_size)
        self.wq = nn.Linear(c.hidden_size, q, bias=c.qkv_bias)
        self.wk = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.wv = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias)
        self.q_norm = _norm(c, c.head_dim) if c.qk_norm else nn.Identity()
        self.k_norm = _norm(c, c.head_dim) if c.qk_norm else nn.Identity()
        self.wo = nn.Linear(q, c.hidden_size, bias=c.out_bias)
        self.sparse = c.sparse(index)
        if self.sparse:
            self.router_experts = ReferenceExperts(c)
        else:
            self.w_gate = None if gpt else nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
            self.w_up = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
            self.w_down = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.mlp_bias)
        self.attn_post_norm = _norm(c, c.hidden_size) if c.sandwich_norms else nn.Identity()
        self.mlp_post_norm = _norm(c, c.hidden_size) if c.sandwich_norms else nn.Identity()
        local = c.rope_local_theta is not None and c.slides(index)
        self.rope = RotaryEmbedding(
            dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling=None) if local else c
        )

    def _attend(self, q, k, v, positions=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = (self.c.query_pre_attn_scalar or q.shape[-1]) ** -0.5
        if self.attention == "sdpa" and positions is None and self.window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        if self.window is not None:
            mask = mask.triu(1 - self.window)  # key j within (i - window, i]
        if positions is not None:  # block-diagonal: a token sees only its own document (0 starts one)
            document = (positions == 0).cumsum(dim=1).to(q.device)  # (b, s)
            mask = mask & (document[:, :, None] == document[:, None, :])[:, None]  # (b, 1, s, s)
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        scores = (q @ k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        return probs @ v

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, -1, self.c.head_dim)  # noqa: E731
        n = self.attn_norm(x)
        q, k, v = self.q_norm(heads(self.wq(n))), self.k_norm(heads(self.wk(n))), heads(self.wv(n))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
        o = self._attend(self.rope(q, positions), self.rope(k, positions), v, positions)
        x = x + self.attn_post_norm(self.wo(o.transpose(1, 2).reshape(b, s, -1)))
        n = self.mlp_norm(x)
        if self.sparse:
            return x + self.router_experts(n)
        if self.w_gate is None:
            hidden = F.gelu(self.w_up(n))
        else:
            gate = self.w_gate(n)
            act = F.gelu(gate, approximate="tanh") if self.c.mlp_activation == "gelu_tanh" else F.silu(gate)
            hidden = act * self.w_up(n)
        return x + self.mlp_post_norm(self.w_down(hidden))


class ReferenceTransformer(nn.Module):
    """Embedding → blocks → norm → head with full logits; `attention` is "math" (explicit) or "sdpa"."""

    def __init__(self, c: ModelConfig, attention: str = "math"):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(ReferenceBlock(c, attention, i) for i in range(c.n_layers))
        self.norm = _norm(c, c.hidden_size)
        self.head = None if c.tie_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids, labels=None, block=None, positions=None):
        """Returns the mean next-token loss (or logits); `block(layer, x)` wraps each layer, e.g. checkpoint;
        `positions` (b, s) packs documents: positions within each, 0 where one starts."""
        x = self.embed(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer in self.layers:
            x = (layer(x) if positions is None else layer(x, positions)) if block is None else block(layer, x)
        logits = self.norm(x) @ (self.embed.weight if self.head is None else self.head.weight).t()
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        if not self.config.router_aux_loss:
            return loss
        logits = [layer.router_experts.logits for layer in self.layers if layer.sparse]
        aux = load_balancing_loss(logits, self.config.experts_per_token)
        return loss + self.config.router_aux_loss_coef * aux

    def memo_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """Returns the state dict under memo.Transformer's names (a mixture of experts' live in one module)."""
        rename = {".router_experts.router.": ".router.", ".router_experts.": ".experts."}
        state = {}
        for name, t in self.state_dict(keep_vars=keep_vars).items():
            for ours, theirs in rename.items():
                if ours in name:
                    name = name.replace(ours, theirs)
                    break
            state[name] = t
        return state
