"""The decoder layer: an explicit forward that writes its skeletal tensors, and an explicit backward, both run
over token tiles everywhere but attention.

Notation: b batch, s tokens, r rows (a tile of tokens), h hidden, a heads, g kv-heads, d head dim, f FFN.
Skeletal tensors (docs/method.md §2) are token-major, (b, s, ...), so a token slice is `t[name][:, rows]`.
Attention alone needs all tokens at once; everything else is token-local and runs one tile of rows at a
time, so only the attention side is ever whole-length on the device:

    group "whole" (whole-length, attention's inputs and outputs)
    x    (b,s,h)    layer input                      -- role "input": always to host in full
    q    (b,s,a,d)  rotated query                    -- role "other": α of the tokens to host, rest recomputed
    k    (b,s,g,d)  rotated key                      -- other
    v    (b,s,g,d)  value                            -- other
    attn (b,s,a,d)  attention output                 -- role "attention": always to host in full
    lse  (b,a,s')   attention log-sum-exp, float32   -- attention (b, a/sp, s'·sp) under sequence parallelism

    group "qkv" (token-local, before attention; a tile of r rows at a time)
    n1   (b,r,h)    attention-norm output            -- other
    n1_stats (b,r,k) its per-token statistics, fp32  -- other (k = 2: mean, rstd for LayerNorm; 1: rstd)

    group "mlp" (token-local, after attention)
    x1   (b,r,h)    x + attention projection         -- other
    n2   (b,r,h)    MLP-norm output                  -- other
    n2_stats (b,r,k) its statistics                  -- other
    gate (b,r,f)    SwiGLU gate (llama only)         -- other
    up   (b,r,f)    up projection                    -- other
    act  (b,r,f)    GeLU(up) or SiLU(gate)*up        -- other

    a mixture-of-experts layer (`memo.experts`) has instead of gate, up, act:
    route_idx (b,s,k) int32  its top-k experts      -- role "input", group "whole": kept, never recomputed
    route_w   (b,s,k)   their routing weights        -- input, whole
    e_gate, e_up, e_act (b,r,k,f)  each routed expert's gate, up and SiLU(gate)*up  -- other, mlp

Where a tile's token-local tensors live (kept whole, a tile-sized slot whose α rows go to host, or fresh)
is the store's choice, behind the `Tiles` interface, and so is where the whole-length ones wait for the backward,
behind `Store`; the layer only fills rows and runs their backward.
Every "other" tensor is a token-local function of x and attn, so the same `fill_qkv` / `fill_mlp` run the
forward, the token-wise recompute (§3) and a tile. With `qk_norm` the backward recomputes q and k before
their norm from n1 (one token-local matmul), and their per-head statistics with them.

A projection may be a `lora.LoraLinear`: `linear` / `linear_into` add its low-rank update to the rows they
write, and its backward adds the adapters' gradients. A frozen parameter (requires_grad False) gets no
gradient: its product is skipped, not computed and dropped.

Packed documents (`memo.documents`, `t["documents"]`): attention is causal within each document, and RoPE
rotates each token by its position within its document (`_rope`), in the forward, the recompute and the backward
alike, so a recomputed row gets its own document's position.

Under Ulysses sequence parallelism (`memo.parallel` sets `seq_parallel`), s is this rank's contiguous
shard of the sequence and every skeletal tensor holds only those tokens; RoPE uses global positions (or the
documents' positions of its rows, which are the whole sequence's on every rank).
Attention alone sees all tokens: for a/sp heads, between the all-to-alls `seq_parallel` provides.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_backward, attention_forward, choose, head_chunks, lse_seq_len
from .config import ModelConfig
from .documents import Documents
from .experts import Experts, Groups, RouterTotals, grouped_mm, route, route_backward
from .lora import dropout_keys, drops_out, keys_of, low_rank_add, low_rank_backward
from .loss import ONE_BACKWARD
from .matmul import add_mm, add_to
from .norms import norm_backward, norm_forward, norm_module, stats_dtype, stats_width
from .rope import rope_at, rope_tables, rotate, unrotate

aten = torch.ops.aten
Role = Literal["input", "attention", "other"]
Group = Literal["whole", "qkv", "mlp"]
GROUPS: tuple[Group, ...] = ("whole", "qkv", "mlp")


@dataclass(frozen=True)
class SkeletalSpec:
    """One skeletal tensor of a layer: its whole-length shape, dtype, how §3 treats it, and its group."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    group: Group = "whole"

    @property
    def nbytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * self.dtype.itemsize

    def rows(self, n_rows: int) -> "SkeletalSpec":
        """Returns the spec of `n_rows` tokens (dimension 1)."""
        return SkeletalSpec((self.shape[0], n_rows, *self.shape[2:]), self.dtype, self.role, self.group)


def bytes_by_role(specs: dict[str, SkeletalSpec]) -> dict[str, int]:
    """Returns the summed bytes of the skeletal tensors of each role (the S_in, S_attn, S_oth of §3)."""
    return {
        role: sum(sp.nbytes for sp in specs.values() if sp.role == role) for role in ("input", "attention", "other")
    }


def in_group(specs: dict[str, SkeletalSpec], group: Group) -> dict[str, SkeletalSpec]:
    return {n: sp for n, sp in specs.items() if sp.group == group}


@dataclass(frozen=True)
class Recompute:
    """What a layer rebuilds before its backward: q, k, v of token rows [start, s), and attention if asked
    (the token-local tiles are the `Tiles`' business)."""

    start: int
    attention: bool = False


