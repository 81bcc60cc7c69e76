"""The activation store: what each mode sends to host, loads back and recomputes, its memory, and its limits."""

import dataclasses

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.plan.trace import trace_iteration
from memo.swap import HostPool, LayerSwap, layer_swaps, make_store, pack_layout, store_layout


def _run(policy, batch=2, seq=40, preset="tiny", n_layers=4):
    model = Transformer(ModelConfig.preset(preset, n_layers=n_layers), policy)
    ids = torch.randint(0, 256, (batch, seq))
    model(ids, labels=ids).backward()
    return model


def _bytes(model, batch, seq, rows=None, role=None, group=None):
    """Returns the bytes of the layer's skeletal tensors of a role and/or group (`rows` token rows of each)."""
    specs = model.layers[0].skeletal_specs(batch, seq, torch.float32, "cpu")
    return sum(
        (sp if rows is None else sp.rows(rows)).nbytes
        for sp in specs.values()
        if (role is None or sp.role == role) and (group is None or sp.group == group)
    )


@pytest.mark.parametrize("tile", [None, 16])
def test_memo_sends_input_attention_and_alpha_rows_and_recomputes_the_rest(tile):
    batch, seq, alpha = 2, 40, 0.37
    model = _run(ActivationPolicy("memo", alpha=alpha, tile_tokens=tile), batch, seq)
    kept = int(alpha * seq)  # 14 of 40 tokens
    whole = _bytes(model, batch, seq, role="input") + _bytes(model, batch, seq, role="attention")
    other = _bytes(model, batch, seq, kept, role="other")  # α rows of q, k, v and the token-local tensors
    local = _bytes(model, batch, seq, kept, group="qkv") + _bytes(model, batch, seq, kept, group="mlp")
    again = _bytes(model, batch, seq, seq - kept, role="other")
    again_local = _bytes(model, batch, seq, seq - kept, group="qkv") + _bytes(model, batch, seq, seq - kept, group="mlp")
    stats = model.swap_stats()
    # layers 0, 1 send everything §3 says. Layers 2, 3 keep their rounding buffers: untiled, their MLP tensors
    # are still in their tile slot at their backward (only n1 runs again); tiled, they send α of their tiles
    if tile is None:
        assert stats.bytes_offloaded == 2 * (whole + other)
        assert stats.bytes_recomputed == 2 * again + 2 * _bytes(model, batch, seq, group="qkv")
        assert stats.alphas == [alpha, alpha, 1.0, 1.0]
    else:
        assert stats.bytes_offloaded == 2 * (whole + other) + 2 * local
        assert stats.bytes_recomputed == 2 * again + 2 * again_local
        assert stats.alphas == [alpha] * 4
    assert stats.bytes_prefetched == stats.bytes_offloaded
    assert stats.tokens_recomputed == 2 * batch * (seq - kept) + 2 * batch * (seq if tile is None else seq - kept)
    assert stats.modes == ["memo"] * 4
    assert model.store.pool.in_use == 0  # every slot came back


def test_checkpointed_layers_send_their_input_alone_and_keep_layers_send_nothing():
    batch, seq = 2, 40
    plan = ("checkpoint", "memo", "keep", "memo", "checkpoint", "keep")
    model = _run(ActivationPolicy("memo", alpha=0.5, plan=plan, tile_tokens=16), batch, seq, n_layers=6)
    layout = model.store.layout
    x = _bytes(model, batch, seq, role="input")
    kept = seq // 2
    whole = x + _bytes(model, batch, seq, role="attention") + _bytes(model, batch, seq, kept, role="other")
    local = _bytes(model, batch, seq, kept, group="qkv") + _bytes(model, batch, seq, kept, group="mlp")
    # layer 0 is overwritten by layer 4 (checkpoint), layer 1 by layer 3; 3 and 4 keep their buffers, and
    # in tiles of 16 rows their token-local tensors do not stay in a tile slot: 3 sends α of them
    sent = [x, whole, 0, local, 0, 0]
    for got, want in zip(layout.host_bytes, sent):  # packed slot by slot, each tensor 512-byte aligned
        assert want <= got < want + 14 * 512 and (got == 0) == (want == 0)
    stats = model.swap_stats()
    assert stats.alphas == [0.0, 0.5, 1.0, 0.5, 0.0, 1.0]
    assert layout.n_keep == 2 and layout.n_buffers == 2
    assert stats.device_skeletal_bytes == layout.device_bytes


