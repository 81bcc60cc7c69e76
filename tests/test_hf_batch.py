"""memo.hf_batch against transformers' own rules, the independent reference: the documents and padding memo reads
from a batch's arguments give the sdpa mask `create_causal_mask` builds, the sequences `find_packed_sequence_indices`
finds and the varlen bounds flash takes (`prepare_fa_kwargs_from_position_ids`, `DataCollatorWithFlattening`);
every batch memo refuses is refused in one line; targets and divisor give `ForCausalLMLoss`'s loss."""

import pytest
import torch
import torch.nn.functional as F

from memo.hf_batch import Batch, documents_of, num_items, targets_of

transformers = pytest.importorskip("transformers")
from transformers.data.data_collator import DataCollatorWithFlattening  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices  # noqa: E402
from transformers.modeling_flash_attention_utils import (  # noqa: E402
    _is_packed_sequence,
    prepare_fa_kwargs_from_position_ids,
)

SEQ = 12
CONFIG = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
CONFIG._attn_implementation = "sdpa"


def _random_positions(gen: torch.Generator, rows: int, seq: int = SEQ) -> torch.Tensor:
    """Returns (rows, seq) positions of documents of random lengths packed back to back, each counting from 0."""
    out = []
    for _ in range(rows):
        row = []
        while len(row) < seq:
            longest = seq if torch.rand((), generator=gen) < 0.3 else seq // 3
            row += range(min(int(torch.randint(1, longest + 1, (), generator=gen)), seq - len(row)))
        out.append(row)
    return torch.tensor(out)


def _sdpa_mask(shape, attention_mask, position_ids) -> torch.Tensor:
    """Returns transformers' sdpa mask (b, s, s) as LlamaModel.forward builds it (positions default to arange)."""
    b, s = shape
    if position_ids is None:
        position_ids = torch.arange(s)[None]
    embeds = torch.zeros(b, s, 8)
    mask = create_causal_mask(CONFIG, embeds, attention_mask, cache=None, position_ids=position_ids)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return causal.expand(b, s, s) if mask is None else mask[:, 0]


def _document_ids(batch: Batch, shape) -> torch.Tensor:
    """Returns (b, s) the document of each token under memo (its row when unpacked)."""
    b, s = shape
    if batch.documents is None:
        return torch.arange(b)[:, None].expand(b, s)
    ids = torch.empty(b * s, dtype=torch.int64)
    for index, (start, stop) in enumerate(batch.documents.bounds):
        ids[start:stop] = index
    return ids.view(b, s)


def _memo_mask(batch: Batch, shape) -> torch.Tensor:
    """Returns the (b, s, s) mask memo's attention applies: causal within each document (row when unpacked)."""
    ids = _document_ids(batch, shape)
    return torch.ones(shape[1], shape[1], dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None, :])


def test_packed_documents_match_sdpa_mask_and_sequence_indices():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        b = 1 + trial % 3
        positions = _random_positions(gen, 1 if trial % 4 == 0 else b)  # (1, s) broadcast over b rows too
        batch = documents_of((b, SEQ), None, positions)
        assert batch.valid is None
        assert torch.equal(_memo_mask(batch, (b, SEQ)), _sdpa_mask((b, SEQ), None, positions))
        sequences = find_packed_sequence_indices(positions.expand(b, SEQ))
        assert (sequences is None) == (batch.documents is None)
        if sequences is not None:
            ids = _document_ids(batch, (b, SEQ))
            same = sequences[:, :, None] == sequences[:, None, :]
            assert torch.equal(same, ids[:, :, None] == ids[:, None, :])


def test_packed_documents_match_flash_varlen_bounds():
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        b = 1 + trial % 3
        positions = _random_positions(gen, b)
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions.reshape(1, -1))
        flash = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k)
        batch = documents_of((b, SEQ), None, positions, **flash)  # accepted: flash's bounds are memo's
        if b == 1:
            assert bool(_is_packed_sequence(positions, 1)) == (batch.documents is not None)
        if batch.documents is None:
            assert cu_q.tolist() == list(range(0, b * SEQ + 1, SEQ))
        else:
            assert torch.equal(batch.documents.cu_seqlens, cu_q)
            assert batch.documents.max_length == int(max_q)


