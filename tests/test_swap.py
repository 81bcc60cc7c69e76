import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.swap import HostPool, pack_layout


def _run(policy, batch=2, seq=40, preset="tiny"):
    model = Transformer(ModelConfig.preset(preset), policy)
    ids = torch.randint(0, 256, (batch, seq))
    model(ids, labels=ids).backward()
    return model


def _skeletal_bytes(model, batch, seq):
    specs = model.layers[0].skeletal_specs(batch, seq, torch.float32, "cpu")
    return {
        role: sum(sp.nbytes for sp in specs.values() if sp.role == role) for role in ("input", "attention", "other")
    }


def test_memo_offloads_input_attention_and_alpha_of_the_rest_for_all_but_two_layers():
    batch, seq, alpha = 2, 40, 0.37
    model = _run(ActivationPolicy("memo", alpha=alpha), batch, seq)
    b = _skeletal_bytes(model, batch, seq)
    kept_rows = int(alpha * seq)  # 14 of 40 tokens
    per_layer = b["input"] + b["attention"] + b["other"] * kept_rows // seq
    stats = model.swap_stats()
    assert stats.bytes_offloaded == 2 * per_layer  # 4 layers, the last two stay on device
    assert stats.bytes_prefetched == stats.bytes_offloaded
    assert stats.bytes_recomputed == 2 * b["other"] * (seq - kept_rows) // seq
    assert stats.tokens_recomputed == 2 * batch * (seq - kept_rows)
    assert stats.alphas == [alpha, alpha, 1.0, 1.0]


def test_memo_device_skeletal_memory_is_two_rounding_buffers_whatever_the_depth():
    small = _run(ActivationPolicy("memo", alpha=0.5), preset="tiny").swap_stats()
    deep = Transformer(ModelConfig.preset("tiny", n_layers=8), ActivationPolicy("memo", alpha=0.5))
    ids = torch.randint(0, 256, (2, 40))
    deep(ids, labels=ids).backward()
    assert deep.swap_stats().device_skeletal_bytes == small.device_skeletal_bytes
    keep = _run(ActivationPolicy("none")).swap_stats()
    assert keep.device_skeletal_bytes >= 2 * small.device_skeletal_bytes - 4 * 512 * 12


def test_host_pool_never_exceeds_its_cap_and_is_sized_exactly():
    probe = _run(ActivationPolicy("memo", alpha=0.6))
    need = probe.swap_stats().host_pool_bytes
    model = _run(ActivationPolicy("memo", alpha=0.6, host_budget_bytes=need))
    stats = model.swap_stats()
    assert stats.host_pool_bytes == need
    assert 0 < stats.host_pool_peak <= need
    assert model.store.pool.in_use == 0  # every slot was prefetched back


def test_too_small_host_budget_fails_before_any_layer_runs():
    need = _run(ActivationPolicy("memo", alpha=0.6)).swap_stats().host_pool_bytes
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.6, host_budget_bytes=need - 1))
    calls = []
    model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 256, (2, 40))
    with pytest.raises(ValueError, match=r"pinned host pool needs .* but the host budget is .*lower `--alpha`"):
        model(ids, labels=ids)
    assert calls == []


def test_host_pool_refuses_to_hold_more_than_its_cap():
    pool = HostPool(1024, cap=1024, device=torch.device("cpu"))
    pool.occupy(1000)
    with pytest.raises(RuntimeError, match="over its cap"):
        pool.occupy(25)


def test_solved_alpha_respects_the_host_budget():
    batch, seq = 2, 40
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo"))
    b = _skeletal_bytes(model, batch, seq)
    fixed = b["input"] + b["attention"]
    budget = 2 * (fixed + b["other"] // 4)  # room for alpha = 0.25 on the two offloaded layers
    model = _run(ActivationPolicy("memo", host_budget_bytes=budget), batch, seq)
    alpha = model.swap_stats().alphas[0]
    assert 0.0 <= alpha <= 0.25 + 1e-9
    assert model.swap_stats().host_pool_bytes <= budget


def test_host_budget_that_cannot_hold_inputs_and_attention_is_an_error():
    with pytest.raises(ValueError, match="host memory cannot hold the offload"):
        _run(ActivationPolicy("memo", host_budget_bytes=1000))


def test_second_forward_before_backward_is_refused_at_backward():
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5))
    ids = torch.randint(0, 256, (1, 16))
    first = model(ids, labels=ids)
    model(ids, labels=ids)
    with pytest.raises(RuntimeError, match="one forward per backward"):
        first.backward()


def test_shape_change_resizes_buffers_and_stays_exact():
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5))
    for seq in (16, 24, 16):
        ids = torch.randint(0, 256, (1, seq))
        model(ids, labels=ids).backward()
        assert model.swap_stats().bytes_offloaded > 0


def test_pack_layout_aligns_every_tensor():
    model = Transformer(ModelConfig.preset("tiny"))
    specs = model.layers[0].skeletal_specs(1, 7, torch.float32, "cpu")
    offsets, total = pack_layout(specs)
    assert all(o % 512 == 0 for o in offsets.values())
    assert total >= sum(sp.nbytes for sp in specs.values())


def test_gpt_7b_at_one_million_tokens_runs_on_meta_without_memory():
    with torch.device("meta"):
        model = Transformer(
            ModelConfig.preset("gpt-7b"), ActivationPolicy("memo", alpha=0.5, host_budget_bytes=1 << 42)
        )
    model.to(torch.bfloat16)
    ids = torch.zeros(1, 1 << 20, dtype=torch.long, device="meta")
    model(ids, labels=ids).backward()
    stats = model.swap_stats()
    h, s = 4096, 1 << 20
    # per layer: 16·b·s·h bf16 (docs/method.md §2) + LSE + two norms' (mean, rstd) in fp32, 512 B-rounded
    assert stats.device_skeletal_bytes == pytest.approx(2 * (16 * s * h * 2 + 32 * s * 4 + 2 * 2 * s * 4), rel=1e-6)
    assert model.layers[0].wq.weight.grad.is_meta


def test_offloaded_last_two_layers_are_neither_prefetched_nor_recomputed():
    """Their rounding buffers still hold their tensors at their backward: loading or rebuilding is waste."""
    batch, seq, alpha = 2, 40, 0.37
    model = _run(ActivationPolicy("memo", alpha=alpha, offload_last_layers=True), batch, seq)
    b = _skeletal_bytes(model, batch, seq)
    kept_rows = int(alpha * seq)
    per_layer = b["input"] + b["attention"] + b["other"] * kept_rows // seq
    stats = model.swap_stats()
    assert stats.bytes_offloaded == 4 * per_layer
    assert stats.bytes_prefetched == 2 * per_layer  # layers 0 and 1 only
    assert stats.tokens_recomputed == 2 * batch * (seq - kept_rows)
    assert model.store.pool.in_use == 0
