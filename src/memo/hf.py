"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2, Qwen3, Gemma 3 and the mixtures of experts
Qwen3-MoE and Mixtral, `config.json` + safetensors, no `transformers` import.

Each family's modeling file in transformers fixes what its config fields mean, and `config_from_hf` reads
them the same way: Llama's `attention_bias` covers q/k/v and o_proj, Qwen2 has q/k/v biases and no other,
Mistral none at all; Qwen3 adds a per-head RMSNorm of q and k. Both config layouts are read: transformers
4.x (`rope_theta` and `rope_scaling` at the top) and 5.x (`rope_parameters` holding `rope_type`,
`rope_theta` and the scaling fields). HF applies RoPE with `rotate_half` (first half of the head dim paired
with the second half), the pairing of `layer.rotate`, so q/k weights map one to one with no permutation
(tests/test_hf.py checks all of this against `transformers`). Weights are read with `safetensors` only: a
checkpoint cannot run code.

A mixture of experts' files hold each expert's gate, up and down projection as tensors of their own (what
`save_pretrained` writes and released checkpoints hold; transformers fuses them in memory); memo stacks them
on dim 0, one (E, f, h) or (E, h, f) tensor each (`hf_names`). memo runs MoE models whose every layer is sparse
(tests/test_moe_hf.py checks both families against `transformers`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig, RopeScaling, check_bool, check_int, check_number, model_config_from
from .files import atomic_folder, read_json_object
from .model import Transformer
from .policy import ActivationPolicy

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE_NAME = "chat_template.jinja"  # where transformers >= 4.43 saves a chat template

# model_type -> (architecture, the config class's default max_position_embeddings)
FAMILIES = {
    "llama": ("LlamaForCausalLM", 2048),
    "mistral": ("MistralForCausalLM", 131072),
    "qwen2": ("Qwen2ForCausalLM", 32768),
    "qwen3": ("Qwen3ForCausalLM", 32768),
    "gemma3_text": ("Gemma3ForCausalLM", 131072),
    "qwen3_moe": ("Qwen3MoeForCausalLM", 32768),
    "mixtral": ("MixtralForCausalLM", 131072),
}
GEMMA = "gemma3_text"
MULTIMODAL = {"gemma3": GEMMA}  # a vision-language folder whose text tower memo reads (`text_config`)
# (prefix of the decoder, name of the head) of a `*ForCausalLM` folder's weights, and where a multimodal folder keeps
# its text tower: transformers 5's names, then the released checkpoints'
PLAIN = ("model.", "lm_head.weight")
TEXT_TOWERS = (("model.language_model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"))
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# memo parameter name in a layer -> HF tensor name in `model.layers.i`
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
# Gemma's four norms a layer: its post_attention_layernorm is on attention's output, not before the MLP
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "mlp_norm": "pre_feedforward_layernorm",
    "attn_post_norm": "post_attention_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}


# a mixture-of-experts family -> (its router's module, its experts' module, memo's expert tensor -> the projection
# of each expert `{experts' module}.{e}.{projection}.weight` that is its row e)
MOE_NAMES = {
    "qwen3_moe": ("mlp.gate", "mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}),
}
EXPERTS = "experts"  # memo's module of a layer's stacked experts: one tensor holds E of the file's


def layer_names(family: str) -> dict[str, str]:
    """Returns memo's name -> the module of `family`'s decoder layer (`LAYER_NAMES`, Gemma's its own; a mixture of
    experts' adds its router)."""
    if family in MOE_NAMES:
        return {**LAYER_NAMES, "router": MOE_NAMES[family][0]}
    return GEMMA_LAYER_NAMES if family == GEMMA else LAYER_NAMES


_TOP_NAMES = {
    "embed.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
}

# Special tokens looked up in a tokenizer without a tokenizer_config.json, most common first (Llama 3, Llama 2 /
# Mistral, GPT-2 / Qwen, ChatML).
_SPECIAL_TOKENS = {
    "bos_token": ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>"),
    "eos_token": ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
}


def hf_name(name: str, family: str = "llama", tower: tuple[str, str] = PLAIN) -> str:
    """Returns the HF `*ForCausalLM` tensor name of a memo parameter name (`layers.3.wq.bias` ->
    `model.layers.3.self_attn.q_proj.bias`) in `family`, under a multimodal folder's text `tower` (its prefix and
    its head's name) when given; an expert stack is several (`hf_names`)."""
    prefix, head = tower
    if name == "head.weight":
        return head
    if name in _TOP_NAMES:
        return prefix + _TOP_NAMES[name]
    _, index, module, kind = name.split(".")
    return f"{prefix}layers.{index}.{layer_names(family)[module]}.{kind}"


def hf_names(name: str, config: ModelConfig, tower: tuple[str, str] = PLAIN) -> list[str]:
    """Returns the HF tensor names that hold memo parameter `name` of a model of `config`, in the order of its rows:
    one, or an expert stack's E (`layers.3.experts.gate` -> `model.layers.3.mlp.experts.{0..E-1}.gate_proj.weight`).
    Reading and writing both go by it."""
    family = hf_family(config)
    if not stacked(name):
        return [hf_name(name, family, tower)]
    _, index, _, kind = name.split(".")
    _, experts, projections = MOE_NAMES[family]
    return [f"{tower[0]}layers.{index}.{experts}.{e}.{projections[kind]}.weight" for e in range(config.n_experts)]


def stacked(name: str) -> bool:
    """Returns whether memo parameter `name` stacks one HF tensor per expert on dim 0."""
    return name.split(".")[2:3] == [EXPERTS]


# ModelConfig field -> the config.json field it is read from: errors name the file's
_HF_FIELDS = {
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "kv_channels": "head_dim",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias",
    "out_bias": "attention_bias",
    "n_experts": "num_experts",
    "experts_per_token": "num_experts_per_tok",
    "expert_ffn_size": "moe_intermediate_size",
    "router_aux_loss": "output_router_logits",
}


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"`{field}` = {value!r} is not supported: {why}")


# ---- config.json -> ModelConfig -------------------------------------------------------------------------


def config_from_hf(cfg: dict, name: str = "custom", source: str | os.PathLike = CONFIG_NAME) -> ModelConfig:
    """Returns the ModelConfig of a Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE or Mixtral `config.json` dict
    (either layout); raises a one-line ValueError naming `source` and any field memo cannot run. ModelConfig checks
    the shapes, as it does memo's own model files."""
    try:
        fields = _model_fields(text_config(cfg), name)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    config = model_config_from(fields, str(source), _HF_FIELDS)
    if config.kv_channels is not None and config.kv_channels * config.n_heads == config.hidden_size:
        return dataclasses.replace(config, kv_channels=None)  # the head dim HF derives: not a setting of its own
    return config


def text_config(cfg: dict) -> dict:
    """Returns the config of a multimodal folder's text tower (Gemma 3's `text_config`), else `cfg` itself: the
    outer config's head tie, which is what transformers' multimodal class ties by, and the text config's token ids
    (transformers 5 keeps them there; older folders at the top)."""
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in MULTIMODAL:
        return cfg
    text = cfg.get("text_config") or {}  # absent or empty: every field the text config class's default
    if not isinstance(text, dict):
        raise _unsupported("text_config", text, "it must be the text tower's config")
    tokens = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    tie = cfg.get("tie_word_embeddings", True)  # Gemma3Config's default
    return {**tokens, **text, "model_type": MULTIMODAL[family], "tie_word_embeddings": tie}


def _model_fields(cfg: dict, name: str) -> dict:
    """Returns the ModelConfig fields of a config.json dict, its values as found (ModelConfig checks them)."""
    family = cfg.get("model_type", "llama")
    if not isinstance(family, str) or family not in FAMILIES:
        raise _unsupported("model_type", family, f"memo reads {', '.join([*FAMILIES, *MULTIMODAL])} checkpoints")
    if family == GEMMA:
        return _gemma_fields({**GEMMA_DEFAULTS, **cfg}, name)
    cfg = {**MOE_DEFAULTS.get(family, {}), **cfg}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [f for f in (*required, *MOE_REQUIRED.get(family, ())) if f not in cfg]
    if missing:
        raise ValueError(f"lacks required field(s): {', '.join(missing)}")
    _check_runnable(cfg)
    heads = cfg["num_attention_heads"]
    max_positions = cfg.get("max_position_embeddings") or FAMILIES[family][1]
    qwen3 = family in ("qwen3", "qwen3_moe")  # q/k norm, and the attention bias on o_proj too
    attention_bias = check_bool("attention_bias", cfg.get("attention_bias", False)) and (qwen3 or family == "llama")
    theta, scaling = _rope(cfg, max_positions)
    kv_heads = cfg.get("num_key_value_heads")
    return dict(
        arch="llama",
        n_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        n_heads=heads,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        n_kv_heads=heads if kv_heads is None else kv_heads,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        name=name,
        kv_channels=cfg.get("head_dim", 128 if family == "qwen3" else None),  # Qwen3Config's default
        qkv_bias=attention_bias or family == "qwen2",
        out_bias=attention_bias,
        mlp_bias=check_bool("mlp_bias", cfg.get("mlp_bias", False)) and family == "llama",
        qk_norm=qwen3,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        max_position_embeddings=max_positions,
        rope_scaling=scaling,
        **_windows(cfg, family),
        **(_moe_fields(cfg, family) if family in MOE_NAMES else {}),
        hf_model_type=family,
    )


# Qwen3MoeConfig's and MixtralConfig's defaults (transformers 5.25) where they differ from the dense families'
# (Mixtral's RoPE base, both classes' kv heads) or are their own; the experts' count, k and width are shapes, required
MOE_DEFAULTS = {
    "qwen3_moe": dict(
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    ),
    "mixtral": dict(
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    ),
}
MOE_REQUIRED = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"), "mixtral": ("num_experts_per_tok",)}
SPARSE_ONLY = "memo runs a mixture of experts with at least one sparse layer"


def _moe_fields(cfg: dict, family: str) -> dict:
    """Returns the mixture-of-experts fields of a Qwen3-MoE or Mixtral config (defaults filled), Qwen3-MoE's dense
    layers where `mlp_only_layers` and `decoder_sparse_step` put them; raises for routing noise, which memo's
    recompute could not draw again."""
    dense = _dense_layers(cfg) if family == "qwen3_moe" else ()
    if cfg.get("router_jitter_noise"):
        raise _unsupported("router_jitter_noise", cfg["router_jitter_noise"], "memo routes without training noise")
    experts = _n_experts(cfg)
    if experts == 0:
        raise _unsupported("num_experts", 0, SPARSE_ONLY)
    if len(dense) == cfg["num_hidden_layers"]:
        raise _unsupported("mlp_only_layers", cfg.get("mlp_only_layers"), SPARSE_ONLY)
    width = cfg["moe_intermediate_size"] if family == "qwen3_moe" else cfg["intermediate_size"]
    return dict(
        n_experts=experts,
        experts_per_token=cfg["num_experts_per_tok"],
        expert_ffn_size=None if width == cfg["intermediate_size"] else width,  # not a width of its own
        norm_topk_prob=family == "mixtral" or cfg["norm_topk_prob"],  # Mixtral always renormalises
        router_aux_loss=cfg["output_router_logits"],
        router_aux_loss_coef=cfg["router_aux_loss_coef"],
        dense_layers=dense,
    )


def _dense_layers(cfg: dict) -> tuple[int, ...]:
    """Returns Qwen3-MoE's dense layers as transformers places them: those in `mlp_only_layers`, and those whose
    number (index + 1) `decoder_sparse_step` does not divide."""
    only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise _unsupported("mlp_only_layers", only, "it must list layer indices")
    check_int("decoder_sparse_step", step)
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)


