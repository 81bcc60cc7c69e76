"""`memo.patch(model)`: a transformers (or PEFT) Llama, Mistral, Qwen2, Qwen3 or Gemma 3 causal LM trains with memo's
activation management, in place, under whatever trains it (a loop, `Trainer`, TRL's `SFTTrainer`, FSDP2).

The patch gives three objects an instance `forward` (the class's own stays, and is what runs without grad):
- each decoder layer: called with memo's per-forward `Call`, it runs memo's explicit layer over this layer's
  weights (`hf_weights.LayerWeights`) inside its own `__call__`, so FSDP2's unshard and reduce-scatter hooks fire;
- the backbone (`model.model`): with grad on, the embedding, memo's layers and the final norm, returning
  `last_hidden_state` as transformers does, so whoever computes the loss (transformers, TRL's fused head) still
  does; the batch arguments follow transformers' packing and padding rules (`hf_batch`);
- the causal LM, only when `labels` reach it: memo's chunked loss over the hidden states, no logits built
  (`CausalLMOutputWithPast.logits` is None: call without `labels`, or under `torch.no_grad()`, for logits).
No module, parameter or buffer is added: `state_dict`, PEFT, FSDP and the optimizer see the model as it was.
Every module memo computes with is looked up at call time. `memo.unpatch(model)` takes the forwards back.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ModelConfig
from .documents import Documents
from .hf import GEMMA, config_from_hf, layer_names
from .hf_batch import documents_of, num_items, targets_of
from .hf_weights import MOE_MODULES, LayerWeights, active_module
from .layer import DecoderLayer, LayerFunction
from .loss import ChunkedCrossEntropy
from .policy import ActivationPolicy
from .swap import ActivationStore, SwapStats, make_store

log = logging.getLogger(__name__)
RECORD = "_memo_patch"  # the causal LM's and backbone's __dict__ entry: a plain object, no state_dict key
PATCHED = ("llama", "mistral", "qwen2", "qwen3", GEMMA, "qwen3_moe", "mixtral")  # the families LayerWeights binds
ROUTER_LOGITS = (
    "`output_router_logits=True`: transformers' load-balancing loss needs every layer's router logits, which memo's "
    "layers do not return; under memo.patch set it False (memo train adds the loss itself)"
)


@dataclass(eq=False)
class Patch:
    """What a patched model holds of memo: its policy, config, activation store and parameter-free layer twins."""

    policy: ActivationPolicy
    config: ModelConfig
    loss_chunk_tokens: int | None
    store: ActivationStore = field(init=False)
    twins: list[DecoderLayer] = field(init=False)
    active: bool = True
    last: Call | None = None  # the last grad forward, until its backward reaches the first layer
    told: set = field(default_factory=set)  # the one-time warnings given
    checkpointed: bool = False  # transformers' activation checkpointing was on (memo turned it off)

    def __post_init__(self) -> None:
        self.store = make_store(self.policy, self.config.n_layers)
        with torch.device("meta"):
            self.twins = [DecoderLayer(self.config, i) for i in range(self.config.n_layers)]
        for twin in self.twins:
            twin.attention_kernel = self.policy.attention

    def __deepcopy__(self, memo) -> Patch:
        """A copy (TRL's reference model, a trainer's) gets its own store, never this one's pinned buffers."""
        return Patch(self.policy, self.config, self.loss_chunk_tokens, active=self.active)

    def __getstate__(self) -> dict:
        return {"policy": self.policy, "config": self.config, "loss_chunk_tokens": self.loss_chunk_tokens}

    def __setstate__(self, state: dict) -> None:
        """An unpickled model's forwards are its class's (pickle rebinds them by name): it runs unpatched."""
        self.__init__(**state, active=False)
        log.warning("memo.patch: a patched model was unpickled: it runs unpatched until memo.patch(model) again")

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.told:
            self.told.add(key)
            log.warning(message)


class Call:
    """One grad-enabled forward: its documents, compute dtype and LoRA dropout key, shared by every layer. A plain
    class, not a dataclass: FSDP2 walks dataclass arguments for tensors, and this one reaches the whole record."""

    def __init__(self, record: Patch, documents: Documents | None, dtype: torch.dtype, key: int | None):
        self.record, self.documents, self.dtype, self.key = record, documents, dtype, key
        self.done = False  # set when the backward has gone through the first layer
        self.output: weakref.ref | None = None  # the graph node of the marked activation: dead once dropped

    def pending(self) -> bool:
        return not self.done and self.output is not None and self.output() is not None


class _BackwardReached(torch.autograd.Function):
    """Identity whose backward marks its call done: the next forward then knows the last one was trained on."""

    @staticmethod
    def forward(ctx, x, call: Call):
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.done = True
        return grad, None


