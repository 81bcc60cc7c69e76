"""memo.from_hf / memo.to_hf against transformers' own Llama, Mistral, Qwen2 and Qwen3 models, the independent
reference: logits, loss and every gradient under each RoPE scaling, strategy and sequence parallelism, the
exported folder loaded back by `AutoModelForCausalLM`, and a one-line error for every feature memo cannot run.
All checkpoints are tiny random ones made with transformers' config classes and `save_pretrained`."""

import dataclasses
import json
import os
import re
import stat
from datetime import timedelta

import pytest
import ranks
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from memo import ActivationPolicy, ModelConfig, Transformer, from_hf, to_hf
from memo.cli import main
from memo.config import RopeScaling
from memo.hf import config_from_hf, config_to_hf, hf_name, save_hf, special_token_ids
from memo.plan.phases import attach
from memo.train import checkpoint
from memo.train.config import TrainConfig

transformers = pytest.importorskip("transformers")

# fp32 on CPU, measured over 8 seeds: logits differ by <= 1.4e-5 (they reach ~6), gradients by <= 8e-6 of the
# tensor's largest entry; the tolerances leave 4-12x margin for other BLAS builds.
LOGITS_TOL = dict(rtol=1e-5, atol=5e-5)
GRAD_REL_TOL = 1e-4  # times each tensor's max |grad|: gradient scales differ by orders of magnitude
SEQ = 24
WINDOW = SEQ // 4  # the windowed families run at 4x their window

# Each family with the features its config can switch on, so that every mapping is exercised.
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, head_dim=24)),  # head_dim != 64 / 4
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),  # every layer slides
    "qwen2": (  # the layers from the second on slide
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=True, tie_word_embeddings=True)),
}
# (rope_parameters, max_position_embeddings): dynamic is checked past max_position_embeddings (SEQ > 16), where it
# stretches; yarn and llama3 with a wide spread of wavelengths around their original length.
ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 500.0}, 64),
    "linear": ({"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}, 16),
    "yarn": ({"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    "llama3": (
        {
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        256,
    ),
}


def _hf_config(family="llama", rope="default", **overrides):
    cls, features = FAMILIES[family]
    parameters, max_positions = ROPES[rope]
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_positions,
        rope_parameters=dict(parameters),
        **features,
    )
    kwargs.update(overrides)
    return getattr(transformers, cls)(**kwargs)


def _hf_model(family="llama", rope="default", **overrides):
    config = _hf_config(family, rope, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    _randomize(model)
    return model.eval()


def _saved(path, family="llama", rope="default", **overrides):
    hf = _hf_model(family, rope, **overrides)
    hf.save_pretrained(path)
    return hf


def _randomize(model: torch.nn.Module) -> None:
    # Large weights make attention far from uniform, so a wrong RoPE pairing, theta or eps shows up;
    # norm weights away from 1 and biases away from 0 so a dropped one would too.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))


def _batch(seq=SEQ):
    ids = torch.randint(0, 128, (2, seq))
    labels = ids.clone()
    labels[:, :3] = -100  # both sides must average over the same (non-ignored, shifted) targets
    return ids, labels


def _assert_grads_match(grads: dict, hf, where: str = "") -> None:
    hf_params = dict(hf.named_parameters())
    for name, grad in grads.items():
        ref = hf_params[hf_name(name)].grad
        atol = GRAD_REL_TOL * ref.abs().max().item()
        torch.testing.assert_close(grad, ref, rtol=GRAD_REL_TOL, atol=atol, msg=lambda m: f"{where} {name}: {m}")


def _assert_matches_hf(model: Transformer, hf) -> None:
    """Checks logits, mean next-token loss and every parameter gradient against `hf`."""
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)
    hf_loss = hf(ids, labels=labels).loss
    hf_loss.backward()
    loss = model(ids, labels=labels)
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, rtol=1e-6, atol=1e-6)
    _assert_grads_match({n: p.grad for n, p in model.named_parameters()}, hf)


# ---- memo's model is transformers' model ----------------------------------------------------------------


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_matches_transformers_logits_loss_and_gradients(tmp_path, family, rope):
    hf = _saved(tmp_path, family, rope)
    model = from_hf(tmp_path)
    c = model.config
    assert c.hf_model_type == family and c.rope_theta == 500.0 and c.n_kv_heads == 2
    assert (c.rope_scaling.type if c.rope_scaling else "default") == rope
    assert c.max_position_embeddings == ROPES[rope][1]
    _assert_matches_hf(model, hf)


def test_family_features_map_to_model_config():
    expected = {  # (kv_channels, qkv_bias, out_bias, mlp_bias, qk_norm, tied, window of each layer)
        "llama": (24, True, True, True, False, False, (None, None)),
        "mistral": (None, False, False, False, False, False, (WINDOW, WINDOW)),
        "qwen2": (None, True, False, False, False, True, (None, WINDOW)),
        "qwen3": (32, True, True, False, True, True, (None, None)),
    }
    for family, want in expected.items():
        c = config_from_hf(_hf_config(family).to_dict())
        windows = (c.window(0), c.window(1))
        got = (c.kv_channels, c.qkv_bias, c.out_bias, c.mlp_bias, c.qk_norm, c.tie_embeddings, windows)
        assert got == want, family


def test_tied_embeddings_stay_one_parameter(tmp_path):
    hf = _saved(tmp_path, "qwen3")
    model = from_hf(tmp_path)
    assert model.head is None and model.head_weight is model.embed.weight
    assert "head.weight" not in dict(model.named_parameters())
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)