def test_memo_device_skeletal_memory_is_two_rounding_buffers_whatever_the_depth():
    small = _run(ActivationPolicy("memo", alpha=0.5)).swap_stats()
    deep = _run(ActivationPolicy("memo", alpha=0.5), n_layers=8).swap_stats()
    assert deep.device_skeletal_bytes == small.device_skeletal_bytes
    keep = _run(ActivationPolicy("none")).swap_stats()
    assert keep.device_skeletal_bytes > 2 * small.device_skeletal_bytes - 4 * 512 * 14


def test_tiles_shrink_the_rounding_buffers_by_the_token_local_tensors():
    batch, seq, tile = 1, 96, 16
    whole = _run(ActivationPolicy("memo", alpha=0.5), batch, seq)
    tiled = _run(ActivationPolicy("memo", alpha=0.5, tile_tokens=tile), batch, seq)
    local = _bytes(whole, batch, seq, group="mlp")  # the larger tile group
    saved = whole.swap_stats().device_skeletal_bytes - tiled.swap_stats().device_skeletal_bytes
    # untiled: one slot of the whole sequence; tiled: two slots of 16 rows
    assert saved == pytest.approx(2 * local * (seq - 2 * tile) / seq, rel=0.02)
    # the last two layers' token-local tensors no longer stay in a whole-sequence slot: they send α of them
    local_rows = _bytes(whole, batch, seq, seq // 2, group="qkv") + _bytes(whole, batch, seq, seq // 2, group="mlp")
    grown = tiled.swap_stats().host_pool_bytes - whole.swap_stats().host_pool_bytes
    assert 0 <= grown - 2 * local_rows < 2 * 14 * 512


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_no_token_local_tensor_or_gradient_is_longer_than_a_tile(preset):
    """Traced on meta: every allocation with the FFN width (the MLP's tensors and gradients) has tile rows."""
    seq, tile = 64, 16
    c = ModelConfig.preset(preset)
    with torch.device("meta"):
        model = Transformer(c, ActivationPolicy("memo", alpha=0.25, tile_tokens=tile))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    model(ids, labels=ids).backward()
    step = trace_iteration(model, ids)
    widths = [e.output.shape for e in step.events if e.kind == "alloc" and e.output is not None]
    ffn = [s for s in widths if len(s) == 3 and s[-1] == c.ffn_hidden_size]
    assert ffn and max(s[1] for s in ffn) == tile
    # the untiled step does build them whole
    with torch.device("meta"):
        whole = Transformer(c, ActivationPolicy("memo", alpha=0.25))
    whole(ids, labels=ids).backward()
    step = trace_iteration(whole, ids)
    assert any(len(e.output.shape) == 3 and e.output.shape[1:] == (seq, c.ffn_hidden_size)
               for e in step.events if e.kind == "alloc" and e.output is not None)


def test_host_pool_never_exceeds_its_cap_and_is_sized_exactly():
    probe = _run(ActivationPolicy("memo", alpha=0.6))
    need = probe.swap_stats().host_pool_bytes
    model = _run(ActivationPolicy("memo", alpha=0.6, host_budget_bytes=need))
    stats = model.swap_stats()
    assert stats.host_pool_bytes == need == model.store.layout.host_total
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


def test_solved_plan_spends_a_short_host_budget_on_alpha_or_checkpoints():
    batch, seq = 2, 40
    probe = _run(ActivationPolicy("memo", alpha=0.0), batch, seq)
    at_zero = probe.swap_stats().host_pool_bytes
    model = _run(ActivationPolicy("memo", host_budget_bytes=at_zero + 8 * 512), batch, seq)
    stats = model.swap_stats()
    assert stats.host_pool_bytes <= at_zero + 8 * 512
    # the layers that send (0, 1) get little α; 2 and 3 keep their tensors in their buffers and tile slots
    assert all(a <= 0.05 for a, m in zip(stats.alphas[:2], stats.modes) if m == "memo")


def test_host_that_cannot_hold_attention_outputs_checkpoints_layers_instead_of_refusing():
    batch, seq = 2, 160
    probe = _run(ActivationPolicy("memo", alpha=0.0), batch, seq)
    x = _bytes(probe, batch, seq, role="input")
    attention = _bytes(probe, batch, seq, role="attention")
    slack = 4 * 13 * 512 + 512  # the solver's room for each host slot's alignment
    budget = 2 * x + attention + slack  # one layer's attention output, not two
    assert attention > slack
    model = _run(ActivationPolicy("memo", host_budget_bytes=budget), batch, seq)
    modes = model.swap_stats().modes
    assert modes[0] == "checkpoint" and modes[2:] == ["memo", "memo"]  # which of layer 1's modes: by measured time
    assert model.swap_stats().host_pool_bytes <= budget


def test_host_that_cannot_hold_even_the_inputs_is_an_error():
    with pytest.raises(ValueError, match="host memory cannot hold the offload: the layer inputs alone"):
        _run(ActivationPolicy("memo", host_budget_bytes=1000))


def test_second_forward_before_backward_is_refused_at_backward():
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5))
    ids = torch.randint(0, 256, (1, 16))
    first = model(ids, labels=ids)
    model(ids, labels=ids)
    with pytest.raises(RuntimeError, match="one forward per backward"):
        first.backward()