# ---- patch / unpatch ---------------------------------------------------------------------------------------


def patch(model: nn.Module, policy: ActivationPolicy | None = None, loss_chunk_tokens: int | None = 4096) -> nn.Module:
    """Makes `model` (a transformers `*ForCausalLM` of a family memo runs, or a PEFT model around one) train with
    memo's activation management under `policy` (default: memo, α and plan solved from measured times); returns
    `model`. `loss_chunk_tokens`: memo computes the loss when `labels` reach the causal LM, this many tokens of
    logits at a time (None: transformers computes it, from logits)."""
    policy = policy or ActivationPolicy("memo")
    lm = causal_lm(model)
    if RECORD in lm.__dict__:
        unpatch(model)
    backbone = lm.model
    config = config_from_hf(lm.config.to_dict(), name=type(lm).__name__, source="model.config")
    if config.router_aux_loss:
        raise ValueError(ROUTER_LOGITS)
    _check_model(lm, config, policy)
    record = Patch(policy, config, loss_chunk_tokens)
    for module in (lm, backbone):
        module.__dict__[RECORD] = record
    if "forward" not in lm.__dict__:  # else someone's own (TRL's fused head): it calls the patched backbone
        _override(lm, _lm_forward)
    _override(backbone, _backbone_forward)
    for layer in backbone.layers[: config.n_layers]:
        _override(layer, _layer_forward)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Takes memo's forwards off `model` (those still in place: a forward someone wrapped around memo's becomes a
    pass-through) and frees its buffers; returns `model`. HF activation checkpointing memo turned off stays off."""
    lm = causal_lm(model)
    record = lm.__dict__.get(RECORD)
    if record is None:
        return model
    record.active = False
    record.store._drop_buffers()
    for module in (lm, lm.model, *lm.model.layers):
        function = getattr(module.__dict__.get("forward"), "__func__", None)
        if hasattr(function, "memo_function") or function is type(module).forward:  # ours, or ours unpickled
            del module.__dict__["forward"]
        module.__dict__.pop(RECORD, None)
    return model


def patch_stats(model: nn.Module) -> SwapStats:
    """Returns what memo's activation store did in `model`'s last training step (modes, α, tile, bytes
    offloaded and recomputed, host pool): `model` patched, or a PEFT model or trainer's copy around it."""
    record = causal_lm(model).__dict__.get(RECORD)
    if record is None:
        raise ValueError("the model is not patched: memo.patch(model) first")
    return record.store.stats


def causal_lm(model: nn.Module) -> nn.Module:
    """Returns the transformers causal LM of `model` (itself, or the one a PEFT model wraps); raises otherwise."""
    if type(model).__name__ == "OptimizedModule":
        raise ValueError("memo.patch takes the model before torch.compile: memo's layers run their own kernels")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    lm = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    family = getattr(getattr(lm, "config", None), "model_type", None)
    if family not in PATCHED or not hasattr(lm, "model") or not hasattr(lm.model, "layers"):
        raise ValueError(
            f"memo.patch runs transformers' {', '.join(PATCHED)} causal LMs, got {type(lm).__name__}"
            + (f" ({family})" if family else "")
        )
    return lm


def _check_model(lm: nn.Module, config: ModelConfig, policy: ActivationPolicy) -> None:
    """Raises for a model whose layers memo would not compute as transformers does."""
    for layer in lm.model.layers:
        forward = type(layer).forward
        if not getattr(forward, "__module__", "").startswith("transformers.") or "forward" in layer.__dict__:
            raise ValueError(
                f"{type(layer).__name__}.forward comes from {getattr(forward, '__module__', '?')} (Liger or another "
                "patch): apply memo.patch to an unpatched model"
            )
        if getattr(layer, "_checkpoint_wrapped_module", None) is not None:
            raise ValueError("the decoder layers are wrapped for activation checkpointing: memo manages activations")
    _check_ranks(policy, config)


def _check_ranks(policy: ActivationPolicy, config: ModelConfig) -> None:
    """Raises for a solved plan under several ranks: each rank would measure (a collective) at its own new longest
    length, and ranks packing other lengths would not meet. Checked at the patch and at every training forward
    (the process group may start after the patch)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1 and policy.layer_modes(config.n_layers) is None:
            raise ValueError(
                "a solved plan measures on every rank at each new batch shape: under several ranks give α "
                "(memo.ActivationPolicy('memo', alpha=...)) or a plan"
            )


def _override(module: nn.Module, function) -> None:
    """Gives `module` an instance `forward` bound to `function`, with the class forward's signature (Trainer reads
    it to keep dataset columns and to pass `num_items_in_batch`)."""
    module.forward = types.MethodType(_wrapped(function, type(module).forward), module)


@functools.cache
def _wrapped(function, original):
    """Returns `function` under `original`'s name and signature (one wrapper per pair, so unpatch finds it)."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return function(self, *args, **kwargs)

    forward.memo_function = function
    return forward


