"""LoRA against PEFT's LoRA on the same transformers model (the independent reference): loss, adapter gradients
and the gradient that reaches the inputs (the embedding's), under every memory strategy, a per-layer plan and
Ulysses sp = 2; frozen weights get no gradient product and no optimizer state; adapters export as a folder PEFT
loads, merge into full weights, and a LoRA run resumes exactly."""

import json
import warnings
from datetime import timedelta

import pytest
import ranks
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from memo import ActivationPolicy, from_hf
from memo.adapter import peft_name
from memo.cli import main
from memo.lora import TARGETS, LoraConfig, apply_lora, keep_mask, module_shapes, set_dropout_keys
from memo.train import checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA, SEQ = 4, 8.0, 32
GRAD_REL_TOL = 1e-4  # times each tensor's max |grad|, as tests/test_hf.py measured for fp32 on CPU
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, head_dim=24)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
}
POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0.5-tiled": ActivationPolicy("memo", alpha=0.5, tile_tokens=12),
    "plan": ActivationPolicy("memo", alpha=(0.3, 0.0, 1.0, 0.5), plan=("checkpoint", "memo", "memo", "keep")),
}


def _save_base(path, family: str) -> None:
    """Saves a random 4-layer checkpoint of `family` to `path`."""
    cls, features = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **features,
    )
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    base.save_pretrained(path)


def _peft_model(path, targets=tuple(TARGETS)) -> torch.nn.Module:
    """Returns the checkpoint in `path` with PEFT adapters (B random, so that A's gradient is not zero) and a
    trainable embedding (its gradient is the inputs')."""
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    torch.manual_seed(2)
    names = [TARGETS[t][1] for t in targets]
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=names, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    model.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    return model.eval()


def _hf_lora(path, family: str, targets=tuple(TARGETS)) -> torch.nn.Module:
    _save_base(path, family)
    return _peft_model(path, targets)


def _memo_lora(path, hf, policy, targets=tuple(TARGETS)):
    """Returns memo's model of the checkpoint with the same adapters as `hf` and a trainable embedding."""
    model = apply_lora(from_hf(path, policy=policy), LoraConfig(RANK, ALPHA, targets))
    theirs = {n.replace(".default", ""): p for n, p in hf.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(theirs[peft_name(name)])
    model.embed.weight.requires_grad_(True)
    return model


def _batch(seq=SEQ):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, seq))
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def _assert_close(ours: dict, theirs: dict, where: str) -> None:
    assert ours.keys() == theirs.keys(), where
    for name, grad in ours.items():
        ref = theirs[name]
        atol = GRAD_REL_TOL * ref.abs().max().item()
        torch.testing.assert_close(grad, ref, rtol=GRAD_REL_TOL, atol=atol, msg=lambda m: f"{where} {name}: {m}")


def _trained_grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _peft_grads(hf, names) -> dict:
    """Returns PEFT's gradients under memo's names (adapters and the embedding)."""
    theirs = {n.replace(".default", ""): p.grad for n, p in hf.named_parameters() if p.requires_grad}
    embed = "base_model.model.model.embed_tokens.weight"
    return {n: theirs[embed if n == "embed.weight" else peft_name(n)] for n in names}


def _same_loss_then_gradients(model, hf, between=None) -> dict:
    """Runs one batch through both, checks the losses agree, and returns memo's gradients by name; `between`
    runs under no_grad between memo's forward and backward (the backward must apply the forward's masks)."""
    ids, labels = _batch()
    hf_loss = hf(input_ids=ids, labels=labels).loss
    hf_loss.backward()
    loss = model(ids, labels=labels)
    if between is not None:
        with torch.no_grad():
            between(ids)
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
    return _trained_grads(model)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_match_peft(tmp_path, family, policy):
    hf = _hf_lora(tmp_path, family)
    model = _memo_lora(tmp_path, hf, POLICIES[policy])
    ours = _same_loss_then_gradients(model, hf)
    assert len(ours) == 1 + 4 * 7 * 2  # the embedding and A, B of seven projections in four layers
    _assert_close(ours, _peft_grads(hf, ours), f"{family} {policy}")
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    if policy != "none":
        assert model.swap_stats().tokens_recomputed > 0 or policy == "full"