def test_shape_change_resizes_buffers_and_stays_exact():
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5, tile_tokens=8))
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
    tile = 1 << 16
    with torch.device("meta"):
        model = Transformer(
            ModelConfig.preset("gpt-7b"), ActivationPolicy("memo", alpha=0.5, tile_tokens=tile, host_budget_bytes=1 << 42)
        )
    model.to(torch.bfloat16)
    ids = torch.zeros(1, 1 << 20, dtype=torch.long, device="meta")
    model(ids, labels=ids).backward()
    stats = model.swap_stats()
    h, s, a = 4096, 1 << 20, 32
    # per buffer, docs/method.md §2's tensors: x, q, k, v, attn whole (5·s·h bf16) + LSE (fp32 per head), and two
    # tile slots of the larger token-local group: x1, n2, up, act (10·h per token, bf16) + LayerNorm's mean, rstd
    whole = 5 * s * h * 2 + a * s * 4
    slot = 10 * tile * h * 2 + 2 * tile * 4
    assert stats.device_skeletal_bytes == pytest.approx(2 * (whole + 2 * slot), rel=1e-5)
    assert stats.tile_tokens == tile
    assert model.layers[0].wq.weight.grad.is_meta


def test_layer_swaps_say_per_layer_what_goes_to_host_and_what_comes_back():
    modes, alphas = ["checkpoint", "memo", "keep", "memo", "memo"], [0.0, 0.5, 1.0, 0.5, 0.5]
    # layers 3 and 4 keep their rounding buffers; untiled, their tensors all stay in them: α = 1, nothing sent
    untiled = layer_swaps(modes, alphas, seq=10, tile=10)
    assert untiled == (
        LayerSwap(mode="checkpoint", alpha=0.0, split=0, sent=True, reloaded=True, survives=False),
        LayerSwap(mode="memo", alpha=0.5, split=5, sent=True, reloaded=True, survives=False),
        LayerSwap(mode="keep", alpha=1.0, split=0, sent=False, reloaded=False, survives=False),
        LayerSwap(mode="memo", alpha=1.0, split=10, sent=False, reloaded=False, survives=True),
        LayerSwap(mode="memo", alpha=1.0, split=10, sent=False, reloaded=False, survives=True),
    )
    tiled = layer_swaps(modes, alphas, seq=10, tile=4, offload_last=True)  # every buffered layer sends
    assert [(s.alpha, s.split, s.sent, s.survives) for s in tiled[3:]] == [(0.5, 5, True, False)] * 2
    assert [s.reloaded for s in tiled] == [s.reloaded for s in untiled]