@pytest.mark.parametrize(
    "variant",
    [
        {"attention_factor": 1.3, "beta_fast": 8.0, "beta_slow": 2.0},
        {"truncate": False},
        {"mscale": 0.9, "mscale_all_dim": 0.6},  # folded into the attention factor, as transformers does
        {"factor": None},  # max_position_embeddings / original_max_position_embeddings
    ],
    ids=["attention-factor-betas", "no-truncate", "mscale", "implicit-factor"],
)
def test_yarn_variants_match_transformers(tmp_path, variant):
    parameters = {**ROPES["yarn"][0], **variant}
    hf = _saved(tmp_path, "qwen3", "yarn", rope_parameters=parameters)
    model = from_hf(tmp_path)
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)


POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0.5": ActivationPolicy("memo", alpha=0.5),
    "memo-a0.5-all-layers": ActivationPolicy("memo", alpha=0.5, offload_last_layers=True),
}


@pytest.mark.parametrize(
    "family, rope, policy",
    [(f, r, p) for f, r in zip(FAMILIES, ("llama3", "dynamic", "yarn", "linear")) for p in ("full", "memo-a0.5")]
    + [("qwen3", "yarn", "memo-a0.5-all-layers")],
)
def test_policies_on_a_loaded_checkpoint_match_transformers(tmp_path, family, rope, policy):
    hf = _saved(tmp_path, family, rope, num_hidden_layers=4)  # memo keeps the last layers' tensors by default
    model = from_hf(tmp_path, policy=POLICIES[policy])
    _assert_matches_hf(model, hf)
    assert model.swap_stats().tokens_recomputed > 0  # the policy really recomputed part of the layers


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qwen2: a full layer, then a windowed one (other ops)
def test_phase_planner_on_a_loaded_checkpoint_matches_transformers(tmp_path, family):
    hf = _saved(tmp_path, family, "yarn")
    model = from_hf(tmp_path, policy=ActivationPolicy("memo", alpha=0.5))
    planner = attach(model, debug=True, time_limit=0.2)
    _assert_matches_hf(model, hf)
    assert not planner.unplanned, planner.unplanned  # each kind of layer has a plan of its own