def test_bf16_lora_errs_no_more_than_peft_in_bf16(tmp_path):
    """Against PEFT in fp32, memo's bf16 LoRA gradients are as close as PEFT's own in bf16 (within 1.5x)."""
    hf = _hf_lora(tmp_path, "qwen3")
    model = _memo_lora(tmp_path, hf, POLICIES["memo-a0.5-tiled"]).to(torch.bfloat16)
    hf_bf16 = _peft_model(tmp_path).to(torch.bfloat16)
    with torch.no_grad():
        for (name, p), ref in zip(hf_bf16.named_parameters(), hf.parameters()):
            p.copy_(ref)
    ids, labels = _batch()
    for m in (hf, hf_bf16):
        m(input_ids=ids, labels=labels).loss.backward()
    model(ids, labels=labels).backward()
    ours = _trained_grads(model)
    exact, theirs = _peft_grads(hf, ours), _peft_grads(hf_bf16, ours)
    for name, grad in ours.items():
        error = lambda g: float((g.float() - exact[name]).norm() / exact[name].norm())
        assert error(grad) < 1.5 * error(theirs[name]) + 1e-3, (name, error(grad), error(theirs[name]))


def test_frozen_parameters_of_any_kind_get_no_gradient_and_leave_the_others_unchanged(tmp_path):
    _save_base(tmp_path, "llama")
    ids, labels = _batch()
    grads = []
    for frozen in ((), ("embed.weight", "layers.1.attn_norm.weight", "layers.2.wq.weight", "layers.3.wk.bias")):
        model = from_hf(tmp_path, policy=POLICIES["plan"])
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)
        model(ids, labels=labels).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert all(grads[-1][n] is None for n in frozen)
    for name, grad in grads[1].items():
        assert grad is None or torch.equal(grad, grads[0][name]), name


class _MaskedDropout(torch.nn.Module):
    """PEFT's dropout slot holding memo's mask for one adapter: what memo's dropout must equal."""

    def __init__(self, key: int, p: float):
        super().__init__()
        self.key, self.p = key, p

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.int32)[None]
        return x * keep_mask(self.key, pos, x.shape[0], x.shape[-1], self.p) / (1 - self.p)


def _drop_alike(model, hf, p=0.25, key=7):
    """Turns on dropout p in memo's adapters and gives PEFT's the same masks; returns `model`."""
    for layer in model.layers:
        for name, _ in TARGETS.values():
            getattr(layer, name).dropout = p
    model.dropout_key = key
    set_dropout_keys(model, key)
    modules = dict(hf.named_modules())
    for i, layer in enumerate(model.layers):
        for name, theirs in TARGETS.values():
            where = "self_attn" if theirs in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            slot = modules[f"base_model.model.model.layers.{i}.{where}.{theirs}"].lora_dropout
            slot["default"] = _MaskedDropout(getattr(layer, name).dropout_key, p)
    return model


@pytest.mark.parametrize("policy", ["none", "memo-a0.5-tiled", "plan"])
def test_lora_dropout_matches_peft_given_the_same_mask(tmp_path, policy):
    hf = _hf_lora(tmp_path, "llama")
    model = _drop_alike(_memo_lora(tmp_path, hf, POLICIES[policy]), hf)
    ours = _same_loss_then_gradients(model, hf, between=lambda ids: model(ids[:, :8]))  # no_grad: drops nothing
    _assert_close(ours, _peft_grads(hf, ours), f"dropout {policy}")
    ids = _batch()[0]
    with torch.no_grad():  # evaluation drops nothing
        plain = _memo_lora(tmp_path, hf, POLICIES["none"])
        torch.testing.assert_close(model(ids), plain(ids))


