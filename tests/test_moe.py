"""Mixture-of-experts layers against the independent reference (memo.reference: every expert over every token,
masked by the top-k routing, plain autograd): every strategy, α, tiles that do not divide s, a per-layer plan,
packed documents, batch 2, both renormalisations, the load-balancing loss, bf16, and sequence parallelism on two
gloo ranks. Parity with transformers' Qwen3-MoE and Mixtral: tests/test_moe_hf.py."""

from __future__ import annotations

import pytest
import ranks
import torch

import memo.layer
from memo import ActivationPolicy, ModelConfig, Transformer
from memo.reference import ReferenceTransformer

MARGIN = 1e-4  # the least gap between a token's k-th and (k+1)-th router probability the inputs must have


def _config(**fields) -> ModelConfig:
    base = dict(n_layers=3, hidden_size=32, n_heads=4, n_kv_heads=2, ffn_hidden_size=48, vocab_size=64)
    moe = dict(n_experts=4, experts_per_token=2, expert_ffn_size=24, norm_topk_prob=True)
    return ModelConfig(arch="llama", **{**base, **moe, **fields})


def _models(config: ModelConfig, policy: ActivationPolicy, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = ReferenceTransformer(config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "router_experts" in name and p.dim() > 1:
                p.normal_(0, 0.3 if "router." in name else 0.1)  # routers far from uniform: clear top-k choices
    model = Transformer(config, policy)
    model.load_state_dict(ref.memo_state_dict())
    return ref.to(dtype), model.to(dtype)


def _assert_clear_routing(ref: ReferenceTransformer) -> None:
    """Raises unless every token's k-th router probability beats its (k+1)-th by MARGIN in every layer: a tie
    could route the two implementations apart."""
    k = ref.config.experts_per_token
    for layer in (layer for layer in ref.layers if layer.sparse):
        top = torch.softmax(layer.router_experts.logits.float(), dim=-1).topk(k + 1, dim=-1).values
        assert (top[..., k - 1] - top[..., k]).min() > MARGIN


def _check(config, policy, ids, positions=None, dtype=torch.float32, rtol=1e-5, grad_tol=1e-4):
    ref, model = _models(config, policy, dtype)
    want = ref(ids, labels=ids, positions=positions)
    _assert_clear_routing(ref)
    want.backward()
    loss = model(ids, labels=ids, positions=positions)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=rtol, atol=rtol)
    refs = ref.memo_state_dict(keep_vars=True)
    for name, p in model.named_parameters():
        g = refs[name].grad
        tol = grad_tol * g.abs().max().item()
        torch.testing.assert_close(p.grad, g, rtol=grad_tol, atol=tol, msg=lambda m: f"{name}: {m}")


POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0-tile7": ActivationPolicy("memo", alpha=0.0, tile_tokens=7),
    "memo-a0.5-tile11": ActivationPolicy("memo", alpha=0.5, tile_tokens=11),
    "memo-a1": ActivationPolicy("memo", alpha=1.0),
    "plan": ActivationPolicy("memo", alpha=0.5, tile_tokens=9, plan=("checkpoint", "memo", "keep")),
}


@pytest.mark.parametrize("name", POLICIES)
def test_every_strategy_matches_the_reference_with_the_load_balancing_loss(name):
    config = _config(router_aux_loss=True, router_aux_loss_coef=0.5)  # large: a wrong aux gradient shows
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    _check(config, POLICIES[name], ids)


@pytest.mark.parametrize("renormalise", [True, False], ids=["norm-topk", "raw-topk"])
def test_renormalised_or_raw_top_k_weights_and_k_of_one(renormalise):
    config = _config(norm_topk_prob=renormalise, experts_per_token=3 if renormalise else 1)  # k = 1 renormalised: w = 1
    ids = torch.randint(0, config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(2))
    _check(config, POLICIES["memo-a0.5-tile11"], ids)


def test_packed_documents_route_within_their_tokens():
    config = _config()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    _check(config, POLICIES["memo-a0.5-tile11"], ids, positions)


def test_bf16_matches_the_bf16_reference_loosely():
    config = _config()
    ids = torch.randint(0, config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    _check(config, POLICIES["memo-a0.5-tile11"], ids, dtype=torch.bfloat16, rtol=2e-2, grad_tol=5e-2)


def test_the_backward_never_routes_again(monkeypatch):
    """The recompute and the backward read the routing the forward kept: `route` runs once per tile, forward only."""
    config = _config()
    ref, model = _models(config, ActivationPolicy("memo", alpha=0.0, tile_tokens=8))
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    calls = []
    real = memo.layer.route
    monkeypatch.setattr(memo.layer, "route", lambda *a: calls.append(1) or real(*a))
    loss = model(ids, labels=ids)
    forward_calls = len(calls)
    assert forward_calls == config.n_layers * 4  # four tiles of 8 rows a layer
    loss.backward()
    assert len(calls) == forward_calls
    assert model.swap_stats().tokens_recomputed > 0  # the experts' tensors were recomputed, not kept


def test_config_refuses_what_memo_cannot_route():
    with pytest.raises(ValueError, match="`experts_per_token` must be a positive integer up to 4"):
        _config(experts_per_token=5)
    with pytest.raises(ValueError, match="are of a mixture of experts: set `n_experts` too"):
        _config(n_experts=0)
    with pytest.raises(ValueError, match="SwiGLU MLPs without biases"):
        _config(mlp_bias=True)


def _sp_rank(rank: int, port: int, sp: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from memo.parallel import full_gradients, init_mesh, parallelize, shard_batch

    ranks.join(rank, 2, port)
    try:
        mesh = init_mesh(sp, timeout=timedelta(seconds=60))
        config = _config(router_aux_loss=True, router_aux_loss_coef=0.5)
        ref, model = _models(config, POLICIES["memo-a0.5-tile11"])
        model = parallelize(model, mesh)
        ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6))
        want = ref(ids, labels=ids)
        want.backward()
        local_ids, targets = shard_batch(ids, ids, mesh)
        loss = model(local_ids, targets=targets)
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        refs = ref.memo_state_dict(keep_vars=True)
        for name, grad in full_gradients(model).items():
            g = refs[name].grad
            torch.testing.assert_close(
                grad, g, rtol=1e-4, atol=1e-4 * g.abs().max().item(), msg=lambda m: f"{name}: {m}"
            )
        dist.barrier()  # neither rank tears its group down while the other still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 1], ids=["sp2", "dp2"])
