"""The norm ops against torch.nn's modules under autograd, and the layer's use of them: statistics kept from
the forward (its backward runs no norm forward) and skeletal tensors written in place."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.layer import DecoderLayer
from memo.norms import norm_backward, norm_forward

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


class Ops(TorchDispatchMode):
    """Records every op call with its positional arguments and its `out=` tensor."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs.get("out")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("kind", [nn.LayerNorm, nn.RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_forward_and_backward_match_torch_nn_under_autograd(kind, dtype):
    torch.manual_seed(0)
    norm = kind(32, eps=1e-5).to(dtype)
    for p in norm.parameters():
        nn.init.normal_(p, mean=1.0, std=0.2)
    x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 7, 32, dtype=dtype)
    norm(x).backward(dy)
    with torch.no_grad():
        y, stats = norm_forward(norm, x)
        dx, grads = norm_backward(norm, dy, x, stats.float())
    torch.testing.assert_close(y, norm(x).detach(), **TOL[dtype])
    torch.testing.assert_close(dx, x.grad, **TOL[dtype])
    for name, g in grads.items():
        torch.testing.assert_close(g, getattr(norm, name).grad, **TOL[dtype], msg=name)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_layer_backward_reuses_the_forward_statistics_instead_of_rerunning_the_norm(preset):
    model = Transformer(ModelConfig.preset(preset), ActivationPolicy("none"))
    ids = torch.randint(0, 256, (1, 16))
    loss = model(ids, labels=ids)
    with Ops() as ops:
        loss.backward()
    names = {str(func) for func, _, _ in ops.calls}
    assert not {"aten.native_layer_norm.default", "memo.rms_norm.default"} & names
    assert not any("rsqrt" in name or "var_mean" in name for name in names)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("rows", [slice(0, 24), slice(9, 24)])
def test_token_local_tensors_are_written_into_their_slots_not_copied(preset, rows):
    layer = DecoderLayer(ModelConfig.preset(preset), 0)
    specs = layer.skeletal_specs(1, 24, torch.float32, "cpu")
    t = {n: torch.randn(sp.shape, dtype=sp.dtype) for n, sp in specs.items()}
    direct = {n for n in ("q", "k", "v", "x1", "gate", "up", "act") if n in t}
    slot = {t[n].untyped_storage().data_ptr(): n for n in t}

    def owner(x):
        return slot.get(x.untyped_storage().data_ptr()) if torch.is_tensor(x) else None

    v = {n: x[:, rows] for n, x in t.items() if n != "lse"}
    with torch.no_grad(), Ops() as ops:
        layer.fill_qkv(v, rows, 24)
        layer.fill_mlp(v)
    copied = {owner(args[0]) for func, args, _ in ops.calls if func is torch.ops.aten.copy_.default}
    written = {owner(out) for _, _, out in ops.calls}
    assert not copied & direct
    assert direct <= written
