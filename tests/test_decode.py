"""memo's cached greedy decoding against transformers' `generate(do_sample=False)` on the same checkpoint, the
independent reference: every dense family with its RoPE variants (dynamic past `max_position_embeddings`, where its
frequencies change as the sequence grows), sliding windows shorter than prompt + answer, Gemma 3, a mixture of
experts, a batch of two, end-of-sequence stopping. A step whose top-2 logit gap is below EPS in transformers' scores
is a near-tie the two could break apart by rounding: such cases are counted and excluded, never silently."""

import pytest
import test_gemma
import test_hf
import test_moe_hf
import torch

from memo import from_hf
from memo.decode import generate

transformers = pytest.importorskip("transformers")

EPS = 1e-4  # logits of fp32 models a rounding apart (~1e-6) never swap an argmax with a gap this wide
PROMPT, NEW = 20, 10  # 30 tokens: past the windows (6) and dynamic RoPE's 16 positions

CASES = {
    **{f"{family}-default": (lambda p, f=family: test_hf._saved(p, f)) for family in test_hf.FAMILIES},
    "llama-dynamic": lambda p: test_hf._saved(p, "llama", "dynamic"),
    "qwen3-yarn": lambda p: test_hf._saved(p, "qwen3", "yarn"),
    "gemma3": lambda p: _save(test_gemma._gemma(), p),
    "qwen3_moe": lambda p: test_moe_hf._saved(p, "qwen3_moe", mlp_only_layers=[1]),
    "mixtral": lambda p: test_moe_hf._saved(p, "mixtral"),
}


def _save(model, path):
    model.save_pretrained(path)
    return model


def _reference(path, ids: torch.Tensor, eos: int | None) -> tuple[list[list[int]], list[float]]:
    """Returns transformers' greedy continuations, cut after their first `eos`, and each step's least top-2 gap, from
    a model loaded afresh: dynamic RoPE keeps the longest length it has seen across calls."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    out = hf.generate(
        ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True, attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    tokens = out.sequences[:, ids.shape[1] :].tolist()
    if eos is not None:
        tokens = [row[: row.index(eos) + 1] if eos in row else row for row in tokens]
    gaps = [float(s.float().topk(2, dim=-1).values.diff(dim=-1).abs().min()) for s in out.scores]
    return tokens, gaps


@pytest.mark.parametrize("case", CASES)
def test_cached_greedy_decoding_is_transformers_generate(tmp_path, case):
    torch.manual_seed(0)  # the random weights of every case
    CASES[case](tmp_path)
    model = from_hf(tmp_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    free, gaps = _reference(tmp_path, ids, None)
    eos = free[0][NEW // 2]  # a token the first sequence decodes midway: it must stop there, the second need not
    want, gaps_eos = _reference(tmp_path, ids, eos)
    near_ties = sum(g < EPS for g in gaps + gaps_eos)
    assert near_ties == 0, f"{near_ties} steps within {EPS} of a tie: pick another seed"
    assert generate(model, ids, NEW) == free
    got = generate(model, ids, NEW, eos=eos)
    assert got == want and got[0][-1] == eos and len(got[0]) <= NEW // 2 + 1
