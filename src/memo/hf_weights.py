"""A transformers decoder layer's weights, read at call time and bound to memo's explicit layer (`memo.patch`).

memo's `DecoderLayer` reads its weights through its modules (`self.wq.weight`, `self.attn_norm.eps`). A patched
model keeps its own modules; for each call a parameter-free twin of the layer (`DecoderLayer` on `meta`, never in
the model's tree) gets views of them: an `nn.Linear` as it is, PEFT's LoRA as one `lora.LoraLinear`, a Llama or
Qwen RMSNorm as an `nn.RMSNorm` over the same weight. They are looked up anew at every forward and again for
the backward, so `get_peft_model` after the patch, FSDP2's per-call unsharded parameters and PEFT's
`modules_to_save` copies are what the layer computes with.

Where the view is not the module's own tensor (a cast to the compute dtype; several adapters summed into one;
LoRA's `lora_B` bias folded into the projection's bias), it is made differentiably in the forward, so autograd
carries the layer's gradient back to the model's parameters in their own dtype; the backward rebuilds the same
values without a graph. Anything memo cannot run exactly (DoRA and other variants, quantized or transposed bases,
hooks or patched forwards on a submodule memo never calls) is refused in one line.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .experts import Experts
from .lora import LoraLinear, adapter_key
from .norms import rms_norm_module

_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_NORMS = ("attn_norm", "q_norm", "k_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm")
# a mixture of experts' modules as transformers 5 holds them in memory (Qwen3-MoE and Mixtral alike)
MOE_MODULES = {"router": "mlp.gate", "experts": "mlp.experts"}


class LayerWeights:
    """The weights of transformers decoder layer `hf_layer` (index `index`) for one forward and its backward, in
    `dtype`; `key` keys LoRA dropout (None: off); `names` the family's module of each memo name (`hf.LAYER_NAMES`),
    `norm_offset` its RMSNorms' (Gemma's scale 1 + weight)."""

    def __init__(
        self,
        hf_layer: nn.Module,
        index: int,
        dtype: torch.dtype,
        key: int | None,
        names: dict[str, str],
        norm_offset: float = 0.0,
    ):
        self.hf_layer, self.index, self.dtype, self.key = hf_layer, index, dtype, key
        self.names, self.norm_offset = names, norm_offset

    def where(self, name: str) -> str:
        """Returns the module path of memo's `name` in the model, for errors."""
        return f"model.layers.{self.index}.{self.names[name]}"

    @contextmanager
    def bound(self, twin: nn.Module):
        """Binds the twin's modules to views of the layer's weights, autocast off (memo casts per layer, as FSDP's
        mixed precision does), and yields the tensors the layer's autograd function must take, in the order of
        `twin.named_parameters()`; puts the twin's own parameter-free modules back on exit."""
        own = dict(twin._modules)
        for part in ("self_attn", "mlp"):  # containers memo computes in place of: nothing may hang on them
            _check_hooks(getattr(self.hf_layer, part), f"model.layers.{self.index}.{part}")
        try:
            with torch.enable_grad():  # in the backward too: a view trains where the tensors it is made of do
                for name in own:
                    if name in _LINEARS and own[name] is None:  # a mixture of experts' layer has no dense MLP
                        continue
                    if name in (*_LINEARS, *MOE_MODULES) or (name in _NORMS and own[name] is not None):
                        twin._modules[name] = self._view(name)
            with torch.autocast(next(self.hf_layer.parameters()).device.type, enabled=False):
                yield [p for _, p in twin.named_parameters()]
        finally:
            twin._modules.update(own)

    def _view(self, name: str) -> nn.Module:
        module = active_module(self.hf_layer.get_submodule(self.names[name]))
        if name in _NORMS:
            return self._norm(module, name)
        if name == "router":
            return self._router(module)
        if name == "experts":
            return self._experts(module)
        return self._linear(module, name)

    def _router(self, module: nn.Module) -> nn.Linear:
        """Returns an nn.Linear view of transformers' top-k router (its weight (E, h); it routes as memo does)."""
        self._check_expert_module(module, "router")
        view = nn.Linear(module.weight.shape[1], module.weight.shape[0], bias=False, device="meta")
        view._parameters["weight"] = self._cast(module.weight)
        return view

    def _experts(self, module: nn.Module) -> Experts:
        """Returns memo's Experts over transformers' fused `gate_up_proj` (E, 2f, h), gate rows first, and
        `down_proj` (E, h, f): the gate and up are views of its halves, so their gradients reach it."""
        self._check_expert_module(module, "experts")
        gate_up, down = self._cast(module.gate_up_proj), self._cast(module.down_proj)
        f = down.shape[-1]
        view = Experts(0, 0, 0).to("meta")
        view._parameters.update(gate=gate_up[:, :f], up=gate_up[:, f:], down=down)
        return view

    def _check_expert_module(self, module: nn.Module, name: str) -> None:
        """Raises for a router or experts module memo would not compute as transformers does: adapters on it
        (PEFT's `target_parameters`), hooks, a patched forward, or a sharded weight."""
        where = self.where(name)
        if type(module).__module__.startswith("peft."):
            raise ValueError(
                f"{where} carries PEFT adapters: LoRA on a mixture of experts' router or experts is not built in memo; "
                "target the attention projections"
            )
        if not type(module).__module__.startswith("transformers.models."):
            raise ValueError(f"{where} is a {type(module).__module__}.{type(module).__name__}: memo runs transformers'")
        _check_hooks(module, where)
        if any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{where} is sharded below the decoder layer: under FSDP2 shard each decoder layer as a unit"
            )

    def _cast(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.dtype)  # differentiable under grad: the gradient reaches t

    def _norm(self, module: nn.Module, name: str) -> nn.Module:
        _check_plain(module, name, self.where(name))
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None or getattr(module, "bias", None) is not None:
            raise ValueError(f"{self.where(name)} is a {type(module).__name__}, not an RMSNorm memo runs")
        view = rms_norm_module(module.weight.shape[0], eps, self.norm_offset, device="meta")
        view._parameters["weight"] = self._cast(module.weight)
        return view

    def _linear(self, module: nn.Module, name: str) -> nn.Module:
        adapters = lora_adapters(module, self.where(name))
        if adapters is not None:  # PEFT's mixed-batch `adapter_names` come as hooks on the LoRA layer
            _check_hooks(module, self.where(name))
        base = module.get_base_layer() if adapters is not None else module
        _check_plain(base, name, self.where(name))
        if not adapters:  # a plain projection, or a LoRA layer whose adapters are merged or off
            if self.dtype == base.weight.dtype:
                return base
            view = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            view._parameters.update(weight=self._cast(base.weight), bias=self._cast(base.bias))
            return view
        return self._low_rank(module, base, adapters, name)

    def _low_rank(self, module, base: nn.Linear, adapters: list[str], name: str) -> LoraLinear:
        """Returns one LoraLinear for the active adapters: A stacked (Σ r, in) with each scale folded in, B side by
        side (out, Σ r), so s·B·A summed over adapters is one product; `lora_B` biases join the base bias."""
        scales = [module.scaling[a] for a in adapters]
        drops = {_dropout(module, a) for a in adapters}
        if len(drops) > 1:
            raise ValueError(
                f"{self.where(name)}: active adapters {', '.join(adapters)} have different lora_dropout "
                f"({sorted(drops)}); memo draws one dropout mask per projection: give them one value"
            )
        a = [module.lora_A[n].weight for n in adapters]
        b = [module.lora_B[n].weight for n in adapters]
        one = len(adapters) == 1
        lora_a = self._cast(a[0]) if one else torch.cat([self._cast(w) * s for w, s in zip(a, scales)])
        lora_b = self._cast(b[0]) if one else torch.cat([self._cast(w) for w in b], dim=1)
        bias = self._cast(base.bias)
        for n, s in zip(adapters, scales):
            if module.lora_B[n].bias is not None:
                extra = self._cast(module.lora_B[n].bias) * s
                bias = extra if bias is None else bias + extra
        tensors = dict(weight=self._cast(base.weight), bias=bias, lora_A=lora_a, lora_B=lora_b)
        dropout = drops.pop()
        key = adapter_key(self.key, self.index, name) if dropout > 0 else None
        return LoraLinear.view(tensors, scales[0] if one else 1.0, dropout, key)