def _n_experts(cfg: dict) -> int:
    """Returns the experts' count: `num_experts` and `num_local_experts` are one field to transformers (an alias),
    Qwen3-MoE's released files spell it the first way, Mixtral's and transformers 5's `save_pretrained` the second."""
    given = [cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None]
    if not given:
        raise ValueError("lacks required field(s): num_experts")
    if given[0] != given[-1]:
        raise _unsupported("num_experts", given[-1], f"it names one field with `num_local_experts` ({given[0]!r})")
    return given[0]


# Gemma3TextConfig's defaults (transformers 5.25), for the fields a saved text_config leaves out
GEMMA_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
GEMMA_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # its global and local RoPE bases


def _gemma_fields(cfg: dict, name: str) -> dict:
    """Returns the ModelConfig fields of a Gemma 3 text config (defaults filled): the llama arch with Gemma's
    norms, GeGLU, embedding and attention scales, sliding layers and their own RoPE base."""
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(field) is not None:
            raise _unsupported(field, cfg[field], "memo does not soft-cap logits or attention scores (Gemma 2)")
    if cfg.get("use_bidirectional_attention"):
        raise _unsupported("use_bidirectional_attention", True, "memo's attention is causal")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise _unsupported("hidden_activation", activation, "memo's Gemma MLP is GeGLU with tanh GELU")
    _check_runnable({**cfg, "hidden_act": "silu", "rope_parameters": None})  # dropout, quantization
    bias = check_bool("attention_bias", cfg["attention_bias"])
    theta, scaling, local = _gemma_rope(cfg, cfg["max_position_embeddings"])
    return dict(
        arch="llama",
        n_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        n_kv_heads=cfg["num_key_value_heads"],
        norm_eps=cfg["rms_norm_eps"],
        rope_theta=theta,
        name=name,
        kv_channels=cfg["head_dim"],
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        tie_embeddings=cfg["tie_word_embeddings"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_scaling=scaling,
        rope_local_theta=local,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        **_windows(cfg, GEMMA),
        hf_model_type=GEMMA,
    )


def _gemma_rope(cfg: dict, max_positions: int) -> tuple[float, RopeScaling | None, float]:
    """Returns (global base, global scaling, local base) of Gemma 3's RoPE: 5.x's `rope_parameters` per layer
    type, or 4.x's `rope_theta`, `rope_scaling` and `rope_local_base_freq`; the sliding layers' is unscaled."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        full = {"rope_theta": GEMMA_THETA["full_attention"], **(params.get("full_attention") or {})}
        local = {"rope_theta": GEMMA_THETA["sliding_attention"], **(params.get("sliding_attention") or {})}
    else:  # 4.x
        full = {"rope_theta": cfg.get("rope_theta", GEMMA_THETA["full_attention"]), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", GEMMA_THETA["sliding_attention"])}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise _unsupported("rope_parameters.sliding_attention", local, "memo scales the global layers' RoPE only")
    theta, scaling = _rope({"rope_parameters": full}, max_positions)
    return theta, scaling, local["rope_theta"]


def _check_runnable(cfg: dict) -> None:
    """Raises for the fields whose values change what the HF model computes in ways memo does not."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _unsupported("hidden_act", cfg["hidden_act"], "memo's MLP is SwiGLU (silu)")
    if cfg.get("attention_dropout", 0.0):
        raise _unsupported("attention_dropout", cfg["attention_dropout"], "memo has no attention dropout")
    if cfg.get("quantization_config"):
        raise _unsupported("quantization_config", cfg["quantization_config"], "memo loads plain weights")
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field) or {}
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise _unsupported(field, rope, "memo runs one RoPE for every layer")
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if factor != 1:
            raise _unsupported("partial_rotary_factor", factor, "memo rotates the whole head dimension")


