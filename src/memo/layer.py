"""The decoder layer: an explicit forward that writes its skeletal tensors, and an explicit backward.

Notation: b batch, s tokens, r rows (a token slice), h hidden, a heads, g kv-heads, d head dim, f FFN.
Skeletal tensors (memo-method.md §2) are token-major, (b, s, ...), so a token slice is `t[name][:, rows]`:

    x    (b,s,h)    layer input                      -- role "input": always to host in full
    n1   (b,s,h)    attention-norm output            -- role "other": α of the tokens to host, rest recomputed
    n1_stats (b,s,k) its per-token statistics, fp32  -- other (k = 2: mean, rstd for LayerNorm; 1: rstd)
    q    (b,s,a,d)  rotated query                    -- other
    q_stats (b,s,a,1) q's per-head RMSNorm rstd      -- other (`qk_norm` only, as are k_stats)
    k    (b,s,g,d)  rotated key                      -- other
    v    (b,s,g,d)  value                            -- other
    attn (b,s,a,d)  attention output                 -- role "attention": always to host in full
    lse  (b,a,s')   attention log-sum-exp, float32   -- attention (b, a/sp, s'·sp) under sequence parallelism
    x1   (b,s,h)    x + attention projection         -- other
    n2   (b,s,h)    MLP-norm output                  -- other
    n2_stats (b,s,k) its statistics                  -- other
    gate (b,s,f)    SwiGLU gate (llama only)         -- other
    up   (b,s,f)    up projection                    -- other
    act  (b,s,f)    GeLU(up) or SiLU(gate)*up        -- other

Every "other" tensor is a token-local function of x and attn, so `fill(t, start)` recomputes rows
[start, s) from them without touching attention (§3), writing each straight into its slot (`out=`) where an
op allows it, so the forward and the recompute move no extra copies. With `qk_norm` the backward needs q
and k before their norm: it recomputes them from n1 (one token-local matmul) rather than keeping them.

Under Ulysses sequence parallelism (`memo.parallel` sets `seq_parallel`), s is this rank's contiguous
shard of the sequence and every skeletal tensor holds only those tokens; RoPE uses global positions.
Attention alone sees all tokens: for a/sp heads, between the all-to-alls `seq_parallel` provides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_backward, attention_forward, lse_seq_len
from .config import ModelConfig
from .norms import norm_backward, norm_forward, rms_norm, rms_norm_backward, stats_dtype, stats_width
from .rope import rope_tables, rotate, unrotate

aten = torch.ops.aten
Role = Literal["input", "attention", "other"]


@dataclass(frozen=True)
class SkeletalSpec:
    """One skeletal tensor of a layer: its full shape, dtype, and how §3 treats it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role

    @property
    def nbytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * self.dtype.itemsize

    def rows(self, n_rows: int) -> "SkeletalSpec":
        """Returns the spec of the first `n_rows` tokens (dimension 1)."""
        return SkeletalSpec((self.shape[0], n_rows, *self.shape[2:]), self.dtype, self.role)


def bytes_by_role(specs: dict[str, SkeletalSpec]) -> dict[str, int]:
    """Returns the summed bytes of the skeletal tensors of each role (the S_in, S_attn, S_oth of §3)."""
    return {
        role: sum(sp.nbytes for sp in specs.values() if sp.role == role) for role in ("input", "attention", "other")
    }


@dataclass(frozen=True)
class Recompute:
    """What a layer must rebuild before its backward: token rows [start, s), and attention too if asked."""

    start: int
    attention: bool = False


