"""FLOP counts (docs/method.md §7): forward + backward = 3 × forward, recomputation is not model FLOPs (it is
counted apart, for HFU). LoRA's model FLOPs are those of the work it needs: a frozen linear (base projections
and head) computes its input's gradient but no weight gradient, 2 × forward; adapters train, 3 × forward;
attention is unchanged. Two conventions for attention, each named wherever a utilisation is shown:

- causal (the default, memo's MFU): a causal kernel computes half of the s×s score matrix, so half is counted;
- full: the whole s×s matrix, as `torch.utils.flop_counter` (and some papers) count it; at long lengths, where
  attention is nearly all the work, this "MFU" is about twice the kernel's real utilisation and can pass 100%.

Packed documents (`documents.DocumentLengths`): a sequence of s tokens made of documents of d_1..d_n tokens whose
tokens attend only within their own document does Σ d_i² of attention work instead of s²; both conventions then count
the matrices the documents need (half of each d_i × d_i, or all of it), not s × s (`MFU_PACKED`, `MFU_PACKED_FULL`).
Memory does not change: activations are per token.

Sliding windows (`ModelConfig.attended`): a layer of window w computes Σ_{i<s} min(i + 1, w) of the s(s + 1)/2 pairs
of causal attention, s·w rather than s²/2 at length; both conventions count that share of their matrix.

Mixtures of experts (`ModelConfig.moe`): a token multiplies by its layer's router (E × h) and the k experts it is
routed to, not by all E, so model FLOPs count the active weights (`linear_params_per_layer(c, active=True)`): 6 ×
active parameters per token plus attention, as torchtitan counts an MoE (`get_nparams_and_active_nparams`, routed
experts weighted by k/E); states, gathers and shards count every expert (`ModelConfig.num_parameters`). The
router's softmax and top-k and the tokens' gather into expert-major order and scatter back are not matmuls: no model
FLOPs (a few per token against 6·h·k·3·f), their bytes timed with the other memory-bound ops of the traced step.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..lora import LoraConfig, module_shapes
from ..policy import PlanProblem, plan_costs, split_row


def sparse_share(c: ModelConfig) -> float:
    """Returns the share of the layers whose MLP is a mixture of experts (0 for a dense model)."""
    return sum(c.sparse(i) for i in range(c.n_layers)) / c.n_layers


def linear_params_per_layer(c: ModelConfig, active: bool = False) -> float:
    """Returns the weight count of a layer's matmuls (q, k, v, o, and the MLP), the mean over the layers. A mixture
    of experts' sparse layers have the router and every expert (what FSDP and ZeRO-3 gather and shard), or with
    `active` the router and the k experts one token is routed to (what its FLOPs multiply by); its dense layers
    (`ModelConfig.dense_layers`) a SwiGLU MLP of `ffn_hidden_size`."""
    projections = sum(i * o for i, o in module_shapes(c).values())  # of a mixture of experts: attention's alone
    if not c.moe:
        return projections
    h, share = c.hidden_size, sparse_share(c)
    experts = c.n_experts * h + (c.experts_per_token if active else c.n_experts) * 3 * h * c.expert_ffn
    return projections + share * experts + (1 - share) * 3 * h * c.ffn_hidden_size


LORA_FLOPS = (
    "model FLOPs of the work LoRA does: frozen linears and head forward + input gradient (2 x forward, no weight "
    "gradient), adapters 3 x forward, attention as in full fine-tuning"
)
MFU_CAUSAL = "model FLOPs, causal attention counted as the half of the s x s matrix the kernel computes"
MFU_FULL = "model FLOPs, the full s x s attention matrix counted (as torch's FlopCounterMode does)"
HFU = "hardware FLOPs: model FLOPs (causal) plus the recomputation the strategy runs"
MFU_PACKED = (
    "packed documents: model FLOPs count the attention the documents need, causal attention as the half of each "
    "document's d x d matrix the kernel computes (sum of d_i^2 / 2 per sequence), not of s x s"
)
MFU_PACKED_FULL = "packed documents: model FLOPs, each document's whole d x d matrix counted (sum of d_i^2), not s x s"


MFU_EXPERTS = (
    "mixture of experts: model FLOPs count the active weights, 6 x (attention projections + router + the k routed "
    "experts) per token and layer, the head and attention as for a dense model (torchtitan's active parameters); "
    "HFU adds what memo's layer runs again in its backward (each routed expert's down projection and the router's "
    "logits; memo and offload-all); the experts' grouped GEMMs timed as the per-expert GEMMs they group, tokens x k "
    "/ E rows each (balanced routing assumed)"
)
MFU_WINDOWED = (
    "sliding window: each windowed layer's attention counted as the sum over tokens of min(position + 1, w) pairs "
    "of the causal count, averaged over the layers; packed documents take the smaller of the two (an upper bound); "
    "timed at the published causal speed, at the length that stands for that work, of the kernel that runs: flash "
    "for the windowed layers, the kernel named above for the others"
)


def layer_forward_flops(
    c: ModelConfig, seq: int, tokens: int | None = None, causal: bool = False
) -> tuple[float, float]:
    """Returns (matmul, attention) forward FLOPs of one layer for `tokens` tokens attending to `seq` tokens."""
    tokens = seq if tokens is None else tokens
    attention = 4.0 * seq * c.n_heads * c.head_dim * tokens
    return 2.0 * linear_params_per_layer(c, active=True) * tokens, attention / 2 if causal else attention


def model_flops_per_token(c: ModelConfig, seq: int, causal: bool = True, lora: LoraConfig | None = None) -> float:
    """Returns training FLOPs per token: for a GPT with FFN 4h, 72·n·h² + 12·n·h·s + 6·V·h with the full matrix
    (`causal=False`), 72·n·h² + 6·n·h·s + 6·V·h with causal attention. With `lora`, the frozen linears and head
    count 2 × forward (no weight gradient), the adapters 3 × forward."""
    matmul, attention = layer_forward_flops(c, seq, 1, causal)
    head = 2.0 * c.vocab_size * c.hidden_size
    if lora is None:
        return 3.0 * (c.n_layers * (matmul + attention) + head)
    adapters = adapter_work(c, lora, 1)["forward"][0]
    return c.n_layers * (2.0 * matmul + 3.0 * attention + 3.0 * adapters) + 2.0 * head


def adapter_work(c: ModelConfig, lora: LoraConfig | None, tokens: int) -> dict[str, tuple[float, float]]:
    """Returns the (FLOPs, bytes) of one layer's adapters for `tokens` tokens in the forward and in the backward,
    as `lora.low_rank_add` and `low_rank_backward` run them per target: forward x·Aᵀ then ·Bᵀ added into the
    output, 2·r·(in + out) FLOPs reading x and reading and writing the output rows; backward dy·B, x·Aᵀ again,
    the two weight gradients and the input's, 2·r·(3·in + 2·out) FLOPs reading dy and x twice each and writing
    the input rows (bf16 rows of `in` and `out` features). At rank 16 the bytes, not the FLOPs, set the speed."""
    if lora is None:
        return {"forward": (0.0, 0.0), "backward": (0.0, 0.0)}
    shapes = module_shapes(c)
    ins = sum(shapes[m][0] for m in lora.modules(c))
    outs = sum(shapes[m][1] for m in lora.modules(c))
    flops = 2.0 * lora.rank * tokens
    return {
        "forward": (flops * (ins + outs), 2.0 * tokens * (ins + 2 * outs)),
        "backward": (flops * (3 * ins + 2 * outs), 2.0 * tokens * (3 * ins + 2 * outs)),
    }


def token_local_flops(c: ModelConfig, tokens: int) -> tuple[float, float]:
    """Returns the forward FLOPs of one layer's token-local matmuls a recompute runs again for `tokens` tokens:
    (the q, k, v projections; the output projection and the MLP's input projections: of a mixture of experts the
    gate and up of the k routed experts, not the router, whose routing is kept). The MLP's last projection is not
    rerun: its output is the layer's, not a skeletal tensor. The mean over the layers."""
    h, q, kv = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    share = sparse_share(c)  # of the layers: a mixture of experts' sparse ones (its dense ones are gated MLPs)
    dense = (1 if c.arch == "gpt" else 2) * h * c.ffn_hidden_size
    mlp_in = share * c.experts_per_token * 2 * h * c.expert_ffn + (1 - share) * dense
    return 2.0 * h * (q + 2 * kv) * tokens, 2.0 * (q * h + mlp_in) * tokens


