"""Attention kernels: the choice follows the kernel a tensor stands for (`meta_kernels`), so a meta trace of a GPU
step has the GPU kernels' shapes (the efficient kernel's padded LSE, flash's native grouped-query heads); and every
kernel's Python path (flash, cuDNN, FlashAttention-4, memory-efficient) gives the reference's output and gradients
through CPU kernels that stand in for CUDA's, alone, in whole models, under the phase planner and when one refuses."""

import dataclasses
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memo import ActivationPolicy, ModelConfig, Transformer, attention
from memo.device import meta_kernels
from memo.documents import Documents
from memo.plan.phases import attach
from memo.reference import ReferenceTransformer

aten = torch.ops.aten


class AttentionCalls(TorchDispatchMode):
    """Records the (q, k) head counts of every attention kernel call, and any head repetition."""

    def __init__(self):
        super().__init__()
        self.heads, self.repeats, self.ops = [], 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if ("_scaled_dot_product" in name or "fa4_attention" in name) and "backward" not in name:
            self.heads.append((args[0].shape[1], args[1].shape[1]))
            self.ops.append(name)
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


# ---- every kernel's Python path, on CPU kernels that mimic CUDA's contracts ----------------------------------
# Each stand-in computes attention in float64 from its own inputs and checks what memo hands it: head counts the
# kernel accepts, causal, no dropout, the scale, and in the backward the very out and LSE (layout and values) its
# forward returned. A mistake in argument order, LSE layout or grouped-query handling fails here.
SCALE = 0.3  # the stand-ins compute with the scale they are given: a wrong one fails the value checks


def _scores(q, k, scale):
    """Returns the causal score matrix in float64, k repeated to q's heads."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.shape[-2]
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))


def _reference(q, k, v, scale):
    """Returns (out, lse (b, h, s)) of causal attention in float64."""
    scores = _scores(q, k, scale)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.softmax(scores, -1) @ v, scores.logsumexp(-1)


def _reference_grads(dout, q, k, v, scale):
    """Returns (dq, dk, dv) in float64 by the textbook backward (dS = P ∘ (dP − rowsum(dP ∘ P))), dk and dv
    summed over each key/value head's query group."""
    group = q.shape[1] // k.shape[1]
    p = torch.softmax(_scores(q, k, scale), -1)
    dout = dout.double()
    kr, vr = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    dp = dout @ vr.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dq, dk, dv = ds @ kr, ds.transpose(-1, -2) @ q.double(), p.transpose(-1, -2) @ dout
    fold = lambda g: g.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _check_saved(q, k, v, out, lse, scale):
    """Asserts that the out and LSE a backward got are those its forward computed for these inputs."""
    ref_out, ref_lse = _reference(q, k, v, scale)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-5)


def _grads_like(dout, q, k, v, scale):
    return tuple(g.to(t.dtype) for g, t in zip(_reference_grads(dout, q, k, v, scale), (q, k, v)))


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # the schema's defaults
    assert (dropout_p, is_causal, return_debug_mask) == (0.0, True, False) and isinstance(scale, float)
    assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
    out, lse = _reference(q, k, v, scale)
    s = q.shape[2]
    empty = q.new_empty(0)
    rng = torch.zeros(2, dtype=torch.uint64)
    return out.to(q.dtype), lse.float(), empty, empty, s, s, rng, empty, empty


def _flash_backward(
    dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
):
    assert (dropout_p, is_causal, max_q, max_k) == (0.0, True, q.shape[2], k.shape[2]) and isinstance(scale, float)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and seed.dtype == torch.uint64
    _check_saved(q, k, v, out, lse, scale)
    return _grads_like(dout, q, k, v, scale)


def _documents(cu: torch.Tensor, tokens: torch.Tensor):
    """Yields each document's tokens (1, h, d_i, d) of a variable-length kernel's (total, h, d) tensors."""
    bounds = cu.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        yield start, stop, [t[start:stop].transpose(0, 1)[None] for t in tokens]


def _flash_varlen(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None, **_):
    assert (dropout_p, is_causal, return_debug_mask) == (0.0, True, False) and isinstance(scale, float)
    assert q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[1] % k.shape[1] == 0
    assert cum_q.dtype == torch.int32 and torch.equal(cum_q, cum_k) and max_q == max_k == int(cum_q.diff().max())
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])  # the varlen kernel's LSE: (h, total)
    for start, stop, (qd, kd, vd) in _documents(cum_q, (q, k, v)):
        doc_out, doc_lse = _reference(qd, kd, vd, scale)
        out[start:stop], lse[:, start:stop] = doc_out[0].transpose(0, 1).to(q.dtype), doc_lse[0]
    rng = torch.zeros(2, dtype=torch.uint64)
    return out, lse, rng, torch.zeros((), dtype=torch.uint64), q.new_empty(0)