def linear_into(out: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """Writes x·Wᵀ + b into `out` (a slot of the skeletal tensors, no temporary) and returns it."""
    return aten.linear.out(x, lin.weight, lin.bias, out=out)


def heads_major(t: torch.Tensor) -> torch.Tensor:
    """Returns a (b, s, heads, d) tensor viewed as (b, heads, s, d), the kernels' layout."""
    return t.transpose(1, 2)


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Returns dW = dyᵀ·x summed over all tokens, for y = x·Wᵀ."""
    return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _token_sum(dy: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).sum(0)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. Parameters live in nn.Linear / norm modules; the arithmetic is explicit."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        c = config
        self.config, self.index = c, index
        self.gpt = c.arch == "gpt"
        h, d, f = c.hidden_size, c.head_dim, c.ffn_hidden_size
        norm = (lambda: nn.LayerNorm(h, eps=c.norm_eps)) if self.gpt else (lambda: nn.RMSNorm(h, eps=c.norm_eps))
        self.attn_norm = norm()
        self.wq = nn.Linear(h, c.n_heads * d, bias=c.qkv_bias)
        self.wk = nn.Linear(h, c.n_kv_heads * d, bias=c.qkv_bias)
        self.wv = nn.Linear(h, c.n_kv_heads * d, bias=c.qkv_bias)
        self.q_norm = nn.RMSNorm(d, eps=c.norm_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(d, eps=c.norm_eps) if c.qk_norm else None
        self.wo = nn.Linear(c.n_heads * d, h, bias=c.out_bias)
        self.mlp_norm = norm()
        self.w_gate = None if self.gpt else nn.Linear(h, f, bias=c.mlp_bias)
        self.w_up = nn.Linear(h, f, bias=c.mlp_bias)
        self.w_down = nn.Linear(f, h, bias=c.mlp_bias)
        self.scale = d**-0.5
        self.arena = None  # a plan.arena.Arena: transient tensors at planned offsets (Transformer.plan_memory)
        self.seq_parallel = None  # a parallel.ulysses.Ulysses: token shards <-> head shards around attention

    # ---- skeletal tensors -------------------------------------------------------------------------------
    def skeletal_specs(self, batch: int, seq: int, dtype, device) -> dict[str, SkeletalSpec]:
        """Returns the layer's skeletal tensors (module docstring) for a (batch, seq) input."""
        c = self.config
        h, a, g, d, f = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden_size
        b, s = batch, seq

        def spec(role: Role, *tail: int) -> SkeletalSpec:
            return SkeletalSpec((b, s, *tail), dtype, role)

        stats = SkeletalSpec((b, s, stats_width(self.attn_norm)), stats_dtype(dtype), "other")
        specs = {
            "x": spec("input", h),
            "n1": spec("other", h),
            "n1_stats": stats,
            "q": spec("other", a, d),
            "k": spec("other", g, d),
            "v": spec("other", g, d),
            "attn": spec("attention", a, d),
            "lse": self._lse_spec(b, s, dtype, torch.device(device)),
            "x1": spec("other", h),
            "n2": spec("other", h),
            "n2_stats": stats,
            "gate": spec("other", f),
            "up": spec("other", f),
            "act": spec("other", f),
        }
        if self.gpt:
            del specs["gate"]
        if c.qk_norm:
            specs["q_stats"] = SkeletalSpec((b, s, a, 1), stats_dtype(dtype), "other")
            specs["k_stats"] = SkeletalSpec((b, s, g, 1), stats_dtype(dtype), "other")
        return specs

    def _lse_spec(self, b: int, s: int, dtype, device: torch.device) -> SkeletalSpec:
        """Returns the LSE's spec: the kernel's, for all heads, or for a/sp heads of all s·sp tokens."""
        a, sp = self.config.n_heads, self.seq_parallel
        if sp is None:
            return SkeletalSpec((b, a, lse_seq_len(s, device, dtype)), torch.float32, "attention")
        return SkeletalSpec((b, a // sp.size, lse_seq_len(s * sp.size, device, dtype)), torch.float32, "attention")

    def _offset(self, s: int) -> int:
        """Returns the global position of this rank's first token (0 without sequence parallelism)."""
        return 0 if self.seq_parallel is None else self.seq_parallel.token_offset(s)

    def _rope(self, s: int, rows: slice, like: torch.Tensor):
        """Returns cos, sin for local token rows `rows` of this rank's `s` tokens (global positions)."""
        at, total = self._offset(s), s * (1 if self.seq_parallel is None else self.seq_parallel.size)
        return rope_tables(self.config, at + rows.start, at + rows.stop, total, like.dtype, like.device)

    def _project(self, n1: torch.Tensor, name: str) -> torch.Tensor:
        """Returns the q or k projection of n1 (b, r, h) as heads (b, r, heads, d), before norm and RoPE."""
        lin = getattr(self, "w" + name)
        return F.linear(n1, lin.weight, lin.bias).unflatten(-1, (-1, self.config.head_dim))

    # ---- forward (also the token-wise recompute) --------------------------------------------------------
    def _norm(self, t: dict, name: str, x: torch.Tensor, rows: slice, norm: nn.Module) -> torch.Tensor:
        """Writes norm(x) into t[name] and its statistics into t[name + "_stats"] (rows `rows`); returns the
        written rows."""
        y, stats = norm_forward(norm, x)
        t[name + "_stats"][:, rows] = stats
        out = t[name][:, rows]
        out.copy_(y)
        return out

    def fill(self, t: dict[str, torch.Tensor], start: int = 0, attention: bool = True) -> tuple | None:
        """Writes the skeletal tensors of token rows [start, s) into `t` from t["x"] (and t["attn"]).

        With `attention`, the attention output and LSE are computed (all rows) and the kernel's aux returned.
        """
        rows = slice(start, t["x"].shape[1])
        self._fill_attention_inputs(t, rows)
        aux = self._fill_attention(t) if attention else None
        self._fill_mlp_inputs(t, rows)
        return aux

    def _fill_attention_inputs(self, t, rows: slice) -> None:
        c = self.config
        x = t["x"][:, rows]  # (b, r, h)
        b, r = x.shape[:2]
        n1 = self._norm(t, "n1", x, rows, self.attn_norm)  # (b, r, h)
        cos, sin = self._rope(t["x"].shape[1], rows, x)
        for name in ("q", "k"):  # (b, r, heads, d): per-head norm (Qwen3), then RoPE into the slot
            proj = self._project(n1, name)
            if c.qk_norm:
                proj, rstd = rms_norm(proj, getattr(self, name + "_norm").weight, c.norm_eps)
                t[name + "_stats"][:, rows] = rstd
            rotate(proj, cos, sin, t[name][:, rows])
        linear_into(t["v"][:, rows].flatten(2), n1, self.wv)  # (b, r, g·d)

    def _fill_attention(self, t) -> tuple:
        sp = self.seq_parallel
        if sp is None:
            q, k, v = heads_major(t["q"]), heads_major(t["k"]), heads_major(t["v"])
            out, lse, aux = attention_forward(q, k, v, self.scale)
            heads_major(t["attn"]).copy_(out)  # (b, a, s, d) into token-major (b, s, a, d)
        else:
            # (b, local tokens, all heads) -> (b, all tokens, a/sp heads) and back: two all-to-alls
            q, k, v = sp.to_heads(t["q"], sp.expand_kv(t["k"]), sp.expand_kv(t["v"]))
            out, lse, aux = attention_forward(heads_major(q), heads_major(k), heads_major(v), self.scale)
            sp.to_tokens(heads_major(out), out=(t["attn"],))
        t["lse"].copy_(lse)
        return aux

    def _fill_mlp_inputs(self, t, rows: slice) -> None:
        x, attn = t["x"][:, rows], t["attn"][:, rows].flatten(2)  # (b, r, h), (b, r, a*d)
        x1 = torch.add(x, F.linear(attn, self.wo.weight, self.wo.bias), out=t["x1"][:, rows])
        n2 = self._norm(t, "n2", x1, rows, self.mlp_norm)
        up = linear_into(t["up"][:, rows], n2, self.w_up)  # (b, r, f)
        if self.gpt:
            aten.gelu.out(up, out=t["act"][:, rows])
        else:
            gate = linear_into(t["gate"][:, rows], n2, self.w_gate)
            torch.mul(F.silu(gate), up, out=t["act"][:, rows])

    def output(self, t) -> torch.Tensor:
        """Returns the layer output y = x1 + act·W_downᵀ (b, s, h), a fresh tensor."""
        return t["x1"] + F.linear(t["act"], self.w_down.weight, self.w_down.bias)

    # ---- backward ---------------------------------------------------------------------------------------
    def _norm_backward(self, dy, x, stats, prefix: str, grads: dict) -> torch.Tensor:
        """Returns dx of the norm `prefix` from its kept statistics and stores its parameter grads."""
        dx, norm_grads = norm_backward(getattr(self, prefix), dy, x, stats)
        grads.update({f"{prefix}.{name}": g for name, g in norm_grads.items()})
        return dx

    def _linear_backward(self, dy, x, name: str, grads: dict) -> torch.Tensor:
        """Returns dx of y = x·Wᵀ + b and stores dW (and db)."""
        lin = getattr(self, name)
        grads[name + ".weight"] = _weight_grad(dy, x)
        if lin.bias is not None:
            grads[name + ".bias"] = _token_sum(dy)
        return dy @ lin.weight

    def backward(self, dy: torch.Tensor, t: dict, aux: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns (dx, parameter grads by name) from dy (b, s, h) and the complete skeletal tensors."""
        c, grads = self.config, {}
        b, s = dy.shape[:2]
        # MLP: y = x1 + act·W_downᵀ
        dact = self._linear_backward(dy, t["act"], "w_down", grads)  # (b, s, f)
        if self.gpt:
            dup = aten.gelu_backward(dact, t["up"])
            dn2 = self._linear_backward(dup, t["n2"], "w_up", grads)
        else:
            gate, up = t["gate"], t["up"]
            dup = dact * F.silu(gate)
            dgate = aten.silu_backward(dact * up, gate)
            dn2 = self._linear_backward(dup, t["n2"], "w_up", grads)
            dn2 += self._linear_backward(dgate, t["n2"], "w_gate", grads)
        dx1 = dy + self._norm_backward(dn2, t["x1"], t["n2_stats"], "mlp_norm", grads)  # (b, s, h)
        # attention: x1 = x + attn·W_oᵀ
        dattn = self._linear_backward(dx1, t["attn"].flatten(2), "wo", grads).view(b, s, c.n_heads, c.head_dim)
        dq, dk, dv = self._attention_backward(dattn, t, aux)  # token-major (b, s, heads, d)
        cos, sin = self._rope(s, slice(0, s), dy)
        n1 = t["n1"]
        dq = self._head_norm_backward(unrotate(dq, cos, sin), n1, t, "q", grads)  # (b, s, a, d)
        dk = self._head_norm_backward(unrotate(dk, cos, sin), n1, t, "k", grads)
        dn1 = self._linear_backward(dq.flatten(2), n1, "wq", grads)
        dn1 += self._linear_backward(dk.flatten(2), n1, "wk", grads)
        dn1 += self._linear_backward(dv.flatten(2), n1, "wv", grads)
        dx = dx1 + self._norm_backward(dn1, t["x"], t["n1_stats"], "attn_norm", grads)
        return dx, grads

    def _head_norm_backward(self, grad, n1, t: dict, name: str, grads: dict) -> torch.Tensor:
        """Returns the gradient of q's or k's projection through its per-head norm (identity without one)."""
        if not self.config.qk_norm:
            return grad
        norm = getattr(self, name + "_norm")
        grad, grads[f"{name}_norm.weight"] = rms_norm_backward(
            grad, self._project(n1, name), t[name + "_stats"], norm.weight
        )
        return grad

    def _attention_backward(self, dattn: torch.Tensor, t: dict, aux: tuple):
        """Returns token-major (dq, dk, dv) of this rank's tokens from dattn (b, s, a, d); attention is not rerun."""
        sp = self.seq_parallel
        if sp is None:
            q, k, v, out = (heads_major(t[n]) for n in ("q", "k", "v", "attn"))
            grads = attention_backward(heads_major(dattn), q, k, v, out, t["lse"], aux, self.scale)
            return tuple(heads_major(g) for g in grads)
        # the mirror of _fill_attention: everything the kernel reads to head shards, dq, dk, dv back to tokens
        q, k, v, out, dout = sp.to_heads(t["q"], sp.expand_kv(t["k"]), sp.expand_kv(t["v"]), t["attn"], dattn)
        grads = attention_backward(*(heads_major(x) for x in (dout, q, k, v, out)), t["lse"], aux, self.scale)
        dq, dk, dv = sp.to_tokens(*(heads_major(g) for g in grads))
        return dq, sp.fold_kv(dk), sp.fold_kv(dv)

    # ---- module entry -----------------------------------------------------------------------------------
    def run(self, phase, *args):
        """Returns `phase(self, *args)`, its transient tensors carved from the arena when there is one."""
        return phase(self, *args) if self.arena is None else self.arena.run(self, phase, *args)

    def forward(self, x: torch.Tensor, store=None) -> torch.Tensor:
        """Returns the layer output: without grad, straight; with grad, through the explicit autograd function
        and `store` (a `swap.ActivationStore`), which keeps the skeletal tensors for the backward."""
        if not torch.is_grad_enabled():
            specs = self.skeletal_specs(x.shape[0], x.shape[1], x.dtype, x.device)
            t = {n: torch.empty(sp.shape, dtype=sp.dtype, device=x.device) for n, sp in specs.items()}
            t["x"] = x
            self.fill(t)
            return self.output(t)
        if store is None:
            raise ValueError("a DecoderLayer trains through an activation store: run it inside memo.Transformer")
        return LayerFunction.apply(x, self, store, *self.parameters())


def forward_phase(layer: DecoderLayer, t: dict) -> tuple[torch.Tensor, tuple]:
    """Returns (output, attention aux): a layer's forward writing its skeletal tensors into `t`."""
    aux = layer.fill(t)
    return layer.output(t), aux


def backward_phase(layer: DecoderLayer, dy: torch.Tensor, t: dict, aux: tuple, recompute: Recompute | None):
    """Returns (dx, parameter grads): the recompute the store asks for, then the layer's backward."""
    if recompute is not None:
        new_aux = layer.fill(t, recompute.start, recompute.attention)
        aux = new_aux if recompute.attention else aux
    return layer.backward(dy, t, aux)


class LayerFunction(torch.autograd.Function):
    """One layer's forward and backward; the store decides where skeletal tensors live in between."""

    @staticmethod
    def forward(ctx, x, layer: DecoderLayer, store, *params):
        t = store.slots(layer.index, x)
        y, aux = layer.run(forward_phase, t)
        store.after_forward(layer.index, aux)
        ctx.layer, ctx.store, ctx.step = layer, store, store.step
        return y

    @staticmethod
    def backward(ctx, dy):
        layer, store = ctx.layer, ctx.store
        t, aux, recompute = store.before_backward(layer.index, ctx.step)
        dx, grads = layer.run(backward_phase, dy.contiguous(), t, aux, recompute)
        store.after_backward(layer.index)
        return (dx, None, None, *(grads[name] for name, _ in layer.named_parameters()))