def test_dropout_masks_keep_one_minus_p_and_do_not_depend_on_the_tiles():
    pos = torch.arange(1000, 1600, dtype=torch.int32)[None]
    whole = keep_mask(123, pos, 3, 256, 0.1)
    assert abs(whole.float().mean().item() - 0.9) < 0.005
    parts = torch.cat([keep_mask(123, pos[:, i : i + 64], 3, 256, 0.1) for i in range(0, 600, 64)], dim=1)
    assert torch.equal(parts, whole)
    assert not torch.equal(whole, keep_mask(124, pos, 3, 256, 0.1))  # another step, another mask
    assert not torch.equal(whole[0], whole[1])  # each sequence its own


def test_some_targets_only_and_a_frozen_embedding_match_peft(tmp_path):
    targets = ("q", "v", "down")
    hf = _hf_lora(tmp_path, "llama", targets)
    model = _memo_lora(tmp_path, hf, POLICIES["memo-a0.5-tiled"], targets)
    model.embed.weight.requires_grad_(False)
    ids, labels = _batch()
    hf(input_ids=ids, labels=labels).loss.backward()
    model(ids, labels=labels).backward()
    ours = _trained_grads(model)
    assert len(ours) == 4 * 3 * 2 and model.embed.weight.grad is None
    _assert_close(ours, _peft_grads(hf, ours), "q,v,down")


def test_frozen_weights_cost_no_gradient_product(tmp_path):
    """The backward of a LoRA model does exactly the full fine-tuning backward's matmul work less the frozen dW
    products (2·tokens·in·out FLOPs each), plus the adapters' own: dy·B, x·Aᵀ, dA, dB and the input part,
    2·tokens·r·(2·out + 3·in) per projection."""
    _hf_lora(tmp_path, "llama")
    flops = {}
    for kind in ("full", "lora"):
        model = from_hf(tmp_path, policy=ActivationPolicy("none"))
        if kind == "lora":
            apply_lora(model, LoraConfig(RANK, ALPHA))
        ids, labels = _batch()
        loss = model(ids, labels=labels)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[kind] = counter.get_total_flops()
    c, tokens = model.config, 2 * SEQ
    shapes = module_shapes(c).values()
    frozen = 2 * tokens * sum(i * o for i, o in shapes) * c.n_layers
    adapters = 2 * tokens * RANK * sum(2 * o + 3 * i for i, o in shapes) * c.n_layers
    assert flops["lora"] == flops["full"] - frozen + adapters