def _flash_varlen_backward(
    dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None, **_
):
    assert (dropout_p, is_causal) == (0.0, True) and isinstance(scale, float) and seed.dtype == torch.uint64
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for start, stop, (dd, qd, kd, vd, od) in _documents(cum_q, (dout, q, k, v, out)):
        _check_saved(qd, kd, vd, od, lse[None, :, start:stop], scale)
        for g, got in zip(grads, _grads_like(dd, qd, kd, vd, scale)):
            g[start:stop] = got[0].transpose(0, 1)
    return tuple(grads)


REFUSED_LENGTHS: list[int] = []  # sequence lengths the cuDNN stand-in refuses, as cuDNN refuses a graph
CUDNN_CALLS: list[int] = []


def _cudnn(
    q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    CUDNN_CALLS.append(q.shape[2])
    assert all(t.transpose(1, 2).is_contiguous() for t in (q, k, v)), "cuDNN's graph wants dense (b, s, h, d)"
    if q.shape[2] in REFUSED_LENGTHS:
        raise RuntimeError("cuDNN Frontend error: no engine supports this graph\nmore detail")
    assert attn_bias is None and compute_log_sumexp and (dropout_p, is_causal, return_debug_mask) == (0.0, True, False)
    assert isinstance(scale, float) and q.shape[1] % k.shape[1] == 0
    out, lse = _reference(q, k, v, scale)
    s, empty, seed = q.shape[2], q.new_empty(0), torch.zeros((), dtype=torch.int64)
    return out.to(q.dtype), lse.float().unsqueeze(-1), empty, empty, s, s, seed, seed, empty


def _cudnn_backward(
    dout, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *, scale=None
):
    assert attn_bias is None and (dropout_p, is_causal) == (0.0, True) and isinstance(scale, float)
    assert out.stride() == dout.stride() == q.stride(), "cuDNN checks out and dout against q's layout"
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32 and (max_q, max_k) == (q.shape[2],) * 2
    _check_saved(q, k, v, out, lse.squeeze(-1), scale)
    return _grads_like(dout, q, k, v, scale)


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert attn_bias is None and compute_log_sumexp and (dropout_p, is_causal) == (0.0, True) and scale > 0
    assert q.shape[1] == k.shape[1] == v.shape[1], "the efficient kernel takes equal head counts"
    out, lse = _reference(q, k, v, scale)
    s = q.shape[2]
    padded = torch.full((*q.shape[:2], -(-s // 32) * 32), float("inf"))
    padded[..., :s] = lse
    seed = torch.zeros((), dtype=torch.int64)
    return out.to(q.dtype), padded, seed, seed


def _efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale=None):
    assert bias is None and (dropout_p, list(mask), is_causal) == (0.0, [True, True, True, False], True) and scale > 0
    s = q.shape[2]
    assert q.shape[1] == k.shape[1] and lse.shape == (*q.shape[:2], -(-s // 32) * 32)
    _check_saved(q, k, v, out, lse[..., :s], scale)
    return (*_grads_like(dout, q, k, v, scale), q.new_empty(0))


def _fa4_module():
    """A stand-in for flash_attn.cute.interface: FA4's calling convention, (b, s, h, d) tensors."""

    def fwd(q, k, v, *, softmax_scale, causal, return_lse, out):
        assert causal and return_lse and softmax_scale > 0 and out.shape == q.shape
        ref, lse = _reference(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale)
        out.copy_(ref.transpose(1, 2))
        return out, lse.float(), None, None, None  # as flash-attn-4 4.0.0b36 returns

    def bwd(q, k, v, out, dout, lse, *, softmax_scale, causal):
        assert causal and softmax_scale > 0 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        heads_major = [t.transpose(1, 2) for t in (q, k, v, out, dout)]
        _check_saved(*heads_major[:4], lse, softmax_scale)
        return tuple(g.transpose(1, 2) for g in _grads_like(heads_major[4], *heads_major[:3], softmax_scale))

    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


@pytest.fixture
def cuda_like_attention(monkeypatch):
    """Registers CPU kernels for the CUDA attention ops (and FA4's entry points), as a CUDA build has them."""
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in {
        "_scaled_dot_product_flash_attention": _flash,
        "_scaled_dot_product_flash_attention_backward": _flash_backward,
        "_scaled_dot_product_cudnn_attention": _cudnn,
        "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
        "_scaled_dot_product_efficient_attention": _efficient,
        "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
        "_flash_attention_forward": _flash_varlen,  # packed documents: one variable-length call
        "_flash_attention_backward": _flash_varlen_backward,
    }.items():
        lib.impl(name, fn, "CPU")
    memo_lib = torch.library.Library("memo", "IMPL")
    memo_lib.impl("fa4_attention", attention._fa4_run, "CPU")  # memo's own code, over the stand-in module
    memo_lib.impl("fa4_attention_backward", attention._fa4_run_backward, "CPU")
    monkeypatch.setitem(sys.modules, attention.FA4_MODULE, _fa4_module())
    monkeypatch.setattr(attention, "_refused", {})
    yield
    lib._destroy()
    memo_lib._destroy()


def _qkv(heads: int, kv_heads: int, s: int = 45, d: int = 16):
    """Returns q, k, v as memo holds them: (b, heads, s, d) views of token-major (b, s, heads, d) tensors."""
    return [torch.randn(2, s, h, d).transpose(1, 2) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kernel", attention.KERNELS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_every_kernel_gives_the_reference_output_and_gradients(cuda_like_attention, kernel, heads, kv_heads):
    q, k, v = _qkv(heads, kv_heads)
    assert kernel in attention.available(q.device, q.dtype)
    out, lse, aux = attention.attention_forward(q, k, v, SCALE, kernel)
    assert aux[0] == kernel and lse.shape[-1] == attention.lse_seq_len(q.shape[2], kernel)
    ref_out, ref_lse = _reference(q, k, v, SCALE)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[..., : q.shape[2]].double(), ref_lse, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(q)
    grads = attention.attention_backward(dout, q, k, v, out, lse, aux, SCALE)
    for got, want, t in zip(grads, _reference_grads(dout, q, k, v, SCALE), (q, k, v)):
        assert got.shape == t.shape  # dk, dv on the key/value heads
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", attention.KERNELS)
@pytest.mark.parametrize(
    "preset, policy",
    [
        ("tiny", ActivationPolicy("memo", alpha=0.37, tile_tokens=8, attention_heads=1)),
        ("tiny-gpt", ActivationPolicy("memo", alpha=1.0, plan=("checkpoint", "memo", "keep", "memo"))),
        ("tiny", ActivationPolicy("full", attention_heads=2)),
    ],
)
def test_models_on_every_kernel_match_the_autograd_reference(cuda_like_attention, kernel, preset, policy):
    config = ModelConfig.preset(preset)
    ref = ReferenceTransformer(config)
    for p in ref.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    model = Transformer(config, dataclasses.replace(policy, attention=kernel))
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 29))
    ref_loss = ref(ids, labels=ids)
    ref_loss.backward()
    loss = model(ids, labels=ids)
    loss.backward()
    assert model.attention_report() == kernel
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    expected = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_kernel_that_refuses_a_shape_falls_back_once_and_says_so(cuda_like_attention, caplog, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REFUSED_LENGTHS", [21])
    monkeypatch.setattr(sys.modules[__name__], "CUDNN_CALLS", [])
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5, attention="cudnn"))
    ids = torch.randint(0, 256, (1, 21))
    with caplog.at_level("WARNING", logger="memo.attention"):
        for _ in range(2):
            model(ids, labels=ids).backward()
    assert CUDNN_CALLS == [21]  # refused once: not tried again at that shape, in any layer or step
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        "attention: cudnn refused 4/2 heads of dim 16 x 21 tokens, float32 on cpu (cuDNN Frontend error: no engine "
        "supports this graph); trying the next kernel"
    ]
    assert model.attention_report().startswith("flash (fell back: cudnn: 4/2 heads")
    model(ids[:, :20], labels=ids[:, :20]).backward()  # another length: cuDNN takes it
    assert CUDNN_CALLS[-1] == 20


def test_auto_takes_the_hopper_kernels_first_on_sm90_and_flash_before_them_elsewhere(cuda_like_attention, monkeypatch):
    cpu = torch.device("cpu")
    assert attention.choose("auto", cpu, torch.bfloat16) == "flash"
    monkeypatch.setattr(attention, "_preference", lambda device: ("fa4", "cudnn", "flash", "efficient"))
    assert attention.choose("auto", cpu, torch.bfloat16) == "fa4"
    assert attention.choose("cudnn", cpu, torch.bfloat16) == "cudnn"


def test_a_kernel_that_cannot_run_here_is_one_line_naming_the_flag():
    with pytest.raises(ValueError, match=r"^`--attention cudnn` cannot run on cpu float32 here; kernels that can: "):
        attention.choose("cudnn", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="`--attention` must be one of auto, flash, cudnn, fa4, efficient"):
        ActivationPolicy("memo", attention="fa3")


@pytest.mark.parametrize("kernel, op", [("cudnn", "aten._scaled_dot_product_cudnn_attention"), ("fa4", "memo.fa4")])
def test_meta_traces_of_a_cuda_step_run_the_chosen_kernel(monkeypatch, kernel, op):
    monkeypatch.setattr(attention, "_fa4_installed", lambda: True)
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5, attention=kernel))
    model.to(torch.bfloat16)
    ids = torch.zeros(1, 40, dtype=torch.long, device="meta")
    with meta_kernels("cuda"), AttentionCalls() as calls:
        model(ids, labels=ids).backward()
    assert model.attention_report() == kernel
    assert calls.ops and all(name.startswith(op) for name in calls.ops)


