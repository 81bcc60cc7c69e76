"""LoRA adapters out as a PEFT adapter folder: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the transformers model of the base checkpoint.

PEFT names an adapter tensor after the module it adapts, `base_model.model.<HF module>.lora_A.weight` (A is
(r, in), B (out, r), the shapes memo keeps), and its config says rank, alpha and which modules
(`target_modules` by their HF names: q_proj, ..., down_proj). No `peft` import: the folder is plain JSON and
safetensors (tests/test_lora.py loads it with peft itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .files import atomic_folder
from .hf import check_exportable, hf_family, hf_name
from .lora import TARGETS, LoraConfig, adapter_names

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def peft_name(name: str) -> str:
    """Returns PEFT's name of a memo adapter tensor (`layers.3.wq.lora_A` ->
    `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`)."""
    module, kind = name.rsplit(".", 1)
    return f"base_model.model.{hf_name(module + '.weight')[: -len('.weight')]}.{kind}.weight"


def adapter_config(lora: LoraConfig, base: str | None) -> dict:
    """Returns the adapter_config.json of a LoRA run: PEFT's LoraConfig fields for plain LoRA."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(TARGETS[t][1] for t in lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    lora: LoraConfig,
    out: Path,
    base: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the adapters of `weights` (memo names) as a PEFT adapter folder `out`, atomically (an existing folder
    memo did not write only with `overwrite`); returns it. `base` is the checkpoint the adapters apply to
    (recorded as base_model_name_or_path)."""
    check_exportable(config, hf_family(config))  # no transformers model, no PEFT adapter: one line, before writing
    tensors = {}
    for module in adapter_names(weights):
        for kind in ("lora_A", "lora_B"):
            tensors[peft_name(f"{module}.{kind}")] = weights[f"{module}.{kind}"].contiguous()
    if not tensors:
        raise ValueError("the run has no LoRA adapters to export (it trained with `--lora-rank 0`): use `--hf`")
    with atomic_folder(out, overwrite=overwrite) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(adapter_config(lora, base), indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        shutil.copymode(tmp / CONFIG_NAME, tmp / WEIGHTS_NAME)  # a new file's mode, not safetensors' 0600
    return Path(out)
