"""memo.patch against the unpatched transformers (and PEFT) model, the independent reference: the loss and every
parameter gradient of Llama, Mistral (within its window), Qwen2 and Qwen3 under memo's α, tiles that do not divide
the sequence, a per-layer plan, packed `position_ids`, right padding and -100 spans, tied and untied embeddings;
PEFT LoRA however it is set up; the no-grad path untouched; and a one-line refusal for what memo cannot run.
Models are tiny random ones from transformers' config classes, fp32 on the CPU."""

import copy
import logging
import types

import pytest
import torch

from memo import ActivationPolicy
from memo.hf_patch import patch, unpatch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

GRAD_REL_TOL = 1e-4  # times each tensor's max |grad| (tests/test_hf.py's convention)
LOSS_REL_TOL = 1e-5
SEQ, VOCAB = 24, 96
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, head_dim=12)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=SEQ // 4)),  # 4x its window
    "qwen2": (  # the layers from the second on slide
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=SEQ // 4, max_window_layers=1),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma3": (  # 4x its window, a global layer between sliding ones, a scale that is not the head dim's
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=SEQ // 4, layer_types=GEMMA_TYPES),
    ),
    # experts of width 16, the eager experts as the reference; routers drawn wide (`model`): clear top-k choices
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            head_dim=8,
            mlp_only_layers=[1],  # a dense layer between sparse ones
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
MOE = ("qwen3_moe", "mixtral")
TILED = ActivationPolicy("memo", alpha=0.5, tile_tokens=5)  # 5 does not divide 24


def model(family: str = "llama", seed: int = 0, **overrides):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **SMALL, **{**extra, **overrides})
    if family in MOE:
        config._experts_implementation = "eager"  # transformers' own loop over experts: the reference
    torch.manual_seed(seed)
    m = getattr(transformers, model_name)(config)
    if family in MOE:
        with torch.no_grad():
            for layer in m.model.layers:
                if hasattr(layer.mlp, "experts"):
                    layer.mlp.gate.weight.normal_(0, 0.5)
    return m


def batch(seed: int = 1, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=g)
    labels = ids.clone()
    labels[:, 3:7] = -100  # a prompt span
    return dict(input_ids=ids, labels=labels)


def train_step(m, inputs) -> tuple[float, dict]:
    m.zero_grad(set_to_none=True)
    loss = m(**inputs).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def assert_same_step(patched, reference, inputs) -> None:
    want_loss, want = train_step(reference, inputs)
    got_loss, got = train_step(patched, inputs)
    assert got_loss == pytest.approx(want_loss, rel=LOSS_REL_TOL)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= GRAD_REL_TOL * g.abs().max(), name


def patched_pair(family="llama", policy=TILED, **overrides):
    reference = model(family, **overrides)
    return patch(copy.deepcopy(reference), policy), reference


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_as_transformers_does_with_tiles_that_do_not_divide(family):
    assert_same_step(*patched_pair(family), batch())


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_ends(alpha):
    assert_same_step(*patched_pair("qwen3", ActivationPolicy("memo", alpha=alpha)), batch())


def test_a_per_layer_plan_and_untied_embeddings():
    policy = ActivationPolicy("memo", alpha=(0.0, 0.5, 1.0), plan=("checkpoint", "memo", "keep"), tile_tokens=7)
    assert_same_step(*patched_pair("qwen2", policy, tie_word_embeddings=False), batch())


@pytest.mark.parametrize("family, over_input", [("llama", False), ("llama", True), ("qwen2", True)])
def test_rounding_buffers_emptied_across_transformers_loss(family, over_input, monkeypatch):
    """With `gradient_over_input` too: where heads x head size is the hidden size (qwen2 here, not this llama)
    attention's gradient is written over each layer's input."""
    import memo.layer

    taken, comes_back = [], memo.layer._input_comes_back
    monkeypatch.setattr(memo.layer, "_input_comes_back", lambda t: taken.append(comes_back(t)) or taken[-1])
    policy = ActivationPolicy(
        "memo", alpha=0.5, plan=("memo", "checkpoint", "memo"), tile_tokens=5, empty_buffers=True,
        gradient_over_input=over_input,
    )  # fmt: skip
    assert_same_step(*patched_pair(family, policy), batch())
    assert taken == [family == "qwen2"] * 3