@pytest.mark.parametrize("kernel", ["cudnn", "fa4", "efficient"])
def test_the_phase_planner_plans_and_replays_a_step_on_every_kernel(cuda_like_attention, kernel):
    config, policy = ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5, attention=kernel)
    plain, planned = Transformer(config, policy), Transformer(config, policy)
    planned.load_state_dict(plain.state_dict())
    planner = attach(planned)
    ids = torch.randint(0, 256, (1, 24))
    for _ in range(2):  # the second step runs the planned phases
        for model in (plain, planned):
            model.zero_grad()
            model(ids, labels=ids).backward()
    assert planner.plans and not planner.unplanned
    assert planned.attention_report() == kernel
    for (name, p), q in zip(plain.named_parameters(), planned.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ---- packed documents: every kernel, one variable-length call (CUDA flash) or one call per document ----------
def _packed(heads: int, kv_heads: int):
    """Returns q, k, v of two 45-token sequences and their documents (one-token ones among them, and runs of
    equal-length neighbours, which one kernel call takes as a batch)."""
    lengths = [(7, 1, 1, 1, 20, 15), (15, 15, 15)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return _qkv(heads, kv_heads), Documents.of(positions, 2, 45, "cpu"), lengths


def _packed_reference(q, k, v, dout, lengths):
    """Returns out, lse, dq, dk, dv in float64, each document computed alone by the textbook formulas."""
    found = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, q[..., 0], q, k, v)]
    for row, doc_lengths in enumerate(lengths):
        at = 0
        for n in doc_lengths:
            part = [t[row : row + 1, :, at : at + n] for t in (q, k, v, dout)]
            results = (*_reference(*part[:3], SCALE), *_reference_grads(part[3], *part[:3], SCALE))
            for whole, got in zip(found, results):
                whole[row : row + 1, :, at : at + n] = got
            at += n
    return found


