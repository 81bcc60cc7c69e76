"""Model configurations: one frozen dataclass and a table of named presets."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Literal

from .units import format_count

Arch = Literal["gpt", "llama"]
RopeType = Literal["linear", "dynamic", "yarn", "llama3"]


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched past the length a model was pretrained at (memo/rope.py).

    The fields and their defaults are those of transformers' `rope_scaling` / `rope_parameters`:
    `linear` divides every frequency by `factor`; `dynamic` (NTK) raises the base with the sequence length
    beyond `max_position_embeddings`; `yarn` interpolates the low frequencies only, between `beta_slow` and
    `beta_fast` rotations over `original_max_positions`, and scales attention by `attention_factor`
    (default 0.1·ln(factor) + 1); `llama3` divides the low frequencies by `factor`, keeps the high ones and
    blends between wavelengths `original_max_positions / low_freq_factor` and `/ high_freq_factor`.
    """

    type: RopeType
    factor: float
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ("linear", "dynamic", "yarn", "llama3"):
            raise ValueError(f"`--rope-scaling` must be linear, dynamic, yarn or llama3, got {self.type!r}")
        if not (_is_number(self.factor) and math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"`--rope-factor` must be a finite number >= 1, got {self.factor!r}")
        if self.original_max_positions is not None:
            check_int("original_max_positions", self.original_max_positions)
        elif self.type in ("yarn", "llama3"):
            raise ValueError(
                f"`--original-max-positions` (the pretraining length) is required by {self.type} RoPE scaling"
            )
        for field in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            if getattr(self, field) is not None:
                check_number(field, getattr(self, field))
        check_bool("truncate", self.truncate)
        if self.type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers 5's names of a layer's attention
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # of the llama arch's gated MLP


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    `gpt`: LayerNorm, GeLU, biases everywhere (the paper's models, docs/method.md §8).
    `llama`: RMSNorm, SwiGLU, no biases by default, grouped-query attention: the family of Llama 2/3.x,
    Mistral (`sliding_window`), Qwen2/2.5 (`qkv_bias`), Qwen3 (`qk_norm`, explicit `kv_channels`).
    A sliding window lets a token of a windowed layer see itself and the `sliding_window - 1` tokens before it
    (transformers 5's convention), at any length; `layer_types` says which layers slide, as transformers 5 names
    them ("sliding_attention" or "full_attention"), and None means all of them.
    Gemma 3's text layers are the llama arch with `norm_offset` 1 (every RMSNorm scales by 1 + weight, in fp32, then
    casts), `sandwich_norms` (a norm after attention and after the MLP, before each residual add), a tanh-GELU
    gated MLP (`mlp_activation`), embeddings scaled by √h (`scale_embeddings`), attention scaled by
    `query_pre_attn_scalar`^-½, and `rope_local_theta` the RoPE base of its sliding layers (unscaled).
    A mixture-of-experts model (`n_experts` > 0) routes each token of every layer's MLP (but `dense_layers`', dense
    SwiGLU MLPs of width `ffn_hidden_size`) to `experts_per_token` of `n_experts` SwiGLU experts of width
    `expert_ffn_size`, weighted by the router's softmax (top-k, renormalised
    with `norm_topk_prob`); `router_aux_loss` adds transformers' load-balancing loss times `router_aux_loss_coef`.
    Both use rotary position embeddings: a learned table of 1M positions would cost more than the model.
    Bias flags left None take the arch's default.
    """

    arch: Arch
    n_layers: int
    hidden_size: int
    n_heads: int
    ffn_hidden_size: int
    vocab_size: int
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    name: str = "custom"
    kv_channels: int | None = None  # the per-head width (Megatron's name); None: hidden_size / n_heads
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # the LM head is the token embedding (one parameter)
    max_position_embeddings: int | None = None  # the length the weights are meant for; None: not known
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # attention window of the layers that slide (Mistral, Qwen2)
    layer_types: tuple[str, ...] | None = None  # per layer: "sliding_attention" or "full_attention"; None: all slide
    norm_offset: float = 0.0  # RMSNorm scales by offset + weight (Gemma: 1, computed in fp32, then cast)
    sandwich_norms: bool = False  # a norm on attention's and the MLP's outputs before each residual add (Gemma)
    mlp_activation: str = "silu"  # of the llama arch's gated MLP: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    scale_embeddings: bool = False  # token embeddings times √h, cast to their dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale 1/√this (Gemma); None: 1/√head_dim
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_theta
    n_experts: int = 0  # routed experts of every layer's MLP (Qwen3-MoE, Mixtral); 0: a dense MLP
    experts_per_token: int = 0  # k: the experts each token is routed to (top-k of the router's softmax)
    expert_ffn_size: int | None = None  # each expert's FFN width; None: ffn_hidden_size (Mixtral's convention)
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE's flag)
    router_aux_loss: bool = False  # add transformers' load-balancing loss (its `output_router_logits`)
    router_aux_loss_coef: float = 0.001  # its weight in the loss
    dense_layers: tuple[int, ...] = ()  # of a mixture of experts: the layers whose MLP is dense (ffn_hidden_size wide)
    hf_model_type: str | None = None  # the Hugging Face family it came from / exports as (llama, mistral, qwen2, qwen3)

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"`arch` must be 'gpt' or 'llama', got {self.arch!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for flag in ("qkv_bias", "out_bias", "mlp_bias"):
            if getattr(self, flag) is None:
                object.__setattr__(self, flag, self.arch == "gpt")
        for field in ("layer_types", "dense_layers"):
            if isinstance(getattr(self, field), list):  # from a config file
                object.__setattr__(self, field, tuple(getattr(self, field)))
        if isinstance(self.rope_scaling, dict):  # from a config file
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        self._check_fields()
        self._check_shapes()

    def _check_fields(self) -> None:
        """Raises for a field of the wrong kind or range: files hand over strings, bools and floats as readily."""
        for field in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "ffn_hidden_size", "vocab_size"):
            check_int(field, getattr(self, field), most=MAX_SIZE)
        if self.kv_channels is not None:
            check_int("kv_channels", self.kv_channels, most=MAX_SIZE)
        for field in ("max_position_embeddings", "sliding_window"):
            if getattr(self, field) is not None:
                check_int(field, getattr(self, field))
        for field in ("norm_eps", "rope_theta"):
            check_number(field, getattr(self, field))
        for field in ("query_pre_attn_scalar", "rope_local_theta"):
            if getattr(self, field) is not None:
                check_number(field, getattr(self, field))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"`mlp_activation` must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}"
            )
        check_bool("sandwich_norms", self.sandwich_norms)
        self._check_experts()
        check_bool("scale_embeddings", self.scale_embeddings)
        if not isinstance(self.norm_offset, (int, float)) or isinstance(self.norm_offset, bool):
            raise ValueError(f"`norm_offset` must be a number, got {self.norm_offset!r}")
        for field in ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tie_embeddings"):
            check_bool(field, getattr(self, field))
        if not isinstance(self.name, str) or not isinstance(self.hf_model_type, (str, type(None))):
            raise ValueError(f"`name` and `hf_model_type` must be strings, got {self.name!r}, {self.hf_model_type!r}")
        types = self.layer_types
        if types is not None and (len(types) != self.n_layers or not set(types) <= set(LAYER_TYPES)):
            raise ValueError(f"`layer_types` must give each of the {self.n_layers} layers one of {LAYER_TYPES}")
        if not isinstance(self.rope_scaling, (RopeScaling, type(None))):
            raise ValueError(f"`rope_scaling` must be a mapping of type, factor, ..., got {self.rope_scaling!r}")

    def _check_experts(self) -> None:
        """Raises for a mixture-of-experts field of the wrong kind, or k outside 1..n_experts."""
        check_int("n_experts", self.n_experts, least=0, most=MAX_SIZE)
        if self.expert_ffn_size is not None:
            check_int("expert_ffn_size", self.expert_ffn_size, most=MAX_SIZE)
        check_bool("norm_topk_prob", self.norm_topk_prob)
        check_bool("router_aux_loss", self.router_aux_loss)
        coef = self.router_aux_loss_coef
        if not (_is_number(coef) and math.isfinite(coef) and coef >= 0):
            raise ValueError(f"`router_aux_loss_coef` must be a finite number >= 0, got {coef!r}")
        if self.n_experts:
            check_int("experts_per_token", self.experts_per_token, most=self.n_experts)
            if self.arch == "gpt" or self.mlp_activation != "silu" or self.mlp_bias or self.sandwich_norms:
                raise ValueError("memo's experts are SwiGLU MLPs without biases of the llama arch (Qwen3-MoE, Mixtral)")
        elif self.experts_per_token or self.dense_layers:
            raise ValueError("`experts_per_token` and `dense_layers` are of a mixture of experts: set `n_experts` too")
        dense = self.dense_layers
        if not isinstance(dense, tuple) or len(set(dense)) != len(dense):
            raise ValueError(f"`dense_layers` must list distinct layer indices, got {dense!r}")
        for i in dense:
            check_int("dense_layers", i, least=0, most=self.n_layers - 1)

    def _check_shapes(self) -> None:
        """Raises unless the heads split the hidden size and each other as attention and RoPE need."""
        if self.kv_channels is None and self.hidden_size % self.n_heads:
            raise ValueError(f"`n_heads` ({self.n_heads}) must divide `hidden_size` ({self.hidden_size})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"`n_kv_heads` ({self.n_kv_heads}) must divide `n_heads` ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"the head dimension (`kv_channels`) must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.qk_norm and self.arch == "gpt":
            raise ValueError("`qk_norm` is an RMSNorm of the llama family; the gpt arch has none")
        gemma = self.norm_offset or self.sandwich_norms or self.mlp_activation != "silu" or self.scale_embeddings
        if gemma and self.arch == "gpt":
            raise ValueError("Gemma's norms, gated GELU and embedding scale are of the llama arch, not gpt")
        if self.rope_scaling is not None and self.rope_scaling.type == "dynamic" and not self.max_position_embeddings:
            raise ValueError("dynamic RoPE scaling needs `max_position_embeddings` (where the stretching starts)")

    @property
    def moe(self) -> bool:
        """Whether the model's MLPs are a mixture of experts (all but `dense_layers`)."""
        return self.n_experts > 0

    def sparse(self, layer: int) -> bool:
        """Returns whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe and layer not in self.dense_layers

    @property
    def expert_ffn(self) -> int:
        """Returns each expert's FFN width."""
        return self.expert_ffn_size or self.ffn_hidden_size

    def active_parameters(self) -> int:
        """Returns the parameters a token's forward multiplies by: every parameter of a dense model; of a mixture of
        experts its k experts of each layer, not all of them."""
        n = self.num_parameters()
        if not self.moe:
            return n
        idle = (self.n_experts - self.experts_per_token) * 3 * self.hidden_size * self.expert_ffn
        return n - (self.n_layers - len(self.dense_layers)) * idle

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """Returns the named preset, with any fields replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_parameters(self) -> int:
        """Returns the parameter count (a tied head counted once)."""
        return sum(_param_shapes_numel(self))

    def with_layers(self, n: int) -> "ModelConfig":
        """Returns the same model with `n` layers, of the attention types and MLP kinds of its last `n` (its deepest:
        in Gemma 3's pattern of five sliding layers and one global they hold a global one)."""
        types = None if self.layer_types is None else self.layer_types[-n:]
        dense = tuple(i - (self.n_layers - n) for i in self.dense_layers if i >= self.n_layers - n)
        return dataclasses.replace(self, n_layers=n, layer_types=types, dense_layers=dense)

    def attended(self, seq: int, attended: float) -> float:
        """Returns the mean over layers of the length that stands for s in attention FLOPs (`attended`: s, or packed
        documents' E[Σ d_i²] / s): a windowed layer's share Σ_{i<s} min(i + 1, w) / (s(s + 1)/2) of s, or with
        documents the smaller of that and theirs (cost/flops.py)."""
        return sum(self.layer_attended(i, seq, attended) for i in range(self.n_layers)) / self.n_layers

    def layer_attended(self, layer: int, seq: int, attended: float) -> float:
        """Returns `attended` for layer `layer` (`attended`): less what its window leaves out."""
        w = self.window(layer)
        if w is None or w >= seq:
            return attended
        pairs = w * (w + 1) / 2 + (seq - w) * w
        return min(attended, seq * pairs / (seq * (seq + 1) / 2))

    def window(self, layer: int) -> int | None:
        """Returns the attention window of layer `layer`, None where it attends to every token before it."""
        return self.sliding_window if self.slides(layer) else None

    def slides(self, layer: int) -> bool:
        """Returns whether layer `layer` is a sliding-window layer."""
        types = self.layer_types
        return self.sliding_window is not None and (types is None or types[layer] == "sliding_attention")

    @property
    def attention_scale(self) -> float:
        """Returns the factor of q·k: 1/√query_pre_attn_scalar (Gemma), else 1/√head_dim."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


MAX_SIZE = 1 << 24  # of a model dimension: past any published model's (the largest vocabularies are ~256K)


def check_int(field: str, value, least: int = 1, most: int | None = None) -> int:
    """Returns `value` if it is a whole number in [least, most]: a config file's string, bool or float is not."""
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= (most or value):
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"`{field}` must be {kind}{f' up to {format_count(most)}' if most else ''}, got {value!r}")
    return value