class Tiles(Protocol):
    """Where the token-local ("qkv", "mlp") tensors of one layer live, tile by tile (swap.py decides)."""

    tile: int  # rows per tile (the last one may be shorter)
    heads: int  # query heads per attention kernel call, at most

    def ranges(self, start: int = 0) -> list[slice]:
        """Returns the tiles of token rows [start, s) in order."""

    def open(self, t: dict, rows: slice, group: Group) -> dict[str, torch.Tensor]:
        """Returns the group's tensors for token `rows`, (b, r, ...), to be written."""

    def close(self, rows: slice, group: Group) -> None:
        """Takes the written rows (e.g. their α part to host)."""

    def restore(self, t: dict, rows: slice, group: Group) -> tuple[dict[str, torch.Tensor], int]:
        """Returns the group's tensors for token `rows` and the first row (within the tile) to recompute."""


class Store(Protocol):
    """Where a training layer's skeletal tensors live from its forward to its backward (swap.ActivationStore)."""

    step: int  # the forward pass under way: a layer's backward must belong to it

    def tiling(self, layer: DecoderLayer, seq: int, device: torch.device) -> tuple[int, int]:
        """Returns (tile length, query heads per attention call) for `seq` of `layer`'s tokens."""

    def slots(self, index: int, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], Tiles]:
        """Returns layer `index`'s whole-length tensors, x copied in (or x itself), and its tiles, to be written."""

    def after_forward(self, index: int, aux: tuple) -> None:
        """Takes the written tensors of layer `index` (e.g. starts their copy to host) and its attention aux."""

    def before_backward(
        self, index: int, step: int
    ) -> tuple[dict[str, torch.Tensor], tuple | None, Tiles, Recompute | None]:
        """Returns layer `index`'s whole-length tensors, attention aux (None: recompute it), tiles and what to
        recompute, for its backward in forward pass `step`."""


@dataclass(frozen=True)
class FreshTiles:
    """Tiles of fresh tensors that keep nothing: inference, and the stores' tests."""

    shapes: tuple[tuple[str, Group, tuple[int, ...], torch.dtype], ...]  # name, group, shape after (b, s)
    batch: int
    seq: int
    tile: int
    heads: int

    @classmethod
    def of(cls, specs: dict[str, SkeletalSpec], tile: int, heads: int) -> "FreshTiles":
        x = specs["x"]
        shapes = tuple((n, sp.group, sp.shape[2:], sp.dtype) for n, sp in specs.items() if sp.group != "whole")
        return cls(shapes, x.shape[0], x.shape[1], tile, heads)

    def ranges(self, start: int = 0) -> list[slice]:
        return tile_ranges(start, self.seq, self.tile)

    def open(self, t, rows, group):
        r = rows.stop - rows.start
        return {
            n: t["x"].new_empty((self.batch, r, *tail), dtype=dtype) for n, g, tail, dtype in self.shapes if g == group
        }

    def close(self, rows, group) -> None:
        pass

    def restore(self, t, rows, group):
        return self.open(t, rows, group), 0


def whole_tensors(specs: dict[str, SkeletalSpec], x: torch.Tensor, **given: torch.Tensor) -> dict[str, torch.Tensor]:
    """Returns a storeless forward's whole-length tensors: x, the `given` ones (a decoder's cache rows), and new
    ones of `specs` for the rest."""
    given = {**given, "x": x}
    return {
        n: given[n] if n in given else x.new_empty(sp.shape, dtype=sp.dtype)
        for n, sp in in_group(specs, "whole").items()
    }


def tile_ranges(start: int, stop: int, tile: int) -> list[slice]:
    """Returns [start, stop) cut into slices of `tile` rows (the last one shorter)."""
    return [slice(i, min(i + tile, stop)) for i in range(start, stop, tile)]


TOKEN_MAJOR = ("x", "q", "k", "v", "attn", "route_idx", "route_w", "pos")  # whole-length, sliced by rows
PASSED = ("documents", "router", "router_grad")  # whole-sequence values every tile reads as they are


def rows_of(t: dict, rows: slice) -> dict:
    """Returns the token rows of the whole-length tensors in `t` (the LSE is not token-major: left out), and of
    the tokens' global positions (1, s) where LoRA dropout needs them; packed `documents`, a mixture of experts'
    `router` totals and their gradient pass as they are."""
    return {**{n: t[n][:, rows] for n in TOKEN_MAJOR if n in t}, **{n: t[n] for n in PASSED if n in t}}


def _tail(v: dict, start: int) -> dict:
    return {n: x if n in PASSED or not isinstance(x, torch.Tensor) else x[:, start:] for n, x in v.items()}


