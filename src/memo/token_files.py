"""memo's token files: token ids written once, memory-mapped by every run that trains on them or prices them.

A token file is a `.bin` of raw token ids with two files beside it, or a 1-D integer `.npy`:

- `<stem>.bin`: the ids, uint16 (uint32 for vocabularies over 65536), one stream of every document in order;
- `<stem>.json`, its sidecar: {format, dtype, num_tokens, num_documents, max_token_id, vocab_size, tokenizer,
  tokenizer_id, document_separator}, checked against the `.bin` whenever it is read;
- `<stem>.docs.npy`: the int64 offset where each document starts (at its separator, if one comes before it).

A `.npy` has no sidecar: it is one document unless `<stem>.docs.npy` lists document starts. The trainer
(`train.data`) packs a token file into sequences, and the cost model (`documents.DocumentLengths.of_file`) reads
its document starts: both read it here, the format's one definition.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import numpy as np

from .files import atomic_output, read_json_object, write_text

log = logging.getLogger(__name__)

TOKEN_FILE_FORMAT = "memo-tokens-v1"
TOKEN_SUFFIXES = (".bin", ".npy")


def write_tokens(
    out: str | Path,
    documents: Iterable[list[int]],
    *,
    empty: str,
    vocab_size: int,
    tokenizer: str,
    tokenizer_id: str,
    separator: str,
) -> dict:
    """Writes `documents` (the token ids of each, in order) as token file `out` (.bin) and returns the sidecar it
    writes beside it: `tokenizer` names the tokenizer (its absolute path, or bytes), `tokenizer_id` says which ids
    these are (`train.data.tokenizer_identity`), `separator` what bounds each document (bos, eos or none; a run
    reading the file must use the same). The ids are streamed, so a corpus need not fit in memory. Raises
    ValueError with the message `empty`, writing nothing, when the documents hold no token."""
    out = Path(out)
    if out.suffix != ".bin":
        raise ValueError(f"token file {str(out)!r} must end in .bin")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    starts: list[int] = []
    num_tokens = max_id = 0
    with atomic_output(out) as tmp, open(tmp, "wb") as f:
        for ids in documents:
            starts.append(num_tokens)
            array = np.asarray(ids, dtype=np.int64)
            max_id = max(max_id, int(array.max()))
            f.write(array.astype(dtype).tobytes())
            num_tokens += len(ids)
        if num_tokens == 0:
            raise ValueError(empty)
    with atomic_output(doc_starts_path(out)) as tmp:
        np.save(tmp, np.asarray(starts, dtype=np.int64))
    sidecar = {
        "format": TOKEN_FILE_FORMAT,
        "dtype": np.dtype(dtype).name,
        "num_tokens": num_tokens,
        "num_documents": len(starts),
        "max_token_id": max_id,
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "tokenizer_id": tokenizer_id,
        "document_separator": separator,
    }
    write_text(_sidecar(out), json.dumps(sidecar, indent=2) + "\n")
    log.info("wrote %d tokens in %d documents to %s", num_tokens, len(starts), out)
    return sidecar


def read_token_file(
    path: str | Path, flag: str = "--data", tokenizer: str | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns (tokens, doc_starts, max_token_id) of a .bin token file or a 1-D .npy, memory-mapped.

    A .bin whose sidecar names another tokenizer than `tokenizer` (an identity, `train.data.tokenizer_identity`)
    is an error. `flag` names the option in errors.
    """
    path = Path(path)
    check_regular(path, flag)
    docs_path = doc_starts_path(path)
    if path.suffix == ".npy":
        tokens = _load_npy(path)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
    else:
        sidecar_path = _sidecar(path)
        sidecar = _read_sidecar(sidecar_path)
        check_tokenizer(path, sidecar.get("tokenizer_id"), tokenizer, flag)
        if path.stat().st_size != sidecar["num_tokens"] * np.dtype(sidecar["dtype"]).itemsize:
            raise ValueError(
                f"{path}: size does not match `num_tokens` {sidecar['num_tokens']} x `dtype` {sidecar['dtype']} of "
                f"its sidecar {sidecar_path.name}"
            )
        tokens = np.memmap(path, dtype=sidecar["dtype"], mode="r") if sidecar["num_tokens"] else np.zeros(0, np.uint16)
    if len(tokens) == 0:
        raise ValueError(f"{path}: token file is empty")
    max_id = int(tokens.max())  # the ids the file really holds, not what a sidecar says (checked against it)
    if int(tokens.min()) < 0:
        raise ValueError(f"{path}: token ids must be non-negative")
    if path.suffix != ".npy" and sidecar.get("max_token_id", max_id) != max_id:
        raise ValueError(
            f"{sidecar_path}: `max_token_id` is {sidecar['max_token_id']} but {path.name} holds ids up to {max_id}: "
            "the sidecar does not describe this file"
        )
    starts = _doc_starts(docs_path, len(tokens)) if docs_path.is_file() else np.zeros(1, dtype=np.int64)
    return tokens, starts, max_id