def test_packed_position_ids_as_transformers_packs_them():
    """Restarting position_ids with no attention_mask: documents that see only themselves, RoPE per document,
    as TRL's padding-free collator sends them (one row, -100 at each document start)."""
    inputs = batch(b=1)
    positions = torch.cat([torch.arange(n) for n in (9, 5, 10)])[None]
    inputs["labels"][positions == 0] = -100
    patched, reference = patched_pair("qwen3")
    assert_same_step(patched, reference, {**inputs, "position_ids": positions, "use_cache": False})
    with pytest.raises(ValueError, match="transformers packs only without a cache: pass use_cache=False"):
        patched(**inputs, position_ids=positions)  # the config's use_cache=True: transformers would not pack


def test_right_padding_through_attention_mask():
    inputs = batch()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 17:] = 0
    inputs["labels"][mask == 0] = -100
    assert_same_step(*patched_pair("mistral"), {**inputs, "attention_mask": mask})


def test_shift_labels_and_the_trainers_token_count_reach_the_loss():
    inputs = batch()
    shifted = torch.roll(inputs["labels"], -1, dims=1)
    shifted[:, -1] = -100
    extra = dict(shift_labels=shifted, num_items_in_batch=torch.tensor(77))
    assert_same_step(*patched_pair(), {"input_ids": inputs["input_ids"], "labels": inputs["labels"], **extra})


def test_a_micro_batch_without_targets_gives_a_connected_zero():
    patched, _ = patched_pair()
    inputs = batch()
    inputs["labels"][:] = -100
    loss = patched(**inputs).loss
    loss.backward()
    assert loss.item() == 0 and all(p.grad is not None and not p.grad.any() for p in patched.parameters())


def test_without_grad_transformers_runs_and_unpatch_gives_the_model_back():
    patched, reference = patched_pair()
    ids = batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, reference(ids).logits)
    assert patched.state_dict().keys() == reference.state_dict().keys()
    assert [n for n, _ in patched.named_modules()] == [n for n, _ in reference.named_modules()]
    unpatch(patched)
    assert all("forward" not in m.__dict__ for m in patched.modules())
    assert_same_step(patched, reference, batch())


def test_logits_come_from_a_call_without_labels_and_the_copy_has_its_own_store():
    patched, reference = patched_pair()
    ids = batch()["input_ids"]
    assert torch.allclose(patched(ids).logits, reference(ids).logits, atol=1e-5)
    twin = copy.deepcopy(patched)
    assert twin._memo_patch.store is not patched._memo_patch.store
    assert_same_step(twin, reference, batch())


def test_hf_activation_checkpointing_is_turned_off_with_one_warning(caplog):
    patched, reference = patched_pair()
    patched.gradient_checkpointing_enable()
    with caplog.at_level(logging.WARNING, logger="memo.hf_patch"):
        assert_same_step(patched, reference, batch())
        train_step(patched, batch())
    assert not patched.model.layers[0].gradient_checkpointing
    assert len([r for r in caplog.records if "activation checkpointing" in r.message]) == 1


def test_an_fp32_model_under_bf16_autocast_runs_its_layers_in_bf16():
    patched, reference = patched_pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = patched(**batch()).loss
        want = reference(**batch()).loss
    loss.backward()
    assert patched._memo_patch.store.specs["x"].dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in patched.parameters())
    assert loss.item() == pytest.approx(want.item(), rel=2e-2)


# ---- PEFT -------------------------------------------------------------------------------------------------------


def lora(m, seed=2, **config):
    out = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, **config))
    torch.manual_seed(seed)
    for name, p in out.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to say
            torch.nn.init.normal_(p, std=0.2)
    return out


@pytest.mark.parametrize(
    "config",
    [
        dict(target_modules=["q_proj", "v_proj"]),
        dict(target_modules="all-linear", use_rslora=True, lora_bias=True, modules_to_save=["lm_head"]),
        dict(target_modules=["o_proj", "down_proj"], modules_to_save=["post_attention_layernorm"]),
        dict(target_modules=["q_proj", "k_proj"], rank_pattern={"q_proj": 2}, alpha_pattern={"k_proj": 3}),
    ],
    ids=["subset", "rslora-bias-head", "norm-to-save", "rank-alpha-patterns"],
)
def test_peft_lora_trains_its_adapters_as_peft_does(config):
    reference = lora(model("qwen2"), **config)
    assert_same_step(patch(copy.deepcopy(reference), TILED), reference, batch())