def test_emptied_buffers_send_and_reload_every_buffered_layer_and_hold_no_bytes_across_the_loss():
    modes, alphas = ["checkpoint", "memo", "keep", "memo", "memo"], [0.0, 0.5, 1.0, 0.5, 0.5]
    swaps = layer_swaps(modes, alphas, seq=10, tile=10, empty=True)  # untiled: nothing survives an emptied slot
    assert [(s.sent, s.reloaded, s.survives) for s in swaps] == [(m != "keep", m != "keep", False) for m in modes]
    batch, seq = 2, 40
    policy = ActivationPolicy("memo", alpha=0.37, tile_tokens=16, empty_buffers=True)
    model = _run(policy, batch, seq)  # a first step sizes the store
    raw = [t for key, t in model.store._raw.items() if key[0] == "buffer"]
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    loss = model(ids, labels=ids)
    assert len(raw) == 2 and all(t.untyped_storage().nbytes() == 0 for t in raw)  # freed from the last forward on
    held, before_backward = {}, model.store.before_backward

    def holding(index, step):
        out = before_backward(index, step)
        held[index] = [t.untyped_storage().nbytes() == t.numel() for t in raw]  # which buffers hold their bytes
        return out

    model.store.before_backward = holding
    loss.backward()
    n = model.config.n_layers
    assert n == 4 and held == {3: [True, True], 2: [True, True], 1: [True, True], 0: [True, False]}  # one at the end
    stats = model.swap_stats()
    kept = int(0.37 * seq)
    whole = _bytes(model, batch, seq, role="input") + _bytes(model, batch, seq, role="attention")
    whole += _bytes(model, batch, seq, kept, role="other", group="whole")
    local = _bytes(model, batch, seq, kept, group="qkv") + _bytes(model, batch, seq, kept, group="mlp")
    layers = model.config.n_layers
    assert stats.bytes_offloaded == stats.bytes_prefetched == layers * (whole + local)
    assert model.store.pool.in_use == 0
    with torch.no_grad():  # a forward with no backward after it: the next step gets its bytes back
        model(ids, labels=ids)
    model(ids, labels=ids).backward()


@pytest.mark.parametrize("shared", [3, 6])
def test_the_lowest_shared_layers_hold_one_rounding_buffer_with_the_same_gradients(shared):
    """With `shared_layers` the lowest layers' backward holds one rounding buffer, each reloading after the backward
    above it (all six: no layer prefetches), with the gradients of buffers kept whole."""
    policy = ActivationPolicy("memo", alpha=0.37, tile_tokens=16, empty_buffers=True, shared_layers=shared)
    model = Transformer(ModelConfig.preset("tiny", n_layers=6), policy)
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    model(ids, labels=ids).backward()  # sizes the store
    raw = [t for key, t in model.store._raw.items() if key[0] == "buffer"]
    held, before_backward = {}, model.store.before_backward

    def holding(index, step):
        out = before_backward(index, step)
        held[index] = [t.untyped_storage().nbytes() == t.numel() for t in raw]
        return out

    model.store.before_backward = holding
    model.zero_grad()
    model(ids, labels=ids).backward()
    assert held == {i: [True, True] if i >= shared else [i % 2 == 0, i % 2 == 1] for i in range(6)}
    got = [p.grad.clone() for p in model.parameters()]
    model.policy = dataclasses.replace(policy, empty_buffers=False, shared_layers=1)
    model.store = make_store(model.policy, 6)
    model.zero_grad()
    model(ids, labels=ids).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, model.parameters()))
    with pytest.raises(ValueError, match="`shared_layers` must be 1, or more with `empty_buffers`, got 2"):
        ActivationPolicy("memo", shared_layers=2)
    with pytest.raises(ValueError, match="`shared_layers` must be 1, or more with `empty_buffers`, got 0"):
        ActivationPolicy("memo", empty_buffers=True, shared_layers=0)