def _rope(cfg: dict, max_positions: int) -> tuple[float, RopeScaling | None]:
    """Returns RoPE's base and scaling as transformers resolves them: `rope_scaling` (4.x) if set, else
    `rope_parameters` (5.x); their `rope_theta` over the top-level one; `rope_type` over the older `type`."""
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(field) or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _unsupported(f"{field}.rope_type", kind, f"memo implements {', '.join(ROPE_TYPES)} RoPE")
    if kind == "default":
        return theta, None
    factor = rope.get("factor")
    # as transformers: a top-level original_max_position_embeddings wins (Phi-3 style), then max_position_embeddings
    original = (
        cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_positions
    )
    fields = {}
    try:
        if kind == "yarn":
            factor = _yarn_factor(max_positions, original) if factor is None else factor
            fields = dict(
                beta_fast=rope.get("beta_fast") or 32.0,
                beta_slow=rope.get("beta_slow") or 1.0,
                attention_factor=_yarn_attention_factor(rope, factor),
                truncate=rope.get("truncate", True),
            )
        elif kind == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if key not in rope:
                    raise ValueError(f"it lacks `{key}`, which llama3 RoPE scaling needs")
            fields = dict(low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"])
        if kind in ("yarn", "llama3"):
            fields["original_max_positions"] = original
        return theta, RopeScaling(kind, factor, **fields)
    except ValueError as err:
        raise ValueError(f"`{field}` = {rope!r} is not supported: {err}") from None


def _yarn_factor(max_positions, original) -> float:
    """Returns YaRN's factor when the config gives none, as transformers derives it: the stretch of the length."""
    return check_int("max_position_embeddings", max_positions) / check_int("original_max_position_embeddings", original)


def _yarn_attention_factor(rope: dict, factor: float) -> float | None:
    """Returns YaRN's attention factor: given, or from `mscale` / `mscale_all_dim` as transformers derives it
    (None: RopeScaling's default, 0.1·ln(factor) + 1)."""
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and all_dim):
        return None
    mscale, all_dim = (check_number(f, rope[f]) for f in ("mscale", "mscale_all_dim"))
    factor = check_number("factor", factor)

    def get_mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    return get_mscale(mscale) / get_mscale(all_dim)


