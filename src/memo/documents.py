"""Packed documents: a batch's sequences cut into documents that attend only to themselves.

A batch carries `positions` (b, S), each token's position within its document, as transformers' packed
sequences do (`position_ids`): a document starts where the position is 0 (every sequence begins with one) and
counts 0, 1, 2, ... from there. RoPE rotates each token by that position, so a document sees what it would
alone; attention is causal within a document and blind across its bounds (a block-diagonal causal mask).

`Documents` is what the layers need of it: the positions on the device, and the documents' bounds over the
b·S tokens taken as one stream (row-major), both as a host list (a loop of kernel calls, one per document) and
as cumulative lengths on the device (the variable-length kernels' `cu_seqlens`). Under Ulysses the positions
are the whole sequence's, the same on every rank: attention sees every token, RoPE slices its rank's rows.

`DocumentLengths` is what the cost model needs of them: not the documents of one batch but the lengths of a
corpus's (a histogram, or one mean length), from which it counts the attention work of a sequence cut from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import check_int
from .token_files import TOKEN_SUFFIXES, check_document_starts, read_token_file
from .units import format_count


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a (b, S) batch: positions (b, S) int64 on the device, bounds (start, stop) of each over the
    b·S tokens in row-major order (host), the same as cumulative lengths (n + 1,) int32 on the device."""

    positions: torch.Tensor
    bounds: tuple[tuple[int, int], ...]
    cu_seqlens: torch.Tensor
    max_length: int

    @classmethod
    def of(cls, positions: torch.Tensor | None, batch: int, seq: int, device) -> "Documents | None":
        """Returns the documents `positions` (b, S) describe, None when every sequence is one document (the plain
        causal path, bitwise as without positions); ValueError when they do not count up within documents."""
        if positions is None:
            return None
        if tuple(positions.shape) != (batch, seq) or positions.dtype.is_floating_point or positions.is_complex():
            raise ValueError(
                f"`positions` must be integer (batch, tokens) = ({batch}, {seq}) (under sequence parallelism the "
                f"whole sequence's), got {tuple(positions.shape)} {positions.dtype}"
            )
        host = positions.detach().to("cpu", torch.int64)  # a no-op for a batch from the data (on the host)
        follows = host[:, 1:] == host[:, :-1] + 1
        if bool(host[:, 0].ne(0).any()) or not bool((host[:, 1:].eq(0) | follows).all()):
            raise ValueError("`positions` must count 0, 1, 2, ... from 0 within each document (0 starts one)")
        if not bool(host[:, 1:].eq(0).any()):
            return None
        edges = _edges(host)
        bounds = tuple(zip(edges[:-1].tolist(), edges[1:].tolist()))
        cu = edges.to(device=device, dtype=torch.int32)
        return cls(host.to(device), bounds, cu, int(edges.diff().max()))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Returns the positions (b, r) of token rows [start, stop) of every sequence."""
        return self.positions[:, start:stop]


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Returns the positions (b, S) int64 of tokens within their documents from `starts` (b, S) bool, True where a
    document begins (a sequence's first token always does)."""
    starts = starts.clone()
    starts[:, 0] = True
    index = torch.arange(starts.shape[1]).expand_as(starts)
    begin = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - begin


def attended_tokens(positions: torch.Tensor) -> float:
    """Returns Σ dᵢ² / tokens of a (b, S) batch's documents: how many tokens a token attends to on average (whole
    d × d matrices), the length that stands for S in attention FLOPs (S itself for one document per sequence)."""
    return float((_edges(positions.cpu()).diff().double() ** 2).sum()) / positions.numel()


def _edges(positions: torch.Tensor) -> torch.Tensor:
    """Returns the documents' bounds (n + 1,) over the b·S tokens of host `positions` in row-major order: where a
    position is 0, and the end."""
    return torch.cat((positions.flatten().eq(0).nonzero().flatten(), torch.tensor([positions.numel()])))


