"""Training data: a generated long-range retrieval task, or text and token files packed into sequences.

Every source answers `batch(step, batch_size) -> (ids, labels)` as a pure function of (seed, step), so a
resumed run sees exactly the batches it would have seen. Labels follow `Transformer`'s convention: position
t predicts labels[t + 1], and IGNORE (-100) marks targets the loss skips.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from ..loss import shift_labels

log = logging.getLogger(__name__)

IGNORE = -100
TOKEN_FILE_FORMAT = "memo-tokens-v1"
TEXT_SUFFIXES = (".txt", ".jsonl")


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    """Returns a torch.Generator seeded from (seed, stream, step); streams keep training and held-out data apart."""
    state = np.random.SeedSequence([seed, stream, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


# ---------------------------------------------------------------------------------------------- generated tasks


@dataclass(frozen=True)
class RetrievalTask:
    """Key-value retrieval over a long haystack: the default task of `memo train`.

    Each sequence is filler with `n_pairs` fact tokens scattered through it, then `n_pairs` queries at the end:

        filler .. fact(k3,v1) .. filler .. fact(k9,v4) .. filler | query(k9) answer(v4) query(k3) answer(v1) ..

    A fact token stands for one (key, value) pair, keys are distinct within a sequence, and values are drawn
    uniformly, so an answer is predictable only by attending from the query back to its fact, anywhere in
    the preceding seq_len tokens. Loss sits on answers alone; chance is ln(n_values). One token per pair
    keeps the retrieval to one attention hop: with key and value as two tokens the model must first build
    a previous-token + induction circuit, which a `tiny` model does not form within a CPU-minutes budget.

    Curriculum: until step `ramp_start` the task lives in the first `start_span` tokens and the rest is filler
    after the queries (unlabelled, and invisible to them under causal attention); the span then grows
    linearly to seq_len at step `ramp_end`. Without it a `tiny` model sits at chance for hundreds of steps
    at 1024 tokens, because at initialization attention spreads over every filler token. Held-out batches
    always use the full seq_len. `ramp_end=0` turns the curriculum off.

    Token ids: facts [0, K*V), queries [K*V, K*V+K), answers [.., +V), filler [.., +n_filler).
    """

    seq_len: int
    seed: int = 0
    n_pairs: int = 16
    n_keys: int = 16
    n_values: int = 8
    n_filler: int = 1
    start_span: int = 256
    ramp_start: int = 150
    ramp_end: int = 350

    def __post_init__(self) -> None:
        for name in ("n_pairs", "n_keys", "n_values", "n_filler"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}")
        if self.n_pairs > self.n_keys:
            raise ValueError(f"`n_pairs` ({self.n_pairs}) cannot exceed `n_keys` ({self.n_keys}): keys are distinct")
        if self.seq_len < 4 * self.n_pairs:
            raise ValueError(
                f"`--seq-len` must be at least {4 * self.n_pairs} for {self.n_pairs} pairs, got {self.seq_len}"
            )
        if self.start_span < 4 * self.n_pairs or not 0 <= self.ramp_start <= self.ramp_end:
            raise ValueError(f"bad curriculum: start_span {self.start_span}, ramp {self.ramp_start}..{self.ramp_end}")

    @property
    def vocab_size_needed(self) -> int:
        return self.n_keys * self.n_values + self.n_keys + self.n_values + self.n_filler

    @property
    def chance_loss(self) -> float:
        return math.log(self.n_values)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the training batch for `step`, the same for the same (seed, step)."""
        return self._sample(batch_size, self.span(step), _generator(self.seed, 0, step))

    def span(self, step: int) -> int:
        """Returns how many leading tokens hold the task at `step` (the curriculum's length)."""
        if step >= self.ramp_end or self.start_span >= self.seq_len:
            return self.seq_len
        grown = (self.seq_len - self.start_span) * max(0, step - self.ramp_start) // (self.ramp_end - self.ramp_start)
        return self.start_span + grown

    def eval_batches(self, n_batches: int = 4, batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Returns full-length held-out batches, drawn from a stream that training never reads."""
        return [self._sample(batch_size, self.seq_len, _generator(self.seed, 1, i)) for i in range(n_batches)]

    def _sample(self, batch: int, span: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = retrieval_batch(batch, span, generator, self.n_pairs, self.n_keys, self.n_values, self.n_filler)
        if span == self.seq_len:
            return ids, labels
        tail = (batch, self.seq_len - span)
        filler0 = self.vocab_size_needed - self.n_filler
        ids = torch.cat((ids, filler0 + torch.randint(0, self.n_filler, tail, generator=generator)), dim=1)
        return ids, torch.cat((labels, torch.full(tail, IGNORE)), dim=1)


def retrieval_batch(
    batch: int,
    seq_len: int,
    generator: torch.Generator,
    n_pairs: int = 16,
    n_keys: int = 16,
    n_values: int = 8,
    n_filler: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ids, labels) of the retrieval task described in `RetrievalTask`; labels are IGNORE but on answers."""
    n_facts = n_keys * n_values
    query0, answer0, filler0 = n_facts, n_facts + n_keys, n_facts + n_keys + n_values
    context = seq_len - 2 * n_pairs
    keys = torch.rand(batch, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]  # (b, p), distinct per row
    values = torch.randint(0, n_values, (batch, n_pairs), generator=generator)  # (b, p)
    slots = torch.rand(batch, context, generator=generator).argsort(dim=1)[:, :n_pairs]  # (b, p) fact positions
    order = torch.rand(batch, n_pairs, generator=generator).argsort(dim=1)  # (b, p) query order
    ids = filler0 + torch.randint(0, n_filler, (batch, seq_len), generator=generator)
    ids.scatter_(1, slots, keys * n_values + values)
    queried_keys, answers = keys.gather(1, order), values.gather(1, order)
    ids[:, context::2] = query0 + queried_keys
    ids[:, context + 1 :: 2] = answer0 + answers
    labels = torch.full_like(ids, IGNORE)
    labels[:, context + 1 :: 2] = answer0 + answers
    return ids, labels


@torch.no_grad()
def retrieval_accuracy(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Returns the fraction of labelled tokens that the model's greedy (argmax) prediction gets exactly right."""
    device = next(model.parameters()).device
    counts = sum(answer_counts(model, ids.to(device), shift_labels(labels).to(device)) for ids, labels in batches)
    if counts[1] == 0:
        raise ValueError("retrieval accuracy needs at least one labelled token")
    return int(counts[0]) / int(counts[1])


@torch.no_grad()
def answer_counts(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns [correct, labelled] over `targets` (shifted labels: position t predicts targets[t]) of the
    model's greedy predictions; a sequence-parallel rank passes its own tokens and gets its own counts."""
    predicted = model(ids).argmax(dim=-1)  # (b, s)
    mask = targets != IGNORE
    return torch.stack(((predicted[mask] == targets[mask]).sum(), mask.sum()))


# ------------------------------------------------------------------------------------------------------ tokenizers


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: no file to load, and it fits the 256-id vocab of the `tiny` presets."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; special tokens are not added (documents are separated by boundaries)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"`--tokenizer` file {str(path)!r} does not exist")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"`--tokenizer` {str(path)!r} is not a Hugging Face tokenizer.json: {e}") from e
        self.name = str(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


TextTokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(path: str | Path | None) -> TextTokenizer:
    """Returns the byte tokenizer for None, else the Hugging Face tokenizer.json at `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


# ---------------------------------------------------------------------------------------------------- text files


def text_files(path: str | Path) -> list[Path]:
    """Returns `path` if it is a .txt/.jsonl file, or the .txt/.jsonl files under a directory, sorted."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"`--data` directory {str(path)!r} holds no .txt or .jsonl files")
        return files
    if not path.exists():
        raise ValueError(f"`--data` file {str(path)!r} does not exist")
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"`--data` {str(path)!r}: expected .txt, .jsonl, .bin (with .json sidecar) or .npy")
    return [path]


def read_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """Yields the documents of one file: a .txt file is one document, a .jsonl file one per non-blank line.

    A whole .txt file is one document because long-context training wants long documents; give a
    directory of .txt files for many. Raises ValueError naming the file (and line) for undecodable UTF-8,
    bad JSON, a missing or non-string `text_key`, or a file without text.
    """
    if path.suffix == ".txt":
        text = _decode(path.read_bytes(), path, 1)
        if not text.strip():
            raise ValueError(f"{path}: file is empty")
        yield text
        return
    empty = True
    with open(path, "rb") as f:  # line by line: a JSONL corpus may not fit in memory
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, path, number)
            if not line.strip():
                continue
            empty = False
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_key not in record:
                raise ValueError(f"{path}:{number}: expected an object with a {text_key!r} field")
            if not isinstance(record[text_key], str):
                kind = type(record[text_key]).__name__
                raise ValueError(f"{path}:{number}: field {text_key!r} is {kind}, not a string")
            yield record[text_key]
    if empty:
        raise ValueError(f"{path}: file is empty")


def _decode(raw: bytes, path: Path, first_line: int) -> str:
    """Returns `raw` as UTF-8, or raises ValueError naming the file and line of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None


def tokenize_documents(files: Iterable[Path], tokenizer: TextTokenizer, text_key: str = "text") -> Iterator[list[int]]:
    """Yields each non-empty document of `files` as token ids."""
    for path in files:
        for text in read_documents(path, text_key):
            ids = tokenizer.encode(text)
            if ids:
                yield ids


# --------------------------------------------------------------------------------------------------- token files


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def _doc_starts_path(path: Path) -> Path:
    return path.with_suffix(".docs.npy")


def write_token_file(
    data: str | Path, out: str | Path, tokenizer_path: str | Path | None = None, text_key: str = "text"
) -> dict:
    """Tokenizes text/JSONL at `data` into `out` (.bin) and returns the sidecar it writes next to it.

    Writes three files, streaming tokens so a corpus need not fit in memory:
    `out` raw uint16 (uint32 for vocabularies over 65536) token ids, `out.with_suffix('.json')` the sidecar
    {format, dtype, num_tokens, num_documents, max_token_id, vocab_size, tokenizer}, and
    `out.with_suffix('.docs.npy')` the int64 offset where each document starts.
    """
    out = Path(out)
    if out.suffix != ".bin":
        raise ValueError(f"token file {str(out)!r} must end in .bin")
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    starts: list[int] = []
    num_tokens = max_id = 0
    with open(out, "wb") as f:
        for ids in tokenize_documents(text_files(data), tokenizer, text_key):
            starts.append(num_tokens)
            array = np.asarray(ids, dtype=np.int64)
            max_id = max(max_id, int(array.max()))
            f.write(array.astype(dtype).tobytes())
            num_tokens += len(ids)
    if num_tokens == 0:
        out.unlink()
        raise ValueError(f"`--data` {str(data)!r} holds no text to tokenize")
    np.save(_doc_starts_path(out), np.asarray(starts, dtype=np.int64))
    sidecar = {
        "format": TOKEN_FILE_FORMAT,
        "dtype": np.dtype(dtype).name,
        "num_tokens": num_tokens,
        "num_documents": len(starts),
        "max_token_id": max_id,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
    }
    _sidecar(out).write_text(json.dumps(sidecar, indent=2) + "\n")
    log.info("wrote %d tokens in %d documents to %s", num_tokens, len(starts), out)
    return sidecar


def read_token_file(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns (tokens, doc_starts, max_token_id) of a .bin token file or a 1-D .npy, memory-mapped.

    A .npy has no sidecar: it is one document unless `<stem>.docs.npy` lists document starts.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`--data` file {str(path)!r} does not exist")
    docs_path = _doc_starts_path(path)
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        max_id = int(tokens.max()) if len(tokens) else 0
        if len(tokens) and int(tokens.min()) < 0:
            raise ValueError(f"{path}: token ids must be non-negative")
    else:
        sidecar_path = _sidecar(path)
        if not sidecar_path.is_file():
            raise ValueError(
                f"{path}: a .bin token file needs its sidecar {sidecar_path.name} (see `write_token_file`)"
            )
        sidecar = json.loads(sidecar_path.read_text())
        if sidecar.get("format") != TOKEN_FILE_FORMAT:
            raise ValueError(f"{sidecar_path}: format is {sidecar.get('format')!r}, expected {TOKEN_FILE_FORMAT!r}")
        if path.stat().st_size != sidecar["num_tokens"] * np.dtype(sidecar["dtype"]).itemsize:
            raise ValueError(
                f"{path}: size does not match {sidecar['num_tokens']} {sidecar['dtype']} tokens in its sidecar"
            )
        tokens = np.memmap(path, dtype=sidecar["dtype"], mode="r") if sidecar["num_tokens"] else np.zeros(0, np.uint16)
        max_id = sidecar["max_token_id"]
    if len(tokens) == 0:
        raise ValueError(f"{path}: token file is empty")
    starts = np.load(docs_path, mmap_mode="r") if docs_path.is_file() else np.zeros(1, dtype=np.int64)
    return tokens, starts, max_id


# ------------------------------------------------------------------------------------------------------- packing


class TokenDataset:
    """A token stream cut into seq_len chunks, served in a seeded shuffled order, one permutation per epoch.

    Chunks ignore document boundaries (no padding is wasted), but the label of a document's first token
    is IGNORE, so no loss is taken predicting across a boundary. The last chunk is padded with IGNORE labels.
    Attention still sees the previous document, as in GPT-style packing.
    """

    def __init__(
        self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, seed: int = 0, max_token_id: int | None = None
    ):
        if seq_len < 2:
            raise ValueError(f"`--seq-len` must be at least 2, got {seq_len}")
        if len(tokens) == 0:
            raise ValueError("the token stream is empty")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        self.num_sequences = -(-len(tokens) // seq_len)
        self.vocab_size_needed = (int(np.max(tokens)) if max_token_id is None else int(max_token_id)) + 1
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def sequence(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (ids, labels) of chunk `index`: ids (seq_len,), labels IGNORE at document starts and padding."""
        start = index * self.seq_len
        chunk = np.asarray(self.tokens[start : start + self.seq_len], dtype=np.int64)
        ids = torch.zeros(self.seq_len, dtype=torch.long)
        ids[: len(chunk)] = torch.from_numpy(chunk)
        labels = ids.clone()
        labels[len(chunk) :] = IGNORE
        lo, hi = np.searchsorted(self.doc_starts, [start + 1, start + len(chunk)])
        labels[torch.from_numpy(self.doc_starts[lo:hi] - start)] = IGNORE  # a document's first token
        return ids, labels

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the batch of optimizer step `step` (counted from 1, as the training loop does): samples
        (step-1)*batch_size onwards of the seeded epoch-by-epoch order, so every epoch visits each chunk once."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        first = (step - 1) * batch_size
        rows = [self.sequence(self._index(first + i)) for i in range(batch_size)]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def _index(self, sample: int) -> int:
        epoch, within = divmod(sample, self.num_sequences)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = torch.randperm(self.num_sequences, generator=_generator(self.seed, 2, epoch))
            self._epoch_order = (epoch, order)
        return int(self._epoch_order[1][within])


# -------------------------------------------------------------------------------------------------- entry point

Source = RetrievalTask | TokenDataset


def make_source(
    data_path: str | Path | None,
    seq_len: int,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
    text_key: str = "text",
) -> Source:
    """Returns what `memo train` trains on: the retrieval task without `data_path`, else its packed tokens.

    `data_path` is a .bin token file (with sidecar), a .npy, a .txt/.jsonl file, or a directory of
    .txt/.jsonl files (tokenized in memory with `tokenizer_path`, bytes by default).
    """
    if data_path is None:
        if tokenizer_path is not None:
            raise ValueError("`--tokenizer` applies only with `--data`")
        return RetrievalTask(seq_len, seed)
    path = Path(data_path)
    if path.suffix in (".bin", ".npy"):
        if tokenizer_path is not None:
            raise ValueError(f"`--tokenizer` does not apply to the pre-tokenized {str(path)!r}")
        tokens, starts, max_id = read_token_file(path)
        return TokenDataset(tokens, starts, seq_len, seed, max_id)
    tokenizer = load_tokenizer(tokenizer_path)
    starts, chunks, total = [], [], 0
    for ids in tokenize_documents(text_files(path), tokenizer, text_key):
        starts.append(total)
        chunks.append(np.asarray(ids, dtype=np.int64))
        total += len(ids)
    if total == 0:
        raise ValueError(f"`--data` {str(path)!r} holds no text to tokenize")
    return TokenDataset(np.concatenate(chunks), np.asarray(starts, dtype=np.int64), seq_len, seed)


def check_vocab(source: Source, vocab_size: int, model: str = "") -> None:
    """Raises ValueError when the source's token ids do not fit a model vocabulary of `vocab_size`."""
    if source.vocab_size_needed > vocab_size:
        which = f"`--model {model}`" if model else "the model"
        raise ValueError(
            f"data needs token ids up to {source.vocab_size_needed - 1} but {which} has vocab_size {vocab_size}; "
            "pick a model whose vocabulary covers the tokenizer"
        )