# ---- the three forwards ------------------------------------------------------------------------------------


def _layer_forward(self, *args, memo_call: Call | None = None, **kwargs):
    if memo_call is None:
        return type(self).forward(self, *args, **kwargs)
    return _run_layer(memo_call, self, args[0])


def _run_layer(call: Call, hf_layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Returns memo's layer over `hf_layer`'s weights on x (b, s, h), inside the layer's own call."""
    record, index = call.record, hf_layer.self_attn.layer_idx
    names = layer_names(record.config.hf_model_type)
    if record.config.moe:  # transformers 5 holds both families' router and experts under `mlp` in memory
        names = {**names, **MOE_MODULES}
    weights = LayerWeights(hf_layer, index, call.dtype, call.key, names, record.config.norm_offset)
    twin = record.twins[index]
    twin.source = weights
    with weights.bound(twin) as params:
        if index == 0:  # sized here, after FSDP has unsharded the first layer: the plan measures its weights
            record.store.begin_step(record.twins, x.shape[0], x.shape[1], call.dtype, x.device)
        if not (x.requires_grad or any(p.requires_grad for p in params)):
            with torch.no_grad():  # a layer with nothing to train below the first that has: keeps nothing
                return twin(x, record.store, call.documents)
        y = LayerFunction.apply(x, twin, record.store, call.documents, None, *params)
    if call.output is None:
        y = _BackwardReached.apply(y, call)
        call.output = weakref.ref(y.grad_fn)
    return y


def _backbone_forward(self, *args, **kwargs):
    record = self.__dict__.get(RECORD)
    if record is None or not record.active or not torch.is_grad_enabled():  # generate: no binding per token
        return type(self).forward(self, *args, **kwargs)
    inputs = _arguments(self, args, kwargs)
    if not _trains(self, inputs):
        return type(self).forward(self, *args, **kwargs)
    return _memo_backbone(self, record, inputs)


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Returns a call's arguments by name as the class forward takes them, defaults filled, the rest under
    "kwargs" (transformers 5 renamed `past_key_values` to `cache`)."""
    signature = _signature(type(module).forward)
    bound = signature.bind(module, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named[next(iter(signature.parameters))]  # self
    rest = next((named.pop(p.name) for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), {})
    if named.get("cache") is None and "past_key_values" in rest:
        named["cache"] = rest.pop("past_key_values")
    return {**named, "kwargs": rest}


@functools.cache
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def _trains(backbone: nn.Module, inputs: dict) -> bool:
    """Returns whether this forward (grad on) is a training one memo runs: no cache to fill, something trains."""
    cache = inputs["cache"]
    if cache is not None and cache.get_seq_length() > 0:
        return False
    embeds = inputs["inputs_embeds"]
    return (embeds is not None and embeds.requires_grad) or any(p.requires_grad for p in backbone.parameters())


def _memo_backbone(self, record: Patch, inputs: dict):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    kwargs = inputs["kwargs"]
    use_cache = _use_cache(self, record, inputs["use_cache"])
    _check_call(self, record, kwargs)
    ids, embeds = inputs["input_ids"], inputs["inputs_embeds"]
    if (ids is None) == (embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    x = self.embed_tokens(ids) if embeds is None else embeds  # (b, s, h), as a module: PEFT's and FSDP's hooks fire
    b, s = x.shape[:2]
    batch = documents_of(
        (b, s),
        inputs["attention_mask"],
        inputs["position_ids"],
        device=x.device,
        **{k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")},
    )
    if use_cache and batch.documents is not None:
        raise ValueError(
            "`position_ids` restart (packed documents) but use_cache is on, and transformers packs only without a "
            "cache: pass use_cache=False (TRL does)"
        )
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    call = Call(record, batch.documents, dtype, _dropout_key(self))
    record.last = call
    x = x.to(dtype)
    for layer in self.layers[: record.config.n_layers]:
        x = layer(x, memo_call=call)
    x = self.norm(x)
    if kwargs.get("return_dict") is False:
        return (x,)
    return BaseModelOutputWithPast(last_hidden_state=x)


def _use_cache(backbone: nn.Module, record: Patch, given: bool | None) -> bool:
    """Returns `use_cache` as transformers resolves it (the config's default, off under activation checkpointing
    in training, which memo turned off: it counts as on once it was)."""
    use_cache = getattr(backbone.config, "use_cache", False) if given is None else given
    checkpointing = record.checkpointed or getattr(backbone, "gradient_checkpointing", False)
    return bool(use_cache) and not (checkpointing and backbone.training)


def _check_call(backbone: nn.Module, record: Patch, kwargs: dict) -> None:
    """Raises for a training forward memo would not run as asked; turns HF activation checkpointing off."""
    if torch.compiler.is_compiling():
        raise ValueError("memo's layers do not run under torch.compile: compile nothing around a patched model")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise ValueError(
            "saved-tensor hooks are active (TRL's activation_offloading, save_on_cpu, checkpoint): memo manages "
            "the activations itself, turn them off"
        )
    if kwargs.get("output_router_logits"):
        raise ValueError(ROUTER_LOGITS)
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise ValueError(f"`{name}` is not returned by memo's layers: ask for it under torch.no_grad()")
    if kwargs.get("is_causal") is False:
        raise ValueError("memo runs causal attention: `is_causal=False` is not supported")
    _check_accelerate()
    _check_ranks(record.policy, record.config)
    if record.last is not None and record.last.pending():
        raise ValueError(
            "memo keeps one forward's activations: call backward before the next training forward, or run the "
            "extra forward under torch.no_grad()"
        )
    checkpointed = [m for m in (backbone, *backbone.layers) if getattr(m, "gradient_checkpointing", False)]
    if checkpointed:
        for m in checkpointed:
            m.gradient_checkpointing = False
        record.checkpointed = True
        record.warn_once("ac", "memo.patch: transformers' activation checkpointing is off: memo manages activations")


def _check_accelerate() -> None:
    """Raises under Accelerate's context or sequence parallelism (memo's layers see whole sequences)."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    config = AcceleratorState._shared_state.get("parallelism_config")
    if config is not None and (getattr(config, "cp_enabled", False) or getattr(config, "sp_enabled", False)):
        raise ValueError("Accelerate's context/sequence parallelism splits what memo's layers need whole: turn it off")