def document_lengths(starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """Returns the length of each document of a stream of `n_tokens` tokens whose documents begin at `starts`."""
    return np.diff(np.append(starts, n_tokens))


@dataclass(frozen=True)
class DocumentLengths:
    """The lengths of the documents packed into training sequences, whose tokens attend only within their own
    document (block-diagonal causal attention): either `mean`, every document that many tokens long, or `histogram`,
    ((length, count), ...) of a corpus's documents (`of_file`). `source` says where the lengths come from."""

    mean: int | None = None
    histogram: tuple[tuple[int, int], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if (self.mean is None) == (not self.histogram):
            raise ValueError("packed documents take one of a mean length and a histogram of lengths")
        if self.mean is not None:
            check_int("--mean-document-tokens", self.mean)
        for length, count in self.histogram:
            check_int("document length", length)
            check_int("document count", count)

    @classmethod
    def of_lengths(cls, lengths, source: str = "") -> DocumentLengths:
        """Returns the histogram of `lengths`, one entry per document (e.g. a token file's)."""
        values, counts = np.unique(np.asarray(lengths, dtype=np.int64).ravel(), return_counts=True)
        return cls(histogram=tuple(zip(values.tolist(), counts.tolist())), source=source)

    @classmethod
    def of_file(cls, path: str | Path, flag: str = "--document-lengths") -> DocumentLengths:
        """Returns the histogram of a memo token file's document lengths (`token_files.read_token_file`: a .bin with
        its .json sidecar, or a .npy; its documents start where `<stem>.docs.npy` says, one document without it)."""
        path = Path(path)
        if path.suffix not in TOKEN_SUFFIXES:
            raise ValueError(
                f"`{flag}` takes a memo token file (.bin with its .json sidecar, or .npy), got {str(path)!r}"
            )
        try:
            tokens, starts, _ = read_token_file(path, flag=flag)
        except ValueError as err:
            raise ValueError(str(err) if f"`{flag}`" in str(err) else f"`{flag}`: {err}") from None
        check_document_starts(path, flag, "the documents' lengths are read from it")
        return cls.of_lengths(document_lengths(starts, len(tokens)), source=str(path))

    @property
    def mean_tokens(self) -> float:
        """Returns the mean document length in tokens."""
        if self.mean is not None:
            return float(self.mean)
        return sum(length * count for length, count in self.histogram) / sum(count for _, count in self.histogram)

    def squares(self, seq: int) -> float:
        """Returns E[Σ d_i²], the expected sum of squared document lengths of a sequence of `seq` tokens: the
        attention work of its documents, where an unpacked sequence does seq².

        - `mean` N: the sequence holds whole documents of N tokens from its start and a last, shorter one:
          seq = q·N + r gives q·N² + r² (exact: no expectation).
        - `histogram`: sequences cut at fixed `seq` boundaries from the concatenated stream of documents, a
          document crossing a cut split in two. Σ d_i² counts the ordered pairs of a sequence's positions that lie
          in one piece, so its expectation over where the cut falls relative to the documents (uniformly, as over
          the many sequences of a corpus) is seq + 2·Σ_{k=1}^{seq-1} (seq - k)·P(positions x and x + k share a
          document), and a position lies in a document of length d at each of its d offsets, so
          P = Σ_d count_d·max(0, d - k) / T (T the tokens of all documents): closed form
          seq + (2 / T)·Σ_d count_d·Σ_{k=1}^{min(d, seq)-1} (seq - k)(d - k), the inner sum a polynomial in
          m = min(d, seq) - 1. It equals, exactly, the mean of Σ d_i² over the windows of `seq` tokens at every
          offset of the documents' stream taken as a cycle (tested by brute force), whatever their order.
        """
        check_int("--seq", seq)
        if self.mean is not None:
            q, r = divmod(seq, self.mean)
            return float(q * self.mean**2 + r * r)
        total = sum(length * count for length, count in self.histogram)
        pairs = 0  # Σ_d count_d·Σ_{k=1}^{m} (seq - k)(d - k), m = min(d, seq) - 1, in exact integers
        for d, count in self.histogram:
            m = min(d, seq) - 1
            pairs += count * (m * seq * d - (seq + d) * m * (m + 1) // 2 + m * (m + 1) * (2 * m + 1) // 6)
        return seq + 2 * pairs / total

    def attended(self, seq: int) -> float:
        """Returns E[Σ d_i²] / seq: how many tokens a token of a `seq`-token sequence attends to on average (the
        whole matrix), the length that stands for s in the attention FLOPs (4·s·heads·head_dim per token, forward)
        and the one whole documents of equal length would have: the document length attention is timed at."""
        return self.squares(seq) / seq

    def __str__(self) -> str:
        if self.mean is not None:
            return f"packed documents of {format_count(self.mean)} tokens"
        return f"packed documents of {self.source or 'a histogram'} (mean {self.mean_tokens:,.0f} tokens)"