def experts_backward_flops(c: ModelConfig, tokens: int) -> float:
    """Returns the forward FLOPs a mixture of experts' backward runs again for `tokens` tokens, whatever the plan
    (`layer.DecoderLayer._experts_backward`): each routed expert's output (its down projection, for the routing
    weights' gradient) and the router's logits (for their gradient; the routing itself is the forward's). The mean
    over the layers: 0 for a dense MLP."""
    return sparse_share(c) * 2.0 * c.hidden_size * (c.experts_per_token * c.expert_ffn + c.n_experts) * tokens


def recompute_flops(
    c: ModelConfig,
    seq: int,
    modes: list[str],
    alphas: list[float],
    offload_last_layers: bool = False,
    tokens: int | None = None,
    causal: bool = False,
    tile: int | None = None,
) -> float:
    """Returns the forward FLOPs a plan (policy.py's modes and α per layer) spends again before backward, for one
    sequence: the token-local matmuls of the rows a layer does not keep, and a checkpointed or recomputed
    layer's attention (`policy.plan_costs`, with FLOPs for its seconds); `tile` the tile length (None: one
    tile)."""
    tokens = seq if tokens is None else tokens
    qkv, mlp = token_local_flops(c, tokens)
    problem = PlanProblem(
        n_layers=c.n_layers,
        input_bytes=0,
        attention_bytes=0,
        other_bytes=0,
        local_bytes=0,
        keep_bytes=0,
        bandwidth=math.inf,
        layer_seconds=0.0,
        backward_seconds=0.0,
        attention_seconds=layer_forward_flops(c, seq, tokens, causal)[1],
        qkv_seconds=qkv,
        mlp_seconds=mlp,
        host_budget=0,
        offload_last_layers=offload_last_layers,
        tiled=tile is not None and tile < tokens,
    )
    kept = [split_row(a, tokens) / tokens for a in alphas]  # whole token rows, as the store splits them
    return plan_costs(problem, modes, kept)["recompute"]


PUBLISHED_CONVENTIONS = {  # how published runs count the FLOPs their utilisation divides by the peak
    "causal": MFU_CAUSAL,
    "full": MFU_FULL + "; Korthikanti et al. 2022's MFU, 72·n·h²·(1 + s/6h + V/12nh) per token",
    "6N": "6 x parameters (embeddings included; of a mixture of experts the active ones, the k routed experts, as "
    "torchtitan counts them) + 12·n·heads·head_dim·s per token (PaLM, app. B): torchtitan, llm-foundry, "
    "FlashAttention-2's Table 1",
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
        return 6.0 * c.active_parameters() + 3.0 * c.n_layers * attention
    if convention == "megatron-eq3":
        return 4.0 * c.n_layers * (matmul + attention) + head
    raise ValueError(f"unknown FLOP convention {convention!r}; choose one of {', '.join(PUBLISHED_CONVENTIONS)}")
