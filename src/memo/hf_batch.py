"""A transformers batch in memo's terms: which tokens attend to which (packed documents, right padding), and the
targets and divisor of its loss.

A patched backbone (`memo.patch`) receives the arguments transformers' own forward does: `attention_mask`,
`position_ids` and, from padding-free collators, flash attention's `cu_seq_lens_q/k` and `max_length_q/k`.
transformers reads them differently per kernel: sdpa, eager and flex pack documents only from `position_ids`
without a mask (a document starts wherever a position does not follow its predecessor); flash unpads a 2D mask
with padding, else takes all four varlen arguments, else packs a batch of one whose positions restart (a document
starts where the position is the smallest). `documents_of` accepts the batches on which memo's attention (plain
causal per row, or packed `Documents`) computes what those kernels do, and refuses the rest in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .documents import Documents
from .loss import IGNORE_INDEX
from .loss import shift_labels as shifted_labels


@dataclass(frozen=True, eq=False)
class Batch:
    """What memo's layers need of a transformers batch: its `documents` (None: each row one causal sequence) and
    `valid` (b, s) bool, False on right padding (None: no padding); padded tokens' outputs are garbage, as in
    transformers, and their targets must be ignored."""

    documents: Documents | None
    valid: torch.Tensor | None


def documents_of(
    input_shape: tuple[int, int],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Batch:
    """Returns the `Batch` a (b, s) batch's transformers arguments describe, with the documents and valid mask on
    `device`; ValueError naming the argument when memo cannot compute what transformers would."""
    batch, seq = input_shape
    lengths = _lengths_of(attention_mask, batch, seq)
    positions = _positions_of(position_ids, batch, seq)
    varlen = dict(
        cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q, max_length_k=max_length_k
    )
    if lengths is not None:
        _refuse_varlen_under_mask(varlen)
        if positions is not None:
            _check_counts_from_zero(positions, lengths)
        return Batch(documents=None, valid=_valid_of(lengths, seq, device))
    documents = None if positions is None else _packed(positions, device)
    _check_cu_seq_lens(varlen, documents, positions, batch, seq)
    _check_max_lengths(varlen, documents, seq)
    return Batch(documents=documents, valid=None)


def _lengths_of(attention_mask, batch: int, seq: int) -> torch.Tensor | None:
    """Returns each row's unpadded length (b,) on the host from a right-padding 2D mask (None without a mask)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        raise ValueError(
            "`attention_mask` must be a 2D (batch, tokens) padding mask of 0s and 1s: memo builds the causal and "
            "document masks itself, so 4D, dict and BlockMask masks are refused (pass the tokenizer's mask, or none)"
        )
    if tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(
            f"`attention_mask` must be ({batch}, {seq}) like the inputs, got {tuple(attention_mask.shape)}"
        )
    host = attention_mask.detach().cpu()
    if host.is_complex() or not bool(((host == 0) | (host == 1)).all()):
        raise ValueError("`attention_mask` must hold 0s and 1s (or bools): 1 a token, 0 padding")
    keep = host.bool()
    lengths = keep.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError(f"`attention_mask` row {int((lengths == 0).nonzero()[0])} has no tokens: drop empty rows")
    wrong = (keep != _prefix(lengths, seq)).any(dim=1)
    if bool(wrong.any()):
        raise ValueError(
            f"`attention_mask` row {int(wrong.nonzero()[0])} is not right padding (1s, then 0s): pad on the right "
            "(tokenizer.padding_side = 'right') or pack documents with `position_ids` and no mask"
        )
    return lengths


