"""Logits and gradients of checkpoints loaded with `memo.from_hf` against transformers' own models, for each
family and RoPE type, under one memo strategy: the table in docs/training.md. Random tiny configs, no downloads.

    python benchmarks/hf_parity.py                     # strategy memo, alpha 0.5, fp32, 4 layers, 96 tokens
    python benchmarks/hf_parity.py --strategy full
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo import ActivationPolicy, from_hf  # noqa: E402
from memo.hf import hf_name  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
}
ROPES = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def hf_model(family: str, rope: str):
    """Returns a random transformers model of `family` with `rope` scaling (max_position_embeddings 64)."""
    config_class, extra = FAMILIES[family]
    config = config_class(
        hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=200, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": rope, "rope_theta": 10000.0, **ROPES[rope]}, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 and biases away from 0, so every gradient matters
            p.normal_(1.0 if p.dim() == 1 and p.shape[0] in (64, 32) else 0.0, 0.1 if p.dim() == 1 else 0.05)
    return model


def compare(family: str, rope: str, policy: ActivationPolicy, seq: int) -> tuple[float, float, float]:
    """Returns the max |difference| of logits, of the loss and of any parameter gradient."""
    hf = hf_model(family, rope)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = from_hf(folder, policy=policy)
    ids = torch.randint(0, 200, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = (ours(ids) - hf(ids).logits).abs().max().item()
    loss, ref = ours(ids, labels=ids), hf(ids, labels=ids).loss
    loss.backward()
    ref.backward()
    grads = max((p.grad - hf.get_parameter(hf_name(n)).grad).abs().max().item() for n, p in ours.named_parameters())
    return logits, abs(loss.item() - ref.item()), grads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="memo", choices=["none", "full", "memo"])
    p.add_argument("--seq", type=int, default=96, help="tokens (beyond max_position_embeddings 64: dynamic scales)")
    args = p.parse_args(argv)
    policy = ActivationPolicy(args.strategy, alpha=0.5 if args.strategy == "memo" else None)
    print(f"# memo vs transformers {transformers.__version__}, strategy {args.strategy}, fp32, {args.seq} tokens")
    print("| family | RoPE | max abs Δ logits | abs Δ loss | max abs Δ gradient |")
    print("|---|---|---:|---:|---:|")
    for family in FAMILIES:
        for rope in ROPES:
            logits, loss, grads = compare(family, rope, policy, args.seq)
            print(f"| {family} | {rope} | {logits:.1e} | {loss:.1e} | {grads:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