def check_number(field: str, value) -> float:
    """Returns `value` if it is a finite number > 0 (JSON's Infinity and NaN, a string or a bool are not)."""
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"`{field}` must be a finite number > 0, got {value!r}")
    return value


def check_bool(field: str, value) -> bool:
    """Returns `value` if it is true or false (a config file's "false" is a string, and truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{field}` must be true or false, got {value!r}")
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rope_scaling(fields: dict) -> RopeScaling:
    """Returns the RopeScaling of a config file's `rope_scaling` mapping."""
    try:
        return RopeScaling(**fields)
    except TypeError as err:
        raise ValueError(f"`rope_scaling`: {err}") from None


def model_config_from(values: dict, source: str, names: dict[str, str] | None = None) -> ModelConfig:
    """Returns the ModelConfig of a file's fields; its error is one line naming `source` and the field as the file
    spells it (`names`: ModelConfig field -> the file's name, e.g. a Hugging Face config.json's)."""
    fields = dataclasses.fields(ModelConfig)
    unknown = sorted(set(values) - {f.name for f in fields})
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in values]
    try:
        if unknown or missing:
            raise ValueError(
                f"unknown field(s) {unknown}" if unknown else f"lacks required field(s) {', '.join(missing)}"
            )
        return ModelConfig(**values)
    except ValueError as err:
        spelled = re.sub(r"`(\w+)`", lambda m: f"`{(names or {}).get(m.group(1), m.group(1))}`", str(err))
        raise ValueError(f"{source}: {spelled}") from None