def _prefix(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """Returns (b, s) bool, True on each row's first `lengths` tokens."""
    return torch.arange(seq) < lengths[:, None]


def _valid_of(lengths: torch.Tensor, seq: int, device) -> torch.Tensor | None:
    """Returns the (b, s) real tokens on `device`, None when no row is padded (an all-ones mask is no mask)."""
    return None if bool((lengths == seq).all()) else _prefix(lengths, seq).to(device)


def _positions_of(position_ids, batch: int, seq: int) -> torch.Tensor | None:
    """Returns `position_ids` as (b, s) int64 on the host, a (1, s) one broadcast over the rows as transformers
    does."""
    if position_ids is None:
        return None
    dtype = getattr(position_ids, "dtype", None)
    integer = dtype is not None and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if not integer or position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq:
        shape = tuple(getattr(position_ids, "shape", ()))
        raise ValueError(
            f"`position_ids` must be an integer tensor of shape ({batch}, {seq}) or (1, {seq}), got {shape} {dtype}"
        )
    return position_ids.detach().to("cpu", torch.int64).expand(batch, seq)


def _check_counts_from_zero(positions: torch.Tensor, lengths: torch.Tensor) -> None:
    """Raises unless positions count 0, 1, 2, ... over each row's real tokens: under a mask transformers packs
    nothing (RoPE alone would follow restarts) and memo's RoPE starts every row at 0."""
    seq = positions.shape[1]
    wrong = (positions != torch.arange(seq)) & _prefix(lengths, seq)
    if bool(wrong.any()):
        row, token = wrong.nonzero()[0].tolist()
        raise ValueError(
            f"`position_ids` must count 0, 1, 2, ... over each row's tokens when `attention_mask` is given (row {row}, "
            f"token {token}): transformers packs no documents under a mask; drop `attention_mask` to pack"
        )


def _packed(positions: torch.Tensor, device) -> Documents | None:
    """Returns the documents of mask-free `positions` (b, s): each starts at 0 and counts up by 1, so that sdpa's
    breaks (a position not following its predecessor) and flash's starts (the smallest position) coincide."""
    follows = positions[:, 1:] == positions[:, :-1] + 1
    offset = (follows.all(dim=1) & positions[:, 0].ne(0)).nonzero()
    if len(offset):
        row = int(offset[0])
        raise ValueError(
            f"`position_ids` row {row} counts from {int(positions[row, 0])}: memo's RoPE starts each row at 0 "
            "(pass positions from 0, or none)"
        )
    wrong = torch.cat((positions[:, :1].ne(0), positions[:, 1:].ne(0) & ~follows), dim=1)
    if bool(wrong.any()):
        row, token = wrong.nonzero()[0].tolist()
        raise ValueError(
            f"`position_ids`: a packed document must start at position 0 and count up by 1 (row {row}, token {token})"
        )
    return Documents.of(positions, *positions.shape, device)


def _refuse_varlen_under_mask(varlen: dict) -> None:
    """Raises if a flash varlen argument comes with a mask: flash then uses the arguments or the mask depending on
    whether the mask pads, sdpa never uses them."""
    given = [name for name, value in varlen.items() if value is not None]
    if given:
        raise ValueError(f"`{given[0]}` describes a padding-free batch: drop it or `attention_mask`")


def _check_cu_seq_lens(varlen: dict, documents: Documents | None, positions, batch: int, seq: int) -> None:
    """Raises unless each given `cu_seq_lens_*` is the bounds memo attends within (the documents', else the rows'),
    those flash's varlen kernel takes over the b·s tokens."""
    if documents is not None:
        bounds = documents.cu_seqlens.cpu().long()
    else:
        bounds = torch.arange(0, batch * seq + 1, seq)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = varlen[name]
        if cu is None:
            continue
        if positions is None:
            raise ValueError(
                f"`{name}` needs the `position_ids` it was cut from (sdpa packs by those alone): pass them too"
            )
        if not isinstance(cu, torch.Tensor) or not torch.equal(cu.detach().cpu().long().flatten(), bounds):
            raise ValueError(
                f"`{name}` must equal the bounds `position_ids` give, {bounds.tolist()}: drop it or make them agree"
            )


def _check_max_lengths(varlen: dict, documents: Documents | None, seq: int) -> None:
    """Raises unless each given `max_length_*` is the longest document (the row length without documents)."""
    longest = seq if documents is None else documents.max_length
    for name in ("max_length_q", "max_length_k"):
        value = varlen[name]
        if value is not None and int(value) != longest:
            raise ValueError(f"`{name}` must be the longest document's length, {longest}, got {int(value)}")


def targets_of(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Returns the (b, s) targets position t predicts, as transformers' ForCausalLMLoss takes them: `shift_labels`
    as given (a sequence-parallel split shifts before it cuts), else `labels` shifted left by one."""
    if ignore_index != IGNORE_INDEX:
        raise ValueError(
            f"`ignore_index` must be {IGNORE_INDEX}, the only label memo's loss ignores, got {ignore_index}"
        )
    name, targets = ("labels", shifted_labels(labels)) if shift_labels is None else ("shift_labels", shift_labels)
    if targets.ndim != 2:
        raise ValueError(f"`{name}` must be (batch, tokens), got {tuple(targets.shape)}")
    return targets


def num_items(targets: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Returns the loss's divisor: `num_items_in_batch` as the Trainer gives it (the target count of the whole
    accumulated step), else this batch's target count, at least 1 so that a batch with no targets gives loss 0 with
    no host sync."""
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, device=targets.device)
    return (targets != IGNORE_INDEX).sum().clamp(min=1)
