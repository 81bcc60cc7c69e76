"""Gemma 3 text in memo's own layer against transformers' Gemma3ForCausalLM (fp32, eager attention): its four norms
scaling by 1 + weight, tanh-GELU MLP, √h embedding scale, query_pre_attn_scalar, sliding layers at 4x their
window with their own RoPE base beside scaled global layers; under every strategy, tiles that do not divide s, a
per-layer plan and packed documents; export and the text tower of a multimodal `gemma3` folder."""

from __future__ import annotations

import json

import pytest
import ranks
import torch
from cli_runs import evaluates, train_and_export
from safetensors.torch import load_file, save_file

from memo import ActivationPolicy, from_hf, patch, to_hf
from memo.hf import config_from_hf, config_token_ids, hf_name

transformers = pytest.importorskip("transformers")

SEQ, WINDOW, VOCAB = 24, 6, 128
LOGITS_TOL = dict(rtol=1e-5, atol=5e-5)
GRAD_REL_TOL = 1e-4  # times each tensor's max |grad| (tests/test_hf.py's convention)
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=TYPES,
    max_position_embeddings=64, rms_norm_eps=1e-6, attention_bias=True, pad_token_id=0, eos_token_id=1,
    bos_token_id=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
)  # fmt: skip
POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0": ActivationPolicy("memo", alpha=0.0, tile_tokens=5),  # 5 does not divide 24
    "memo-a0.5": ActivationPolicy("memo", alpha=0.5, tile_tokens=7),
    "memo-a1": ActivationPolicy("memo", alpha=1.0, offload_last_layers=True),
    "plan": ActivationPolicy("memo", alpha=0.5, plan=("checkpoint", "memo", "keep", "memo"), tile_tokens=5),
}


def _randomize(model: torch.nn.Module) -> None:
    """Large weights, norm weights away from 0 (the scale is 1 + w) and biases away from 0, so that a dropped
    norm, offset, scale or bias shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))


def _gemma(**overrides):
    config = transformers.Gemma3TextConfig(**{**TEXT, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float()
    _randomize(model)
    return model.eval()


def _batch(b: int = 2):
    ids = torch.randint(3, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def _assert_matches(model, hf, ids, labels, **inputs) -> None:
    """Checks logits, loss and every gradient of `model` (memo's, or a patched transformers one: its own names)
    against `hf` on the same batch."""
    patched = isinstance(model, transformers.PreTrainedModel)
    with torch.no_grad():
        got = model(input_ids=ids, **inputs).logits if patched else model(ids)
        torch.testing.assert_close(got, hf(input_ids=ids, **inputs).logits, **LOGITS_TOL)
    hf_loss = hf(input_ids=ids, labels=labels, **inputs).loss
    hf_loss.backward()
    loss = model(input_ids=ids, labels=labels, **inputs).loss if patched else model(ids, labels=labels)
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
    theirs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        ref = theirs[name if patched else hf_name(name, "gemma3_text")].grad
        atol = GRAD_REL_TOL * ref.abs().max().item()
        torch.testing.assert_close(p.grad, ref, rtol=GRAD_REL_TOL, atol=atol, msg=lambda m: f"{name}: {m}")


def test_config_maps_every_gemma_feature():
    c = config_from_hf(_gemma().config.to_dict())
    assert (c.norm_offset, c.sandwich_norms, c.mlp_activation, c.scale_embeddings) == (1.0, True, "gelu_tanh", True)
    assert (c.query_pre_attn_scalar, c.rope_local_theta, c.rope_theta, c.rope_scaling.factor) == (24, 50.0, 500.0, 2.0)
    assert [c.window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW] and c.qk_norm and c.tie_embeddings


@pytest.mark.parametrize("policy", POLICIES)
def test_gemma3_at_4x_its_window_matches_transformers(tmp_path, policy):
    hf = _gemma()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path, policy=POLICIES[policy])
    _assert_matches(model, hf, *_batch())
    if policy.startswith(("memo", "plan")):
        assert model.swap_stats().tokens_recomputed > 0 or policy == "memo-a1"


def test_packed_documents_attend_and_slide_within_their_own_document(tmp_path):
    hf = _gemma()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path, policy=POLICIES["memo-a0.5"])
    ids = _batch(1)[0]
    lengths = (10, 14)  # the second document is longer than twice the window
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, positions=positions)
        alone = torch.cat([hf(part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, **LOGITS_TOL)


def test_export_loads_in_transformers_with_the_same_logits_and_config(tmp_path):
    hf = _gemma()
    hf.save_pretrained(tmp_path / "in")
    model = from_hf(tmp_path / "in")
    to_hf(model, tmp_path / "out", seq_len=SEQ)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == "Gemma3ForCausalLM" and back.config.layer_types == TYPES
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, **LOGITS_TOL)
    assert config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()), "in") == model.config


def _multimodal(path, tied: bool = True):
    """Saves a tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower beside the text model) and returns it;
    `tied` is the outer config's, which the multimodal class ties its head by (its text_config says True)."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=tied
    )
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    _randomize(model)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("layout, tied", [("transformers 5", True), ("released", True), ("transformers 5", False)])
def test_the_text_tower_of_a_multimodal_gemma3_folder_matches_its_text_model(tmp_path, layout, tied):
    mm = _multimodal(tmp_path, tied)
    assert mm.config.text_config.tie_word_embeddings  # the inner flag says tied whatever the outer one says
    if layout == "released":  # the Hub's files: language_model.model.* and language_model.lm_head.weight
        state = load_file(tmp_path / "model.safetensors")
        renamed = {k.replace("model.language_model.", "language_model.model."): v for k, v in state.items()}
        save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = from_hf(tmp_path, policy=POLICIES["memo-a0.5"])
    assert model.config.hf_model_type == "gemma3_text" and model.config.tie_embeddings == tied
    assert config_token_ids(tmp_path) == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}  # text_config's
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), mm(input_ids=ids).logits, **LOGITS_TOL)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("hidden_activation", "gelu", "hidden_activation"),
    ],
)
def test_what_memo_does_not_run_is_one_line_naming_the_field(field, value, named):
    cfg = {**_gemma().config.to_dict(), field: value}
    with pytest.raises(ValueError, match=f"`{named}`") as err:
        config_from_hf(cfg)
    assert "\n" not in str(err.value)


