"""FLOP counts (docs/method.md §7): forward + backward = 3 × forward, recomputation is not model FLOPs (it is
counted apart, for HFU). Two conventions for attention, each named wherever a utilisation is shown:

- causal (the default, memo's MFU): a causal kernel computes half of the s×s score matrix, so half is counted;
- full: the whole s×s matrix, as `torch.utils.flop_counter` (and some papers) count it; at long lengths, where
  attention is nearly all the work, this "MFU" is about twice the kernel's real utilisation and can pass 100%.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..policy import split_row


def linear_params_per_layer(c: ModelConfig) -> int:
    """Returns the weight count of one layer's matmuls (q, k, v, o, and the MLP)."""
    h, q, kv = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    mlp = (2 if c.arch == "gpt" else 3) * h * c.ffn_hidden_size
    return h * q + 2 * h * kv + q * h + mlp


MFU_CAUSAL = "model FLOPs, causal attention counted as the half of the s x s matrix the kernel computes"
MFU_FULL = "model FLOPs, the full s x s attention matrix counted (as torch's FlopCounterMode does)"
HFU = "hardware FLOPs: model FLOPs (causal) plus the recomputation the strategy runs"


def layer_forward_flops(
    c: ModelConfig, seq: int, tokens: int | None = None, causal: bool = False
) -> tuple[float, float]:
    """Returns (matmul, attention) forward FLOPs of one layer for `tokens` tokens attending to `seq` tokens."""
    tokens = seq if tokens is None else tokens
    attention = 4.0 * seq * c.n_heads * c.head_dim * tokens
    return 2.0 * linear_params_per_layer(c) * tokens, attention / 2 if causal else attention


def model_flops_per_token(c: ModelConfig, seq: int, causal: bool = True) -> float:
    """Returns training FLOPs per token: for a GPT with FFN 4h, 72·n·h² + 12·n·h·s + 6·V·h with the full matrix
    (`causal=False`), 72·n·h² + 6·n·h·s + 6·V·h with causal attention."""
    matmul, attention = layer_forward_flops(c, seq, 1, causal)
    return 3.0 * (c.n_layers * (matmul + attention) + 2.0 * c.vocab_size * c.hidden_size)


def recompute_flops(
    c: ModelConfig, seq: int, strategy: str, alphas=None, reloaded=(), tokens=None, causal: bool = False
) -> float:
    """Returns the forward FLOPs a strategy spends again before backward, for one sequence.

    `full` re-runs each layer's forward except the last projection (its output is not needed);
    `memo` re-runs the token-local matmuls (all but the last projection) for the (1 − α) tokens of
    every layer whose tensors come back from host (`ActivationPolicy.reloaded_layers`, §3).
    """
    tokens = seq if tokens is None else tokens
    w_down = c.ffn_hidden_size * c.hidden_size
    local = 2.0 * (linear_params_per_layer(c) - w_down)
    if strategy == "full":
        return c.n_layers * (local * tokens + layer_forward_flops(c, seq, tokens, causal)[1])
    if strategy == "memo":
        return sum(local * (tokens - split_row(alphas[i], tokens)) for i in reloaded)
    return 0.0


PUBLISHED_CONVENTIONS = {  # how published runs count the FLOPs their utilisation divides by the peak
    "causal": MFU_CAUSAL,
    "full": MFU_FULL + "; Korthikanti et al. 2022's MFU, 72·n·h²·(1 + s/6h + V/12nh) per token",
    "6N": "6 x parameters (embeddings included) + 12·n·heads·head_dim·s per token (PaLM, app. B): torchtitan, "
    "llm-foundry, FlashAttention-2's Table 1",
    "megatron-eq3": "Megatron-LM's equation 3, 96·n·h²·(1 + s/6h + V/16nh) per token: full recomputation counted "
    "(four passes), the full s x s matrix",
}


def counted_flops_per_token(c: ModelConfig, seq: int, convention: str) -> float:
    """Returns the FLOPs per token a published run's convention counts (`PUBLISHED_CONVENTIONS`)."""
    matmul, attention = layer_forward_flops(c, seq, 1)
    head = 6.0 * c.vocab_size * c.hidden_size
    if convention == "causal":
        return model_flops_per_token(c, seq)
    if convention == "full":
        return model_flops_per_token(c, seq, causal=False)
    if convention == "6N":
        return 6.0 * c.num_parameters() + 3.0 * c.n_layers * attention
    if convention == "megatron-eq3":
        return 4.0 * c.n_layers * (matmul + attention) + head
    raise ValueError(f"unknown FLOP convention {convention!r}; choose one of {', '.join(PUBLISHED_CONVENTIONS)}")
