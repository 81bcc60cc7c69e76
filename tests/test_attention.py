"""Kernel choice follows the kernel a tensor stands for (`meta_kernels`), so a meta trace of a GPU step
has the GPU kernels' shapes: the efficient kernel's padded LSE, flash's native grouped-query heads."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.device import meta_kernels

aten = torch.ops.aten


class AttentionCalls(TorchDispatchMode):
    """Records the (q, k) head counts of every attention kernel call, and any head repetition."""

    def __init__(self):
        super().__init__()
        self.heads, self.repeats = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "_scaled_dot_product" in name and "backward" not in name:
            self.heads.append((args[0].shape[1], args[1].shape[1]))
        self.repeats += "repeat_interleave" in name or func is aten.index_select.default
        return func(*args, **(kwargs or {}))


def _meta_step(dtype, seq: int, preset: str = "tiny"):
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset(preset), ActivationPolicy("memo", alpha=0.5, host_budget_bytes=1 << 40))
    model.to(dtype)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with meta_kernels("cuda"), AttentionCalls() as calls:
        model(ids, labels=ids).backward()
        lse = model.layers[0].skeletal_specs(1, seq, dtype, "meta")["lse"]
    return lse, calls


@pytest.mark.parametrize("dtype, lse_len", [(torch.float32, 32), (torch.bfloat16, 29)])
def test_meta_trace_of_a_cuda_step_keeps_the_lse_length_of_the_cuda_kernel(dtype, lse_len):
    lse, _ = _meta_step(dtype, 29)  # fp32 runs the efficient kernel, whose LSE is padded to 32 tokens
    assert lse.shape[-1] == lse_len


def test_cuda_flash_takes_grouped_query_heads_without_repeating_them():
    config = ModelConfig.preset("tiny")
    assert config.n_kv_heads < config.n_heads
    _, calls = _meta_step(torch.bfloat16, 64)
    assert calls.heads == [(config.n_heads, config.n_kv_heads)] * config.n_layers
    assert calls.repeats == 0