def test_interleaved_rope_pairing_would_be_caught(tmp_path):
    # Meta's original checkpoints pair (2i, 2i+1); HF permutes q/k rows into halves. Undoing that permutation
    # must break the match, or the logits check above could not tell the two conventions apart.
    hf = _saved(tmp_path)
    model = from_hf(tmp_path)
    d = model.config.head_dim
    halves_to_pairs = torch.arange(d).view(2, d // 2).t().reshape(-1)
    with torch.no_grad():
        for layer in model.layers:
            for w, b in ((layer.wq.weight, layer.wq.bias), (layer.wk.weight, layer.wk.bias)):
                w.copy_(w.view(-1, d, w.shape[1])[:, halves_to_pairs].reshape_as(w))
                b.copy_(b.view(-1, d)[:, halves_to_pairs].reshape_as(b))
        ids, _ = _batch()
        assert not torch.allclose(model(ids), hf(ids).logits, **LOGITS_TOL)


@pytest.mark.parametrize("window", [SEQ - 1, 5, 2])  # 1 would leave q and k no gradient: nothing to compare
def test_sliding_windows_of_any_length_match_transformers(tmp_path, window):
    hf = _saved(tmp_path, "qwen2", sliding_window=window, num_hidden_layers=3, max_window_layers=1)
    model = from_hf(tmp_path, policy=POLICIES["memo-a0.5"])
    assert [layer.window for layer in model.layers] == [None, window, window]
    _assert_matches_hf(model, hf)


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-2)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = from_hf(tmp_path)
    assert model.config.rope_theta == 10000.0 and model.config.norm_eps == 1e-2
    _assert_matches_hf(model, hf)


def test_dtype_is_kept_or_cast(tmp_path):
    _hf_model().to(torch.bfloat16).save_pretrained(tmp_path)
    assert {p.dtype for p in from_hf(tmp_path).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in from_hf(tmp_path, dtype=torch.float32).parameters()} == {torch.float32}


# ---- sequence parallelism -------------------------------------------------------------------------------

SP_CASES = [("qwen3", "default", "memo-a0.5-all-layers"), ("llama", "dynamic", "none"), ("qwen2", "yarn", "full")]


def _sp_rank(rank: int, port: int, root: str) -> None:
    from memo.parallel import full_gradients, init_mesh, parallelize, shard_batch

    ranks.join(rank, 2, port)
    import torch.distributed as dist

    try:
        mesh = init_mesh(2, timeout=timedelta(seconds=60))
        for family, rope, policy in SP_CASES:
            path = f"{root}/{family}-{rope}"
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
            model = parallelize(from_hf(path, policy=POLICIES[policy]), mesh)
            torch.manual_seed(1)
            ids, labels = _batch(32)  # 16 tokens a rank: dynamic RoPE must stretch for all 32 (> 16 positions)
            hf_loss = hf(ids, labels=labels).loss
            hf_loss.backward()
            local_ids, targets = shard_batch(ids, labels, mesh)
            loss = model(local_ids, targets=targets)
            loss.backward()
            where = f"sp=2 {family} {rope} {policy}"
            torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
            _assert_grads_match(full_gradients(model), hf, where)
            assert policy == "none" or model.swap_stats().tokens_recomputed > 0, where
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_sp2_matches_transformers(tmp_path, free_port):
    for family, rope, _ in SP_CASES:  # 4 layers: memo rebuilds only the layers whose buffer is reused
        _saved(tmp_path / f"{family}-{rope}", family, rope, num_hidden_layers=4)
    mp.spawn(_sp_rank, args=(free_port(), str(tmp_path)), nprocs=2)


# ---- export ---------------------------------------------------------------------------------------------

EXPORTS = {  # a memo config per family, with the RoPE it trained with
    "llama": dict(
        kv_channels=24,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        max_position_embeddings=256,
        rope_scaling=RopeScaling("llama3", 8.0, original_max_positions=32),
    ),
    "mistral": dict(sliding_window=WINDOW, max_position_embeddings=16, rope_scaling=RopeScaling("dynamic", 2.0)),
    "qwen2": dict(
        qkv_bias=True,
        sliding_window=WINDOW,
        layer_types=("full_attention", "sliding_attention"),
        rope_scaling=RopeScaling(
            "yarn", 4.0, original_max_positions=16, beta_fast=8.0, attention_factor=1.3, truncate=False
        ),
    ),
    "qwen3": dict(kv_channels=32, qk_norm=True, rope_scaling=RopeScaling("linear", 2.0)),
}