def _sp_rank(rank: int, port: int, root: str) -> None:
    from memo.parallel import full_gradients, init_mesh, parallelize, shard_batch

    ranks.join(rank, 2, port)
    import torch.distributed as dist

    try:
        mesh = init_mesh(2, timeout=timedelta(seconds=60))
        for dropout in (0.0, 0.25):  # the mask of a token a rank holds is keyed by its global position
            hf = _peft_model(root)
            model = _memo_lora(root, hf, POLICIES["memo-a0.5-tiled"])
            model = parallelize(_drop_alike(model, hf, dropout) if dropout else model, mesh)
            ids, labels = _batch()
            hf_loss = hf(input_ids=ids, labels=labels).loss
            hf_loss.backward()
            local_ids, targets = shard_batch(ids, labels, mesh)
            loss = model(local_ids, targets=targets)
            loss.backward()
            torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)
            ours = full_gradients(model)
            assert len(ours) == 1 + 4 * 7 * 2
            _assert_close(ours, _peft_grads(hf, ours), f"sp=2 rank {rank} dropout {dropout}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_sp2_lora_matches_peft(tmp_path, free_port):
    _save_base(tmp_path, "qwen3")
    mp.spawn(_sp_rank, args=(free_port(), str(tmp_path)), nprocs=2)


# ---- runs: training, resume, export, eval ---------------------------------------------------------------

TRAIN = ["--seq-len", "64", "--batch-size", "2", "--eval-every", "100", "--lr", "1e-2", "--warmup-steps", "1"]
TRAIN += ["--schedule", "constant", "--lora-rank", "4", "--lora-targets", "q,v,o,down", "--json"]


def _losses(out: str) -> list[float]:
    return [r["loss"] for r in map(json.loads, out.splitlines()) if "loss" in r]


def _hf_folder(path):
    _hf_lora(path, "llama")
    return str(path)


def test_lora_run_trains_adapters_only_and_resumes_exactly(tmp_path, capsys):
    base = _hf_folder(tmp_path / "base")
    args = ["train", "--model", base, *TRAIN, "--save-every", "2", "--lora-dropout", "0.1"]
    assert main([*args, "--steps", "4", "--out", str(tmp_path / "whole")]) == 0
    whole = _losses(capsys.readouterr().out)
    assert main([*args, "--steps", "2", "--out", str(tmp_path / "cut")]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--steps", "4", "--json"]) == 0
    cut = _losses(capsys.readouterr().out)
    assert cut == whole and whole[-1] < whole[0]
    saved = checkpoint.load_latest(tmp_path / "whole")
    assert all(".lora_" in name for name in saved.optimizer)  # no state for a frozen weight
    start = load_file(f"{base}/model.safetensors")
    assert torch.equal(saved.model["layers.1.wq.weight"], start["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(saved.model["embed.weight"], start["model.embed_tokens.weight"])
    assert saved.model["layers.1.wq.lora_B"].abs().sum() > 0  # B started at zero and trained


def test_adapter_export_loads_in_peft_and_merged_export_in_transformers(tmp_path, capsys):
    base = _hf_folder(tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--model", base, *TRAIN, "--steps", "3", "--out", str(run)]) == 0
    assert main(["export", str(run), "--adapter", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    ids = _batch()[0]
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
    assert not [w for w in caught if "keys" in str(w.message).lower()]  # PEFT's missing adapter keys
    again = adapted.load_adapter(str(tmp_path / "adapter"), adapter_name="again")
    assert not again.unexpected_keys and not [k for k in again.missing_keys if ".again." in k]
    adapted.set_adapter("default")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    saved = checkpoint.load_latest(run)
    model = from_hf(base, policy=ActivationPolicy("none"))
    apply_lora(model, LoraConfig(4, 16.0, ("q", "v", "o", "down")))
    model.load_state_dict(saved.model)
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(adapted(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(merged(ids).logits, ours, rtol=1e-4, atol=1e-4)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str((tmp_path / "base").resolve())


def test_eval_of_a_lora_run_equals_eval_of_its_merged_export_and_refusals(tmp_path, capsys):
    base = _hf_folder(tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--model", base, *TRAIN, "--steps", "2", "--out", str(run)]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    text = tmp_path / "held_out.txt"
    text.write_text("a held-out document of plain text, long enough for one sequence of sixty-four bytes. " * 4)
    reports = []
    for model in (run, tmp_path / "merged"):
        capsys.readouterr()
        ask = ["eval", str(model), "--lengths", "64", "--trials", "0", "--ppl-file", str(text), "--json"]
        assert main(ask) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    (ours,), (merged,) = (r["perplexity"]["buckets"] for r in reports)
    assert ours["tokens"] == merged["tokens"] > 0 and ours["loss"] == pytest.approx(merged["loss"], rel=1e-5)
    full = tmp_path / "full"
    tiny = ["--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--steps", "1"]
    assert main(["train", *tiny, "--out", str(full)]) == 0
    capsys.readouterr()
    assert main(["export", str(full), "--adapter", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no `--lora-rank`" in err[0] and not (tmp_path / "a").exists()
