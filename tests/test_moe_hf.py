"""memo.from_hf / memo.to_hf of mixtures of experts against transformers' own Qwen3-MoE and Mixtral, the independent
reference: every tensor and config field through a round trip, logits, loss (the load-balancing loss included) and
every gradient under each strategy, and a one-line error for every field memo cannot run. All checkpoints are tiny
random ones made with transformers' config classes and `save_pretrained` (per-expert tensors on disk)."""

import dataclasses
import json

import pytest
import torch
from cli_runs import evaluates, train_and_export
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hf import _load_hf, _randomize

from memo import ActivationPolicy, ModelConfig, Transformer, from_hf, to_hf
from memo.hf import config_from_hf, config_to_hf, hf_name, save_hf

transformers = pytest.importorskip("transformers")

SEQ, WINDOW = 24, 6  # Mixtral slides every layer: the tests run at 4x its window
MARGIN = 1e-4  # the least gap between a token's k-th and (k+1)-th router probability the inputs must have
GRAD_TOL = 1e-4  # times each tensor's max |grad|
E, K, F = 4, 2, 16  # experts, experts per token, expert width

# Each family with the features its config can switch on: Qwen3-MoE's biases, head_dim != 32 / 4 and a dense width
# of its own (unused, every layer sparse), Mixtral's window.
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=24,
            moe_intermediate_size=F,
            num_experts=E,
            head_dim=16,
            attention_bias=True,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": ("MixtralConfig", dict(intermediate_size=F, num_local_experts=E, sliding_window=WINDOW)),
}
# Seeds of the weights and the batch whose routing has MARGIN in every layer (each test asserts it; seed 0 passes for
# both families and every case below): a near-tie could route memo and transformers apart by rounding alone.
SEEDS = {"qwen3_moe": 0, "mixtral": 0}


def _hf_config(family: str, **overrides):
    cls, features = FAMILIES[family]
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=K,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        **features,
    )
    return getattr(transformers, cls)(**{**kwargs, **overrides})


def _hf_model(family: str, **overrides):
    """Returns transformers' model of `family`, random and large-weighted, eager attention and experts."""
    torch.manual_seed(SEEDS[family])
    config = _hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).float()
    _randomize(model)
    return model.eval()


def _saved(path, family: str, **overrides):
    hf = _hf_model(family, **overrides)
    hf.save_pretrained(path)
    return hf


def _batch(hf) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ids, labels) of SEEDS' batch, after checking that its routing has MARGIN in every layer of `hf`."""
    torch.manual_seed(SEEDS[hf.config.model_type])
    ids = torch.randint(0, 64, (2, SEQ))
    with torch.no_grad():
        router_logits = hf(ids, output_router_logits=True).router_logits
    for logits in router_logits:
        top = torch.softmax(logits.float(), dim=-1).topk(K + 1, dim=-1).values
        assert (top[:, K - 1] - top[:, K]).min() > MARGIN
    labels = ids.clone()
    labels[:, :3] = -100  # both sides average over the same (non-ignored, shifted) targets
    return ids, labels


def _hf_grad(hf, name: str) -> torch.Tensor:
    """Returns the gradient of transformers' in-memory tensor that memo's `name` is: experts fused as gate_up_proj
    (E, 2f, h), gate rows first, and down_proj (E, h, f); the router `mlp.gate` in both families."""
    params = dict(hf.named_parameters())
    if ".router." not in name and ".experts." not in name:
        return params[hf_name(name)].grad
    _, index, module, kind = name.split(".")
    moe = f"model.layers.{index}.mlp."
    if module == "router":
        return params[moe + "gate.weight"].grad
    if kind == "down":
        return params[moe + "experts.down_proj"].grad
    fused = params[moe + "experts.gate_up_proj"].grad
    return fused[:, :F] if kind == "gate" else fused[:, F:]


