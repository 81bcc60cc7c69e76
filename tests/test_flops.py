"""The FLOPs formulas against torch's FlopCounterMode on tiny models, recomputation included."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.cost.flops import (
    counted_flops_per_token,
    layer_forward_flops,
    linear_params_per_layer,
    model_flops_per_token,
    recompute_flops,
)
from memo.documents import DocumentLengths, document_positions
from memo.policy import mode_alphas
from memo.reference import ReferenceTransformer

aten = torch.ops.aten


def _cpu_flash_forward(query, key, value, *args, out_shape=None, **kwargs):
    b, h, s, d = query  # FlopCounterMode passes shapes; full s×s matrix, QKᵀ and PV
    return 4 * b * h * s * key[2] * d


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    b, h, s, d = query  # dV, dP, dQ, dK
    return 8 * b * h * s * key[2] * d


def _linear_out(x, weight, *args, out_shape=None, **kwargs):
    rows = 1
    for dim in x[:-1]:
        rows *= dim
    return 2 * rows * weight[0] * weight[1]  # the layer writes skeletal tensors with aten.linear.out


COUNTED = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    aten.linear: _linear_out,
}


def _count(model, ids) -> int:
    with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter:
        model(ids, labels=ids).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_model_flops_match_the_counted_flops_of_the_autograd_reference(preset):
    cfg = ModelConfig.preset(preset)
    ids = torch.randint(0, 256, (2, 24))
    counted = _count(ReferenceTransformer(cfg), ids)  # FlopCounterMode counts the whole s x s matrix
    assert counted == model_flops_per_token(cfg, 24, causal=False) * 2 * 24
    attention = 3 * cfg.n_layers * 4 * 24 * cfg.n_heads * cfg.head_dim  # per token, full matrix
    assert counted - attention / 2 * 2 * 24 == pytest.approx(model_flops_per_token(cfg, 24) * 2 * 24)


def test_gpt_formula_is_the_papers():
    c = ModelConfig.preset("gpt-7b")
    n, h, v, s = c.n_layers, c.hidden_size, c.vocab_size, 1 << 20
    assert model_flops_per_token(c, s, causal=False) == 72 * n * h * h + 12 * n * h * s + 6 * v * h
    assert model_flops_per_token(c, s) == 72 * n * h * h + 6 * n * h * s + 6 * v * h


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize(
    "policy",
    [
        ActivationPolicy("none"),
        ActivationPolicy("full"),
        ActivationPolicy("memo", alpha=0.3),
        ActivationPolicy("memo", alpha=[0.2, 0.9, 0.5, 0.5], offload_last_layers=True),
        ActivationPolicy("memo", alpha=0.4, plan=("checkpoint", "memo", "keep", "checkpoint"), tile_tokens=7),
    ],
    ids=["none", "full", "memo", "memo-all-layers", "tiled-plan"],
)
def test_recompute_flops_are_exactly_what_the_model_runs_again(preset, policy):
    cfg = ModelConfig.preset(preset)
    b, s = 2, 24
    ids = torch.randint(0, 256, (b, s))
    n = cfg.n_layers
    modes, alphas = policy.layer_modes(n), mode_alphas(policy.layer_modes(n), policy.layer_alphas(n) or [0.0] * n)
    extra = recompute_flops(cfg, s, modes, alphas, policy.offload_last_layers, tile=policy.tile_for(s))
    assert _count(Transformer(cfg, policy), ids) == model_flops_per_token(cfg, s, causal=False) * b * s + b * extra


def _count_forward(model, ids) -> int:
    with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter, torch.no_grad():
        model(ids, labels=ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_published_conventions_against_the_counted_flops(preset):
    cfg, tokens = ModelConfig.preset(preset), 2 * 24
    ids = torch.randint(0, 256, (2, 24))
    model = ReferenceTransformer(cfg)
    counted, forward = _count(model, ids), _count_forward(model, ids)
    assert counted_flops_per_token(cfg, 24, "full") * tokens == counted
    assert counted_flops_per_token(cfg, 24, "causal") * tokens == model_flops_per_token(cfg, 24) * tokens
    # Megatron's equation 3 counts a fourth pass: the layers' forward again (the head is not recomputed)
    head_forward = 2 * cfg.vocab_size * cfg.hidden_size * tokens
    assert counted_flops_per_token(cfg, 24, "megatron-eq3") * tokens == counted + forward - head_forward
    # 6N counts every parameter, the ones no matmul multiplies with too (embedding table, norms, biases)
    idle = cfg.num_parameters() - cfg.n_layers * linear_params_per_layer(cfg) - cfg.vocab_size * cfg.hidden_size
    assert counted_flops_per_token(cfg, 24, "6N") * tokens == pytest.approx(counted + 6 * idle * tokens)
    with pytest.raises(ValueError, match="unknown FLOP convention"):
        counted_flops_per_token(cfg, 24, "palm")


# ---- packed documents: attention over Σ d_i², not s² ----------------------------------------------------------


def test_shorter_documents_do_less_attention_and_the_same_matmuls():
    c, seq = ModelConfig.preset("gpt-7b"), 1 << 20
    lengths = [None, 1 << 18, 1 << 14, 1 << 12, 1 << 10, 1]
    attended = [seq if n is None else DocumentLengths(mean=n).attended(seq) for n in lengths]
    matmuls, attentions = zip(*(layer_forward_flops(c, a, seq, causal=True) for a in attended))
    assert len(set(matmuls)) == 1 and list(attentions) == sorted(attentions, reverse=True)
    assert attentions[-1] == attentions[0] / seq  # one-token documents: each token attends to itself alone
    per_token = [model_flops_per_token(c, a) for a in attended]
    assert per_token == sorted(per_token, reverse=True)
    # 72nh² + 6nh·E[Σd²]/s + 6Vh: the paper's formula with E[Σd²]/s in place of s
    n, h, v = c.n_layers, c.hidden_size, c.vocab_size
    assert per_token[4] == 72 * n * h * h + 6 * n * h * 1024 + 6 * v * h


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_packed_model_flops_match_the_counted_flops_of_block_diagonal_attention(preset):
    cfg, seq = ModelConfig.preset(preset), 24
    lengths = [[5, 9, 10], [24], [1, 1, 22]]
    starts = torch.zeros(len(lengths), seq, dtype=torch.bool)
    for row, documents in enumerate(lengths):
        starts[row, np.cumsum([0, *documents[:-1]])] = True
    ids = torch.randint(0, 256, (len(lengths), seq))
    model = Transformer(cfg, ActivationPolicy("none"))
    with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter:  # counts each document's d x d matrix
        model(ids, labels=ids, positions=document_positions(starts)).backward()
    squares = sum(d * d for documents in lengths for d in documents) / len(lengths)  # Σ d_i² per sequence
    tokens = len(lengths) * seq
    assert counter.get_total_flops() == model_flops_per_token(cfg, squares / seq, causal=False) * tokens