def _param_shapes_numel(c: ModelConfig) -> list[int]:
    h, f, d = c.hidden_size, c.ffn_hidden_size, c.head_dim
    q, kv = c.n_heads * d, c.n_kv_heads * d
    attention = h * (q + 2 * kv) + q * h + c.qkv_bias * (q + 2 * kv) + c.out_bias * h + c.qk_norm * 2 * d
    mlp = (2 if c.arch == "gpt" else 3) * h * f + c.mlp_bias * (f + h)
    experts = c.n_experts * h + c.n_experts * 3 * h * c.expert_ffn  # the router and every expert's gate, up, down
    norm = (2 if c.arch == "gpt" else 1) * h
    layer = attention + (4 if c.sandwich_norms else 2) * norm
    layers = c.n_layers * layer + sum(experts if c.sparse(i) else mlp for i in range(c.n_layers))
    return [c.vocab_size * h, layers, norm, 0 if c.tie_embeddings else c.vocab_size * h]


def _gpt(name: str, n_layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(
        arch="gpt",
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=50257,
        name=name,
    )


def _llama3(name: str, n_layers: int, hidden: int, heads: int, ffn: int, factor: float, **kw) -> ModelConfig:
    """Returns a Llama 3.1/3.2 shape: 8 kv heads, 128K vocabulary, θ = 500000, llama3 RoPE scaling from 8K."""
    scaling = RopeScaling("llama3", factor, original_max_positions=8192)
    return ModelConfig(
        arch="llama",
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=128256,
        n_kv_heads=8,
        rope_theta=500000.0,
        name=name,
        max_position_embeddings=131072,
        rope_scaling=scaling,
        hf_model_type="llama",
        **kw,
    )


def _gemma3(name: str, n_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, scalar: int):
    """Returns a Gemma 3 text tower of 4B and up: 262208-token vocabulary, windows of 1024 on five layers of six,
    RoPE θ = 1M scaled linearly by 8 on the global layers and 10K on the sliding ones, tied embeddings."""
    return ModelConfig(
        arch="llama",
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=262_208,
        n_kv_heads=kv_heads,
        norm_eps=1e-6,
        rope_theta=1e6,
        name=name,
        kv_channels=head_dim,
        qk_norm=True,
        tie_embeddings=True,
        max_position_embeddings=131_072,
        rope_scaling=RopeScaling("linear", 8.0),
        sliding_window=1024,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)),
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=scalar,
        rope_local_theta=1e4,
        hf_model_type="gemma3_text",
    )