def test_patch_before_get_peft_model_and_two_active_adapters():
    reference = lora(model("llama"), target_modules=["q_proj", "up_proj"])
    reference.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj"]))
    reference.base_model.set_adapter(["default", "second"])
    for name, p in reference.named_parameters():
        if "lora_B.second" in name:
            torch.nn.init.normal_(p, std=0.2)
    patched = patch(model("llama"), TILED)  # patched first, adapters after
    patched = peft.get_peft_model(patched, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    patched.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj"]))
    patched.base_model.set_adapter(["default", "second"])
    patched.load_state_dict(reference.state_dict())
    assert_same_step(patched, reference, batch())


def test_fp32_adapters_on_a_bf16_base_get_fp32_gradients():
    reference = lora(model("qwen3").to(torch.bfloat16), target_modules=["q_proj", "v_proj"])
    patched = patch(copy.deepcopy(reference), TILED)
    want_loss, want = train_step(reference, batch())
    got_loss, got = train_step(patched, batch())
    assert got_loss == pytest.approx(want_loss, rel=1e-2)
    for name, g in want.items():
        assert got[name].dtype == torch.float32
        assert (got[name] - g).abs().max() <= 0.05 * g.abs().max(), name


def test_lora_dropout_keeps_its_mask_through_recompute_and_a_no_grad_forward():
    """The mask is keyed per forward and kept for its backward: a forward under no_grad in between changes
    nothing, and α (what is recomputed) changes nothing."""
    grads = []
    for alpha, between in ((1.0, False), (0.0, True)):
        policy = ActivationPolicy("memo", alpha=alpha, tile_tokens=5)
        m = patch(lora(model("llama"), target_modules=["q_proj", "down_proj"], lora_dropout=0.5), policy)
        torch.manual_seed(5)
        loss = m(**batch()).loss
        if between:
            with torch.no_grad():
                m(**batch())
        loss.backward()
        grads.append([p.grad for p in m.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


# ---- refusals ---------------------------------------------------------------------------------------------------


def test_dora_is_refused_in_one_line():
    m = patch(lora(model(), target_modules=["q_proj"], use_dora=True), TILED)
    with pytest.raises(ValueError, match=r"self_attn.q_proj: adapter 'default' is a LoRA variant .*DoRA"):
        m(**batch())


@pytest.mark.parametrize(
    "where, how",
    [("layers.1.mlp.down_proj", "hook"), ("layers.0.mlp", "forward"), ("layers.2.input_layernorm", "forward")],
)
def test_a_hook_or_a_forward_of_its_own_on_a_module_memo_computes_is_refused(where, how):
    """Liger's `apply_liger_kernel_to_llama(model=...)` binds its own forwards to the MLP and norms: memo would
    silently skip them."""
    m = patch(model(), TILED)
    module = m.model.get_submodule(where)
    if how == "hook":
        module.register_forward_hook(lambda *a: None)
    else:
        module.forward = types.MethodType(type(module).forward, module)
    with pytest.raises(ValueError, match=rf"model.{where} has a patched forward or forward hooks"):
        m(**batch())


def test_generate_runs_transformers_own_path():
    patched, reference = patched_pair()
    ids = batch()["input_ids"][:1, :8]
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(patched.generate(ids, **kw), reference.generate(ids, **kw))


def test_a_patched_layer_class_is_refused_at_patch_time():
    m = model()
    layer = m.model.layers[0]
    layer.forward = lambda *a, **k: type(layer).forward(layer, *a, **k)
    with pytest.raises(ValueError, match="Liger or another patch"):
        patch(m, TILED)


def test_two_training_forwards_before_one_backward_are_refused():
    m = patch(model(), TILED)
    kept = m(**batch()).loss
    with pytest.raises(ValueError, match="call backward before the next training forward"):
        m(**batch())
    kept.backward()


@pytest.mark.parametrize(
    "why, match",
    [
        ("saved tensor hooks", "saved-tensor hooks are active"),
        ("output_attentions", "`output_attentions` is not returned"),
        ("left padding", "attention_mask"),
    ],
)
def test_what_memo_cannot_run_is_refused_in_one_line(why, match):
    m = patch(model(), TILED)
    inputs = batch()
    with pytest.raises(ValueError, match=match):
        if why == "saved tensor hooks":
            with torch.autograd.graph.save_on_cpu():
                m(**inputs)
        elif why == "output_attentions":
            m(**inputs, output_attentions=True)
        else:
            mask = torch.ones(2, SEQ, dtype=torch.long)
            mask[0, :3] = 0
            m(**inputs, attention_mask=mask)


def test_a_second_forward_after_backward_or_after_dropping_the_graph_is_fine():
    m = patch(model(), TILED)
    loss = m(**batch()).loss
    loss.backward()
    m(**batch())  # the first graph trained on (and still referenced): fine
    m(**batch())  # the second dropped without backward (its loss never kept): fine


def test_targets_at_padded_positions_are_refused():
    """transformers computes a pad query from the real tokens; memo's layers run causal attention over the pads."""
    inputs = batch()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 17:] = 0
    with pytest.raises(ValueError, match=r"labels at padded positions \(attention_mask 0\) must be -100"):
        patch(model(), TILED)(**inputs, attention_mask=mask)


def test_a_second_backward_of_one_graph_is_refused_in_one_line():
    loss = patch(model(), TILED)(**batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="memo runs one backward per forward"):
        loss.backward()


def test_a_solved_plan_is_refused_once_several_ranks_run(monkeypatch):
    """The process group may start after the patch (Trainer starts it): every training forward checks."""
    m = patch(model(), ActivationPolicy("memo"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(ValueError, match="under several ranks give α"):
        m(**batch())


def test_an_unpickled_patched_model_runs_unpatched_and_patches_again(caplog):
    import pickle

    patched, reference = patched_pair()
    with caplog.at_level(logging.WARNING, logger="memo.hf_patch"):
        loaded = pickle.loads(pickle.dumps(patched))
    assert "runs unpatched until memo.patch(model) again" in caplog.text
    assert loaded(**batch()).logits is not None  # transformers' own forward
    assert_same_step(patch(loaded, TILED), reference, batch())


def test_accelerate_context_parallelism_is_refused(monkeypatch):
    from accelerate.state import AcceleratorState

    config = types.SimpleNamespace(cp_enabled=True, sp_enabled=False)
    monkeypatch.setitem(AcceleratorState._shared_state, "parallelism_config", config)
    with pytest.raises(ValueError, match="Accelerate's context/sequence parallelism"):
        patch(model(), TILED)(**batch())


def test_attention_dropout_and_compile_are_refused_at_patch_time():
    with pytest.raises(ValueError, match="attention_dropout"):
        patch(model(attention_dropout=0.1))
    with pytest.raises(ValueError, match="before torch.compile"):
        patch(torch.compile(model()))


def test_batches_of_varying_length_reuse_the_bytes_and_the_plan_of_the_longest(monkeypatch):
    """A trainer's packed batches change length every step: a shorter one is served from the buffers and the
    solved plan of the longest so far (nothing allocated, pinned or measured again), a longer one resizes."""
    import memo.swap

    measured = []
    measure = memo.swap.measure_layer_seconds
    monkeypatch.setattr(memo.swap, "measure_layer_seconds", lambda *a: measured.append(1) or measure(*a))
    reference = model("qwen3")
    patched = patch(copy.deepcopy(reference), ActivationPolicy("memo", tile_tokens=5))  # α and plan solved
    store = patched._memo_patch.store
    pointers = []
    for length in (SEQ, 17, SEQ - 1, SEQ + 6):
        ids = torch.randint(0, VOCAB, (2, length))
        inputs = dict(input_ids=ids, labels=ids)
        assert_same_step(patched, reference, inputs)
        pointers.append((store._raw[("buffer", 0)].data_ptr(), store.pool.buffer.data_ptr()))
        assert set(store._raw) == store._used  # nothing the plan no longer carves stays allocated
    assert pointers[0] == pointers[1] == pointers[2] and len(measured) == 2  # solved at 24, again at 30


@pytest.mark.parametrize("family", MOE)
def test_experts_route_with_a_clear_margin_and_train_under_lora_on_attention(family):
    """The family test's inputs leave no near-tie to route apart; adapters on attention train as PEFT's do; the
    load-balancing loss's router logits and adapters on the experts are refused in one line."""
    reference = model(family)
    with torch.no_grad():
        logits = reference(**batch(), output_router_logits=True).router_logits
    for layer_logits in logits:  # the k-th and (k+1)-th logits apart by far more than the two paths' rounding
        top = layer_logits.float().topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-4
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    reference = peft.get_peft_model(model(family), lora)
    assert_same_step(patch(copy.deepcopy(reference), TILED), reference, batch())
    with pytest.raises(ValueError, match="`output_router_logits=True`: transformers' load-balancing loss"):
        patch(model(family, output_router_logits=True))
    patched = patch(model(family), TILED)
    with pytest.raises(ValueError, match="`output_router_logits=True`"):
        patched(**batch(), output_router_logits=True)
    on_experts = peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match="LoRA on a mixture of experts' router or experts is not built"):
        train_step(patch(peft.get_peft_model(model(family), on_experts), TILED), batch())
