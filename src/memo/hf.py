"""Hugging Face Llama checkpoints in and out: `config.json` + safetensors, no `transformers` import.

HF's Llama applies RoPE with `rotate_half` (first half of the head dim paired with the second half), the
same pairing as `layer.rotate`, so q/k weights map one to one with no permutation (tests/test_hf.py checks
this against `transformers`). Weights are read with `safetensors` only: a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .model import Transformer
from .policy import ActivationPolicy

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "wq.weight",
    "self_attn.k_proj.weight": "wk.weight",
    "self_attn.v_proj.weight": "wv.weight",
    "self_attn.o_proj.weight": "wo.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "w_gate.weight",
    "mlp.up_proj.weight": "w_up.weight",
    "mlp.down_proj.weight": "w_down.weight",
}


def hf_names(n_layers: int) -> dict[str, str]:
    """Returns memo parameter name -> HF `LlamaForCausalLM` tensor name."""
    names = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    }
    for i in range(n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for theirs, ours in _LAYER_NAMES.items()})
    return names


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json: `{field}` = {value!r} is not supported: {why}")


def _rope_theta(cfg: dict) -> float:
    """Returns RoPE's base from either layout (4.x: top-level `rope_theta`; 5.x: `rope_parameters`)."""
    theta = cfg.get("rope_theta", 10000.0)
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if rope is None:
            continue
        per_layer = not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values())
        if per_layer or rope.get("rope_type", rope.get("type", "default")) != "default":
            raise _unsupported(field, rope, "memo implements only default RoPE (no scaling or per-layer RoPE)")
        theta = rope.get("rope_theta", theta)
    return float(theta)


def config_from_hf(cfg: dict, name: str = "custom") -> ModelConfig:
    """Returns the ModelConfig of a Llama `config.json` dict; raises ValueError naming any field memo cannot run."""
    if cfg.get("model_type", "llama") != "llama":
        raise _unsupported("model_type", cfg["model_type"], "only Llama checkpoints convert")
    missing = [
        f
        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if f not in cfg
    ]
    if missing:
        raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _unsupported("hidden_act", cfg["hidden_act"], "memo's Llama MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field, False):
            raise _unsupported(field, cfg[field], "memo's Llama layers have no biases")
    if cfg.get("attention_dropout", 0.0):
        raise _unsupported("attention_dropout", cfg["attention_dropout"], "memo has no attention dropout")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        raise _unsupported("head_dim", head_dim, "ModelConfig needs head_dim = hidden_size / num_attention_heads")
    return ModelConfig(
        "llama",
        n_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        n_heads=heads,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        name=name,
    )


def _weight_files(path: Path) -> dict[str, Path]:
    """Returns HF tensor name -> the safetensors file holding it (single file preferred, as HF does)."""
    single = path / WEIGHTS_NAME
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    index = path / INDEX_NAME
    if not index.is_file():
        raise FileNotFoundError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (only safetensors load)")
    files = {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    for file in set(files.values()):
        if not file.is_file():
            raise FileNotFoundError(f"{INDEX_NAME} names a shard that is missing: {file}")
    return files


def _read_state_dict(path: Path, names: dict[str, str], tied: bool) -> dict[str, torch.Tensor]:
    """Returns memo name -> tensor read from the checkpoint, checking that the tensor names match exactly."""
    files = _weight_files(path)
    # Old checkpoints stored RoPE's inv_freq buffer; it is recomputed from rope_theta.
    present = {n for n in files if not n.endswith("rotary_emb.inv_freq")}
    wanted = dict(names)
    if tied and "lm_head.weight" not in present:
        del wanted["head.weight"]  # copied from the embedding below
    missing, unexpected = sorted(set(wanted.values()) - present), sorted(present - set(wanted.values()))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint tensors do not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    by_file: dict[Path, list[str]] = {}
    for ours, theirs in wanted.items():
        by_file.setdefault(files[theirs], []).append(ours)
    state = {}
    for file, ours_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            state.update({ours: f.get_tensor(wanted[ours]) for ours in ours_names})
    if "head.weight" not in state:
        state["head.weight"] = state["embed.weight"].clone()
    return state


def from_hf(
    path: str | os.PathLike, policy: ActivationPolicy | None = None, dtype: torch.dtype | None = None
) -> Transformer:
    """Returns a memo.Transformer holding a local HF Llama checkpoint (`save_pretrained` layout).

    `dtype` None keeps the stored dtype (the embedding's, if the file mixes them). Tied embeddings are copied
    into memo's separate head, so training afterwards updates them independently.
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
    cfg = json.loads(config_file.read_text())
    config = config_from_hf(cfg, name=path.name or "custom")
    names = hf_names(config.n_layers)
    state = _read_state_dict(path, names, tied=bool(cfg.get("tie_word_embeddings", False)))
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = Transformer(config, policy)
    for name, p in model.state_dict().items():
        if state[name].shape != p.shape:
            shape = tuple(state[name].shape)
            raise ValueError(f"{names[name]} has shape {shape}, config.json implies {tuple(p.shape)}")
    dtype = dtype or state["embed.weight"].dtype  # one dtype throughout, even if the file mixes them
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()}, assign=True)
    return model


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    """Returns a `config.json` dict for LlamaForCausalLM (transformers 4.x layout, which 5.x also reads)."""
    if config.arch != "llama":
        raise ValueError(
            f"only arch 'llama' converts to Hugging Face Llama, got {config.arch!r} (model {config.name!r})"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def to_hf(model: Transformer, path: str | os.PathLike) -> None:
    """Writes `config.json` + `model.safetensors` that `AutoModelForCausalLM.from_pretrained(path)` loads.

    Files are written in a temporary directory beside `path` and renamed in, so a crash never leaves a
    half-written checkpoint: a new `path` appears whole, an existing one gets each file replaced whole.
    """
    path = Path(path)
    config = config_to_hf(model.config, model.embed.weight.dtype)
    names = hf_names(model.config.n_layers)
    state = {names[n]: t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()  # not tempfile.mkdtemp: its 0700 mode would stay on the renamed checkpoint
    try:
        save_file(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if not path.exists():
            tmp.rename(path)
            return
        for name in (WEIGHTS_NAME, CONFIG_NAME):  # each file whole; for an instant new weights meet the old config
            os.replace(tmp / name, path / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