@pytest.mark.parametrize("stand_ins", [True, False], ids=["cuda-stand-ins", "cpu-kernels"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_every_kernel_over_packed_documents_gives_the_masked_reference(request, stand_ins, heads, kv_heads):
    if stand_ins:
        request.getfixturevalue("cuda_like_attention")
    (q, k, v), documents, lengths = _packed(heads, kv_heads)
    dout = torch.randn_like(q)
    want = _packed_reference(q, k, v, dout, lengths)
    for kernel in attention.available(q.device, q.dtype):
        out, lse, aux = attention.attention_forward(q, k, v, SCALE, kernel, documents)
        assert aux[0] == kernel and aux[1] == ("varlen" if stand_ins and kernel == "flash" else "per document")
        assert aux[1] == "varlen" or len(aux[2]) == 5  # calls: 7 | 1, 1, 1 | 20 | 15 and 15, 15, 15
        grads = attention.attention_backward(dout, q, k, v, out, lse, aux, SCALE, documents)
        for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), (out, lse[..., :45], *grads), want):
            where = f"{kernel} {name}"
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("kernel", attention.KERNELS)
def test_models_over_packed_documents_on_every_kernel_match_the_masked_reference(cuda_like_attention, kernel):
    config = ModelConfig.preset("tiny")
    ref = ReferenceTransformer(config)
    for p in ref.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    policy = ActivationPolicy("memo", alpha=0.37, tile_tokens=8, attention_heads=1, attention=kernel)
    model = Transformer(config, policy)
    model.load_state_dict(ref.state_dict())
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in [(3, 1, 25), (12, 17)]])
    ids = torch.randint(0, 256, (2, 29))
    ref(ids, labels=ids, positions=positions).backward()
    model(ids, labels=ids, positions=positions).backward()
    how = "varlen" if kernel == "flash" else "per document"  # the stand-ins offer flash's variable-length call
    assert model.attention_report() == f"{kernel}, {how} over packed documents"
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_auto_runs_packed_documents_in_one_variable_length_call_where_there_is_one(cuda_like_attention, monkeypatch):
    monkeypatch.setattr(attention, "_preference", lambda device: ("fa4", "cudnn", "flash", "efficient"))
    (q, k, v), documents, _ = _packed(4, 2)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    assert attention.attention_forward(q, k, v, SCALE, "auto")[2][0] == "fa4"  # one document per sequence
    assert attention.attention_forward(q, k, v, SCALE, "auto", documents)[2][:2] == ("flash", "varlen")
    assert attention.attention_forward(q, k, v, SCALE, "cudnn", documents)[2][:2] == ("cudnn", "per document")