def _memo_model(family: str, tied: bool, dtype=torch.float32) -> Transformer:
    config = ModelConfig(
        "llama",
        2,
        64,
        4,
        96,
        128,
        n_kv_heads=2,
        norm_eps=1e-3,
        rope_theta=500.0,
        tie_embeddings=tied,
        hf_model_type=family,
        **EXPORTS[family],
    )
    model = Transformer(config)
    _randomize(model)
    return model.to(dtype)


def _load_hf(path):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager"
    )
    assert all(not v for v in info.values()), info  # no missing, unexpected or mismatched keys
    return hf.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family, tied):
    model = _memo_model(family, tied)
    out = to_hf(model, tmp_path / "ckpt", seq_len=SEQ)
    hf = _load_hf(out)
    assert hf.config.model_type == family and type(hf).__name__ == hf.config.architectures[0]
    assert hf.config.tie_word_embeddings is tied
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) is tied
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
    ids = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)
    back = from_hf(out)  # and back: the same model
    assert dataclasses.replace(back.config, name="x") == dataclasses.replace(
        model.config, name="x", max_position_embeddings=hf.config.max_position_embeddings
    )
    for name, p in back.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name


def test_export_replaces_an_existing_checkpoint_and_keeps_bf16(tmp_path):
    model = _memo_model("llama", tied=False, dtype=torch.bfloat16)
    out = tmp_path / "ckpt"
    to_hf(_memo_model("qwen3", tied=True), out)
    to_hf(model, out)  # replaces the files of an existing checkpoint
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left behind
    back = from_hf(out)
    for name, p in back.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, model.state_dict()[name]), name
    assert _load_hf(out).config.model_type == "llama"


def _tokenizer(folder, with_config: bool):
    from tokenizers import Tokenizer, models

    tokens = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>", "<pad>", *(f"t{i}" for i in range(20))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if with_config:  # an instruct model: its eos is <|im_end|>, and it has no bos
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
            "pad_token": "<pad>",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def test_special_tokens_come_from_tokenizer_config_else_the_usual_names(tmp_path):
    plain = _tokenizer(tmp_path / "plain", with_config=False)
    assert special_token_ids(plain) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 4}
    chat = _tokenizer(tmp_path / "chat", with_config=True)
    assert special_token_ids(chat.parent) == {"bos_token_id": None, "eos_token_id": 3, "pad_token_id": 4}


def test_export_writes_trained_length_rope_tokens_generation_config_and_modes(tmp_path):
    old = os.umask(0o022)
    try:
        model = _memo_model("llama", tied=True)
        out = to_hf(model, tmp_path / "ckpt", seq_len=4096, tokenizer=_tokenizer(tmp_path / "tok", with_config=True))
    finally:
        os.umask(old)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096  # the trained length, above the config's 256
    assert cfg["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    assert cfg["rope_theta"] == 500.0 and cfg["rope_scaling"]["rope_type"] == "llama3"  # 4.x's layout as well
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, 3, 4)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (None, 3, 4)
    assert sorted(p.name for p in out.iterdir()) == [
        ".memo",  # memo's mark: a later export may replace the folder whole
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    hf = _load_hf(out)
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.eos_token_id == 3


def test_dynamic_rope_export_keeps_max_position_embeddings_its_frequencies_depend_on(tmp_path):
    model = _memo_model("mistral", tied=False)
    out = to_hf(model, tmp_path / "ckpt", seq_len=SEQ)
    hf = _load_hf(out)
    assert hf.config.max_position_embeddings == 16  # not SEQ: that would change the stretched frequencies
    ids = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hf_model_type="qwen2"), "`qkv_bias` True"),
        (dict(hf_model_type="mistral", mlp_bias=True), "`mlp_bias` False"),
        (dict(hf_model_type="llama", qk_norm=True), "`qk_norm` False"),
        (dict(hf_model_type="qwen3"), "`qk_norm` True"),
        (dict(hf_model_type="llama", qkv_bias=True), "`out_bias` True"),
        (dict(hf_model_type="llama", sliding_window=64), "no `sliding_window`"),
        (dict(hf_model_type="gemma"), "`hf_model_type` must be one of"),
    ],
)
def test_export_refuses_layers_the_family_lacks_in_one_line(tmp_path, overrides, match):
    model = Transformer(ModelConfig.preset("tiny", **overrides))
    with pytest.raises(ValueError, match=match) as err:
        to_hf(model, tmp_path / "ckpt")
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())