def _dropout_key(backbone: nn.Module) -> int | None:
    """Returns a fresh LoRA dropout key from torch's generator when an adapter drops out (so it follows the
    seed), else None, leaving the generator untouched."""
    drops = any(
        isinstance(m, nn.Dropout) and m.training and m.p > 0
        for name, m in backbone.named_modules()
        if "lora_dropout" in name
    )
    return int(torch.randint(1 << 31, ())) if drops else None


def _lm_forward(self, *args, **kwargs):
    record = self.__dict__.get(RECORD)
    if record is not None and record.active and torch.is_grad_enabled() and record.config.moe:
        if _arguments(self, args, kwargs).get("output_router_logits"):
            raise ValueError(ROUTER_LOGITS)
    if record is None or not record.active or not record.loss_chunk_tokens or not torch.is_grad_enabled():
        return type(self).forward(self, *args, **kwargs)  # generate: no binding per token
    inputs = _arguments(self, args, kwargs)
    keep = inputs["logits_to_keep"]
    head = _head(self) if inputs["labels"] is not None and isinstance(keep, int) and keep == 0 else None
    if head is None:
        return type(self).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs = inputs["kwargs"]
    count, shift, ignore = (kwargs.pop(k, None) for k in ("num_items_in_batch", "shift_labels", "ignore_index"))
    targets = targets_of(inputs["labels"], shift, -100 if ignore is None else ignore)
    backbone = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")
    out = self.model(**{k: inputs[k] for k in backbone}, **kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    weight = head.weight.full_tensor() if type(head.weight).__name__ == "DTensor" else head.weight
    targets = targets.to(hidden.device)
    _check_padded_targets(targets, inputs["attention_mask"])
    divisor = num_items(targets, count)
    loss = ChunkedCrossEntropy.apply(hidden, weight, targets, record.loss_chunk_tokens, divisor, None)
    return (loss,) if kwargs.get("return_dict") is False else CausalLMOutputWithPast(loss=loss, logits=None)


def _check_padded_targets(targets: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Raises when a padded position (attention_mask 0) has a target: transformers computes it from a query that
    attends to the real tokens, memo's layers run causal attention over the pads (collators give pads -100)."""
    if attention_mask is not None and bool(((targets != -100) & (attention_mask.to(targets.device) == 0)).any()):
        raise ValueError("labels at padded positions (attention_mask 0) must be -100, as the collators set them")


def _head(lm: nn.Module) -> nn.Module | None:
    """Returns the LM head as the causal LM's forward would run it (PEFT's active `modules_to_save` copy), or None
    when it is not a plain nn.Linear (then transformers computes the loss from logits)."""
    head = lm.get_output_embeddings()
    head = head if head is None else active_module(head)
    plain = isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and head.bias is None
    return head if plain and not head._forward_hooks and not head._forward_pre_hooks else None
