"""memo.from_hf / memo.to_hf against `transformers`' own LlamaForCausalLM, the independent reference."""

import dataclasses
import json

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer, from_hf, to_hf
from memo.hf import hf_names

transformers = pytest.importorskip("transformers")

# fp32 on CPU, measured over 8 seeds: logits differ by <= 1.4e-5 (they reach ~6), gradients by <= 8e-6 of the
# tensor's largest entry; the tolerances leave 4-12x margin for other BLAS builds.
LOGITS_TOL = dict(rtol=1e-5, atol=5e-5)
GRAD_REL_TOL = 1e-4  # times each tensor's max |grad|: gradient scales differ by orders of magnitude


def _hf_model(**overrides):
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attn_implementation="eager",
    )
    kwargs.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).float()
    _randomize(model)
    return model.eval()


def _randomize(model: torch.nn.Module) -> None:
    # Large weights make attention far from uniform, so a wrong RoPE pairing, theta or eps shows up;
    # norm weights away from 1 so a dropped one would too.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))


def _batch():
    ids = torch.randint(0, 128, (2, 24))
    labels = ids.clone()
    labels[:, :3] = -100  # both sides must average over the same (non-ignored, shifted) targets
    return ids, labels


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
    hf_params = dict(hf.named_parameters())
    names = hf_names(model.config.n_layers)
    for name, p in model.named_parameters():
        ref = hf_params[names[name]].grad
        atol = GRAD_REL_TOL * ref.abs().max().item()
        torch.testing.assert_close(p.grad, ref, rtol=GRAD_REL_TOL, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "theta, eps, shard",
    [(10000.0, 1e-6, None), (500.0, 1e-2, "20KB")],
    ids=["default-rope-single-file", "theta500-eps1e-2-sharded"],
)
def test_from_hf_matches_transformers_logits_loss_and_gradients(tmp_path, theta, eps, shard):
    hf = _hf_model(rope_theta=theta, rms_norm_eps=eps)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = from_hf(tmp_path)
    assert model.config.rope_theta == theta and model.config.norm_eps == eps
    assert model.config.n_kv_heads == 2 and model.embed.weight.dtype == torch.float32
    _assert_matches_hf(model, hf)


@pytest.mark.parametrize(
    "policy",
    [
        ActivationPolicy("full"),
        ActivationPolicy("memo", alpha=0.5),
        ActivationPolicy("memo", alpha=0.5, offload_last_layers=True),
    ],
    ids=["full", "memo-a0.5", "memo-a0.5-all-layers"],
)
def test_policies_on_a_loaded_checkpoint_match_transformers(tmp_path, policy):
    hf = _hf_model(rope_theta=500.0)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path, policy=policy)
    _assert_matches_hf(model, hf)
    assert model.swap_stats().tokens_recomputed > 0  # the policy really recomputed part of the layers


def test_interleaved_rope_pairing_would_be_caught(tmp_path):
    # Meta's original checkpoints pair (2i, 2i+1); HF permutes q/k rows into halves. Undoing that permutation
    # must break the match, or the logits check above could not tell the two conventions apart.
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    d = model.config.head_dim
    halves_to_pairs = torch.arange(d).view(2, d // 2).t().reshape(-1)
    with torch.no_grad():
        for layer in model.layers:
            for w in (layer.wq.weight, layer.wk.weight):
                w.copy_(w.view(-1, d, w.shape[1])[:, halves_to_pairs].reshape_as(w))
        ids, _ = _batch()
        assert not torch.allclose(model(ids), hf(ids).logits, **LOGITS_TOL)


def test_tied_embeddings_are_copied_into_the_head(tmp_path):
    hf = _hf_model(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert torch.equal(model.head.weight, model.embed.weight)
    assert model.head.weight.data_ptr() != model.embed.weight.data_ptr()
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **LOGITS_TOL)


def test_transformers_4x_config_layout_gives_the_same_config(tmp_path):
    _hf_model(rope_theta=500.0).save_pretrained(tmp_path)
    new = from_hf(tmp_path).config
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"], cfg["num_key_value_heads"], cfg["head_dim"]
    cfg.update(rope_theta=500.0, rope_scaling=None, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert from_hf(tmp_path).config == new


def test_dtype_is_kept_or_cast(tmp_path):
    _hf_model().to(torch.bfloat16).save_pretrained(tmp_path)
    assert {p.dtype for p in from_hf(tmp_path).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in from_hf(tmp_path, dtype=torch.float32).parameters()} == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_hf_loads_in_transformers_without_missing_keys_and_round_trips(tmp_path, dtype):
    config = ModelConfig.preset("tiny", rope_theta=500.0, norm_eps=1e-3)
    model = Transformer(config)
    _randomize(model)
    model.to(dtype)
    out = tmp_path / "ckpt"
    to_hf(Transformer(config), out)
    to_hf(model, out)  # replaces the files of an existing checkpoint
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left behind
    back = from_hf(out)
    assert dataclasses.replace(back.config, name=config.name) == config
    for name, p in back.state_dict().items():
        assert p.dtype == dtype and torch.equal(p, model.state_dict()[name]), name
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert all(not v for v in info.values()), info
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.rms_norm_eps == 1e-3
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model.float()(ids), hf.float()(ids).logits, **LOGITS_TOL)


def test_to_hf_rejects_gpt_arch(tmp_path):
    with pytest.raises(ValueError, match="only arch 'llama'"):
        to_hf(Transformer(ModelConfig.preset("tiny-gpt")), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())


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
    with pytest.raises(FileNotFoundError, match="model-00002"):
        from_hf(saved)


def test_pickle_checkpoints_are_not_read(saved):
    for f in saved.glob("model*"):
        f.unlink()
    (saved / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        from_hf(saved)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("head_dim", 32),
        ("attention_dropout", 0.1),
        ("model_type", "qwen2"),
    ],
)
def test_unsupported_config_field_is_named_in_the_error(saved, field, value):
    cfg = json.loads((saved / "config.json").read_text())
    cfg[field] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"`{field}`"):
        from_hf(saved)


@pytest.mark.parametrize(
    "field, value, match", [("num_hidden_layers", 5, "missing"), ("intermediate_size", 80, "shape")]
)
def test_weights_disagreeing_with_config_are_a_clear_error(saved, field, value, match):
    cfg = json.loads((saved / "config.json").read_text())
    cfg[field] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        from_hf(saved)


def test_extra_tensors_are_a_clear_error(tmp_path):
    _hf_model().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.3"):
        from_hf(tmp_path)