def test_two_ranks_match_the_reference_aux_loss_included(free_port, sp):
    """Sequence parallel (each rank half of every sequence) or data parallel (half of the batch): the aux loss's
    counts are all-reduced, each rank's probability sums carry its own gradient."""
    import torch.multiprocessing as mp

    mp.spawn(_sp_rank, args=(free_port(), sp), nprocs=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_phase_planner_serves_the_experts_bit_identically(dtype):
    import copy

    from memo.plan.phases import attach

    torch.manual_seed(0)
    plain = Transformer(_config(router_aux_loss=True), POLICIES["plan"]).to(dtype)
    planned = copy.deepcopy(plain)
    planner = attach(planned, debug=True, time_limit=0.2)
    ids = torch.randint(0, 64, (2, 29), generator=torch.Generator().manual_seed(7))
    for _ in range(2):  # the second step replays the plans made in the first
        results = []
        for model in (plain, planned):
            model.zero_grad()
            loss = model(ids, labels=ids)
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert torch.equal(results[0][0], results[1][0])
        for name, g in results[0][1].items():
            assert torch.equal(g, results[1][1][name]), name
    unplanned = planner.summary()["unplanned_phases"]
    if dtype == torch.bfloat16:
        assert not unplanned
    else:  # said at plan time, not found astray at run time
        assert {u["why"] for u in unplanned} == {"the grouped GEMM of its experts has a meta kernel in bf16 only"}


def test_lora_adapts_attention_of_an_expert_model_and_refuses_the_experts():
    from memo.lora import LoraConfig, apply_lora, check_targets

    config = _config()
    with pytest.raises(ValueError, match="`--lora-targets` names gate,down: adapters on .* experts are not built"):
        check_targets(LoraConfig(4, targets=("q", "gate", "down")), config)
    ref, model = _models(config, POLICIES["memo-a0.5-tile11"])
    apply_lora(model, LoraConfig(4))
    with torch.no_grad():  # B away from 0: A's gradient is then not 0 either
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.named_parameters() if "lora_" in n}
    assert {n.split(".")[2] for n in trained} == {"wq", "wk", "wv", "wo"}


@pytest.mark.parametrize("name", ["full", "memo-a0-tile7", "memo-a0.5-tile11", "plan"])
def test_dense_layers_among_sparse_ones_share_the_store(name):
    """A dense MLP layer between sparse ones (Qwen3-MoE's `mlp_only_layers`): the rounding buffers and tile slots
    fit both kinds of layer, each layer sees its own kind's views, and the aux loss counts the sparse layers."""
    config = _config(n_layers=4, dense_layers=(1, 2), router_aux_loss=True, router_aux_loss_coef=0.5)
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(9))
    policy = POLICIES[name]
    if name == "plan":
        policy = ActivationPolicy("memo", alpha=0.5, tile_tokens=9, plan=("checkpoint", "memo", "keep", "memo"))
    _check(config, policy, ids)
    model = _models(config, policy)[1]
    assert [layer.experts is None for layer in model.layers] == [False, True, True, False]
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_dense_layers_are_checked():
    with pytest.raises(ValueError, match="`dense_layers` must be an integer >= 0 up to 2"):
        _config(dense_layers=(3,))
    with pytest.raises(ValueError, match="`dense_layers` must list distinct layer indices"):
        _config(dense_layers=(1, 1))


def test_the_store_allocates_what_its_layout_says_for_mixed_kinds_of_layer():
    """Dense and sparse layers share the rounding buffers (sized for the larger kind); keep and recompute layers get
    slots of their own kind; the layout the cost model reads is what the store allocates."""
    from memo.swap import store_layout

    config = _config(n_layers=4, dense_layers=(1,))
    policy = ActivationPolicy("memo", alpha=0.3, plan=("memo", "keep", "checkpoint", "keep"), tile_tokens=7)
    model = _models(config, policy)[1]
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(10))
    model(ids, labels=ids).backward()
    store = model.store
    assert len(store.kinds) == 2 and store._kind == [0, 1, 0, 0]
    assert store_layout(store.layer_specs, store.swaps, 7) == store.layout
    buffers = [views for kinds in store._buffers for views in kinds]
    views = [t for slot in (*buffers, *store._keep.values()) for t in slot.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in views}
    assert sum(storages.values()) == store.layout.device_bytes
    assert store.layout.keep_bytes == sum(
        sum(-(-sp.nbytes // 512) * 512 for sp in store.layer_specs[i].values()) for i in (1, 3)
    )  # a dense keep layer and a sparse one, each its own size
