"""Generated training data: tasks whose loss can only fall if the model reads far-away tokens."""

from __future__ import annotations

import torch


def copy_task_batch(
    batch: int, seq_len: int, generator: torch.Generator, alphabet: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (input_ids, labels) where the second half of each sequence repeats the first half.

    Tokens of the second half are predictable only by looking back seq_len/2 positions; labels of the
    first half are ignored (-100) so the loss measures long-range recall alone. Tokens come from the first
    `alphabet` ids: chance loss is ln(alphabet), and a tiny model learns the recall in a few hundred steps.
    """
    if seq_len < 4:
        raise ValueError(f"`--seq-len` must be at least 4 for the copy task, got {seq_len}")
    half = seq_len // 2
    first = torch.randint(0, alphabet, (batch, half), generator=generator)
    ids = torch.cat((first, first, first[:, : seq_len - 2 * half]), dim=1)
    labels = ids.clone()
    labels[:, : half + 1] = -100  # position t's label is labels[t+1]: predict from the repeat onwards
    return ids, labels