def token_file_separator(path: str | Path) -> str | None:
    """Returns the separator (bos, eos, none) a .bin token file's documents were written with, as its sidecar
    records it ("none" for one written before memo added separators); None for a .npy or a missing sidecar."""
    sidecar = _sidecar(Path(path))
    if Path(path).suffix != ".bin" or not sidecar.is_file():
        return None
    return _read_sidecar(sidecar).get("document_separator", "none")


def token_file_tokenizer(path: str | Path) -> str | None:
    """Returns the identity of the tokenizer that wrote a .bin token file, as its sidecar records it; None for a
    .npy, a missing sidecar or one written before memo recorded it."""
    sidecar = _sidecar(Path(path))
    if Path(path).suffix != ".bin" or not sidecar.is_file():
        return None
    return _read_sidecar(sidecar).get("tokenizer_id")


def check_separator(path: str | Path, recorded: str | None, expected: str, flag: str) -> None:
    """Raises ValueError when the documents of token file `path` carry another separator (`recorded`) than the
    run's `expected` one: one run must not mix them. "auto" expects nothing, and an unknown one passes."""
    if recorded is None or expected == "auto" or recorded == expected:
        return
    raise ValueError(
        f"`{flag}` {str(path)!r} was written with document separator {recorded}, not the run's "
        f"`--document-separator` {expected}: write it again with that separator (`write_token_file`)"
    )


def check_tokenizer(path: str | Path, identity: str | None, expected: str | None, flag: str) -> None:
    """Raises ValueError when the tokens of `path` (`identity`) come from another tokenizer than the run's
    (`expected`): their ids would mean other text. Either unknown (files written before memo recorded it) passes."""
    if identity is None or expected is None or identity == expected:
        return
    raise ValueError(
        f"`{flag}` {str(path)!r} is tokenized by {_shown(identity)}, not by the run's tokenizer "
        f"{_shown(expected)}: tokenize it with the run's tokenizer (`write_token_file`)"
    )


def _shown(identity: str) -> str:
    return identity[:19] + "..." if identity.startswith("sha256:") else identity


def check_regular(path: Path, flag: str) -> None:
    """Raises ValueError unless `path` is a regular file: reading a named pipe, a device or a socket would block
    or never end."""
    if not path.exists():
        raise ValueError(f"`{flag}` file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"`{flag}` {str(path)!r} is not a regular file (a pipe, device or socket): give a file")


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def check_document_starts(path: Path, flag: str, remedy: str) -> None:
    """Raises ValueError when .bin token file `path` lacks the document starts `write_tokens` writes beside it
    (a .npy without them is one document by the format's definition); `remedy` says what needs them and what to do."""
    starts = doc_starts_path(path)
    if path.suffix == ".bin" and not starts.is_file():
        raise ValueError(f"`{flag}` {str(path)!r} has no {starts.name} (its document boundaries): {remedy}")


def doc_starts_path(path: Path) -> Path:
    return path.with_suffix(".docs.npy")


def _read_sidecar(path: Path) -> dict:
    """Returns a .bin file's sidecar, its fields checked (format, an integer dtype, num_tokens)."""
    if not path.is_file():
        raise ValueError(f"a .bin token file needs its sidecar {path} (see `write_token_file`)")
    sidecar = read_json_object(path)
    if sidecar.get("format") != TOKEN_FILE_FORMAT:
        raise ValueError(f"{path}: `format` is {sidecar.get('format')!r}, expected {TOKEN_FILE_FORMAT!r}")
    if sidecar.get("dtype") not in ("uint16", "uint32", "int32", "int64"):
        raise ValueError(f"{path}: `dtype` is {sidecar.get('dtype')!r}, expected uint16, uint32, int32 or int64")
    count = sidecar.get("num_tokens")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{path}: `num_tokens` must be a count, got {count!r}")
    return sidecar


def _doc_starts(path: Path, n_tokens: int) -> np.ndarray:
    """Returns the document starts of `<stem>.docs.npy`, checked: 1-D integers from 0, increasing, in the file."""
    starts = _load_npy(path)
    ok = starts.ndim == 1 and starts.dtype.kind in "iu" and len(starts) and starts[0] == 0
    if not (ok and bool(np.all(np.diff(starts) > 0)) and int(starts[-1]) < n_tokens):
        raise ValueError(
            f"{path}: document starts must be a 1-D integer array from 0, increasing and below the "
            f"{n_tokens} tokens of its token file"
        )
    return starts


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable .npy array ({err})") from None