def lora_adapters(module: nn.Module, where: str) -> list[str] | None:
    """Returns the adapters of a PEFT LoRA layer (at `where`) that its forward would apply ([] when merged or
    disabled), None for a module that is not a PEFT tuner layer; raises for a tuner layer memo cannot run exactly."""
    try:
        from peft.tuners.lora import Linear as PeftLoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    if not isinstance(module, BaseTunerLayer):
        return None
    if type(module) is not PeftLoraLinear:
        raise ValueError(f"{where} is a PEFT {type(module).__name__}: memo runs plain LoRA (peft.tuners.lora.Linear)")
    if module.fan_in_fan_out:
        raise ValueError(f"{where} has fan_in_fan_out=True: memo runs nn.Linear bases")
    if module.disable_adapters:
        if module.merged:
            raise ValueError(f"{where} has adapters merged and disabled: unmerge them (model.unmerge_adapter())")
        return []
    if module.merged:
        return []
    active = [a for a in module.active_adapters if a in module.lora_A]
    variants = [a for a in active if a in getattr(module, "lora_variant", {})]
    if variants:
        kind = type(module.lora_variant[variants[0]]).__name__
        raise ValueError(
            f"{where}: adapter {variants[0]!r} is a LoRA variant ({kind}, e.g. DoRA): memo runs plain LoRA"
        )
    return active


