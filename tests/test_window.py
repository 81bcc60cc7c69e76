"""Sliding-window attention: the CPU's banded kernel calls against a dense masked reference, the window's edge
(distances w - 1, w, w + 1), packed documents, a layer at 4x its window, and the config that says which layers
slide. Parity with transformers' Mistral and Qwen2 at 4x their window: tests/test_hf.py and tests/test_patch.py."""

from __future__ import annotations

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo import window as band
from memo.attention import attention_backward, attention_forward
from memo.cost.efficiency import published_band
from memo.cost.estimate import Layout, Pricing, estimate
from memo.cost.hardware import GPUS
from memo.documents import Documents
from memo.hf import config_from_hf
from memo.job import Job
from memo.reference import ReferenceTransformer

SCALE = 0.3
H100 = GPUS["H100-SXM"]


def _qkv(b=2, heads=4, kv_heads=2, s=70, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, s, d, generator=g) for n in (heads, kv_heads, kv_heads))


def _reference(q, k, v, visible: torch.Tensor):
    """Returns dense softmax attention over `visible` (s, s) or (b, 1, s, s), k and v repeated to q's heads, with
    autograd: the independent reference."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * SCALE
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def _window_mask(s: int, w: int) -> torch.Tensor:
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return (j <= i) & (j > i - w)


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("w", [20, 16, 1])
def test_banded_blocks_equal_dense_masked_attention_and_its_gradients(monkeypatch, w):
    monkeypatch.setattr(band, "BLOCK", 16)  # 16 does not divide 70: a short last block
    q, k, v = _qkv()
    out, lse, aux = attention_forward(q, k, v, SCALE, window=w)
    assert aux[:2] == ("flash", "band")
    qr, kr, vr = _leaves(q, k, v)
    ref = _reference(qr, kr, vr, _window_mask(q.shape[2], w))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    for got, want in zip(attention_backward(dout, q, k, v, out, lse, aux, SCALE), (qr, kr, vr)):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w", [7, 16])
def test_a_query_sees_the_key_w_minus_1_before_it_and_not_the_one_w_before(monkeypatch, w):
    monkeypatch.setattr(band, "BLOCK", 8)
    q, k, v = _qkv(s=40)
    out, lse, aux = attention_forward(q, k, v, SCALE, window=w)
    i = 33
    dout = torch.zeros_like(out)
    dout[:, :, i] = 1.0  # the gradient of query i's output alone
    _, dk, dv = attention_backward(dout, q, k, v, out, lse, aux, SCALE)
    touched = (dk.abs().sum((0, 1, 3)) > 0) | (dv.abs().sum((0, 1, 3)) > 0)
    assert touched.nonzero().flatten().tolist() == list(range(i - w + 1, i + 1))  # w keys: i - w + 1 .. i


def test_a_window_covering_the_sequence_is_plain_causal_attention():
    q, k, v = _qkv(s=24)
    out, _, aux = attention_forward(q, k, v, SCALE, window=24)
    plain, _, plain_aux = attention_forward(q, k, v, SCALE)
    assert aux == plain_aux == ("flash",)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_packed_documents_slide_within_their_own_document(monkeypatch):
    monkeypatch.setattr(band, "BLOCK", 4)
    b, s, w = 2, 30, 5
    positions = torch.cat([torch.arange(12), torch.arange(18), torch.arange(6), torch.arange(6), torch.arange(18)])
    documents = Documents.of(positions.view(b, s), b, s, torch.device("cpu"))
    q, k, v = _qkv(b=b, s=s)
    out, lse, aux = attention_forward(q, k, v, SCALE, documents=documents, window=w)
    start = positions.view(b, s) == 0
    doc = start.cumsum(1)  # (b, s): which document each token is in
    visible = (doc[:, :, None] == doc[:, None, :]) & _window_mask(s, w)  # (b, s, s)
    qr, kr, vr = _leaves(q, k, v)
    ref = _reference(qr, kr, vr, visible[:, None])
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    grads = attention_backward(dout, q, k, v, out, lse, aux, SCALE, documents)
    for got, want in zip(grads, (qr, kr, vr)):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-5)


GEMMA = dict(  # Gemma 3's arithmetic (its norms, GeGLU, scales, a RoPE base of the sliding layers' own)
    norm_offset=1.0, sandwich_norms=True, mlp_activation="gelu_tanh", scale_embeddings=True, qk_norm=True,
    query_pre_attn_scalar=24, rope_local_theta=50.0,
)  # fmt: skip


def _tiny(**fields) -> ModelConfig:
    return ModelConfig.preset("tiny", n_layers=3, hidden_size=64, n_heads=4, n_kv_heads=2, ffn_hidden_size=96, **fields)


@pytest.mark.parametrize(
    "policy",
    [ActivationPolicy("none"), ActivationPolicy("full"), ActivationPolicy("memo", alpha=0.5, tile_tokens=7)],
    ids=["none", "full", "memo-a0.5-tile7"],
)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_a_model_at_4x_its_window_matches_the_reference_with_the_window_as_a_mask(policy, gemma):
    types = ("sliding_attention", "full_attention", "sliding_attention")
    config = _tiny(sliding_window=8, layer_types=types, **(GEMMA if gemma else {}))
    torch.manual_seed(0)
    ref = ReferenceTransformer(config)
    if gemma:  # norm weights away from 0, where the scale 1 + w hides a dropped offset
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    model = Transformer(config, policy)
    model.load_state_dict(ref.state_dict())
    assert [layer.window for layer in model.layers] == [8, None, 8]
    ids = torch.randint(0, config.vocab_size, (2, 32))
    want = ref(ids, labels=ids)
    want.backward()
    loss = model(ids, labels=ids)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = refs[name].grad
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4 * g.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_layer_types_are_checked_and_read_from_transformers_configs():
    with pytest.raises(ValueError, match="`layer_types` must give each of the 3 layers"):
        _tiny(sliding_window=8, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="`layer_types` must give"):
        _tiny(sliding_window=8, layer_types=("sliding_attention", "chunked_attention", "full_attention"))
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, model_type="qwen2", use_sliding_window=True, sliding_window=16,
    )  # fmt: skip
    assert config_from_hf({**base, "max_window_layers": 1}).layer_types == (
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    )
    assert config_from_hf({**base, "max_window_layers": 0}).layer_types is None  # every layer slides
    none = config_from_hf(base)  # Qwen2Config's default: the layers from the 28th on slide
    assert (none.sliding_window, none.layer_types) == (None, None)
    off = config_from_hf({**base, "use_sliding_window": False, "max_window_layers": 0})
    assert off.sliding_window is None
    with pytest.raises(ValueError, match="`layer_types` .* each of the 3 layers"):
        config_from_hf({**base, "layer_types": ["full_attention"]})  # too short, even with nothing sliding


# ---- the cost model: a window's share of causal attention -----------------------------------------------------


def test_windowed_attention_counts_the_pairs_a_window_leaves_brute_force():
    for seq, w in ((20, 6), (20, 20), (20, 30), (1000, 64)):
        causal = sum(i + 1 for i in range(seq))
        pairs = sum(min(i + 1, w) for i in range(seq))
        assert _tiny(sliding_window=w).attended(seq, seq) == pytest.approx(seq * pairs / causal, rel=1e-12)
    half = _tiny(sliding_window=64, layer_types=("sliding_attention", "full_attention", "full_attention"))
    every = _tiny(sliding_window=64).attended(1000, 1000)
    assert half.attended(1000, 1000) == pytest.approx((every + 2 * 1000) / 3, rel=1e-12)  # a layer in 3
    assert _tiny(sliding_window=64).attended(1000, 40) == 40  # short documents: theirs, the smaller


def test_estimate_times_windowed_attention_at_its_share_and_leaves_memory_as_it_was():
    seq, w = 65536, 4096
    full, windowed = (_tiny(), _tiny(sliding_window=w))
    eff = published_band(H100, full, seq, full.n_heads)  # one efficiency for both: seconds scale with FLOPs
    pricing, layout = Pricing(band=eff), Layout(system="megatron-deepspeed", recompute="full")
    a, b = (estimate(Job(model=m, seq=seq), H100, "megatron-deepspeed", pricing, layout) for m in (full, windowed))
    share = windowed.attended(seq, seq) / seq  # about 2w / s
    assert share == pytest.approx(2 * w / seq, rel=0.04)
    assert b.seconds["attention"] == pytest.approx(share * a.seconds["attention"], rel=1e-12)
    assert b.attention_flops == pytest.approx(share * a.attention_flops, rel=1e-12)
    assert b.seconds["matmul"] == a.seconds["matmul"]
    same = ("model_states", "skeletal_buffers", "transient_peak")  # the windowed kernel's calls fragment otherwise
    assert [b.device_bytes[k] for k in same] == [a.device_bytes[k] for k in same]


def test_a_solved_plan_prices_attention_at_the_mean_of_the_models_sliding_and_full_layers(monkeypatch):
    """The plan problem stands for every layer with one; layer 0, the one timed, may slide where others do not."""
    from memo import swap

    seen = []
    monkeypatch.setattr(swap, "measure_layer_seconds", lambda *_: {"qkv": 1.0, "attention": 1.0, "mlp": 1.0})
    monkeypatch.setattr(swap, "solve_plan", lambda problem, modes: seen.append(problem) or (["memo"] * 3, [0.5] * 3))
    config = _tiny(sliding_window=8, layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    ids = torch.zeros(1, 64, dtype=torch.long)
    Transformer(config, ActivationPolicy("memo", tile_tokens=16))(ids, labels=ids).backward()
    share = config.attended(64, 64) / config.layer_attended(0, 64, 64)
    assert share > 1 and seen[0].attention_seconds == pytest.approx(share)  # the full layer weighs in


def test_a_windowed_layer_under_the_efficient_kernel_keeps_flashs_unpadded_lse():
    """`--attention efficient` pads the LSE the layer sizes to 32 tokens; a windowed call runs flash, whose is s."""
    from memo.device import meta_kernels

    for s in (100, 128):
        with meta_kernels("cuda"), torch.device("meta"):
            model = Transformer(_tiny(sliding_window=16), ActivationPolicy("memo", alpha=0.5, attention="efficient"))
            ids = torch.zeros(1, s, dtype=torch.long)
            model.to(torch.bfloat16)(ids, labels=ids).backward()
        assert model.layers[0].attention_ran == "flash"


def test_estimate_times_windowed_layers_on_flash_and_the_others_on_the_kernel_asked():
    """Each layer's attention time is its FLOPs at its own kernel's published speed for the length of its work:
    the full layers' on cuDNN at s, the windowed layers' on flash at their window's share of s."""
    seq, w = 65536, 4096
    config = _tiny(sliding_window=w, layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    layout = Layout(system="megatron-deepspeed", recompute="full")
    e = estimate(Job(model=config, seq=seq, attention="cudnn"), H100, "megatron-deepspeed", layout=layout)
    assert e.attention_kernel == "cudnn, windowed layers flash"
    heads, rows = config.n_heads, seq
    full = published_band(H100, config, seq, heads, "cudnn", rows=rows, length=seq).mid
    windowed = config.layer_attended(0, seq, seq)
    flash = published_band(H100, config, seq, heads, "flash", rows=rows, length=windowed).mid
    flops = 4 * config.n_heads * config.head_dim * seq * seq / 2  # a full layer's causal forward FLOPs
    share = 2 * windowed / seq  # the two windowed layers' FLOPs, in full layers'
    fwd = flops * (1 / full.attention_forward + share / flash.attention_forward)
    bwd = 2.5 * flops * (1 / full.attention_backward + share / flash.attention_backward)
    assert e.seconds["attention"] == pytest.approx((fwd + bwd) / H100.peak_flops, rel=1e-9)
