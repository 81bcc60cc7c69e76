"""The transformer, top to bottom: token embedding → decoder layers → final norm → LM head / chunked loss."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from .attention import refusals
from .config import ModelConfig
from .decode import generate
from .documents import Documents
from .experts import router_aux_loss
from .layer import DecoderLayer
from .lora import set_dropout_keys
from .loss import TokenReduction, shift_labels, target_cross_entropy
from .norms import norm_forward, norm_module
from .policy import ActivationPolicy
from .swap import ActivationStore, SwapStats, make_store

log = logging.getLogger(__name__)


class Transformer(nn.Module):
    """Decoder-only LM whose layers keep, offload or recompute activations as `policy` says."""

    def __init__(self, config: ModelConfig, policy: ActivationPolicy | None = None, loss_chunk_tokens: int = 4096):
        super().__init__()
        self.config = config
        self.policy = policy or ActivationPolicy("none")
        self.policy.layer_alphas(config.n_layers)  # validates per-layer α and plan lists against the depth
        self.policy.layer_modes(config.n_layers)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        for layer in self.layers:
            layer.attention_kernel = self.policy.attention
        h = config.hidden_size
        self.norm = norm_module(config, h)
        self.head = None if config.tie_embeddings else nn.Linear(h, config.vocab_size, bias=False)
        self.store: ActivationStore = make_store(self.policy, config.n_layers)
        self.token_reduction: TokenReduction | None = None  # memo.parallel: the loss is a mean over all ranks
        self.dropout_key = 0  # keys LoRA dropout's masks: the trainer sets one per step and micro-batch
        self._told_unplanned = False  # that the phase planner leaves packed batches to the allocator
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2n); norm scales 1 (weights
        0 where the scale is 1 + weight)."""
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        one = 0.0 if self.config.norm_offset else 1.0
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.constant_(p, one) if name.endswith("norm.weight") else nn.init.zeros_(p)
            else:
                nn.init.normal_(
                    p, std=out_std if name.endswith(("wo.weight", "w_down.weight", "experts.down")) else 0.02
                )

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the mean next-token loss when `labels` are given (with grad, plus a mixture of experts' load-
        balancing loss where the config asks for it, as transformers adds it), else logits (b, s, V) for short inputs.

        `targets` replaces `labels` with labels already shifted (position t predicts targets[t]): what a
        sequence-parallel rank holds, its last token predicting the next rank's first (parallel.shard_batch).
        `positions` (b, S) packs documents (`memo.documents`): each token's position within its document, of the
        whole sequence on every sequence-parallel rank, on any device (the host spares a copy back); a document's
        tokens attend only to it.
        """
        x = self.layer_states(input_ids, positions)
        if labels is None and targets is None:
            return norm_forward(self.norm, x)[0] @ self.head_weight.t()
        targets = shift_labels(labels) if targets is None else targets
        loss = target_cross_entropy(
            x, self.head_weight, targets, self.loss_chunk_tokens, self.token_reduction, norm=self.norm
        )
        totals = [layer.router_totals for layer in self.layers if layer.router_totals is not None]
        if not totals:
            return loss
        coef = self.config.router_aux_loss_coef  # transformers adds it to the loss of the labels: so does memo
        return loss + router_aux_loss(totals, input_ids.numel(), coef, self.token_reduction)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the final-norm hidden states (b, s, h): what the LM head reads (decode from a few rows of
        them without building the s × V logits)."""
        return norm_forward(self.norm, self.layer_states(input_ids, positions))[0]

    def layer_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the last layer's output (b, s, h), before the final norm (which the loss applies chunk by
        chunk); `positions` as in `forward`."""
        b, s = input_ids.shape
        sp = self.layers[0].seq_parallel
        total = s * (1 if sp is None else sp.size)
        documents = Documents.of(positions, b, total, input_ids.device)  # (b, S): every document's bounds
        if documents is not None and self.layers[0].phases is not None and not self._told_unplanned:
            log.warning("the phase planner serves one document per sequence: packed batches use the allocator")
            self._told_unplanned = True
        x = self.embeddings(input_ids)  # (b, s, h)
        set_dropout_keys(self, self.dropout_key if torch.is_grad_enabled() else None)  # LoRA dropout: training only
        for layer in self.layers:  # a mixture of experts' routing totals: those of this forward, if it trains
            layer.router_totals = None
        if torch.is_grad_enabled():
            self.store.begin_step(self.layers, b, s, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, self.store, documents)
        return x

    def greedy(self, input_ids: torch.Tensor, max_new_tokens: int, eos=None) -> list[list[int]]:
        """Returns each prompt's greedy continuation (`memo.decode.generate`: one prefill, then a step per token
        over cached keys and values), up to and including its first `eos` id when given."""
        return generate(self, input_ids, max_new_tokens, eos)

    def embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Returns the token embeddings (b, s, h) the first layer reads (Gemma's scaled by √h in their dtype)."""
        x = self.embed(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    @property
    def head_weight(self) -> torch.Tensor:
        """Returns the LM head's weight (vocab, h): the token embedding itself when they are tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def attention_report(self) -> str:
        """Returns the attention kernel(s) the last forwards ran (over packed documents: which, and how), and any
        that refused a shape and fell back."""
        ran = sorted({layer.attention_ran for layer in self.layers if layer.attention_ran})
        ran += [f"{how} over packed documents" for how in sorted({layer.packed_ran for layer in self.layers} - {None})]
        refused = refusals()
        return ", ".join(ran) + (f" (fell back: {'; '.join(refused)})" if refused else "") if ran else "none yet"

    def swap_stats(self) -> SwapStats:
        """Returns what the activation store did in the last step (bytes offloaded, recomputed, pool peak)."""
        return self.store.stats