def _dropout(module, adapter: str) -> float:
    """Returns the adapter's dropout probability as its forward applies it: an nn.Dropout in training mode."""
    drop = module.lora_dropout[adapter]
    return float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0


def active_module(module: nn.Module) -> nn.Module:
    """Returns the module a PEFT `modules_to_save` wrapper's forward would run: its active copy, or the original."""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return module
    if not isinstance(module, ModulesToSaveWrapper):
        return module
    active = module.active_adapters
    if module.disable_adapters or not active or any(a not in module.modules_to_save for a in active):
        return module.original_module
    return module.modules_to_save[active[0]]


def _check_plain(module: nn.Module, name: str, where: str) -> None:
    """Raises unless `module` (memo's `name`, at `where`) computes what memo's layer computes in its place: an
    nn.Linear or a transformers RMSNorm with its class's own forward and no hooks (memo never calls it: a hook or a
    patched forward, Liger's for one, would silently not run)."""
    cls = type(module)
    known = isinstance(module, nn.Linear) if name in _LINEARS else cls.__module__.startswith("transformers.models.")
    if not known or (name in _LINEARS and cls.forward is not nn.Linear.forward):
        raise ValueError(f"{where} is a {cls.__module__}.{cls.__name__}: memo runs nn.Linear and transformers' RMSNorm")
    _check_hooks(module, where)
    if type(module.weight).__name__ == "DTensor":
        raise ValueError(f"{where} is sharded below the decoder layer: under FSDP2 shard each decoder layer as a unit")


def _check_hooks(module: nn.Module, where: str) -> None:
    """Raises when `module`, which memo computes itself, has a forward of its own or hooks that would not run."""
    if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        raise ValueError(
            f"{where} has a patched forward or forward hooks (Liger's patches, adapter hooks): memo computes this "
            "module itself and would skip them; remove them or unpatch memo"
        )
    if not type(module).__module__.startswith(("transformers.", "torch.nn.", "peft.")):
        raise ValueError(f"{where} is a {type(module).__module__}.{type(module).__name__}: memo runs transformers' own")