def _windows(cfg: dict, family: str) -> dict:
    """Returns `sliding_window` and `layer_types` of the config as transformers 5 reads the family's: Mistral slides
    every layer (by 4096 tokens unless it says), Qwen2/3 the layers `layer_types` names when `use_sliding_window`,
    by default those from `max_window_layers` on; no window when no layer slides, no types when all do."""
    if family == "llama":
        return {"sliding_window": None, "layer_types": None}
    if family == "mistral":
        return {"sliding_window": cfg.get("sliding_window", 4096), "layer_types": None}
    if family in MOE_NAMES:
        return _moe_window(cfg, family)
    gemma = family == GEMMA
    window = (
        cfg.get("sliding_window", 4096)
        if gemma or check_bool("use_sliding_window", cfg.get("use_sliding_window", False))
        else None
    )
    layers = check_int("num_hidden_layers", cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and gemma:  # Gemma 3's rule: every `sliding_window_pattern`-th layer is global
        pattern = check_int("sliding_window_pattern", cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if types is None:  # the Qwen2/3 rule: layers from max_window_layers on slide
        first = check_int("max_window_layers", cfg.get("max_window_layers", 28), 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise _unsupported("layer_types", types, "it must be a list of each layer's attention type")
    unknown = sorted(set(types) - {"full_attention", "attention", "sliding_attention"})
    if unknown:
        raise _unsupported("layer_types", unknown, "memo runs full or sliding-window attention")
    if len(types) != layers:
        raise _unsupported("layer_types", types, f"it must name the attention of each of the {layers} layers")
    sliding = tuple("sliding_attention" if t == "sliding_attention" else "full_attention" for t in types)
    if window is None or "sliding_attention" not in sliding:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": None if "full_attention" not in sliding else sliding}


def _moe_window(cfg: dict, family: str) -> dict:
    """Returns the window of a Qwen3-MoE or Mixtral config (defaults filled), which transformers 5 gives every layer:
    Mixtral's when set, Qwen3-MoE's under `use_sliding_window`, where a `max_window_layers` that would leave the
    first layers full (as Qwen2/3 read it) is refused: the versions disagree on it."""
    slides = family == "mixtral" or check_bool("use_sliding_window", cfg.get("use_sliding_window", False))
    window = cfg.get("sliding_window") if slides else None
    if window is not None and family == "qwen3_moe" and cfg.get("max_window_layers", 0) != 0:
        raise _unsupported(
            "max_window_layers", cfg["max_window_layers"], "transformers 5 slides every Qwen3-MoE layer, ignoring it"
        )
    return {"sliding_window": window, "layer_types": None}


# ---- ModelConfig -> config.json -------------------------------------------------------------------------


def hf_family(config: ModelConfig) -> str:
    """Returns the HF model_type a config exports as: its `hf_model_type`, else the family whose layers it has
    (of a mixture of experts Qwen3-MoE for q/k norm, else Mixtral; Gemma 3 for its norms, Qwen3 for q/k norm, Qwen2
    for q/k/v-only biases, Mistral for a sliding window, Llama otherwise)."""
    if config.hf_model_type is not None:
        return config.hf_model_type
    if config.moe:
        return "qwen3_moe" if config.qk_norm else "mixtral"
    if config.norm_offset:
        return GEMMA
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias and not config.out_bias and not config.mlp_bias:
        return "qwen2"
    if config.sliding_window is not None and not (config.qkv_bias or config.out_bias or config.mlp_bias):
        return "mistral"
    return "llama"


def check_exportable(config: ModelConfig, family: str) -> None:
    """Raises unless transformers' `family` has exactly the layers of `config`."""
    if config.arch != "llama":
        raise ValueError(f"only arch 'llama' converts to Hugging Face, got {config.arch!r} (model {config.name!r})")
    if family not in FAMILIES:
        raise ValueError(f"`hf_model_type` must be one of {', '.join(FAMILIES)}, got {family!r}")
    has = {field: getattr(config, field) for field in ("qkv_bias", "out_bias", "mlp_bias", "qk_norm")}
    holds = {  # what each family's layers have; None: either, set by its config
        "llama": {"qkv_bias": None, "out_bias": "qkv_bias", "mlp_bias": None, "qk_norm": False},
        "mistral": {"qkv_bias": False, "out_bias": False, "mlp_bias": False, "qk_norm": False},
        "qwen2": {"qkv_bias": True, "out_bias": False, "mlp_bias": False, "qk_norm": False},
        "qwen3": {"qkv_bias": None, "out_bias": "qkv_bias", "mlp_bias": False, "qk_norm": True},
        GEMMA: {"qkv_bias": None, "out_bias": "qkv_bias", "mlp_bias": False, "qk_norm": True},
        "qwen3_moe": {"qkv_bias": None, "out_bias": "qkv_bias", "mlp_bias": False, "qk_norm": True},
        "mixtral": {"qkv_bias": False, "out_bias": False, "mlp_bias": False, "qk_norm": False},
    }[family]
    for field, want in holds.items():
        want = has[want] if isinstance(want, str) else want
        if want is not None and has[field] != want:
            raise ValueError(
                f"Hugging Face {family} needs `{field}` {want}, the model has {has[field]}: "
                "set `hf_model_type` to the family that has its layers (llama, mistral, qwen2, qwen3, qwen3_moe, "
                "mixtral)"
            )
    gemma = (config.norm_offset, config.sandwich_norms, config.mlp_activation, config.scale_embeddings)
    if (family == GEMMA) != (gemma == (1.0, True, "gelu_tanh", True)):
        raise ValueError(
            f"Hugging Face {family} {'has' if family == GEMMA else 'lacks'} Gemma's norms (1 + weight, one after "
            "attention and after the MLP), tanh-GELU MLP and embedding scale; the model "
            f"{'lacks some' if family == GEMMA else 'has some'}: set `hf_model_type` to the family that has its layers"
        )
    if family == "llama" and config.sliding_window is not None:
        raise ValueError("Hugging Face llama has no `sliding_window`: set `hf_model_type` to mistral, qwen2 or qwen3")
    if family in ("mistral", *MOE_NAMES) and config.layer_types is not None and config.sliding_window is not None:
        raise ValueError(f"Hugging Face {family} slides every layer: `layer_types` needs qwen2 or qwen3")
    _check_moe_exportable(config, family)
    if family == "llama" and config.hidden_size % config.n_heads:  # LlamaConfig's own check
        raise ValueError(
            f"Hugging Face llama needs `n_heads` ({config.n_heads}) to divide `hidden_size` ({config.hidden_size})"
        )


def _check_moe_exportable(config: ModelConfig, family: str) -> None:
    """Raises unless `family` routes to experts exactly when `config` does, and renormalises as it does."""
    if (family in MOE_NAMES) != config.moe:
        raise ValueError(
            f"Hugging Face {family} {'routes to experts' if family in MOE_NAMES else 'has dense MLPs'}, "
            f"the model {'has dense MLPs' if family in MOE_NAMES else 'routes to experts'}: set `hf_model_type` to "
            f"{'a dense family (llama, mistral, qwen2, qwen3)' if family in MOE_NAMES else 'qwen3_moe or mixtral'}"
        )
    if family == "mixtral" and not config.norm_topk_prob:
        raise ValueError(
            "Hugging Face mixtral renormalises the top-k routing weights: `norm_topk_prob` off needs qwen3_moe"
        )
    if family == "mixtral" and config.dense_layers:
        raise ValueError("Hugging Face mixtral routes every layer to experts: `dense_layers` needs qwen3_moe")


def _layer_types(config: ModelConfig) -> list[str]:
    """Returns transformers 5's `layer_types` of a config: each layer's attention."""
    return ["sliding_attention" if config.slides(i) else "full_attention" for i in range(config.n_layers)]


def _gemma_to_hf(config: ModelConfig, out: dict) -> None:
    """Writes Gemma 3's own fields into `out`: its activation's name, attention scale, window per layer, RoPE per
    layer type (5.x) and its 4.x names, and the soft-capping it runs without."""
    del out["hidden_act"]
    local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
    out.update(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=config.qkv_bias,
        query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
        sliding_window=config.sliding_window,
        layer_types=_layer_types(config),
        rope_parameters={
            "full_attention": out["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        rope_local_base_freq=local,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )


def _moe_to_hf(config: ModelConfig, out: dict) -> None:
    """Writes a Qwen3-MoE or Mixtral config's experts into `out`: every layer sparse, Mixtral's expert width in
    `intermediate_size`, the experts' count under the name each family's released files use (transformers reads
    either)."""
    out.update(
        num_experts_per_tok=config.experts_per_token,
        output_router_logits=config.router_aux_loss,
        router_aux_loss_coef=config.router_aux_loss_coef,
    )
    if out["model_type"] == "mixtral":
        out.update(intermediate_size=config.expert_ffn, num_local_experts=config.n_experts, router_jitter_noise=0.0)
        return
    out.update(
        num_experts=config.n_experts,
        moe_intermediate_size=config.expert_ffn,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(config.dense_layers),
        use_sliding_window=config.sliding_window is not None,
        sliding_window=config.sliding_window,
    )


def _rope_to_hf(config: ModelConfig) -> dict:
    """Returns the 5.x `rope_parameters` of a config (rope_type, rope_theta and the scaling fields)."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    r = config.rope_scaling
    if r is None:
        return rope
    rope.update(rope_type=r.type, factor=r.factor)
    if r.type in ("yarn", "llama3"):
        rope["original_max_position_embeddings"] = r.original_max_positions
    if r.type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if r.attention_factor is not None:
            rope["attention_factor"] = r.attention_factor
        if not r.truncate:  # written only when off: older readers know no such key and truncate
            rope["truncate"] = False
    return rope


def config_to_hf(
    config: ModelConfig, dtype: torch.dtype, seq_len: int | None = None, token_ids: dict | None = None
) -> dict:
    """Returns the `config.json` dict of `config` as its HF family (`hf_family`).

    RoPE is written in both layouts: `rope_parameters` (what 5.x reads) and top-level `rope_theta` +
    `rope_scaling` (4.x, which 5.x also reads). `max_position_embeddings` is at least the trained `seq_len`
    and the config's, except under dynamic scaling, whose frequencies depend on it: there it stays the config's.
    """
    family = hf_family(config)
    check_exportable(config, family)
    rope, r = _rope_to_hf(config), config.rope_scaling
    if r is not None and r.type == "dynamic":
        max_positions = config.max_position_embeddings
    else:  # YaRN's stretched length too: transformers warns when it is neither that nor the original one
        stretched = round(r.original_max_positions * r.factor) if r is not None and r.type == "yarn" else 0
        max_positions = max(config.max_position_embeddings or 0, seq_len or 0, stretched) or FAMILIES[family][1]
    out = {
        "architectures": [FAMILIES[family][0]],
        "model_type": family,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": max_positions,
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        **{key: (token_ids or {}).get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),  # 4.x's name
    }
    if family in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = config.qkv_bias
    if family == "llama":
        out["mlp_bias"] = config.mlp_bias
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = config.sliding_window
    if family in MOE_NAMES:
        _moe_to_hf(config, out)
    if family == GEMMA:
        _gemma_to_hf(config, out)
    if family in ("qwen2", "qwen3"):
        types = _layer_types(config)
        out.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window)
        out["max_window_layers"] = next((i for i, t in enumerate(types) if t == "sliding_attention"), config.n_layers)
        out["layer_types"] = types
    return out


# ---- tokenizer ------------------------------------------------------------------------------------------


def tokenizer_file(tokenizer: str | os.PathLike) -> Path:
    """Returns the tokenizer.json of a path that is one or a folder holding one."""
    path = Path(tokenizer)
    path = path / TOKENIZER_NAMES[0] if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} does not exist")
    return path


def config_token_ids(model: str | os.PathLike) -> dict[str, int | None]:
    """Returns the bos/eos/pad ids that a Hugging Face folder's config.json names ({} for anything else: a preset,
    a config file, a folder that is gone)."""
    path = Path(model) / CONFIG_NAME
    if not str(model) or not path.is_file():
        return {}
    cfg = text_config(read_json_object(path))
    return {key: cfg.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def special_token_ids(tokenizer: str | os.PathLike) -> dict[str, int | None]:
    """Returns {bos,eos,pad}_token_id of a HF tokenizer.json: the tokens its tokenizer_config.json or
    special_tokens_map.json names, else the first of the usual ones it has; None when there is none."""
    from tokenizers import Tokenizer

    path = tokenizer_file(tokenizer)
    vocab = Tokenizer.from_file(str(path))
    named = {}
    for side in reversed(TOKENIZER_NAMES[1:]):  # tokenizer_config.json wins
        if (path.parent / side).is_file():
            named.update(read_json_object(path.parent / side))
    ids = {}
    for key, usual in _SPECIAL_TOKENS.items():
        if key in named:
            token = named[key]["content"] if isinstance(named[key], dict) else named[key]
            ids[key + "_id"] = None if token is None else vocab.token_to_id(token)
        else:
            ids[key + "_id"] = next((i for i in map(vocab.token_to_id, usual) if i is not None), None)
    return ids


# ---- reading ------------------------------------------------------------------------------------------


def _text_tower(path: Path, files: dict[str, Path]) -> tuple[str, str]:
    """Returns (prefix, head name) of the text tower a multimodal folder's weights (`files`) hold (`TEXT_TOWERS`)."""
    for prefix, head in TEXT_TOWERS:
        if prefix + "embed_tokens.weight" in files:
            return prefix, head
    raise ValueError(f"{path}: no text tower's embedding under {' or '.join(p for p, _ in TEXT_TOWERS)}")


def _weight_files(path: Path) -> dict[str, Path]:
    """Returns HF tensor name -> the safetensors file holding it (single file preferred, as HF does)."""
    single = path / WEIGHTS_NAME
    if single.is_file():
        with _opened(single) as f:
            return {name: single for name in f.keys()}
    index = path / INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (only safetensors load)")
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: expected a `weight_map` object of tensor name: file")
    files = {name: _shard(index, file) for name, file in weight_map.items()}
    for file in set(files.values()):
        if not file.is_file():
            raise ValueError(f"{index} names a shard that is missing: {file}")
    return files


def _shard(index: Path, file) -> Path:
    """Returns the path of a shard an index names: a file name in the checkpoint's folder, never a path that
    leads out of it (an index is data from whoever published the checkpoint)."""
    if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
        raise ValueError(f"{index}: shard {file!r} is not a file in the checkpoint folder")
    return index.parent / file


@contextmanager
def _opened(file: Path) -> Iterator:
    """Yields the safetensors file open for reading; safetensors' own errors (a truncated file, a bad header, a
    tensor it does not hold) become a ValueError naming the file."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{file}: safetensors cannot read it: {err}") from None


def _read_state_dict(
    path: Path,
    files: dict[str, Path],
    names: dict[str, list[str]],
    shapes: dict,
    tied: bool,
    tower: tuple[str, str] | None,
) -> dict[str, torch.Tensor]:
    """Returns memo name -> tensor read from the checkpoint's `files` (`_weight_files`), one shard at a time, each
    the stack of its HF tensors `names` (`hf_names`) once all are read; checks that the tensor names match exactly
    (those of a multimodal folder's text `tower` only) and that each tensor has the shape `shapes` says and a
    floating-point dtype."""
    if tower is not None:
        files = {n: f for n, f in files.items() if n.startswith(tower[0]) or n == tower[1]}
    head = (tower or PLAIN)[1]
    # Old checkpoints stored RoPE's inv_freq buffer; it is recomputed from the config. A tied head is the
    # embedding, whether or not the file also holds a copy.
    present = {n for n in files if not n.endswith("rotary_emb.inv_freq") and not (tied and n == head)}
    wanted = {theirs for group in names.values() for theirs in group}
    missing, unexpected = sorted(wanted - present), sorted(present - wanted)
    if missing or unexpected:
        raise ValueError(
            f"{path}: the tensors do not match {CONFIG_NAME}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    by_file: dict[Path, list[tuple[str, int]]] = {}  # shard -> (memo name, row) of each HF tensor it holds
    for ours, group in names.items():
        for row, theirs in enumerate(group):
            by_file.setdefault(files[theirs], []).append((ours, row))
    state, rows = {}, {}
    for file, parts in by_file.items():
        with _opened(file) as f:
            for ours, row in parts:
                theirs, shape = names[ours][row], shapes[ours][1:] if stacked(ours) else shapes[ours]
                rows.setdefault(ours, {})[row] = _checked(f.get_tensor(theirs), file, theirs, shape)
                if len(rows[ours]) == len(names[ours]):  # whole: held once, not as pieces too
                    state[ours] = _joined(ours, rows.pop(ours))
    return state


def _joined(name: str, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """Returns memo's tensor `name` of its HF tensors by row: an expert stack's stacked on dim 0, else the one."""
    return torch.stack([rows[i] for i in range(len(rows))]) if stacked(name) else rows[0]


def _checked(tensor: torch.Tensor, file: Path, name: str, shape: torch.Size) -> torch.Tensor:
    """Returns `tensor` if it is a weight of `shape`: integer or boolean data would be cast to floats silently."""
    if tensor.shape != shape:
        raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{file}: {name} has dtype {str(tensor.dtype).removeprefix('torch.')}, not floating point")
    return tensor


def from_hf(
    path: str | os.PathLike,
    policy: ActivationPolicy | None = None,
    dtype: torch.dtype | None = None,
    config: ModelConfig | None = None,
) -> Transformer:
    """Returns a memo.Transformer holding a local HF Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), Qwen3-MoE or Mixtral
    checkpoint (`save_pretrained` layout, one or several safetensors files).

    `dtype` None keeps the stored dtype (the embedding's, if the file mixes them). Tied embeddings stay tied:
    one parameter, the embedding, is also the LM head. `config` replaces the folder's own (the same shapes
    with other RoPE settings: context extension).
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
    raw = read_json_object(config_file)
    config = config or config_from_hf(raw, path.name or "custom", config_file)
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = Transformer(config, policy)
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    files = _weight_files(path)
    tower = _text_tower(path, files) if text_config(raw) is not raw else None
    names = {name: hf_names(name, config, tower or PLAIN) for name in shapes}
    state = _read_state_dict(path, files, names, shapes, config.tie_embeddings, tower)
    dtype = dtype or state["embed.weight"].dtype  # one dtype throughout, even if the file mixes them
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()}, assign=True)
    return model


# ---- writing ------------------------------------------------------------------------------------------


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raises unless `weights` are exactly the parameters, by name and shape, of a model of `config`."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(config).state_dict().items()}
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    wrong = sorted(n for n in set(shapes) & set(weights) if weights[n].shape != shapes[n])
    if missing or unexpected or wrong:
        raise ValueError(
            f"the weights do not fit model {config.name!r}: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"other shapes {wrong[:5]}"
        )


def save_hf(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    path: str | os.PathLike,
    seq_len: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    token_ids: dict[str, int | None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes `weights` (memo names) as a HF checkpoint folder that `AutoModelForCausalLM.from_pretrained`
    loads with no missing or unexpected keys; returns `path`.

    The folder holds config.json (`config_to_hf`), generation_config.json, model.safetensors and, given a
    HF `tokenizer` (tokenizer.json or its folder), its tokenizer.json, tokenizer_config.json and
    special_tokens_map.json, whose bos/eos/pad ids the configs name; without one, `token_ids` (those of the
    checkpoint the model came from, `config_token_ids`) are kept. Files are written in a temporary
    folder beside `path` and renamed in, so a crash never leaves a half-written checkpoint: a new `path`
    appears whole; an existing one (empty, an earlier export, or any with `overwrite`: `memo.files`) is
    replaced whole. Modes are those of any new file (0644 and a 0755 folder under the usual umask 022), not
    safetensors' 0600.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file: a Hugging Face checkpoint is a folder, give a folder path")
    _check_weights(config, weights)
    token_ids = special_token_ids(tokenizer) if tokenizer is not None else token_ids or {}
    dtype = weights["embed.weight"].dtype
    hf_config = config_to_hf(config, dtype, seq_len, token_ids)
    tokens = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {"_from_model_config": True, **{k: hf_config[k] for k in tokens}}
    state = {theirs: part for n, t in weights.items() for theirs, part in zip(hf_names(n, config), _parts(n, t))}
    with atomic_folder(path, overwrite=overwrite) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
        (tmp / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        shutil.copymode(tmp / CONFIG_NAME, tmp / WEIGHTS_NAME)
        if tokenizer is not None:  # the file the run trained with, whatever its name, and its folder's companions
            trained = tokenizer_file(tokenizer)
            shutil.copyfile(trained, tmp / TOKENIZER_NAMES[0])  # contents only: the mode is a new file's
            for name in (*TOKENIZER_NAMES[1:], CHAT_TEMPLATE_NAME):
                if (trained.parent / name).is_file():
                    shutil.copyfile(trained.parent / name, tmp / name)
    return path


def _parts(name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Returns the tensors memo's `name` is written as, on the CPU: an expert stack's rows (views, which safetensors
    writes as they are), else itself."""
    tensor = tensor.detach().to("cpu").contiguous()
    return list(tensor.unbind(0)) if stacked(name) else [tensor]


def to_hf(
    model: Transformer,
    path: str | os.PathLike,
    seq_len: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes `model` as a HF checkpoint folder (`save_hf`): `seq_len` is the length it was trained at,
    `tokenizer` the HF tokenizer.json (or its folder) it was trained with; returns `path`. An existing folder
    memo did not write is replaced only with `overwrite`."""
    return save_hf(model.config, model.state_dict(), path, seq_len, tokenizer, overwrite=overwrite)
