"""Greedy decoding with a key/value cache through memo's own layers: one prefill over the prompts, then one token
row per step (RULER's answers, issue 39), as transformers' `generate(do_sample=False)` decodes.

The prefill is the layers' inference forward (`DecoderLayer.infer`: memo's attention kernels and tiles, no s × s
matrix), which leaves each layer's rotated keys and values (b, s, g, d) behind: they start the cache. A step feeds
one token row per sequence through the same pieces a training layer runs on a tile (`fill_qkv` with RoPE at the
row's position, then `fill_mlp` and `output`: norms, q/k norms, LoRA, Gemma's sandwich norms, a mixture of experts'
routing), and attention of that one query over the cached keys (a window keeps the last w). RoPE's dynamic scaling
takes the length so far, as transformers' does at each step (the prompt's keys keep the prompt's frequencies).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from .layer import DecoderLayer, FreshTiles, heads_major, rows_of, whole_tensors
from .norms import norm_forward

ROW = slice(0, 1)  # the one token row of a step


class Cache:
    """Each layer's rotated keys and values of the tokens so far, (b, capacity, g, d), and how many are filled."""

    def __init__(self, prefill: list[dict[str, torch.Tensor]], capacity: int):
        self.keys, self.values = [], []
        for t in prefill:
            k, v = t["k"], t["v"]
            self.keys.append(k.new_empty(k.shape[0], capacity, *k.shape[2:]))
            self.values.append(v.new_empty(v.shape[0], capacity, *v.shape[2:]))
            self.keys[-1][:, : k.shape[1]] = k
            self.values[-1][:, : v.shape[1]] = v
        self.length = prefill[0]["k"].shape[1]


@torch.inference_mode()
def generate(model, ids: torch.Tensor, max_new_tokens: int, eos: int | Iterable[int] | None = None) -> list[list[int]]:
    """Returns each sequence's greedy continuation of the prompts `ids` (b, s): `max_new_tokens` tokens, or up to
    and including its first end-of-sequence token (`eos`: an id or several), as transformers' greedy `generate`."""
    layers = list(model.layers)
    if layers[0].seq_parallel is not None:
        raise ValueError("memo decodes in one process: evaluate without `--sp`")
    stop = {eos} if isinstance(eos, int) else set(eos or ())
    x = model.embeddings(ids)
    prefill = []
    for layer in layers:
        x, t = layer.infer(x, model.store)
        prefill.append({"k": t["k"], "v": t["v"]})
        del t
    cache = Cache(prefill, ids.shape[1] + max_new_tokens)
    del prefill
    out: list[list[int]] = [[] for _ in range(ids.shape[0])]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        next_ids = _next_tokens(model, x[:, -1:])  # (b,)
        for k, token in enumerate(next_ids.tolist()):
            if not done[k]:
                out[k].append(token)
                done[k] = token in stop
        if bool(done.all()):
            break
        x = model.embeddings(next_ids[:, None])  # (b, 1, h)
        for i, layer in enumerate(layers):
            x = _step(layer, x, cache, i)
        cache.length += 1
    return out


def _next_tokens(model, last: torch.Tensor) -> torch.Tensor:
    """Returns the argmax token (b,) of the last rows (b, 1, h): final norm, then one row of logits each."""
    hidden = norm_forward(model.norm, last)[0][:, 0]  # (b, h)
    return (hidden @ model.head_weight.t()).argmax(dim=-1)


def _step(layer: DecoderLayer, x: torch.Tensor, cache: Cache, index: int) -> torch.Tensor:
    """Returns the layer's output (b, 1, h) of one new token row at position `cache.length`, its key and value
    written into the cache."""
    b, p = x.shape[0], cache.length
    specs = layer.skeletal_specs(b, 1, x.dtype, x.device)
    t = whole_tensors(specs, x, k=cache.keys[index][:, p : p + 1], v=cache.values[index][:, p : p + 1])
    pos = layer.positions(1, x.device)
    if pos is not None:  # LoRA dropout keys on positions: inference draws none, the row's own all the same
        t["pos"] = pos + p
    tiles = FreshTiles.of(specs, 1, 1)
    layer.fill_qkv({**rows_of(t, ROW), **tiles.open(t, ROW, "qkv")}, slice(p, p + 1), p + 1)
    _attend(layer, t, cache, index)
    v = {**rows_of(t, ROW), **tiles.open(t, ROW, "mlp")}
    layer.fill_mlp(v)
    return layer.output(v, torch.empty_like(x))


def _attend(layer: DecoderLayer, t: dict, cache: Cache, index: int) -> None:
    """Writes the new row's attention output over the cached keys and its own (the last w of them when the layer
    slides) into t["attn"] (b, 1, a, d)."""
    end = cache.length + 1
    start = 0 if layer.window is None else max(0, end - layer.window)
    k, v = (heads_major(c[index][:, start:end]) for c in (cache.keys, cache.values))  # (b, g, n, d)
    q = heads_major(t["q"])  # (b, a, 1, d)
    out = F.scaled_dot_product_attention(q, k, v, scale=layer.scale, enable_gqa=q.shape[1] != k.shape[1])
    t["attn"].copy_(out.transpose(1, 2))