def linear_into(out: torch.Tensor, x: torch.Tensor, lin: nn.Linear, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Writes x·Wᵀ + b (+ a LoRA update) into `out` (rows of a skeletal tensor, no temporary) and returns it."""
    if out.is_contiguous():
        aten.linear.out(x, lin.weight, lin.bias, out=out)
    else:
        for x_b, out_b in zip(x, out):  # token rows of several sequences: each sequence's rows are contiguous
            aten.linear.out(x_b, lin.weight, lin.bias, out=out_b)
    return low_rank_add(out, x, lin, pos)


def linear(x: torch.Tensor, lin: nn.Linear, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Returns x·Wᵀ + b (+ a LoRA update; `pos`, the rows' global positions, keys its dropout) in a new tensor."""
    return low_rank_add(F.linear(x, lin.weight, lin.bias), x, lin, pos)


def heads_major(t: torch.Tensor) -> torch.Tensor:
    """Returns a (b, s, heads, d) tensor viewed as (b, heads, s, d), the kernels' layout."""
    return t.transpose(1, 2)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. Parameters live in nn.Linear / norm modules; the arithmetic is explicit."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        c = config
        self.config, self.index = c, index
        self.gpt = c.arch == "gpt"
        h, d, f = c.hidden_size, c.head_dim, c.ffn_hidden_size
        self.attn_norm = norm_module(c, h)
        self.wq = nn.Linear(h, c.n_heads * d, bias=c.qkv_bias)
        self.wk = nn.Linear(h, c.n_kv_heads * d, bias=c.qkv_bias)
        self.wv = nn.Linear(h, c.n_kv_heads * d, bias=c.qkv_bias)
        self.q_norm = norm_module(c, d) if c.qk_norm else None
        self.k_norm = norm_module(c, d) if c.qk_norm else None
        self.wo = nn.Linear(c.n_heads * d, h, bias=c.out_bias)
        self.mlp_norm = norm_module(c, h)
        dense = not c.sparse(index)
        self.w_gate = nn.Linear(h, f, bias=c.mlp_bias) if dense and not self.gpt else None
        self.w_up = nn.Linear(h, f, bias=c.mlp_bias) if dense else None
        self.w_down = nn.Linear(f, h, bias=c.mlp_bias) if dense else None
        self.router = None if dense else nn.Linear(h, c.n_experts, bias=False)  # (E, h)
        self.experts = None if dense else Experts(c.n_experts, h, c.expert_ffn)
        self.attn_post_norm = norm_module(c, h) if c.sandwich_norms else None  # on attention's output (Gemma)
        self.mlp_post_norm = norm_module(c, h) if c.sandwich_norms else None  # on the MLP's output
        self.scale = c.attention_scale
        local = c.rope_local_theta is not None and c.slides(index)  # Gemma 3's sliding layers: their own base
        self.rope_config = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling=None) if local else c
        self.window = c.window(index)  # None: full causal attention; w: a token sees itself and w - 1 before it
        self.phases = None  # a plan.phases.PhasePlanner: transient tensors at planned offsets (plan.phases.attach)
        self.seq_parallel = None  # a parallel.ulysses.Ulysses: token shards <-> head shards around attention
        self.attention_kernel = "auto"  # the kernel asked for (`attention.CHOICES`); the model sets its policy's
        self.attention_ran: str | None = None  # the kernel the last forward's attention ran (one document a row)
        self.packed_ran: str | None = None  # ... over packed documents, and how: "varlen" or "per document"
        self.source = None  # a patch's weights: binds this twin's modules to a transformers layer's at each call
        self.router_totals = None  # a mixture of experts' routing of the last forward (experts.RouterTotals)

    # ---- skeletal tensors -------------------------------------------------------------------------------
    def skeletal_specs(self, batch: int, seq: int, dtype, device) -> dict[str, SkeletalSpec]:
        """Returns the layer's skeletal tensors (module docstring) for a (batch, seq) input, whole-length."""
        c = self.config
        h, a, g, d, f = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden_size
        b, s = batch, seq

        def spec(role: Role, group: Group, *tail: int) -> SkeletalSpec:
            return SkeletalSpec((b, s, *tail), dtype, role, group)

        def stats(group: Group) -> SkeletalSpec:
            return SkeletalSpec((b, s, stats_width(self.attn_norm)), stats_dtype(dtype), "other", group)

        specs = {
            "x": spec("input", "whole", h),
            "q": spec("other", "whole", a, d),
            "k": spec("other", "whole", g, d),
            "v": spec("other", "whole", g, d),
            "attn": spec("attention", "whole", a, d),
            "lse": self._lse_spec(b, s, dtype, torch.device(device)),
            "n1": spec("other", "qkv", h),
            "n1_stats": stats("qkv"),
            "x1": spec("other", "mlp", h),
            "n2": spec("other", "mlp", h),
            "n2_stats": stats("mlp"),
            "gate": spec("other", "mlp", f),
            "up": spec("other", "mlp", f),
            "act": spec("other", "mlp", f),
        }
        if self.gpt:
            del specs["gate"]
        if self.experts is not None:  # the routing, kept whole, and each routed expert's tensors in place of the MLP's
            k, fe = c.experts_per_token, c.expert_ffn
            for name in ("gate", "up", "act"):
                specs["e_" + name] = spec("other", "mlp", k, fe)
                del specs[name]
            specs["route_idx"] = SkeletalSpec((b, s, k), torch.int32, "input", "whole")
            specs["route_w"] = spec("input", "whole", k)
        if self.config.sandwich_norms:  # the post norms' inputs: attention's projection and the MLP's output
            specs.update(
                o=spec("other", "mlp", h), o_stats=stats("mlp"), m=spec("other", "mlp", h), m_stats=stats("mlp")
            )
        return specs

    def _lse_spec(self, b: int, s: int, dtype, device: torch.device) -> SkeletalSpec:
        """Returns the LSE's spec: the kernel's, for all heads, or for a/sp heads of all s·sp tokens."""
        a, sp = self.config.n_heads, self.seq_parallel
        kernel = choose(self.attention_kernel, device, dtype)
        if sp is None:
            return SkeletalSpec((b, a, lse_seq_len(s, kernel)), torch.float32, "attention")
        return SkeletalSpec((b, a // sp.size, lse_seq_len(s * sp.size, kernel)), torch.float32, "attention")

    def _rope(self, s: int, rows: slice, like: torch.Tensor, documents: Documents | None = None):
        """Returns cos, sin for local token rows `rows` of this rank's `s` tokens: (r, 1, d/2) at their global
        positions, or (b, r, 1, d/2) at their positions within packed `documents`."""
        sp = self.seq_parallel
        at, total = (0, s) if sp is None else (sp.token_offset(s), s * sp.size)
        if documents is not None:
            positions = documents.rows(at + rows.start, at + rows.stop)  # (b, r)
            return rope_at(self.rope_config, positions, documents.max_length, like.dtype)
        return rope_tables(self.rope_config, at + rows.start, at + rows.stop, total, like.dtype, like.device)

    def _project(self, n1: torch.Tensor, name: str, pos=None) -> torch.Tensor:
        """Returns the q or k projection of n1 (b, r, h) as heads (b, r, heads, d), before norm and RoPE."""
        return linear(n1, getattr(self, "w" + name), pos).unflatten(-1, (-1, self.config.head_dim))

    def positions(self, s: int, device) -> torch.Tensor | None:
        """Returns the global positions (1, s) of this rank's tokens when an adapter drops out, else None."""
        if not any(map(drops_out, self.children())):
            return None
        at = 0 if self.seq_parallel is None else self.seq_parallel.token_offset(s)
        return torch.arange(at, at + s, dtype=torch.int32, device=device)[None]

    # ---- forward pieces (also the token-wise recompute); `v` holds rows of every tensor, (b, r, ...) ------
    def fill_norm1(self, v: dict) -> None:
        """Writes n1 and its statistics from x."""
        _norm_into(v, "n1", v["x"], self.attn_norm)

    def fill_qkv(self, v: dict, rows: slice, s: int) -> None:
        """Writes n1, then q, k (per-head norm with `qk_norm`, then RoPE) and v of token `rows` of s."""
        self.fill_norm1(v)
        n1 = v["n1"]  # (b, r, h)
        cos, sin = self._rope(s, rows, n1, v.get("documents"))
        for name in ("q", "k"):  # (b, r, heads, d)
            proj = self._project(n1, name, v.get("pos"))
            if self.config.qk_norm:
                proj = norm_forward(getattr(self, name + "_norm"), proj)[0]
            rotate(proj, cos, sin, v[name])
        linear_into(v["v"].flatten(2), n1, self.wv, v.get("pos"))  # (b, r, g·d)

    def attention_shape(self, s: int) -> tuple[int, int, int]:
        """Returns (query heads, key/value heads, tokens) the attention kernels see on this rank for its `s`."""
        c, sp = self.config, self.seq_parallel
        if sp is None:
            return c.n_heads, c.n_kv_heads, s
        return c.n_heads // sp.size, c.n_kv_heads * sp.kv_repeat // sp.size, s * sp.size

    def _head_chunks(self, t: dict, per_call: int) -> list[tuple[slice, list[slice]]]:
        """Returns the attention kernel calls over this rank's heads (attention.head_chunks)."""
        heads, kv, _ = self.attention_shape(t["x"].shape[1])
        return head_chunks(heads, kv, per_call)

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor, heads: slice):
        """Returns k and v (b, kv heads, all tokens, d) of the kv `heads` of this rank, for the kernels."""
        sp = self.seq_parallel
        if sp is None:
            return heads_major(k)[:, heads], heads_major(v)[:, heads]
        return tuple(heads_major(x) for x in sp.to_heads(k, v, heads=(heads, heads)))

    def _kv(self, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns token-major k and v with as many heads as the sequence-parallel split needs."""
        sp = self.seq_parallel
        return (t["k"], t["v"]) if sp is None else (sp.expand_kv(t["k"]), sp.expand_kv(t["v"]))

    def attend(self, t: dict, per_call: int) -> tuple:
        """Writes the attention output and LSE of all s tokens from q, k, v, `per_call` query heads per kernel call
        at most (`attention.head_chunks`); returns the kernel's aux."""
        sp, kernel, documents = self.seq_parallel, self.attention_kernel, t.get("documents")
        k, v = self._kv(t)
        for kv_heads, q_chunks in self._head_chunks(t, per_call):
            kc, vc = self._kv_heads(k, v, kv_heads)  # (b, kv heads, all tokens, d)
            for heads in q_chunks:
                if sp is None:
                    q = heads_major(t["q"])[:, heads]
                    out, lse, aux = attention_forward(q, kc, vc, self.scale, kernel, documents, self.window)
                    heads_major(t["attn"])[:, heads].copy_(out)  # (b, heads, s, d) into token-major (b, s, a, d)
                else:  # (b, local tokens, all heads) -> (b, all tokens, these heads) and back: two all-to-alls
                    (q,) = sp.to_heads(t["q"], heads=(heads,))
                    out, lse, aux = attention_forward(
                        heads_major(q), kc, vc, self.scale, kernel, documents, self.window
                    )
                    sp.to_tokens(heads_major(out), out=(t["attn"],), heads=(heads,))
                t["lse"][:, heads, : lse.shape[-1]].copy_(lse)  # a windowed call's flash LSE: no padding
                kernel = aux[0]  # after a refusal the next calls start from the kernel that ran
        if documents is None:
            self.attention_ran = kernel
        else:  # apart: "auto" takes the variable-length kernel for documents, the phase planner whole sequences
            self.packed_ran = f"{kernel}, {aux[1]}"
        return aux

    def fill_mlp(self, v: dict, route: bool = True) -> None:
        """Writes x1, n2 (+ statistics), up, (gate,) act of the rows from x and attn; with sandwich norms also o and
        m, the post norms' inputs (+ statistics); of a mixture of experts, the routing (unless `route` is False: the
        recompute reads the routing its forward kept) and each routed expert's gate, up and act."""
        pos = v.get("pos")
        o = linear(v["attn"].flatten(2), self.wo, pos)  # (b, r, h)
        if self.attn_post_norm is not None:
            v["o"].copy_(o)
            o, stats = norm_forward(self.attn_post_norm, o)
            v["o_stats"].copy_(stats)
        x1 = torch.add(v["x"], o, out=v["x1"])
        del o  # before the MLP's tensors come
        _norm_into(v, "n2", x1, self.mlp_norm)
        if self.experts is not None:
            return self._fill_experts(v, route)
        up = linear_into(v["up"], v["n2"], self.w_up, pos)  # (b, r, f)
        if self.gpt:
            aten.gelu.out(up, out=v["act"])
        else:
            gate = linear_into(v["gate"], v["n2"], self.w_gate, pos)
            torch.mul(self._activation(gate), up, out=v["act"])
        if self.mlp_post_norm is not None:
            linear_into(v["m"], v["act"], self.w_down, pos)
            v["m_stats"].copy_(norm_forward(self.mlp_post_norm, v["m"])[1])

    def _fill_experts(self, v: dict, route_now: bool) -> None:
        """Writes the rows' routing (when `route_now`) and their experts' e_gate, e_up, e_act (b, r, k, f), computed
        in expert-major order (`Groups`) and written back token-major."""
        c = self.config
        n2 = v["n2"].reshape(-1, c.hidden_size)  # (T, h)
        if route_now:
            logits = F.linear(n2, self.router.weight)  # (T, E)
            weights, idx, probs = route(logits, c.experts_per_token, c.norm_topk_prob)
            v["route_w"].copy_(weights.view(v["route_w"].shape))
            v["route_idx"].copy_(idx.view(v["route_idx"].shape))
            if "router" in v:
                v["router"].add(probs, idx)
            del logits, probs
        groups = v["groups"] = Groups.of(v["route_idx"], c.n_experts)
        xs = n2[groups.token]  # (T·k, h), expert-major
        gate = grouped_mm(xs, self.experts.gate.transpose(1, 2), groups)  # (T·k, f)
        up = grouped_mm(xs, self.experts.up.transpose(1, 2), groups)
        del xs
        for name, value in (("e_gate", gate), ("e_up", up), ("e_act", F.silu(gate).mul_(up))):
            groups.token_major(v[name], value)

    def _experts_output(self, v: dict) -> torch.Tensor:
        """Returns the rows' routed experts' weighted sum (b, r, h) from their e_act and the kept routing."""
        groups, shape = v.get("groups"), v["x1"].shape
        if groups is None:
            groups = Groups.of(v["route_idx"], self.config.n_experts)
        down = grouped_mm(groups.expert_major(v["e_act"]), self.experts.down.transpose(1, 2), groups)
        down *= groups.expert_major(v["route_w"])[:, None]  # (T·k, h)
        return down.new_zeros(shape[0] * shape[1], shape[2]).index_add_(0, groups.token, down).view(shape)

    def _activation(self, gate: torch.Tensor) -> torch.Tensor:
        """Returns the gated MLP's activation of `gate`: SiLU, or Gemma's tanh GELU."""
        return F.gelu(gate, approximate="tanh") if self.config.mlp_activation == "gelu_tanh" else F.silu(gate)

    def output(self, v: dict, out: torch.Tensor) -> torch.Tensor:
        """Writes the layer output of the rows, y = x1 + act·W_downᵀ (b, r, h) (its post norm's with sandwich
        norms, from the m fill_mlp wrote), into `out`."""
        if self.mlp_post_norm is not None:
            return torch.add(v["x1"], norm_forward(self.mlp_post_norm, v["m"])[0], out=out)
        if self.experts is not None:
            return torch.add(v["x1"], self._experts_output(v), out=out)
        return torch.add(v["x1"], linear(v["act"], self.w_down, v.get("pos")), out=out)

    # ---- backward pieces: each adds its parameter gradients (summed over tiles) to `grads` -----------------
    def _linear_backward(self, dy, x, name: str, grads: dict, pos=None) -> torch.Tensor:
        """Returns dx of y = x·Wᵀ + b (+ LoRA) and adds dW and db where they train (a frozen W costs no product)
        and the adapters' gradients."""
        lin = getattr(self, name)
        if lin.weight.requires_grad:
            add_mm(grads, name + ".weight", _flat(dy).t(), _flat(x))
        if lin.bias is not None and lin.bias.requires_grad:
            add_to(grads, name + ".bias", _flat(dy).sum(0))
        dx = dy @ lin.weight
        low_rank_backward(dy, x, lin, name, grads, dx, pos)
        return dx

    def _norm_backward(self, dy, x, stats, prefix: str, grads: dict) -> torch.Tensor:
        """Returns dx of the norm `prefix` from its kept statistics and adds its parameter grads."""
        norm = getattr(self, prefix)
        dx, norm_grads = norm_backward(norm, dy, x, stats)
        for name, g in norm_grads.items():
            if getattr(norm, name).requires_grad:
                add_to(grads, f"{prefix}.{name}", g)
        return dx

    def mlp_backward(self, dy: torch.Tensor, v: dict, grads: dict, dx1: torch.Tensor) -> None:
        """Writes dx1 = dy + the MLP's input gradient (b, r, h) for the rows of dy, y = x1 + MLP(norm(x1))."""
        pos = v.get("pos")
        if self.experts is not None:
            dn2 = self._experts_backward(dy, v, grads)
            torch.add(dy, self._norm_backward(dn2, v["x1"], v["n2_stats"], "mlp_norm", grads), out=dx1)
            return
        dm = dy if self.mlp_post_norm is None else self._norm_backward(dy, v["m"], v["m_stats"], "mlp_post_norm", grads)
        dact = self._linear_backward(dm, v["act"], "w_down", grads, pos)  # (b, r, f)
        del dm
        if self.gpt:
            dn2 = self._linear_backward(aten.gelu_backward(dact, v["up"]), v["n2"], "w_up", grads, pos)
        else:
            gate, up = v["gate"], v["up"]
            dup = dact * self._activation(gate)
            if self.config.mlp_activation == "gelu_tanh":
                dgate = aten.gelu_backward(dact * up, gate, approximate="tanh")
            else:
                dgate = aten.silu_backward(dact * up, gate)
            del dact
            dn2 = self._linear_backward(dup, v["n2"], "w_up", grads, pos)
            dn2 += self._linear_backward(dgate, v["n2"], "w_gate", grads, pos)
        torch.add(dy, self._norm_backward(dn2, v["x1"], v["n2_stats"], "mlp_norm", grads), out=dx1)

    def _experts_backward(self, dy: torch.Tensor, v: dict, grads: dict) -> torch.Tensor:
        """Returns dn2 (T, h) of the routed experts' weighted sum and the router for the rows of dy (b, r, h), with
        the routing kept from the forward; adds the experts' and the router's gradients."""
        c, ex = self.config, self.experts
        n2, dy = v["n2"].reshape(-1, c.hidden_size), dy.reshape(-1, c.hidden_size)  # (T, h)
        idx = v["route_idx"]  # (b, r, k)
        groups = Groups.of(idx, c.n_experts)
        xs, dys = n2[groups.token], dy[groups.token]  # (T·k, h), expert-major
        gate, up, act = (groups.expert_major(v[name]) for name in ("e_gate", "e_up", "e_act"))
        out = grouped_mm(act, ex.down.transpose(1, 2), groups)  # (T·k, h): each expert's output, for dweights
        dweights = torch.empty(idx.numel(), device=dy.device).index_copy_(0, groups.order, _dot(dys, out))
        del out
        d_down = dys * groups.expert_major(v["route_w"])[:, None]  # (T·k, h)
        del dys
        # a tile's weight gradients in the compute dtype (the grouped kernel's fast path writes bf16; it accumulates
        # in fp32 within the tile), summed over tiles in fp32 by add_to
        if ex.down.requires_grad:
            add_to(grads, "experts.down", grouped_mm(d_down.t(), act, groups))  # (E, h, f)
        dact = grouped_mm(d_down, ex.down, groups)  # (T·k, f)
        del d_down, act
        dup = dact * F.silu(gate)
        dgate = aten.silu_backward(dact * up, gate)
        del dact, gate, up
        for name, grad in (("gate", dgate), ("up", dup)):
            if getattr(ex, name).requires_grad:
                add_to(grads, "experts." + name, grouped_mm(grad.t(), xs, groups))  # (E, f, h)
        dxs = grouped_mm(dgate, ex.gate, groups).add_(grouped_mm(dup, ex.up, groups))  # (T·k, h)
        del dgate, dup, xs
        dn2 = torch.zeros_like(n2).index_add_(0, groups.token, dxs)
        logits = F.linear(n2, self.router.weight)  # the continuous values again; the choice stays the forward's
        dlogits = route_backward(
            dweights.view(n2.shape[0], -1), logits, idx.reshape(n2.shape[0], -1), c.norm_topk_prob, v.get("router_grad")
        )
        if self.router.weight.requires_grad:
            add_mm(grads, "router.weight", dlogits.t(), n2)
        return dn2.addmm_(dlogits, self.router.weight).view(v["n2"].shape)

    def projection_backward(self, dx1: torch.Tensor, v: dict, grads: dict, dattn: torch.Tensor) -> None:
        """Writes dattn (b, r, a, d) of x1 = x + attn·W_oᵀ (its post norm's with sandwich norms) for the rows of
        dx1."""
        do = dx1
        if self.attn_post_norm is not None:
            do = self._norm_backward(dx1, v["o"], v["o_stats"], "attn_post_norm", grads)
        dattn.copy_(self._linear_backward(do, v["attn"].flatten(2), "wo", grads, v.get("pos")).view(dattn.shape))

    def attention_backward(self, dattn: torch.Tensor, t: dict, aux: tuple, per_call: int):
        """Returns token-major (dq, dk, dv) of this rank's s tokens from dattn (b, s, a, d), a few heads per kernel
        call as in `attend`; attention is not rerun. Each gradient is written over a tensor its heads' kernel calls
        were the last to read: dq over dattn, and (one rank) dk, dv over k, v, which nothing reads after attention's
        backward; under sequence parallelism k, v are gathered copies of other shapes and dk, dv are new."""
        sp = self.seq_parallel
        tokens = self.attention_shape(t["x"].shape[1])[2]
        k, v = self._kv(t)
        dk, dv = (k, v) if sp is None else (torch.empty_like(k), torch.empty_like(v))
        for kv_heads, q_chunks in self._head_chunks(t, per_call):
            kc, vc = self._kv_heads(k, v, kv_heads)
            dkc = dvc = None  # summed over the calls that share these kv heads
            for heads in q_chunks:
                if sp is None:
                    q, out, dout = (heads_major(x)[:, heads] for x in (t["q"], t["attn"], dattn))
                else:  # everything the kernel reads to head shards, the gradients back to tokens
                    q, out, dout = (heads_major(x) for x in sp.to_heads(t["q"], t["attn"], dattn, heads=(heads,) * 3))
                lse = t["lse"][:, heads, : lse_seq_len(tokens, aux[0])]
                gq, gk, gv = attention_backward(dout, q, kc, vc, out, lse, aux, self.scale, t.get("documents"))
                del q, out, dout
                if sp is None:
                    heads_major(dattn)[:, heads].copy_(gq)
                else:
                    sp.to_tokens(heads_major(gq), out=(dattn,), heads=(heads,))
                dkc, dvc = _sum_part(dkc, gk), _sum_part(dvc, gv)
                del gq, gk, gv
            if sp is None:
                heads_major(dk)[:, kv_heads].copy_(dkc)
                heads_major(dv)[:, kv_heads].copy_(dvc)
            else:
                sp.to_tokens(
                    heads_major(dkc.to(k.dtype)), heads_major(dvc.to(v.dtype)), out=(dk, dv), heads=(kv_heads,) * 2
                )
            del kc, vc, dkc, dvc
        return (dattn, dk, dv) if sp is None else (dattn, sp.fold_kv(dk), sp.fold_kv(dv))

    def qkv_backward(self, dq, dk, dv, v: dict, rows: slice, s: int, grads: dict) -> torch.Tensor:
        """Returns the input gradient (b, r, h) through q, k, v and the attention norm, for token `rows`."""
        cos, sin = self._rope(s, rows, dq, v.get("documents"))
        n1, pos = v["n1"], v.get("pos")
        dq = self._head_norm_backward(unrotate(dq, cos, sin), n1, "q", grads, pos)  # (b, r, a, d)
        dk = self._head_norm_backward(unrotate(dk, cos, sin), n1, "k", grads, pos)
        dn1 = self._linear_backward(dq.flatten(2), n1, "wq", grads, pos)
        dn1 += self._linear_backward(dk.flatten(2), n1, "wk", grads, pos)
        dn1 += self._linear_backward(dv.flatten(2), n1, "wv", grads, pos)
        return self._norm_backward(dn1, v["x"], v["n1_stats"], "attn_norm", grads)

    def _head_norm_backward(self, grad, n1, name: str, grads: dict, pos=None) -> torch.Tensor:
        """Returns the gradient of q's or k's projection through its per-head norm (identity without one)."""
        if not self.config.qk_norm:
            return grad
        proj = self._project(n1, name, pos)
        rstd = norm_forward(getattr(self, name + "_norm"), proj)[1]
        return self._norm_backward(grad, proj, rstd, name + "_norm", grads)

    # ---- module entry -----------------------------------------------------------------------------------
    def run(self, phase, t: dict, *args):
        """Returns `phase(self, t, *args)`, its transient tensors carved from the phase planner's buffer when there
        is one. Packed documents run unplanned: their kernel calls (one per document on the CPU) differ from batch
        to batch."""
        if self.phases is None or "documents" in t:
            return phase(self, t, *args)
        return self.phases.run(self, phase, t, *args)

    def infer(self, x: torch.Tensor, store: Store | None = None, documents: Documents | None = None):
        """Returns (the output, the whole-length tensors: x, q, k, v, attn, ...) of a forward without autograd, tile
        by tile (the store's tiles when given): inference keeps nothing but what a caller reads of them (a decoder,
        its rotated keys and values)."""
        b, s = x.shape[:2]
        specs = self.skeletal_specs(b, s, x.dtype, x.device)
        tile, heads = (s, self.attention_shape(s)[0]) if store is None else store.tiling(self, s, x.device)
        t = _with_positions(self, whole_tensors(specs, x), documents)
        return forward_phase(self, t, FreshTiles.of(specs, tile, heads))[0], t

    def forward(self, x: torch.Tensor, store: Store | None = None, documents: Documents | None = None) -> torch.Tensor:
        """Returns the layer output: without grad, straight (tile by tile); with grad, through the explicit
        autograd function and `store`, which keeps the skeletal tensors for the backward. `documents`: the packed
        documents of the batch (attention within each, RoPE from each start)."""
        if not torch.is_grad_enabled():
            return self.infer(x, store, documents)[0]
        if store is None:
            raise ValueError("a DecoderLayer trains through an activation store: run it inside memo.Transformer")
        if self.experts is None or not self.config.router_aux_loss:
            return LayerFunction.apply(x, self, store, documents, None, *self.parameters())
        totals = RouterTotals.zeros(self.config.n_experts, x.device)
        y, prob_sum = LayerFunction.apply(x, self, store, documents, totals, *self.parameters())
        self.router_totals = RouterTotals(prob_sum, totals.counts)  # the load-balancing loss's (model.py)
        return y


def _with_positions(layer: DecoderLayer, t: dict, documents: Documents | None) -> dict:
    """Returns `t` with its tokens' global positions when the layer's LoRA dropout needs them, and the packed
    `documents` when there are some."""
    pos = layer.positions(t["x"].shape[1], t["x"].device)
    t = t if pos is None else {**t, "pos": pos}
    return t if documents is None else {**t, "documents": documents}


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Returns the row-wise dot products of a and b (R, h) in float32."""
    return torch.linalg.vecdot(a.float(), b.float())


def _sum_part(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Returns total + part: the first part as it is, the sum of several in float32 (16-bit parts), in place."""
    if total is None:
        return part
    if total.dtype != torch.promote_types(total.dtype, torch.float32):
        total = total.float()
    return total.add_(part)


def _norm_into(v: dict, name: str, x: torch.Tensor, norm: nn.Module) -> None:
    """Writes norm(x) into v[name] and its statistics into v[name + "_stats"]."""
    y, stats = norm_forward(norm, x)
    v[name + "_stats"].copy_(stats)
    v[name].copy_(y)


def forward_phase(layer: DecoderLayer, t: dict, tiles: Tiles) -> tuple[torch.Tensor, tuple]:
    """Returns (output (b, s, h), attention aux): a layer's forward, writing the whole-length tensors into `t`
    and the token-local ones tile by tile where `tiles` says."""
    s = t["x"].shape[1]
    for rows in tiles.ranges():  # n1 -> q, k, v, a tile at a time
        layer.fill_qkv({**rows_of(t, rows), **tiles.open(t, rows, "qkv")}, rows, s)
        tiles.close(rows, "qkv")
    aux = layer.attend(t, tiles.heads)  # all s tokens
    y = torch.empty_like(t["x"])  # (b, s, h)
    for rows in tiles.ranges():  # x1 -> n2 -> MLP -> y
        v = {**rows_of(t, rows), **tiles.open(t, rows, "mlp")}
        layer.fill_mlp(v)
        layer.output(v, y[:, rows])
        tiles.close(rows, "mlp")
    return y, aux


def _input_comes_back(t: dict) -> bool:
    """True when attention's output gradient can be written over the layer input x: the store gave x's host copy
    (`x_host`), and q and the attention output have x's dtype and row layout (a·d = h), so each MLP tile writes its
    own rows of x after reading them, and x can come back into q's bytes once attention's backward is done."""
    x = t["x"]
    return "x_host" in t and all(
        t[n].dtype == x.dtype and t[n].is_contiguous() and t[n].flatten(2).shape == x.shape for n in ("x", "q", "attn")
    )


def backward_phase(layer: DecoderLayer, t: dict, dy: torch.Tensor, aux: tuple, tiles: Tiles, recompute):
    """Returns (dx (b, s, h), parameter grads): the recompute the store asks for, then the layer's backward,
    tile by tile around the attention backward. Given x's host copy, attention's output gradient and then dq live
    in x's bytes, and x comes back from host for the q, k, v tiles: one whole-length tensor less."""
    s = t["x"].shape[1]
    if recompute is not None:  # q, k, v rows the host did not keep (and attention, for a checkpointed layer)
        for rows in tiles.ranges(recompute.start):
            layer.fill_qkv({**rows_of(t, rows), **tiles.open(t, rows, "qkv")}, rows, s)
        if recompute.attention:
            aux = layer.attend(t, tiles.heads)
    grads: dict[str, torch.Tensor] = {}
    dx = dy  # (b, s, h): dx1 written over dy tile by tile (each tile reads its dy rows first), then + the rest
    over_input = _input_comes_back(t)
    dattn = t["x"].view(t["attn"].shape) if over_input else torch.empty_like(t["attn"])  # (b, s, a, d)
    for rows in tiles.ranges():  # MLP and output projection, a tile at a time
        v, start = tiles.restore(t, rows, "mlp")
        v = {**rows_of(t, rows), **v}
        if start < rows.stop - rows.start:
            layer.fill_mlp(_tail(v, start), route=False)  # the (1 - α) rows: recomputed, token-wise
        layer.mlp_backward(dy[:, rows], v, grads, dx[:, rows])
        layer.projection_backward(dx[:, rows], v, grads, dattn[:, rows])
    dq, dk, dv = layer.attention_backward(dattn, t, aux, tiles.heads)  # (b, s, heads, d), all tokens; dq is dattn
    del dattn
    if over_input:  # dq holds x's bytes: x comes back from host into q's, which nothing reads after attention
        t = {**t, "x": t["q"].view(t["x"].shape).copy_(t["x_host"], non_blocking=True)}
    for rows in tiles.ranges():  # q, k, v projections and the attention norm, a tile at a time
        v, start = tiles.restore(t, rows, "qkv")
        v = {**rows_of(t, rows), **v}
        if start < rows.stop - rows.start:
            layer.fill_norm1(_tail(v, start))
        dx[:, rows].add_(layer.qkv_backward(dq[:, rows], dk[:, rows], dv[:, rows], v, rows, s, grads))
    del dq, dk, dv, v  # before the gradients are cast: they need not be alive together
    params = dict(layer.named_parameters())
    return dx, {name: g.to(params[name].dtype) for name, g in grads.items()}


class LayerFunction(torch.autograd.Function):
    """One layer's forward and backward; the store decides where skeletal tensors live in between. Given a mixture
    of experts' `totals` (experts.RouterTotals), it sums the routing probabilities into them and returns that sum
    as a second output, whose gradient (the load-balancing loss's) the backward adds to every token's."""

    @staticmethod
    def forward(ctx, x, layer: DecoderLayer, store: Store, documents, totals, *params):
        t, tiles = store.slots(layer.index, x)
        t = _with_positions(layer, t, documents)
        y, aux = layer.run(forward_phase, t if totals is None else {**t, "router": totals}, tiles)
        store.after_forward(layer.index, aux)
        ctx.layer, ctx.store, ctx.step, ctx.documents, ctx.source = layer, store, store.step, documents, layer.source
        ctx.keys = dropout_keys(layer)  # LoRA dropout's masks, as this forward drew them
        return y if totals is None else (y, totals.prob_sum)

    @staticmethod
    def backward(ctx, dy, dprob=None):
        """The gradient of a layer's output belongs to the layer stack (its only consumer is the next layer, or
        the loss, which made it): the backward writes dx over it rather than holding both whole."""
        if getattr(ctx, "ran", False):
            raise RuntimeError(ONE_BACKWARD)
        ctx.ran = True
        layer, store = ctx.layer, ctx.store
        with nullcontext() if ctx.source is None else ctx.source.bound(layer), keys_of(layer, ctx.keys):
            t, aux, tiles, recompute = store.before_backward(layer.index, ctx.step)
            t = _with_positions(layer, t, ctx.documents)
            t = t if dprob is None else {**t, "router_grad": dprob}
            dx, grads = layer.run(backward_phase, t, dy.contiguous(), aux, tiles, recompute)
            names = [name for name, _ in layer.named_parameters()]
        return (dx, None, None, None, None, *(grads.get(name) for name in names))  # frozen: None