# ---- round trip: transformers -> memo -> transformers ----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_round_trips_through_memo_tensor_for_tensor(tmp_path, family):
    hf = _saved(tmp_path / "theirs", family, output_router_logits=True, router_aux_loss_coef=0.25)
    model = from_hf(tmp_path / "theirs", dtype=torch.float32)
    c = model.config
    assert (c.hf_model_type, c.n_experts, c.experts_per_token, c.expert_ffn) == (family, E, K, F)
    assert c.norm_topk_prob and c.router_aux_loss and c.router_aux_loss_coef == 0.25
    out = to_hf(model, tmp_path / "ours")
    back = _load_hf(out)  # no missing, unexpected or mismatched keys
    theirs, ours = hf.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    with (
        safe_open(tmp_path / "theirs" / "model.safetensors", "pt") as a,
        safe_open(out / "model.safetensors", "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())  # per-expert tensors, as transformers writes them
    fields = (
        "num_experts num_experts_per_tok norm_topk_prob output_router_logits router_aux_loss_coef sliding_window "
        "intermediate_size moe_intermediate_size decoder_sparse_step mlp_only_layers rms_norm_eps "
        "num_key_value_heads rope_parameters architectures"
    ).split()
    for field in fields:
        assert getattr(back.config, field, None) == getattr(hf.config, field, None), field
    assert back.model.layers[0].self_attn.head_dim == hf.model.layers[0].self_attn.head_dim  # Mixtral's file: null
    again = from_hf(out).config
    assert again == dataclasses.replace(c, name=again.name)


def test_experts_split_across_shards_read_the_same(tmp_path):
    _saved(tmp_path / "one", "qwen3_moe")
    _hf_model("qwen3_moe").save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        shards = json.load(f)["weight_map"]
    experts = [shards[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for e in range(E) for p in ("gate_proj", "up_proj")]
    assert len(set(experts)) > 1  # one memo tensor's rows come from several files
    one, sharded = from_hf(tmp_path / "one").state_dict(), from_hf(tmp_path / "sharded").state_dict()
    for name, tensor in one.items():
        assert torch.equal(sharded[name], tensor), name


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_released_shapes_export_a_config_transformers_and_memo_read_back(preset):
    config = ModelConfig.preset(preset)
    cfg = config_to_hf(config, torch.bfloat16)
    hf = transformers.AutoConfig.for_model(**cfg)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.num_hidden_layers) == (
        config.n_experts,
        config.experts_per_token,
        48 if "qwen" in preset else 32,
    )
    width = hf.moe_intermediate_size if config.hf_model_type == "qwen3_moe" else hf.intermediate_size
    assert width == config.expert_ffn
    assert config_from_hf(cfg, preset) == config


# ---- memo's model is transformers' model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, overrides",
    [("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False}), ("mixtral", {})],
    ids=["qwen3_moe-renormalised", "qwen3_moe-not-renormalised", "mixtral"],
)
def test_logits_match_transformers(tmp_path, family, overrides):
    hf = _saved(tmp_path, family, **overrides)
    model = from_hf(tmp_path, dtype=torch.float32)
    assert model.config.norm_topk_prob == overrides.get("norm_topk_prob", True)
    ids, _ = _batch(hf)
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(model(ids), theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


POLICIES = {
    "none": ActivationPolicy("none"),
    "memo": ActivationPolicy("memo", alpha=0.5, tile_tokens=7, offload_last_layers=True),  # 7 does not divide 24
    "full": ActivationPolicy("full"),
}
# (family, config overrides): the load-balancing loss at a coefficient large enough that a wrong gradient of it shows
CASES = {
    "qwen3_moe-aux": ("qwen3_moe", dict(norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=0.5)),
    "mixtral-aux": ("mixtral", dict(output_router_logits=True, router_aux_loss_coef=0.5)),
    "qwen3_moe": ("qwen3_moe", {}),
    # a dense layer (its own width, 24) after a sparse one, the aux loss over the sparse one alone
    "qwen3_moe-dense-layer": (
        "qwen3_moe",
        dict(mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.5),
    ),
    "qwen3_moe-sparse-step": ("qwen3_moe", dict(decoder_sparse_step=2)),  # layer 0 dense, layer 1 sparse
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_transformers(tmp_path, case, policy):
    family, overrides = CASES[case]
    hf = _saved(tmp_path, family, **overrides)
    model = from_hf(tmp_path, policy=POLICIES[policy], dtype=torch.float32)
    assert model.config.router_aux_loss == overrides.get("output_router_logits", False)
    assert [layer.experts is None for layer in model.layers] == [not hasattr(m.mlp, "experts") for m in hf.model.layers]
    ids, labels = _batch(hf)
    want = hf(ids, labels=labels).loss  # + coef · aux where the config outputs router logits
    want.backward()
    loss = model(ids, labels=labels)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0.0)
    for name, p in model.named_parameters():
        ref = _hf_grad(hf, name)
        atol = GRAD_TOL * ref.abs().max().item()
        torch.testing.assert_close(p.grad, ref, rtol=0.0, atol=atol, msg=lambda m: f"{name}: {m}")
    if policy != "none":
        assert model.swap_stats().tokens_recomputed > 0


# ---- what memo cannot run ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Returns family -> the config.json dict transformers writes for it."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        _hf_config(family).save_pretrained(path)
        out[family] = json.loads((path / "config.json").read_text())
    return out


@pytest.mark.parametrize(
    "family, changes, named",
    [
        ("qwen3_moe", {"mlp_only_layers": [0, 1]}, "mlp_only_layers"),  # no sparse layer left: a dense model
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"num_local_experts": 0}, "num_experts"),
        ("qwen3_moe", {"num_experts": 8}, "num_experts"),  # disagrees with the num_local_experts saved
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "max_window_layers"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_a_field_memo_cannot_run_is_named_in_a_one_line_error(configs, family, changes, named):
    with pytest.raises(ValueError, match=f"`{named}`") as err:
        config_from_hf({**configs[family], **changes})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_of_absent_fields_are_the_config_classes(configs, family):
    kept = "model_type hidden_size num_hidden_layers num_attention_heads intermediate_size vocab_size".split()
    kept += ["num_experts_per_tok", "num_local_experts"] + (["moe_intermediate_size"] if family == "qwen3_moe" else [])
    bare = {k: v for k, v in configs[family].items() if k in kept} | {"num_attention_heads": 8}  # Mixtral's 8 kv heads
    hf, ours = transformers.AutoConfig.for_model(**bare), config_from_hf(bare)
    assert ours.norm_topk_prob == getattr(hf, "norm_topk_prob", True)  # Qwen3MoeConfig's False; Mixtral always
    assert (ours.n_kv_heads, ours.norm_eps) == (hf.num_key_value_heads, hf.rms_norm_eps)
    assert (ours.rope_theta, ours.sliding_window) == (hf.rope_parameters["rope_theta"], hf.sliding_window)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert (ours.router_aux_loss, ours.router_aux_loss_coef) == (hf.output_router_logits, hf.router_aux_loss_coef)


def test_an_expert_tensor_missing_or_fused_is_named(tmp_path):
    _saved(tmp_path, "mixtral")
    tensors = load_file(tmp_path / "model.safetensors")
    gone = tensors.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = gone
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \[.*experts\.3\.w3\.weight.*unexpected \[.*gate_up_proj"):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    "fields, family, match",
    [
        ({"qk_norm": True}, "qwen3_moe", "Hugging Face qwen3_moe routes to experts"),
        ({"n_experts": E, "experts_per_token": K}, "llama", "Hugging Face llama has dense MLPs"),
        ({"n_experts": E, "experts_per_token": K, "norm_topk_prob": False}, "mixtral", "`norm_topk_prob`"),
        (
            {"n_experts": E, "experts_per_token": K, "sliding_window": 4, "layer_types": ("full_attention",) * 2},
            "mixtral",
            "slides every layer",
        ),
        ({"n_experts": E, "experts_per_token": K}, "qwen3_moe", "`qk_norm` True"),
    ],
)
def test_export_refuses_a_family_without_the_models_layers_in_one_line(tmp_path, fields, family, match):
    config = ModelConfig("llama", 2, 32, 4, 24, 64, hf_model_type=family, **fields)
    with pytest.raises(ValueError, match=match) as err:
        save_hf(config, Transformer(config).state_dict(), tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_memo_train_export_reload_and_eval_a_qwen3_moe_folder(tmp_path, capsys):
    """A tiny Qwen3-MoE folder through the CLI, the load-balancing loss on: train, export, transformers reads the
    export back with memo's logits, eval runs."""
    from memo.eval import load

    hf = _hf_model("qwen3_moe", vocab_size=256, max_position_embeddings=128, output_router_logits=True)  # byte tokens
    hf.save_pretrained(tmp_path / "moe")
    run, out, text = train_and_export(tmp_path / "moe", tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert back.config.output_router_logits and back.config.num_experts == E
    trained = load(run, torch.device("cpu"), torch.float32).model
    assert trained.config.router_aux_loss
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = back(ids)
        for layer_logits in theirs.router_logits:  # no near-tie between the k-th and (k+1)-th expert
            top = layer_logits.float().topk(K + 1, dim=-1).values
            assert (top[:, K - 1] - top[:, K]).min() > 1e-3
        torch.testing.assert_close(trained(ids), theirs.logits, rtol=1e-5, atol=1e-5)
    evaluates(run, text, capsys)


def test_a_dense_layer_among_sparse_ones_round_trips(tmp_path):
    hf = _saved(tmp_path / "theirs", "qwen3_moe", mlp_only_layers=[0])
    model = from_hf(tmp_path / "theirs", dtype=torch.float32)
    assert model.config.dense_layers == (0,) and model.layers[0].w_gate.weight.shape == (24, 32)
    back = _load_hf(to_hf(model, tmp_path / "ours"))
    assert back.config.mlp_only_layers == [0]
    theirs, ours = hf.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(ours[n], t) for n, t in theirs.items())