def test_export_refuses_weights_that_do_not_fit_the_config(tmp_path):
    model = _memo_model("qwen3", tied=True)
    weights = {**model.state_dict(), "head.weight": torch.zeros(128, 64)}
    with pytest.raises(ValueError, match=r"unexpected \['head.weight'\]"):
        save_hf(model.config, weights, tmp_path / "ckpt")
    assert not list(tmp_path.iterdir())


def test_export_picks_the_family_that_has_the_layers():
    from memo.hf import hf_family

    assert hf_family(ModelConfig.preset("tiny")) == "llama"
    assert hf_family(ModelConfig.preset("tiny", qk_norm=True)) == "qwen3"
    assert hf_family(ModelConfig.preset("tiny", qkv_bias=True)) == "qwen2"
    assert hf_family(ModelConfig.preset("tiny", sliding_window=64)) == "mistral"


def test_to_hf_rejects_gpt_arch(tmp_path):
    with pytest.raises(ValueError, match="only arch 'llama'"):
        to_hf(Transformer(ModelConfig.preset("tiny-gpt")), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())


def test_memo_export_hf_writes_a_run_as_a_transformers_checkpoint(tmp_path, capsys):
    source = tmp_path / "qwen3"
    _saved(source, "qwen3", "yarn")
    tokenizer = _tokenizer(tmp_path / "tok", with_config=False)
    model = from_hf(source)
    masters = {f"{n}.master": p.detach() + 0.01 for n, p in model.named_parameters()}  # the fp32 truth
    weights = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    cfg = TrainConfig(model=str(source), seq_len=512, tokenizer=str(tokenizer))
    run = tmp_path / "run"
    checkpoint.save(run, 3, weights, masters, {"config": cfg.to_dict()}, keep=1)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    hf = _load_hf(out)
    assert hf.config.max_position_embeddings == 512 and hf.config.dtype == torch.float32
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (1, 2, 4)
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    with torch.no_grad():
        for p in model.parameters():
            p += 0.01
        ids = torch.randint(0, 128, (2, SEQ))
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)
    old = os.umask(0o022)
    try:
        assert main(["export", str(run)]) == 0  # the plain export: memo names in one file
    finally:
        os.umask(old)
    plain = capsys.readouterr().out.strip()
    assert plain.endswith("export/model.safetensors") and stat.S_IMODE(os.stat(plain).st_mode) == 0o644
    from safetensors.torch import load_file

    assert load_file(plain).keys() == weights.keys()


@pytest.mark.parametrize("model, match", [("gone", "is neither a preset"), ("tiny-gpt", "only arch 'llama'")])
def test_memo_export_hf_of_a_run_it_cannot_convert_exits_2_with_one_line(tmp_path, capsys, model, match):
    weights = Transformer(ModelConfig.preset("tiny-gpt")).state_dict()
    cfg = TrainConfig(model=str(tmp_path / model) if model == "gone" else model)
    checkpoint.save(tmp_path / "run", 1, weights, {}, {"config": cfg.to_dict()}, keep=1)
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1 and not (tmp_path / "hf").exists()