PRESETS: dict[str, ModelConfig] = {
    # docs/method.md §8 (the paper's table)
    "gpt-7b": _gpt("gpt-7b", 32, 4096, 32),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-30b": _gpt("gpt-30b", 48, 7168, 56),
    "gpt-65b": _gpt("gpt-65b", 80, 8192, 64),
    # published Llama configs
    "llama2-7b": ModelConfig(
        arch="llama",
        n_layers=32,
        hidden_size=4096,
        n_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        n_kv_heads=32,
        name="llama2-7b",
    ),
    "llama3-8b": ModelConfig(
        arch="llama",
        n_layers=32,
        hidden_size=4096,
        n_heads=32,
        ffn_hidden_size=14336,
        vocab_size=128256,
        n_kv_heads=8,
        rope_theta=500000.0,
        name="llama3-8b",
    ),
    # the released checkpoints people extend (their config.json shapes; vocabularies as shipped)
    "llama3.1-8b": _llama3("llama3.1-8b", 32, 4096, 32, 14336, factor=8.0),
    "llama3.2-1b": _llama3("llama3.2-1b", 16, 2048, 32, 8192, factor=32.0, kv_channels=64, tie_embeddings=True),
    "llama3.2-3b": _llama3("llama3.2-3b", 28, 3072, 24, 8192, factor=32.0, kv_channels=128, tie_embeddings=True),
    "qwen2.5-7b": ModelConfig(
        arch="llama",
        n_layers=28,
        hidden_size=3584,
        n_heads=28,
        ffn_hidden_size=18944,
        vocab_size=152064,
        n_kv_heads=4,
        norm_eps=1e-6,
        rope_theta=1e6,
        name="qwen2.5-7b",
        qkv_bias=True,
        max_position_embeddings=131072,
        hf_model_type="qwen2",
    ),
    "qwen3-8b": ModelConfig(
        arch="llama",
        n_layers=36,
        hidden_size=4096,
        n_heads=32,
        ffn_hidden_size=12288,
        vocab_size=151936,
        n_kv_heads=8,
        norm_eps=1e-6,
        rope_theta=1e6,
        name="qwen3-8b",
        kv_channels=128,
        qk_norm=True,
        max_position_embeddings=40960,
        hf_model_type="qwen3",
    ),
    "mistral-7b": ModelConfig(
        arch="llama",
        n_layers=32,
        hidden_size=4096,
        n_heads=32,
        ffn_hidden_size=14336,
        vocab_size=32768,
        n_kv_heads=8,
        rope_theta=1e6,
        name="mistral-7b",
        max_position_embeddings=32768,
        hf_model_type="mistral",
    ),
    # google/gemma-3-{12b,27b}-pt config.json's text_config (shapes, window and RoPE as in Google's MaxText
    # configs/models/gemma3-12b.yml and gemma3-27b.yml; the 27B's query_pre_attn_scalar is 168, not its head dim)
    "gemma3-12b": _gemma3("gemma3-12b", 48, 3840, 16, 8, 256, 15360, 256),
    "gemma3-27b": _gemma3("gemma3-27b", 62, 5376, 32, 16, 128, 21504, 168),
    # mixtures of experts, their config.json shapes: Qwen/Qwen3-30B-A3B (every layer sparse: decoder_sparse_step 1,
    # no mlp_only_layers; intermediate_size 6144 is its dense MLP's, unused; 30.5B total, 3.3B activated) and
    # mistralai/Mixtral-8x7B-v0.1 (no sliding window; 46.7B total, 12.9B active)
    "qwen3-30b-a3b": ModelConfig(
        arch="llama",
        n_layers=48,
        hidden_size=2048,
        n_heads=32,
        ffn_hidden_size=6144,
        vocab_size=151936,
        n_kv_heads=4,
        norm_eps=1e-6,
        rope_theta=1e6,
        name="qwen3-30b-a3b",
        kv_channels=128,
        qk_norm=True,
        max_position_embeddings=40960,
        n_experts=128,
        experts_per_token=8,
        expert_ffn_size=768,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        hf_model_type="qwen3_moe",
    ),
    "mixtral-8x7b": ModelConfig(
        arch="llama",
        n_layers=32,
        hidden_size=4096,
        n_heads=32,
        ffn_hidden_size=14336,
        vocab_size=32000,
        n_kv_heads=8,
        rope_theta=1e6,
        name="mixtral-8x7b",
        max_position_embeddings=32768,
        n_experts=8,
        experts_per_token=2,
        router_aux_loss_coef=0.02,
        hf_model_type="mixtral",
    ),
    # CPU-sized debug presets used by tests and the default training job
    "tiny": ModelConfig(
        arch="llama",
        n_layers=4,
        hidden_size=64,
        n_heads=4,
        ffn_hidden_size=176,
        vocab_size=256,
        n_kv_heads=2,
        name="tiny",
    ),
    "tiny-gpt": ModelConfig(
        arch="gpt", n_layers=4, hidden_size=64, n_heads=4, ffn_hidden_size=256, vocab_size=256, name="tiny-gpt"
    ),
}