def test_padding_free_collator_batch_is_accepted():
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    out = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [7]}])
    varlen = {k: out[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    batch = documents_of(tuple(out["input_ids"].shape), None, out["position_ids"], **varlen)
    assert batch.documents.bounds == ((0, 3), (3, 5), (5, 6))


def test_unpacked_rows_are_plain_causal():
    for b, positions in ((2, None), (2, torch.arange(SEQ).expand(2, SEQ)), (3, torch.arange(SEQ)[None])):
        batch = documents_of((b, SEQ), None, positions)
        assert batch.documents is None and batch.valid is None
        assert torch.equal(_memo_mask(batch, (b, SEQ)), _sdpa_mask((b, SEQ), None, positions))


def test_all_ones_mask_is_no_mask():
    batch = documents_of((2, SEQ), torch.ones(2, SEQ, dtype=torch.int64), torch.arange(SEQ)[None])
    assert batch.documents is None and batch.valid is None


def test_right_padding_matches_sdpa_mask_on_real_tokens():
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([SEQ, 5, 1])
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    garbage = torch.randint(0, 50, (3, SEQ), generator=gen)
    tokens_then = torch.where(mask.bool(), torch.arange(SEQ), garbage)  # anything on the padding
    tokens_then_zeros = torch.where(mask.bool(), torch.arange(SEQ), 0)  # TRL's right-padded position_ids
    for positions in (None, tokens_then, tokens_then_zeros):
        batch = documents_of((3, SEQ), mask, positions)
        assert batch.documents is None and torch.equal(batch.valid, mask.bool())
        memo, hf = _memo_mask(batch, (3, SEQ)), _sdpa_mask((3, SEQ), mask, positions)
        assert torch.equal(memo[batch.valid], hf[batch.valid])  # the query rows of real tokens


def test_refused_packings_are_where_sdpa_and_flash_disagree():
    for positions in ([[0, 1, 1, 2]], [[0, 1, 2, 5, 6]], [[3, 4, 0, 1]]):
        positions = torch.tensor(positions)
        sdpa = find_packed_sequence_indices(positions)
        starts = sdpa.diff(prepend=sdpa[:, :1] - 1) != 0
        (cu, _), _ = prepare_fa_kwargs_from_position_ids(positions)
        assert starts.flatten().nonzero().flatten().tolist() != cu[:-1].tolist()
        with pytest.raises(ValueError, match="must start at position 0"):
            documents_of(tuple(positions.shape), None, positions)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert _is_packed_sequence(packed, 1)  # flash drops an all-ones mask and packs, sdpa keeps it and does not
    assert torch.equal(_sdpa_mask((1, 6), torch.ones(1, 6), packed), torch.ones(6, 6, dtype=torch.bool).tril()[None])


REFUSED = {  # each on a (1, 6) batch
    "offset run": (dict(position_ids=torch.arange(3, 9)[None]), r"`position_ids` row 0 counts from 3"),
    "break at p": (dict(position_ids=torch.tensor([[0, 1, 2, 5, 6, 7]])), r"count up by 1 \(row 0, token 3\)"),
    "repeat": (dict(position_ids=torch.tensor([[0, 1, 2, 2, 3, 4]])), r"count up by 1 \(row 0, token 3\)"),
    "packed under mask": (
        dict(attention_mask=torch.ones(1, 6), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]])),
        r"\(row 0, token 3\).*drop `attention_mask` to pack",
    ),
    "offset under mask": (
        dict(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), position_ids=torch.arange(1, 7)[None]),
        r"must count 0, 1, 2, ... over each row's tokens when `attention_mask` is given \(row 0, token 0\)",
    ),
    "float positions": (dict(position_ids=torch.arange(6.0)[None]), r"`position_ids` must be an integer tensor"),
    "positions shape": (dict(position_ids=torch.arange(5)[None]), r"`position_ids` must be an integer tensor"),
    "left padding": (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]])), r"row 0 is not right padding"),
    "hole": (dict(attention_mask=torch.tensor([[1, 1, 0, 1, 0, 0]])), r"row 0 is not right padding"),
    "empty row": (dict(attention_mask=torch.zeros(1, 6, dtype=torch.bool)), r"row 0 has no tokens"),
    "4D mask": (dict(attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool)), r"`attention_mask` must be a 2D"),
    "dict mask": (dict(attention_mask={"full_attention": torch.ones(1, 6)}), r"`attention_mask` must be a 2D"),
    "mask values": (dict(attention_mask=torch.full((1, 6), 2)), r"`attention_mask` must hold 0s and 1s"),
    "mask shape": (dict(attention_mask=torch.ones(1, 5)), r"`attention_mask` must be \(1, 6\)"),
    "cu without positions": (dict(cu_seq_lens_q=torch.tensor([0, 6])), r"`cu_seq_lens_q` needs the `position_ids`"),
    "cu mismatch": (
        dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), cu_seq_lens_k=torch.tensor([0, 6])),
        r"`cu_seq_lens_k` must equal the bounds `position_ids` give, \[0, 3, 6\]",
    ),
    "cu under mask": (
        dict(attention_mask=torch.ones(1, 6), position_ids=torch.arange(6)[None], cu_seq_lens_q=torch.tensor([0, 6])),
        r"`cu_seq_lens_q` describes a padding-free batch",
    ),
    "max length": (dict(max_length_q=5), r"`max_length_q` must be the longest document's length, 6, got 5"),
}


@pytest.mark.parametrize("arguments, message", REFUSED.values(), ids=REFUSED.keys())
def test_batches_memo_cannot_run_are_refused_in_one_line(arguments, message):
    with pytest.raises(ValueError, match=message) as error:
        documents_of((1, 6), **arguments)
    assert "\n" not in str(error.value)


def test_rows_spanning_cu_seq_lens_are_refused():
    with pytest.raises(ValueError, match=r"`cu_seq_lens_q` must equal the bounds `position_ids` give, \[0, 6, 12\]"):
        documents_of((2, 6), None, torch.arange(6)[None], cu_seq_lens_q=torch.tensor([0, 12]))


def test_targets_and_divisor_give_transformers_loss():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    labels[0, :3] = -100
    shifted = torch.randint(0, 11, (2, 7), generator=gen)
    shifted[1, 4:] = -100
    for count in (None, torch.tensor(5), 9):
        for shift_labels in (None, shifted):
            targets = targets_of(labels, shift_labels)
            ours = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / num_items(targets, count)
            ref = ForCausalLMLoss(logits, labels, 11, num_items_in_batch=count, shift_labels=shift_labels)
            torch.testing.assert_close(ours, ref)


def test_batch_without_targets_divides_by_one():
    targets = targets_of(torch.full((2, 5), -100))
    assert int(num_items(targets)) == 1


def test_other_ignore_index_is_refused():
    with pytest.raises(ValueError, match=r"`ignore_index` must be -100"):
        targets_of(torch.zeros(1, 4, dtype=torch.int64), ignore_index=0)