def test_export_finds_the_tokenizer_that_tokenized_a_runs_token_file(tmp_path):
    from memo.train.checkpoint import run_tokenizer

    tokens = tmp_path / "tokens.bin"
    (tmp_path / "tokens.json").write_text(json.dumps({"tokenizer": "/data/tokenizer.json"}))
    assert run_tokenizer({"data": str(tokens), "tokenizer": None}) == "/data/tokenizer.json"
    assert run_tokenizer({"data": str(tokens), "tokenizer": "given.json"}) == "given.json"
    (tmp_path / "tokens.json").write_text(json.dumps({"tokenizer": "bytes"}))
    assert run_tokenizer({"data": str(tokens), "tokenizer": None}) is None
    assert run_tokenizer({"data": None, "tokenizer": None}) is None


# ---- both config layouts, and what memo cannot run ------------------------------------------------------


def _as_4x(cfg: dict) -> dict:
    """Returns a 5.x config.json dict in transformers 4.x's layout: rope_theta and rope_scaling (with the older
    `type` key) at the top, torch_dtype, no layer_types."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype", None)
    cfg.pop("layer_types", None)
    return cfg


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_4x_and_5x_config_layouts_give_the_same_config(tmp_path, family, rope):
    _hf_config(family, rope).save_pretrained(tmp_path)
    new = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new and "rope_scaling" not in new
    assert config_from_hf(_as_4x(new)) == config_from_hf(new)


# written by transformers 4.57.1's Qwen2Config(...).save_pretrained with the features and RoPE of "qwen2", "yarn"
QWEN2_YARN_4_57 = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "dtype": "float32",
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "layer_types": ["full_attention", "sliding_attention"],
    "max_position_embeddings": 256,
    "max_window_layers": 1,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64, "rope_type": "yarn"},
    "rope_theta": 500.0,
    "sliding_window": 32,
    "tie_word_embeddings": True,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": True,
    "vocab_size": 128,
}


def test_a_config_written_by_transformers_4x_reads_as_the_5x_one():
    assert config_from_hf(QWEN2_YARN_4_57) == config_from_hf(_hf_config("qwen2", "yarn", sliding_window=32).to_dict())


def test_exported_config_reads_the_same_in_either_layout(tmp_path):
    out = to_hf(_memo_model("qwen2", tied=True), tmp_path / "ckpt", seq_len=SEQ)
    cfg = json.loads((out / "config.json").read_text())
    only_5x = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    only_4x = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    assert config_from_hf(only_5x) == config_from_hf(only_4x) == config_from_hf(cfg)


def test_defaults_of_absent_fields_are_each_config_class_defaults():
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128)
    assert config_from_hf({**base, "model_type": "qwen3"}).head_dim == 128  # Qwen3Config's head_dim
    assert config_from_hf({**base, "model_type": "mistral"}).sliding_window == 4096
    assert config_from_hf({**base, "model_type": "llama"}).max_position_embeddings == 2048
    qwen2 = config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True})
    assert qwen2.sliding_window is None  # no layer slides: 2 layers, the first 28 never do


@pytest.mark.parametrize(
    "family, field, value, named",
    [
        (
            "llama",
            "rope_parameters",
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            "rope_parameters.rope_type",
        ),
        ("llama", "rope_scaling", {"type": "su", "factor": 2.0}, "rope_scaling.rope_type"),
        ("llama", "rope_parameters", {"full_attention": {"rope_type": "default"}}, "rope_parameters"),
        ("llama", "partial_rotary_factor", 0.5, "partial_rotary_factor"),
        (
            "qwen3",
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial_rotary_factor",
        ),
        ("llama", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}, "rope_parameters"),
        ("llama", "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "rope_parameters"),
        ("mistral", "hidden_act", "gelu", "hidden_act"),
        ("qwen2", "attention_dropout", 0.1, "attention_dropout"),
        ("qwen3", "layer_types", ["full_attention", "chunked_attention"], "layer_types"),
        ("llama", "quantization_config", {"quant_method": "gptq"}, "quantization_config"),
        ("llama", "model_type", "gemma", "model_type"),
    ],
)
def test_unsupported_config_field_is_named_in_a_one_line_error(tmp_path, family, field, value, named):
    _saved(tmp_path, family)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"`{named}`") as err:
        from_hf(tmp_path)
    assert "\n" not in str(err.value)


# ---- files that are missing or disagree -----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    _hf_model().save_pretrained(tmp_path, max_shard_size="20KB")
    return tmp_path


def test_missing_config_json_is_a_clear_error(saved):
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(saved)


def test_missing_weights_are_a_clear_error(saved):
    (saved / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_hf(saved)


def test_missing_shard_is_a_clear_error(saved):
    next(saved.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="model-00002"):
        from_hf(saved)


def test_pickle_checkpoints_are_not_read(saved):
    for f in saved.glob("model*"):
        f.unlink()
    (saved / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        from_hf(saved)


@pytest.mark.parametrize(
    "field, value, match",
    [("num_hidden_layers", 3, "missing"), ("intermediate_size", 80, "shape"), ("attention_bias", False, "unexpected")],
)
def test_weights_disagreeing_with_config_are_a_clear_error(saved, field, value, match):
    cfg = json.loads((saved / "config.json").read_text())
    cfg[field] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        from_hf(saved)


def test_extra_tensors_are_a_clear_error(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1"):
        from_hf(tmp_path)


# ---- bad config.json values and bad safetensors: one line naming the file (and field or tensor) ----------


def _config_json(**overrides) -> dict:
    config = config_to_hf(ModelConfig.preset("tiny"), torch.float32)
    return {**config, **overrides}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_attention_heads": 0}, "`num_attention_heads` must be a positive integer up to 16M, got 0"),
        ({"hidden_size": "64"}, "`hidden_size` must be a positive integer up to 16M, got '64'"),
        ({"num_hidden_layers": True}, "`num_hidden_layers` must be a positive integer up to 16M, got True"),
        ({"intermediate_size": 96.5}, "`intermediate_size` must be a positive integer up to 16M, got 96.5"),
        ({"vocab_size": -1}, "`vocab_size` must be a positive integer up to 16M, got -1"),
        ({"hidden_size": 66, "head_dim": None}, "`num_attention_heads` (4) must divide `hidden_size` (66)"),
        ({"num_key_value_heads": 3}, "`num_key_value_heads` (3) must divide `num_attention_heads` (4)"),
        ({"head_dim": 15}, "the head dimension (`head_dim`) must be even"),
        ({"rms_norm_eps": "1e-6"}, "`rms_norm_eps` must be a finite number > 0, got '1e-6'"),
        ({"attention_bias": "false"}, "`attention_bias` must be true or false, got 'false'"),
        ({"tie_word_embeddings": 1}, "`tie_word_embeddings` must be true or false, got 1"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "`rope_theta` must be a finite"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "`--rope-factor` must be a finite number >= 1"),
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": "2"}, "`max_window_layers` must"),
        ({"model_type": ["llama"]}, "`model_type` = ['llama'] is not supported"),
        ({"model_type": "qwen3", "layer_types": "full_attention"}, "`layer_types` = 'full_attention' is not supported"),
    ],
)
def test_a_config_json_value_memo_cannot_shape_a_model_of_is_one_line_naming_file_and_field(overrides, message):
    with pytest.raises(ValueError) as err:
        config_from_hf(_config_json(**overrides), source="ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json: ") and message in str(err.value), err.value
    assert "\n" not in str(err.value)


def test_a_bad_config_json_is_one_line_from_the_cli(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(_config_json(num_attention_heads=0)))
    assert main(["estimate", "--model", str(tmp_path / "ckpt"), "--seq", "4K", "--gpus", "1", "--gpu", "h200"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "config.json: `num_attention_heads` must be a positive integer" in err


@pytest.fixture
def tiny_ckpt(tmp_path):
    """A one-layer `tiny` checkpoint as memo exports it, and its tensors (HF names)."""
    path = to_hf(Transformer(ModelConfig.preset("tiny", n_layers=1)), tmp_path / "ckpt")
    return path, load_file(path / "model.safetensors")


def _sharded(path, tensors: dict, weight_map: dict) -> None:
    """Rewrites the checkpoint as shards `weight_map` names (file -> its tensors) and an index of `weight_map`."""
    (path / "model.safetensors").unlink()
    for file in set(weight_map.values()):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, path / file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_truncated_safetensors_file_is_one_line_naming_it(tiny_ckpt):
    path, _ = tiny_ckpt
    data = (path / "model.safetensors").read_bytes()
    for broken in (data[:1000], data[:-8], b"not a safetensors file"):
        (path / "model.safetensors").write_bytes(broken)
        with pytest.raises(ValueError, match=f"^{path / 'model.safetensors'}: safetensors cannot read it: "):
            from_hf(path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", 7])
def test_an_index_naming_a_shard_outside_the_folder_is_refused_unread(tiny_ckpt, shard):
    path, tensors = tiny_ckpt
    _sharded(path, tensors, {n: "model-1.safetensors" for n in tensors})
    save_file(tensors, path.parent / "outside.safetensors")  # a readable file there: refused all the same
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"index.json: shard {re.escape(repr(shard))} is not a file in the checkpoint"):
        from_hf(path)


def test_an_index_naming_the_wrong_shard_for_a_tensor_is_one_line_naming_the_shard(tiny_ckpt):
    path, tensors = tiny_ckpt
    weight_map = {n: f"model-{i % 2}.safetensors" for i, n in enumerate(sorted(tensors))}
    _sharded(path, tensors, weight_map)
    moved = sorted(tensors)[0]
    index = {"weight_map": {**weight_map, moved: "model-1.safetensors"}}  # it is in model-0
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"model-1.safetensors: safetensors cannot read it: .*{re.escape(moved)}"):
        from_hf(path)


def test_a_missing_shard_is_a_value_error_naming_it(tiny_ckpt):
    path, tensors = tiny_ckpt
    _sharded(path, tensors, {n: "model-1.safetensors" for n in tensors})
    (path / "model-1.safetensors").unlink()
    with pytest.raises(ValueError, match="names a shard that is missing: .*model-1.safetensors"):
        from_hf(path)


@pytest.mark.parametrize(
    "tensor, message",
    [
        (torch.ones(3), r"model.norm.weight has shape \(3,\), config.json implies \(64,\)"),
        (torch.ones(64, dtype=torch.int32), "model.norm.weight has dtype int32, not floating point"),
        (torch.ones(64, dtype=torch.bool), "model.norm.weight has dtype bool, not floating point"),
    ],
)
def test_a_tensor_of_the_wrong_shape_or_dtype_is_one_line_naming_file_and_tensor(tiny_ckpt, tensor, message):
    path, tensors = tiny_ckpt
    save_file({**tensors, "model.norm.weight": tensor}, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"^{path / 'model.safetensors'}: {message}$"):
        from_hf(path)


def test_a_broken_shard_is_one_line_from_memo_train(tiny_ckpt, tmp_path, capsys):
    path, _ = tiny_ckpt
    (path / "model.safetensors").write_bytes(b"\x00" * 7)
    argv = ["train", "--model", str(path), "--seq-len", "64", "--batch-size", "2", "--steps", "2"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "model.safetensors: safetensors cannot read it" in err


def test_export_copies_a_tokenizer_file_of_any_name_as_tokenizer_json(tmp_path):
    trained = _tokenizer(tmp_path / "tok", with_config=False).rename(tmp_path / "tok" / "my-words.json")
    out = to_hf(Transformer(ModelConfig.preset("tiny")), tmp_path / "ckpt", tokenizer=trained)
    assert (out / "tokenizer.json").read_bytes() == trained.read_bytes()