def test_memo_patch_trains_gemma_packed_as_transformers_does():
    """tests/test_patch.py runs every family case on Gemma too; here its four norms under packed position_ids."""
    import copy

    reference = _gemma()
    patched = patch(copy.deepcopy(reference), ActivationPolicy("memo", alpha=0.5, tile_tokens=5))
    ids, labels = _batch(1)
    positions = torch.cat([torch.arange(n) for n in (10, 14)])[None]
    labels[positions == 0] = -100
    _assert_matches(patched, reference, ids, labels, position_ids=positions, use_cache=False)


def test_memo_patch_refuses_a_multimodal_gemma_naming_the_families_it_runs(tmp_path):
    with pytest.raises(
        ValueError, match="gemma3_text, qwen3_moe, mixtral causal LMs, got Gemma3ForConditionalGeneration"
    ):
        patch(_multimodal(tmp_path))


def _sp_rank(rank: int, port: int, root: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from memo.parallel import full_gradients, init_mesh, parallelize, shard_batch

    ranks.join(rank, 2, port)
    try:
        mesh = init_mesh(2, timeout=timedelta(seconds=60))
        hf = transformers.AutoModelForCausalLM.from_pretrained(root, attn_implementation="eager").eval()
        model = parallelize(from_hf(root, policy=POLICIES["memo-a0.5"]), mesh)
        ids, labels = _batch()
        hf_loss = hf(ids, labels=labels).loss
        hf_loss.backward()
        local_ids, targets = shard_batch(ids, labels, mesh)
        loss = model(local_ids, targets=targets)
        loss.backward()
        torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
        theirs = dict(hf.named_parameters())
        for name, grad in full_gradients(model).items():
            ref = theirs[hf_name(name, "gemma3_text")].grad
            torch.testing.assert_close(grad, ref, rtol=GRAD_REL_TOL, atol=GRAD_REL_TOL * ref.abs().max().item())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_sp2_matches_transformers(tmp_path, free_port):
    import torch.multiprocessing as mp

    _gemma().save_pretrained(tmp_path)  # 12 tokens a rank: the window of 6 crosses the ranks' boundary
    mp.spawn(_sp_rank, args=(free_port(), str(tmp_path)), nprocs=2)


def test_memo_train_export_reload_and_eval_a_gemma_folder(tmp_path, capsys):
    from memo.eval import load

    _gemma(vocab_size=256, max_position_embeddings=128).save_pretrained(tmp_path / "gemma")  # byte tokens
    run, out, text = train_and_export(tmp_path / "gemma", tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    trained = load(run, torch.device("cpu"), torch.float32).model
    ids = torch.randint(0, 256, (2, 40))  # past the window of 6 on every sliding layer
    with torch.no_grad():
        torch.testing.assert_close(trained(ids), back(ids).logits, **LOGITS_TOL)
    evaluates(run, text, capsys)


def test_the_12b_preset_has_the_published_text_models_parameters():
    from memo import ModelConfig

    # keras-hub's gemma3_12b_text: 11,765,788,416 parameters with a 262,144-token vocabulary; HF's has 64 more rows
    c = ModelConfig.preset("gemma3-12b")
    assert c.num_parameters() == 11_765_788_416 + 64 * c.hidden_size
    assert [c.window(i) for i in range(6)] == [1024] * 5 + [None] and c.attention_scale == 256**-0.5
    assert ModelConfig.preset("gemma3-27b").attention_scale == 168**-0.5


def test_gemma_norm_in_bf16_is_bitwise_transformers_own_scale_then_cast():
    """Gemma scales by 1 + w in fp32 and casts last, where Llama casts first: one bf16 rounding apart, too little
    for a model-level tolerance to see, so the norm is compared alone, bit for bit, forward and backward."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from memo.norms import OffsetRMSNorm, norm_backward, norm_forward

    theirs = Gemma3RMSNorm(64, eps=1e-6)
    ours = OffsetRMSNorm(64, 1e-6, 1.0)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.3)
        ours.weight.copy_(theirs.weight)
    theirs, ours = theirs.bfloat16(), ours.bfloat16()
    x = torch.randn(3, 5, 64).bfloat16().requires_grad_()
    y = theirs(x)
    got, stats = norm_forward(ours, x.detach())
    assert torch.equal(got, y)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, grads = norm_backward(ours, dy, x.detach(), stats)
    torch.testing.assert_close(dx, x.grad, rtol=1e-2, atol=1e-2)  # autograd's bf16 steps against fp32 ones
    torch.testing.assert_close(grads["weight"], theirs.weight.grad, rtol=1e-2, atol=1e-2)
