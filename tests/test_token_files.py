"""memo's token files (memo.token_files): what is written reads back memory-mapped with its document starts, a file
that its sidecar does not describe is refused, and nothing is left behind by a write that fails."""

import json

import numpy as np
import pytest

from memo.documents import document_lengths
from memo.token_files import read_token_file, write_tokens


def _write(out, documents, vocab_size=256):
    about = {"tokenizer": "bytes", "tokenizer_id": "bytes", "separator": "none"}
    return write_tokens(out, documents, empty="no tokens", vocab_size=vocab_size, **about)


def test_written_documents_read_back_memory_mapped_with_their_starts(tmp_path):
    sidecar = _write(tmp_path / "c.bin", [[1, 2, 3], [4], [250, 6]])
    assert sidecar == json.loads((tmp_path / "c.json").read_text())
    assert sidecar["dtype"] == "uint16" and sidecar["num_tokens"] == 6 and sidecar["num_documents"] == 3
    tokens, starts, max_id = read_token_file(tmp_path / "c.bin")
    assert isinstance(tokens, np.memmap) and tokens.tolist() == [1, 2, 3, 4, 250, 6] and max_id == 250
    assert starts.tolist() == [0, 3, 4] and document_lengths(starts, len(tokens)).tolist() == [3, 1, 2]


def test_ids_of_a_vocabulary_over_65536_are_written_as_uint32(tmp_path):
    assert _write(tmp_path / "c.bin", [[69999]], vocab_size=70_000)["dtype"] == "uint32"
    assert read_token_file(tmp_path / "c.bin")[0].tolist() == [69999]


def test_documents_without_a_token_and_a_name_without_bin_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="^no tokens$"):
        _write(tmp_path / "c.bin", [])
    with pytest.raises(ValueError, match="must end in .bin"):
        _write(tmp_path / "c.npy", [[1]])
    assert list(tmp_path.iterdir()) == []


def test_bin_without_sidecar_or_with_wrong_size_is_rejected(tmp_path):
    _write(tmp_path / "c.bin", [list(b"abc")])
    with open(tmp_path / "c.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="size does not match"):
        read_token_file(tmp_path / "c.bin")
    (tmp_path / "c.json").unlink()
    with pytest.raises(ValueError, match="sidecar"):
        read_token_file(tmp_path / "c.bin")