def test_store_layout_is_what_the_store_allocates():
    model = _run(ActivationPolicy("memo", alpha=0.3, plan=("memo", "keep", "memo", "checkpoint"), tile_tokens=7))
    store = model.store
    swaps = layer_swaps(["memo", "keep", "memo", "checkpoint"], [0.3, 1.0, 0.3, 0.0], 40, 7)  # no store needed
    assert swaps == store.swaps
    layout = store_layout(store.specs, swaps, 7)
    assert layout == store.layout
    buffers = [views for kinds in store._buffers for views in kinds]  # per rounding buffer, each kind of layer's views
    views = [t for slot in (*buffers, *store._keep.values()) for t in slot.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in views}
    assert sum(storages.values()) == layout.device_bytes
    assert store.pool.nbytes == layout.host_total


@pytest.mark.parametrize("tile", [None, 16])
def test_offloaded_last_two_layers_get_their_tiles_back_but_not_their_buffers(tile):
    """Their rounding buffers still hold the whole-length tensors at their backward: loading them is waste (and
    untiled, their tile slots still hold the token-local ones)."""
    batch, seq, alpha = 2, 40, 0.37
    model = _run(ActivationPolicy("memo", alpha=alpha, offload_last_layers=True, tile_tokens=tile), batch, seq)
    kept = int(alpha * seq)
    whole = _bytes(model, batch, seq, role="input") + _bytes(model, batch, seq, role="attention")
    whole += _bytes(model, batch, seq, kept, role="other", group="whole")
    local = _bytes(model, batch, seq, kept, group="qkv") + _bytes(model, batch, seq, kept, group="mlp")
    last_local = 0 if tile is None else local
    stats = model.swap_stats()
    assert stats.bytes_offloaded == 2 * (whole + local) + 2 * (whole + last_local)
    assert stats.bytes_prefetched == 2 * (whole + local) + 2 * last_local  # whole-length parts of 0 and 1 only
    assert model.store.pool.in_use == 0


def test_gradient_over_input_writes_attention_gradients_over_a_layer_input_on_host(monkeypatch):
    """Attention's output gradient (then dq) takes the bytes of x, which comes back from host into q's: every
    layer backward whose input went to host allocates one whole-length tensor less, with the same gradients."""
    import memo.layer as layer_module
    from memo.plan.trace import Tracer

    batch, seq = 2, 40
    backward_phase, runs, models = layer_module.backward_phase, {}, {}

    def traced(layer, t, *args):
        with Tracer() as tracer:
            out = backward_phase(layer, t, *args)
        runs[over][layer.index] = ("x_host" in t, tracer.trace.peak)
        return out

    monkeypatch.setattr(layer_module, "backward_phase", traced)
    for over in (True, False):
        runs[over] = {}
        policy = ActivationPolicy(
            "memo", alpha=0.37, tile_tokens=16, plan=("checkpoint", "memo", "memo", "memo"), gradient_over_input=over
        )
        torch.manual_seed(0)
        models[over] = _run(policy, batch, seq)
    x = batch * seq * models[False].config.hidden_size * 4
    # layers 0 (checkpointed) and 1 sent their input; 2 and 3 kept their rounding buffers
    assert [runs[True][i][0] for i in range(4)] == [True, True, False, False]
    assert not any(sent for sent, _ in runs[False].values())
    assert [runs[False][i][1] - runs[True][i][1] for i in range(4)] == [x, x, 0, 0]
    for (name, p), q in zip(models[True].named_parameters(), models[False].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
