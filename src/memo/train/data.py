"""Training data: a generated long-range retrieval task, or text and token files packed into sequences.

Every source answers `batch(step, batch_size) -> (ids, labels, positions)` as a pure function of (seed, step),
so a resumed run sees exactly the batches it would have seen, and `eval_batches(n, batch_size)`, a list of such
batches, the same held-out ones at every evaluation. Labels follow `Transformer`'s convention: position t
predicts labels[t + 1], and IGNORE_INDEX (-100) marks targets the loss skips. Positions are None when each sequence
is one document to the model (the generated task, and `concat` packing), else (b, s) int64: each token's
position within its document, 0 where one begins, with which the model attends within documents only
(`Transformer.forward(positions=)`, `memo.documents`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import numpy as np
import torch

from ..chat import ChatTemplate, check_conversation, render_conversation, tokenize_rendered
from ..config import check_int
from ..documents import document_lengths, document_positions
from ..loss import IGNORE_INDEX, shift_labels
from ..token_files import (
    TOKEN_SUFFIXES,
    check_document_starts,
    check_regular,
    check_separator,
    check_tokenizer,
    read_token_file,
    token_file_separator,
    write_tokens,
)

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 256  # rows decoded at a time: a Parquet corpus is streamed, never read whole
PACKINGS = ("mask", "concat")  # documents attend only to themselves, or across each other (GPT-style)
SEPARATORS = ("auto", "bos", "eos", "none")  # the special tokens that bound each document of text data
MAX_DOCUMENTS = 1024  # documents kept apart per sequence by default: `TokenDataset`'s max_documents
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma
PROBE = "a"  # text encoded to find the tokens a tokenizer's post-processor adds around a sequence
CHAT_FIELD = "messages"  # the JSONL field / Parquet column of conversations, read where there is no text field
LONG_CONVERSATIONS = ("refuse", "truncate")  # what becomes of a conversation longer than a sequence

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # ids (b, s), labels (b, s), positions or None


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

    def batch(self, step: int, batch_size: int) -> Batch:
        """Returns the training batch for `step`, the same for the same (seed, step); positions None (each
        sequence is one document)."""
        return *self._sample(batch_size, self.span(step), _generator(self.seed, 0, step)), None

    def span(self, step: int) -> int:
        """Returns how many leading tokens hold the task at `step` (the curriculum's length)."""
        if step >= self.ramp_end or self.start_span >= self.seq_len:
            return self.seq_len
        grown = (self.seq_len - self.start_span) * max(0, step - self.ramp_start) // (self.ramp_end - self.ramp_start)
        return self.start_span + grown

    def eval_batches(self, n_batches: int = 4, batch_size: int = 8) -> list[Batch]:
        """Returns full-length held-out batches, drawn from a stream that training never reads."""
        return [(*self._sample(batch_size, self.seq_len, _generator(self.seed, 1, i)), None) for i in range(n_batches)]

    def _sample(self, batch: int, span: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = retrieval_batch(batch, span, generator, self.n_pairs, self.n_keys, self.n_values, self.n_filler)
        if span == self.seq_len:
            return ids, labels
        tail = (batch, self.seq_len - span)
        filler0 = self.vocab_size_needed - self.n_filler
        ids = torch.cat((ids, filler0 + torch.randint(0, self.n_filler, tail, generator=generator)), dim=1)
        return ids, torch.cat((labels, torch.full(tail, IGNORE_INDEX)), dim=1)


def retrieval_batch(
    batch: int,
    seq_len: int,
    generator: torch.Generator,
    n_pairs: int = 16,
    n_keys: int = 16,
    n_values: int = 8,
    n_filler: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ids, labels) of the retrieval task described in `RetrievalTask`; labels are IGNORE_INDEX but on
    answers."""
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
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, context + 1 :: 2] = answer0 + answers
    return ids, labels


@torch.no_grad()
def retrieval_accuracy(model: torch.nn.Module, batches: Iterable[Batch]) -> float:
    """Returns the fraction of labelled tokens that the model's greedy (argmax) prediction gets exactly right,
    over batches of the retrieval task (one document per sequence: their positions are None)."""
    device = next(model.parameters()).device
    counts = sum(answer_counts(model, ids.to(device), shift_labels(labels).to(device)) for ids, labels, _ in batches)
    if counts[1] == 0:
        raise ValueError("retrieval accuracy needs at least one labelled token")
    return int(counts[0]) / int(counts[1])


@torch.no_grad()
def answer_counts(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns [correct, labelled] over `targets` (shifted labels: position t predicts targets[t]) of the
    model's greedy predictions; a sequence-parallel rank passes its own tokens and gets its own counts."""
    predicted = model(ids).argmax(dim=-1)  # (b, s)
    mask = targets != IGNORE_INDEX
    return torch.stack(((predicted[mask] == targets[mask]).sum(), mask.sum()))


# ------------------------------------------------------------------------------------------------------ tokenizers


@dataclass(frozen=True)
class Separator:
    """The special tokens that bound each document of text data: `ids` before it (kind "bos"), after it ("eos"),
    or none. The label of a document's first token stays IGNORE_INDEX either way: a BOS is never predicted across a
    boundary, and an EOS is predicted by the document it ends."""

    kind: str = "none"
    ids: tuple[int, ...] = ()

    def wrap(self, ids: list[int]) -> list[int]:
        """Returns a document's token ids with the separator added."""
        return [*self.ids, *ids] if self.kind == "bos" else [*ids, *self.ids]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: no file to load, and it fits the 256-id vocab of the `tiny` presets."""

    name = identity = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def separator(self, choice: str = "auto") -> Separator:
        """Returns no separator: bytes have no special tokens, so `bos` or `eos` is an error."""
        if choice in ("bos", "eos"):
            raise ValueError(
                f"`--document-separator {choice}`: the byte tokenizer has no special tokens; give `--tokenizer`, "
                "or use auto or none"
            )
        return Separator()


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. `encode` adds no special tokens: documents get the tokenizer's own
    separator (`separator`) when they are tokenized (`tokenize_documents`)."""

    def __init__(self, path: str | Path, flag: str = "`--tokenizer`"):
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{flag} file {str(path)!r} does not exist")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{flag} {str(path)!r} is not a Hugging Face tokenizer.json: {e}") from e
        self.name = str(path)
        self.identity = tokenizer_identity(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def separator(self, choice: str = "auto") -> Separator:
        """Returns the tokens that bound a document under `choice` (SEPARATORS): bos, what the tokenizer's
        post-processor puts before a sequence (Llama's `<s>`, `<|begin_of_text|>`); eos, what it puts after one,
        else its end-of-text special token (EOS_TOKENS: GPT-2's and Qwen's `<|endoftext|>`, Mistral's `</s>`);
        auto, bos if it has one, else eos if it has one, else none. Raises ValueError for a bos or eos it lacks."""
        if choice == "none":
            return Separator()
        before, after = self._template()
        found = {"bos": before, "eos": after or self._end_of_text()}
        if choice == "auto":
            kind = next((k for k in ("bos", "eos") if found[k]), "none")
            return Separator(kind, found.get(kind, ()))
        if not found[choice]:
            where = "its post-processor adds none" if choice == "bos" else f"none of {', '.join(EOS_TOKENS)}"
            raise ValueError(
                f"`--document-separator {choice}`: tokenizer {self.name} has no {choice.upper()} token ({where}); "
                "use auto or none"
            )
        return Separator(choice, found[choice])

    def _template(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Returns the ids the tokenizer's post-processor (a TemplateProcessing) adds before and after a sequence:
        the library encodes a probe with and without its special tokens, and the difference is theirs."""
        for probe in self._probes():
            try:
                plain = self._tokenizer.encode(probe, add_special_tokens=False).ids
                full = self._tokenizer.encode(probe, add_special_tokens=True).ids
            except Exception:  # the Rust side's own type: a word outside a vocabulary that has no unknown token
                continue
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
            if plain and at is not None:
                return tuple(full[:at]), tuple(full[at + len(plain) :])
        raise ValueError(
            f"tokenizer {self.name}: cannot tell which special tokens it adds around a sequence; give "
            "`--document-separator none`"
        )

    def _probes(self) -> Iterator[str]:
        """Yields texts to encode: PROBE, then the text of the tokenizer's first ordinary (not added) token."""
        yield PROBE
        added = self._tokenizer.get_added_tokens_decoder()
        ordinary = [i for i in self._tokenizer.get_vocab(with_added_tokens=False).values() if i not in added]
        if ordinary:
            yield self._tokenizer.decode([min(ordinary)])

    def _end_of_text(self) -> tuple[int, ...]:
        """Returns the id of the tokenizer's end-of-text special token, the first of EOS_TOKENS it declares; ()
        for none."""
        special = {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        return next(((special[name],) for name in EOS_TOKENS if name in special), ())


TextTokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(path: str | Path | None) -> TextTokenizer:
    """Returns the byte tokenizer for None, else the Hugging Face tokenizer.json at `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def tokenizer_identity(path: str | Path | None) -> str:
    """Returns what names a tokenizer's ids whatever its file is called: "bytes", or the sha256 of its
    tokenizer.json (two files with the same content tokenize alike)."""
    if path is None:
        return ByteTokenizer.identity
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"`--tokenizer` file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------------------------------------------- text files


def text_files(path: str | Path, flag: str = "--data") -> list[Path]:
    """Returns `path` if it is a .txt/.jsonl/.parquet file, or those files under a directory, sorted; `flag`
    names the option in errors."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and not p.is_dir())
        for p in files:
            check_regular(p, flag)
        if not files:
            raise ValueError(f"`{flag}` directory {str(path)!r} holds no .txt, .jsonl or .parquet files")
        return files
    check_regular(path, flag)
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"`{flag}` {str(path)!r}: expected .txt, .jsonl, .parquet, .bin (with .json sidecar) or .npy")
    return [path]


class Document(NamedTuple):
    """One document of a text file: `where` it is (the file, and its line or row) and its `body`, a text or a
    conversation (a list of messages, `memo.chat`)."""

    where: str
    body: str | list


def read_documents(path: Path, text_field: str = "text") -> Iterator[Document]:
    """Yields the documents of one file: a .txt file is one document, a .jsonl file one per non-blank line
    (its `text_field`), a .parquet file one per row (its `text_field` column). A record without `text_field` is
    read from CHAT_FIELD (`messages`) instead; a field that holds a list is a conversation.

    A whole .txt file is one document because long-context training wants long documents; give a
    directory of .txt files for many. Raises ValueError naming the file (and line or row) for an unreadable
    file, undecodable UTF-8, bad JSON, a missing field, one that is neither a string nor a list, or a file
    without text.
    """
    read = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}[path.suffix]
    try:
        yield from read(path, text_field)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def holds_conversations(path: str | Path, text_field: str = "text", flag: str = "--data") -> bool:
    """Returns whether text data `path` (`text_files`) holds conversations: its first document is one."""
    return isinstance(next(read_documents(text_files(path, flag)[0], text_field)).body, list)


def _txt_documents(path: Path, text_field: str) -> Iterator[Document]:
    text = _decode(path.read_bytes(), path, 1)
    if not text.strip():
        raise ValueError(f"{path}: file is empty")
    yield Document(str(path), text)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Document]:
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
            if not isinstance(record, dict) or not {text_field, CHAT_FIELD} & record.keys():
                raise ValueError(
                    f"{path}:{number}: expected an object with a {text_field!r} field (or {CHAT_FIELD!r}, a "
                    "conversation)"
                )
            field = text_field if text_field in record else CHAT_FIELD
            if not isinstance(record[field], (str, list) if field == text_field else list):
                kind, expected = type(record[field]).__name__, _expected(field == text_field)
                raise ValueError(f"{path}:{number}: field {field!r} is {kind}, not {expected}")
            yield Document(f"{path}:{number}", record[field])
    if empty:
        raise ValueError(f"{path}: file is empty")


def _parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    """Yields the `text_field` column of a Parquet file (as `datasets` exports), else its CHAT_FIELD column,
    PARQUET_BATCH_ROWS rows at a time and no other column, so a file larger than memory streams. Rows count from
    0, as in `datasets`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        schema = table.schema_arrow
        field = CHAT_FIELD if text_field not in schema.names and CHAT_FIELD in schema.names else text_field
        if field not in schema.names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)})")
        kind = schema.field(field).type
        if not ((field == text_field and _is_text(pa, kind)) or pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ValueError(f"{path}: column {field!r} is {kind}, not {_expected(field == text_field)}")
        if table.metadata.num_rows == 0:
            raise ValueError(f"{path}: file is empty")
        row = 0
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for body in batch.column(0).to_pylist():
                if body is None:
                    raise ValueError(f"{path}: column {field!r} is null at row {row}")
                yield Document(f"{path} row {row}", body)
                row += 1
    except pa.ArrowException as e:  # not Parquet, truncated, or a corrupt page
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None


def _expected(text_field: bool) -> str:
    """Returns what the text field holds (a text or a conversation), or CHAT_FIELD (a conversation)."""
    return "a string or a list of messages" if text_field else "a list of messages"


def _is_text(pa, kind) -> bool:
    """Returns whether an Arrow type holds strings (plain, large, view, or dictionary-encoded)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _decode(raw: bytes, path: Path, first_line: int) -> str:
    """Returns `raw` as UTF-8, or raises ValueError naming the file and line of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None


def tokenize_documents(
    files: Iterable[Path], tokenizer: TextTokenizer, text_field: str = "text", separator: Separator = Separator()
) -> Iterator[list[int]]:
    """Yields each non-empty document of `files` as token ids, with `separator` (`TextTokenizer.separator`); a
    conversation among them is an error (`tokenize_conversations` reads conversations)."""
    for path in files:
        for where, body in read_documents(path, text_field):
            if not isinstance(body, str):
                raise ValueError(f"{where}: a conversation among text documents: give conversations and text apart")
            ids = tokenizer.encode(body)
            if ids:
                yield separator.wrap(ids)


def tokenize_conversations(
    files: Iterable[Path],
    template: ChatTemplate,
    tokenizer: TextTokenizer,
    seq_len: int,
    text_field: str = "text",
    long_conversations: str = "refuse",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (tokens, document starts, trained) of the conversations of `files` rendered with `template`
    (`memo.chat`): each a document, or one per assistant turn where the template rewrites earlier turns (a warning
    counts them); trained marks the assistant's tokens. A document longer than `seq_len` is an error naming its
    row, or with `long_conversations` truncate cut to its first `seq_len` tokens (a warning counts them)."""
    chunks, trained, starts, total = [], [], [], 0
    split = cut = lost = 0
    for where, body in (document for path in files for document in read_documents(path, text_field)):
        if isinstance(body, str):
            raise ValueError(f"{where}: text among conversations: give conversations and text apart")
        check_conversation(body, where)
        rendered = render_conversation(template, body, where)
        split += len(rendered) > 1
        for document in rendered:
            ids, mask = tokenize_rendered(document, tokenizer.encode, where)
            if len(ids) > seq_len and long_conversations == "refuse":
                raise ValueError(
                    f"{where}: the conversation is {len(ids)} tokens, longer than a sequence ({seq_len}): give "
                    f"`--long-conversations truncate` to keep its first {seq_len} tokens, or longer sequences"
                )
            cut, lost = cut + (len(ids) > seq_len), lost + sum(mask[seq_len:])
            starts.append(total)
            chunks.append(np.asarray(ids[:seq_len], dtype=np.int64))
            trained.append(np.asarray(mask[:seq_len], dtype=bool))
            total += len(chunks[-1])
    _log_conversations(template, split, cut, lost, seq_len)
    return np.concatenate(chunks), np.asarray(starts, dtype=np.int64), np.concatenate(trained)


def _log_conversations(template: ChatTemplate, split: int, cut: int, lost: int, seq_len: int) -> None:
    """Logs, once per data source, the conversations made one document per turn and those truncated."""
    if split:
        log.warning(
            "%d conversation(s) are one document per assistant turn, the earlier turns repeated in each: the chat "
            "template of %s rewrites earlier turns as a conversation goes on", split, template.folder,
        )  # fmt: skip
    if cut:
        log.warning(
            "%d conversation(s) longer than a sequence cut to its %d tokens (`--long-conversations truncate`): "
            "%d assistant token(s) left out", cut, seq_len, lost,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------- token files


def write_token_file(
    data: str | Path,
    out: str | Path,
    tokenizer_path: str | Path | None = None,
    text_field: str = "text",
    separator: str = "auto",
) -> dict:
    """Tokenizes text/JSONL/Parquet at `data` into token file `out` (.bin, `token_files`: with its sidecar and
    document starts, streamed so a corpus need not fit in memory) and returns the sidecar it writes. `separator`
    (SEPARATORS) bounds each document; the sidecar records what it resolved to, and the tokenizer: its absolute
    path, or bytes, and `tokenizer_identity`. Conversations are refused: a token file has no place for which
    tokens are the assistant's."""
    if holds_conversations(data, text_field):
        raise ValueError(
            f"`--data` {str(data)!r} holds conversations (`messages`): a token file cannot hold which tokens are the "
            "assistant's; give the .jsonl/.parquet to `memo train --data`"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    bounds = tokenizer.separator(separator)
    return write_tokens(
        out,
        tokenize_documents(text_files(data), tokenizer, text_field, bounds),
        empty=f"`--data` {str(data)!r} holds no text to tokenize",
        vocab_size=tokenizer.vocab_size,
        tokenizer=str(Path(tokenizer_path).absolute()) if tokenizer_path is not None else tokenizer.name,
        tokenizer_id=tokenizer.identity,
        separator=bounds.kind,
    )


# ------------------------------------------------------------------------------------------------------- packing


class TokenDataset:
    """A token stream cut into seq_len chunks, served in a seeded shuffled order, one permutation per epoch.

    The stream is `tokens`, or with `spans` ((n, 2) [start, end) ranges of whole documents, in order) the
    concatenation of those ranges: how `split_documents` keeps held-out documents out of training without
    copying a memory-mapped corpus. Chunks ignore document boundaries (no padding is wasted), but the label
    of a document's first token is IGNORE_INDEX, so no loss is taken predicting across a boundary. The last chunk
    is padded with IGNORE_INDEX labels.

    `pack_documents` (PACKINGS) says what attention sees. "concat" is GPT-style packing: attention and RoPE
    positions run across documents, and batches carry positions None. "mask" gives each token its position
    within its document, so each document attends only to itself: positions restart at 0 at every document
    start, and at a chunk's first token (a document cut by a chunk boundary continues in the next chunk as a new
    document, from position 0, as if read alone from there). Padding is a document of its own, never seen by
    real tokens. At most `max_documents` documents (padding aside) are kept apart in a chunk: later ones join the
    `max_documents`-th (they attend to it as in concat, their positions count on, their first labels stay
    IGNORE_INDEX). That bounds the attention segments of a sequence, each one kernel call where no variable-length
    kernel runs (a CPU, or a kernel other than flash on CUDA), without dropping a token;
    `joined_documents` counts the documents it joins.

    `trained` (bool, one per token of `tokens`: conversations, `tokenize_conversations`) keeps the labels of the
    tokens it marks (the assistant's) and no others, and chunks then hold whole documents, so that no conversation
    is cut from its prompt: each chunk starts at a document and takes those that fit whole (one longer than
    seq_len goes on in the next chunks, as without `trained`), and is padded after them.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        doc_starts: np.ndarray,
        seq_len: int,
        seed: int = 0,
        max_token_id: int | None = None,
        spans: np.ndarray | None = None,
        pack_documents: str = "concat",
        max_documents: int = MAX_DOCUMENTS,
        trained: np.ndarray | None = None,
    ):
        if seq_len < 2:
            raise ValueError(f"`--seq-len` must be at least 2, got {seq_len}")
        if pack_documents not in PACKINGS:
            raise ValueError(f"`--pack-documents` must be one of {', '.join(PACKINGS)}, got {pack_documents!r}")
        check_int("--max-documents-per-sequence", max_documents)
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.pack_documents, self.max_documents = pack_documents, max_documents
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        whole = [[0, len(tokens)]]
        self.spans = np.asarray(whole if spans is None else spans, dtype=np.int64).reshape(-1, 2)
        self._span_offsets = np.concatenate(([0], np.cumsum(self.spans[:, 1] - self.spans[:, 0])))  # in the stream
        self.num_tokens = int(self._span_offsets[-1])
        if self.num_tokens == 0:
            raise ValueError("the token stream is empty")
        self._starts = self.doc_starts if spans is None else _stream_starts(self.doc_starts, self.spans)
        self.trained = None if trained is None else np.asarray(trained, dtype=bool)
        self._chunks = None if trained is None else _whole_document_chunks(self._starts, self.num_tokens, seq_len)
        self.num_sequences = -(-self.num_tokens // seq_len) if self._chunks is None else len(self._chunks)
        self.vocab_size_needed = (int(np.max(tokens)) if max_token_id is None else int(max_token_id)) + 1
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def sequence(self, index: int) -> Batch:
        """Returns (ids, labels, positions) of chunk `index`: ids (seq_len,), labels IGNORE_INDEX at document starts,
        padding and tokens `trained` leaves out, positions (seq_len,) within documents in mask packing, else None."""
        start, length = self._chunk(index)
        ids = torch.zeros(self.seq_len, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX)
        filled, span = 0, int(np.searchsorted(self._span_offsets, start, side="right")) - 1
        while filled < length and span < len(self.spans):
            lo = int(self.spans[span, 0] + start + filled - self._span_offsets[span])
            hi = min(int(self.spans[span, 1]), lo + length - filled)
            piece = torch.from_numpy(np.asarray(self.tokens[lo:hi], dtype=np.int64))
            ids[filled : filled + len(piece)] = labels[filled : filled + len(piece)] = piece
            if self.trained is not None:
                labels[filled : filled + len(piece)][~torch.from_numpy(self.trained[lo:hi])] = IGNORE_INDEX
            filled, span = filled + len(piece), span + 1
        first, last = np.searchsorted(self._starts, [start, start + filled])
        begins = np.asarray(self._starts[first:last]) - start  # documents starting in the chunk
        labels[torch.from_numpy(begins[begins > 0])] = IGNORE_INDEX  # position 0's label is never a target anyway
        if self.pack_documents == "concat":
            return ids, labels, None
        starts = torch.zeros(self.seq_len, dtype=torch.bool)
        starts[torch.from_numpy(np.union1d([0], begins)[: self.max_documents])] = True  # the first chunk token too
        if filled < self.seq_len:  # padding: a document of its own
            starts[filled] = True
        return ids, labels, document_positions(starts[None])[0]

    def _chunk(self, index: int) -> tuple[int, int]:
        """Returns where chunk `index` starts in the stream and how many tokens it holds."""
        if self._chunks is None:
            start = index * self.seq_len
            return start, min(self.seq_len, self.num_tokens - start)
        end = self._chunks[index + 1] if index + 1 < len(self._chunks) else self.num_tokens
        return int(self._chunks[index]), int(end - self._chunks[index])

    def document_lengths(self) -> np.ndarray:
        """Returns the token count of each document of the stream, in order (a held-out split's are not its)."""
        return document_lengths(self._starts, self.num_tokens)

    def joined_documents(self) -> tuple[int, int]:
        """Returns (documents joined to the one before them by max_documents, chunks holding them); (0, 0) in
        concat packing, where documents are not kept apart."""
        if self.pack_documents == "concat":
            return 0, 0
        if self._chunks is None:
            chunks = self._starts // self.seq_len
        else:
            chunks = np.searchsorted(self._chunks, self._starts, side="right") - 1
        chunk, count = np.unique(chunks, return_counts=True)
        first = chunk * self.seq_len if self._chunks is None else self._chunks[chunk]
        mid_document = ~np.isin(first, self._starts)  # its first token continues a document
        over = np.maximum(count + mid_document - self.max_documents, 0)
        return int(over.sum()), int(np.count_nonzero(over))

    def batch(self, step: int, batch_size: int) -> Batch:
        """Returns the batch of optimizer step `step` (counted from 1, as the training loop does): samples
        (step-1)*batch_size onwards of the seeded epoch-by-epoch order, so every epoch visits each chunk once."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        first = (step - 1) * batch_size
        return _stack([self.sequence(self._index(first + i)) for i in range(batch_size)])

    def eval_batches(self, n_batches: int = 4, batch_size: int = 8) -> list[Batch]:
        """Returns the stream's first n_batches x batch_size chunks in order, the same at every evaluation (fewer
        batches for a shorter stream); rows past its end are padding, IGNORE_INDEX labels (in mask packing one document
        each), so every batch is full."""
        positions = torch.arange(self.seq_len) if self.pack_documents == "mask" else None
        padding = torch.zeros(self.seq_len, dtype=torch.long), torch.full((self.seq_len,), IGNORE_INDEX), positions
        return [
            _stack([self.sequence(i) if i < self.num_sequences else padding for i in range(first, first + batch_size)])
            for first in range(0, min(n_batches * batch_size, self.num_sequences), batch_size)
        ]

    def _index(self, sample: int) -> int:
        epoch, within = divmod(sample, self.num_sequences)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = torch.randperm(self.num_sequences, generator=_generator(self.seed, 2, epoch))
            self._epoch_order = (epoch, order)
        return int(self._epoch_order[1][within])


def _whole_document_chunks(starts: np.ndarray, total: int, seq_len: int) -> np.ndarray:
    """Returns where each chunk starts in a stream of `total` tokens whose documents start at `starts` (the first
    at 0) when chunks hold whole documents: a chunk starts at a document and takes those that fit in seq_len; a
    document longer than that fills chunks of its own, the last one taking what fits after it."""
    chunks = [0]
    for start, end in zip(starts.tolist(), [*starts[1:].tolist(), total]):
        if end - chunks[-1] <= seq_len:
            continue
        if start > chunks[-1]:
            chunks.append(start)
        while end - chunks[-1] > seq_len:
            chunks.append(chunks[-1] + seq_len)
    return np.asarray(chunks, dtype=np.int64)


def _stack(rows: list[Batch]) -> Batch:
    ids, labels, positions = zip(*rows)
    return torch.stack(ids), torch.stack(labels), None if positions[0] is None else torch.stack(positions)


def _stream_starts(doc_starts: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Returns where the documents of `spans` ((n, 2) ranges of whole documents of the token file) start in the
    stream that concatenates them."""
    first, last = np.searchsorted(doc_starts, spans[:, 0]), np.searchsorted(doc_starts, spans[:, 1])
    counts = last - first
    span = np.repeat(np.arange(len(spans)), counts)  # the span of each document
    document = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(first, counts)
    offsets = np.concatenate(([0], np.cumsum(spans[:, 1] - spans[:, 0])))[:-1]
    return doc_starts[document] - spans[span, 0] + offsets[span]


def split_documents(source: TokenDataset, fraction: float, seed: int = 0) -> tuple[TokenDataset, TokenDataset]:
    """Returns (train, held_out) of a whole token stream: round(fraction x documents), at least one, held out
    whole, and the rest to train on. Both read `source`'s tokens in place (a .bin stays memory-mapped).

    Which documents is a fixed hash of (seed, document index), not a random stream whose algorithm may change
    with the numpy version: a resumed run holds out the same documents, so it never evaluates one it trained on.
    """
    starts, total = source.doc_starts, len(source.tokens)
    n = len(starts)
    k = max(1, round(fraction * n))
    if k >= n:
        raise ValueError(
            f"`--eval-split` {fraction} of {n} document(s) leaves none to train on: "
            "give more documents or `--eval-data`"
        )
    salt = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))
    held = np.sort(np.argpartition(_splitmix64(np.arange(n, dtype=np.uint64) ^ salt), k - 1)[:k])
    held_starts = starts[held]
    held_ends = np.where(held + 1 < n, starts[np.minimum(held + 1, n - 1)], total)
    train = np.stack((np.append(0, held_ends), np.append(held_starts, total)), axis=1)
    held_out = np.stack((held_starts, held_ends), axis=1)
    log.info("held out %d of %d documents (%d tokens) for evaluation", k, n, int((held_ends - held_starts).sum()))
    max_id = source.vocab_size_needed - 1
    packing = {"pack_documents": source.pack_documents, "max_documents": source.max_documents}
    packing["trained"] = source.trained
    return tuple(
        TokenDataset(
            source.tokens, starts, source.seq_len, source.seed, max_id, spans[spans[:, 1] > spans[:, 0]], **packing
        )
        for spans in (train, held_out)
    )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Returns splitmix64's finaliser of each uint64 (a bijection that scatters neighbouring inputs)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# -------------------------------------------------------------------------------------------------- entry point

Source = RetrievalTask | TokenDataset


def make_source(
    data_path: str | Path | None,
    seq_len: int,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    **packing,
) -> Source:
    """Returns what `memo train` trains on: the retrieval task without `data_path` (one document per sequence:
    the `packing` arguments of `token_dataset` do not apply), else its packed tokens (see `token_dataset`),
    checked to come from the run's `tokenizer` (an identity; None: not known)."""
    if data_path is None:
        if tokenizer_path is not None:
            raise ValueError("`--tokenizer` applies only with `--data`")
        return RetrievalTask(seq_len, seed)
    if Path(data_path).suffix in TOKEN_SUFFIXES and tokenizer_path is not None:
        raise ValueError(f"`--tokenizer` does not apply to the pre-tokenized {str(data_path)!r}")
    return token_dataset(data_path, seq_len, seed, tokenizer_path, text_field, tokenizer=tokenizer, **packing)


def token_dataset(
    path: str | Path,
    seq_len: int,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
    text_field: str = "text",
    flag: str = "--data",
    tokenizer: str | None = None,
    pack_documents: str = "concat",
    max_documents: int = MAX_DOCUMENTS,
    separator: str = "auto",
    long_conversations: str = "refuse",
) -> TokenDataset:
    """Returns the packed tokens of `path` (`TokenDataset`, packed by `pack_documents` and `max_documents`): a
    .bin token file (with sidecar) or a .npy, memory-mapped, or a .txt/.jsonl/.parquet file or a directory of
    them, tokenized in memory with `tokenizer_path` (bytes by default; unused by token files), each document
    bounded by the tokenizer's `separator` (SEPARATORS, `HFTokenizer.separator`). Tokens of another tokenizer
    than `tokenizer` (the identity of the one the model reads; None: not known), and a token file written with
    another separator than a `separator` other than auto, are errors. `flag` names the option in errors.

    Conversations (`holds_conversations`) are rendered with the chat template of `tokenizer_path`'s folder, its
    special tokens in place of a separator, and trained on the assistant's tokens alone, each conversation whole
    in a sequence (`tokenize_conversations`, `long_conversations`: LONG_CONVERSATIONS)."""
    path = Path(path)
    packing = {"pack_documents": pack_documents, "max_documents": max_documents}
    if path.suffix in TOKEN_SUFFIXES:
        tokens, starts, max_id = read_token_file(path, flag, tokenizer)
        check_separator(path, token_file_separator(path), separator, flag)
        if pack_documents == "mask":  # read as one document, its documents would attend to each other
            remedy = (
                "write the token file again with memo.train.data.write_token_file, or give `--pack-documents concat`"
            )
            check_document_starts(path, flag, f"`--pack-documents mask` needs it; {remedy}")
        return TokenDataset(tokens, starts, seq_len, seed, max_id, **packing)
    text_tokenizer = load_tokenizer(tokenizer_path)
    check_tokenizer(path, text_tokenizer.identity, tokenizer, flag)
    if holds_conversations(path, text_field, flag):
        if long_conversations not in LONG_CONVERSATIONS:
            raise ValueError(f"`--long-conversations` must be one of {', '.join(LONG_CONVERSATIONS)}")
        template = ChatTemplate(tokenizer_path, f"`{flag}` {str(path)!r}")
        files = text_files(path, flag)
        tokens, starts, trained = tokenize_conversations(
            files, template, text_tokenizer, seq_len, text_field, long_conversations
        )
        return TokenDataset(tokens, starts, seq_len, seed, trained=trained, **packing)
    bounds = text_tokenizer.separator(separator)
    starts, chunks, total = [], [], 0
    for ids in tokenize_documents(text_files(path, flag), text_tokenizer, text_field, bounds):
        starts.append(total)
        chunks.append(np.asarray(ids, dtype=np.int64))
        total += len(ids)
    if total == 0:
        raise ValueError(f"`{flag}` {str(path)!r} holds no text to tokenize")
    return TokenDataset(np.concatenate(chunks), np.asarray(starts, dtype=np.int64), seq_len, seed, **packing)


def separator_kind(
    path: str | Path, tokenizer_path: str | Path | None = None, separator: str = "auto", text_field: str = "text"
) -> str | None:
    """Returns the separator (bos, eos, none) the documents of `--data` `path` carry: what `separator` resolves to
    with the tokenizer of text (`tokenizer_path`, bytes by default), none for conversations (their chat template
    writes the special tokens), or a token file's own (None: a .npy does not say)."""
    if Path(path).suffix in TOKEN_SUFFIXES:
        return token_file_separator(path)
    if holds_conversations(path, text_field):
        return "none"
    return load_tokenizer(tokenizer_path).separator(separator).kind


def check_vocab(source: Source, vocab_size: int, model: str = "") -> None:
    """Raises ValueError when the source's token ids do not fit a model vocabulary of `vocab_size`."""
    if source.vocab_size_needed > vocab_size:
        which = f"`--model {model}`" if model else "the model"
        raise ValueError(
            f"data needs token ids up to {source.vocab_size_needed - 1} but {which} has vocab_size {vocab_size}; "
            "pick a model whose vocabulary covers the tokenizer"
        )
