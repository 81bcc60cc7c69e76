import json
import os

import numpy as np
import pytest
import torch

from memo.config import ModelConfig
from memo.loss import IGNORE_INDEX
from memo.model import Transformer
from memo.policy import ActivationPolicy
from memo.token_files import read_token_file, token_file_separator, token_file_tokenizer
from memo.train.data import (
    ByteTokenizer,
    HFTokenizer,
    RetrievalTask,
    Separator,
    TokenDataset,
    check_vocab,
    make_source,
    retrieval_accuracy,
    retrieval_batch,
    separator_kind,
    split_documents,
    text_files,
    token_dataset,
    tokenizer_identity,
    write_token_file,
)


def _write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def _write_parquet(path, texts, key="text", row_group_size=None, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: texts, **columns}), path, row_group_size=row_group_size)
    return path


def _stream(source: TokenDataset) -> tuple[list[int], list[int]]:
    """Returns the ids and labels of every chunk of `source`, padding dropped."""
    ids = torch.cat([source.sequence(i)[0] for i in range(source.num_sequences)])[: source.num_tokens]
    labels = torch.cat([source.sequence(i)[1] for i in range(source.num_sequences)])[: source.num_tokens]
    return ids.tolist(), labels.tolist()


def _same(a: tuple, b: tuple) -> bool:
    """Returns whether two batches (ids, labels, positions or None) are equal."""
    return all(x is y is None or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _word_level_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["the cat sat", "the dog sat on the cat"], trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path, tokenizer


# ------------------------------------------------------------------------------------------------ packing


def test_packing_masks_labels_that_cross_document_boundaries():
    # Documents [10 11 12] [20 21] [30 31 32 33 34], stream of 10 tokens, seq_len 4 -> 3 chunks, last padded.
    tokens = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33, 34])
    data = TokenDataset(tokens, np.array([0, 3, 5]), seq_len=4)
    assert data.num_sequences == 3
    ids, labels, positions = data.sequence(0)
    assert positions is None  # concat packing: attention crosses documents
    assert ids.tolist() == [10, 11, 12, 20]
    assert labels.tolist() == [10, 11, 12, IGNORE_INDEX]  # 12 -> 20 crosses into document 2
    ids, labels, _ = data.sequence(1)
    assert ids.tolist() == [21, 30, 31, 32]
    assert labels.tolist() == [21, IGNORE_INDEX, 31, 32]  # 21 -> 30 crosses into document 3
    ids, labels, _ = data.sequence(2)
    assert ids.tolist() == [33, 34, 0, 0]
    assert labels.tolist() == [33, 34, IGNORE_INDEX, IGNORE_INDEX]  # padding is never a target


def test_packed_loss_equals_per_document_loss_on_boundary_free_targets():
    tokens = np.array([1, 2, 3, 4, 5, 6])
    ids, labels, _ = TokenDataset(tokens, np.array([0, 2]), seq_len=6).sequence(0)
    targets = [(t, int(labels[t + 1])) for t in range(5) if labels[t + 1] != IGNORE_INDEX]
    assert targets == [(0, 2), (2, 4), (3, 5), (4, 6)]  # never predicts 3 from 2


def _chunk_positions(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Returns the positions of each chunk under mask packing, worked out from the document lengths alone: a token
    at offset j of its chunk, p tokens into its document, is at min(p, j); padding is one more document."""
    total = sum(lengths)
    padded = -(-total // seq_len) * seq_len
    within = [p for n in lengths + ([padded - total] if padded > total else []) for p in range(n)]
    return [[min(within[c + j], j) for j in range(seq_len)] for c in range(0, padded, seq_len)]


def test_mask_packing_restarts_positions_at_each_document_each_chunk_and_the_padding():
    # Documents [10 11 12] [20 21] [30 31 32 33 34], seq_len 4: document 3 is cut by a chunk boundary.
    tokens, starts = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33, 34]), np.array([0, 3, 5])
    mask = TokenDataset(tokens, starts, seq_len=4, pack_documents="mask")
    concat = TokenDataset(tokens, starts, seq_len=4)
    assert [mask.sequence(i)[2].tolist() for i in range(3)] == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 0, 1]]
    assert [mask.sequence(i)[2].tolist() for i in range(3)] == _chunk_positions([3, 2, 5], 4)
    for i in range(3):  # the same ids and labels: a document's first label is IGNORE_INDEX in both
        assert _same(mask.sequence(i)[:2], concat.sequence(i)[:2]) and concat.sequence(i)[2] is None
    ids, labels, positions = mask.batch(1, 3)
    assert positions.shape == ids.shape == (3, 4) and positions.dtype == torch.long
    assert concat.batch(1, 3)[2] is None
    padding = mask.eval_batches(1, 4)[0]  # three chunks and a row of padding: one document of its own
    assert padding[2][3].tolist() == [0, 1, 2, 3] and (padding[1][3] == IGNORE_INDEX).all()


def test_mask_packing_of_a_held_out_split_restarts_at_the_documents_of_each_part():
    documents = _numbered_documents(40)
    source = _packed(documents, seq_len=7)
    masked = TokenDataset(source.tokens, source.doc_starts, 7, pack_documents="mask")
    for part in split_documents(masked, 0.2, seed=5):
        chosen = sorted(set(_stream(part)[0]))
        expected = _chunk_positions([len(documents[i]) for i in chosen], 7)
        assert [part.sequence(i)[2].tolist() for i in range(part.num_sequences)] == expected
        assert part.pack_documents == "mask"


def test_max_documents_per_sequence_joins_later_documents_to_the_last_kept_one():
    # Eight documents of 2 tokens, seq_len 8: four per chunk; at most 2 kept apart, the rest join the second.
    tokens = np.arange(16)
    data = TokenDataset(tokens, np.arange(0, 16, 2), seq_len=8, pack_documents="mask", max_documents=2)
    ids, labels, positions = data.sequence(0)
    assert positions.tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    no = IGNORE_INDEX
    assert labels.tolist() == [0, 1, no, 3, no, 5, no, 7]  # still no target across a boundary
    assert ids.tolist() == list(range(8))
    assert data.joined_documents() == (4, 2)  # two of the four documents of each of the two chunks
    cut = TokenDataset(tokens, np.array([0, 5, 6]), seq_len=4, pack_documents="mask", max_documents=2)
    assert cut.sequence(1)[2].tolist() == [0, 0, 1, 2]  # chunk 1 starts mid-document: that one counts too
    assert cut.joined_documents() == (1, 1)
    assert TokenDataset(tokens, np.array([0]), seq_len=4, max_documents=1).joined_documents() == (0, 0)
    with pytest.raises(ValueError, match=r"`--max-documents-per-sequence` must be a positive integer, got 0"):
        TokenDataset(tokens, np.array([0]), seq_len=4, pack_documents="mask", max_documents=0)
    with pytest.raises(ValueError, match=r"`--pack-documents` must be one of mask, concat, got 'none'"):
        TokenDataset(tokens, np.array([0]), seq_len=4, pack_documents="none")


def test_mask_packed_batches_with_positions_are_a_function_of_seed_and_step(tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", [f"document {i} " * (1 + i % 3) for i in range(30)])
    run = make_source(data, seq_len=16, seed=3, pack_documents="mask", max_documents=3)
    first = {step: run.batch(step, 4) for step in range(1, 9)}
    resumed = make_source(data, seq_len=16, seed=3, pack_documents="mask", max_documents=3)
    for step in (7, 2, 5):
        assert _same(resumed.batch(step, 4), first[step]) and first[step][2] is not None


# ------------------------------------------------------------------------------------------ document separators


def _special_tokenizer(path, style: str):
    """Writes a word-level tokenizer.json with special tokens as published ones have them: "llama" prepends <s>
    by its post-processor (and has </s>), "gpt" declares <|endoftext|> and adds nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>"] if style == "llama" else ["<unk>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate([*specials, "the", "cat", "dog", "sat"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    if style == "llama":
        single, pair = "<s> $A", "<s> $A <s> $B"
        tokenizer.post_processor = processors.TemplateProcessing(single, pair, special_tokens=[("<s>", 1)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.save(str(path))
    return path


def test_the_byte_tokenizer_separates_documents_by_nothing():
    assert ByteTokenizer().separator("auto") == Separator() and ByteTokenizer().separator("none").ids == ()
    with pytest.raises(ValueError, match=r"`--document-separator eos`: the byte tokenizer has no special tokens"):
        ByteTokenizer().separator("eos")


def test_hf_separators_bos_from_the_template_else_end_of_text(tmp_path):
    llama = HFTokenizer(_special_tokenizer(tmp_path / "llama.json", "llama"))
    gpt = HFTokenizer(_special_tokenizer(tmp_path / "gpt.json", "gpt"))
    assert llama.separator("auto") == llama.separator("bos") == Separator("bos", (1,))
    assert llama.separator("eos") == Separator("eos", (2,))  # </s>, declared but not added by its template
    assert gpt.separator("auto") == gpt.separator("eos") == Separator("eos", (1,))
    assert gpt.separator("none") == Separator()
    with pytest.raises(ValueError, match=r"`--document-separator bos`: tokenizer .*gpt.json has no BOS token"):
        gpt.separator("bos")
    data = _write_jsonl(tmp_path / "d.jsonl", ["the cat", "dog sat"])
    expected = {"llama": [1, 3, 4, 1, 5, 6], "gpt": [2, 3, 1, 4, 5, 1]}
    for style, tokens in expected.items():
        source = make_source(data, seq_len=6, tokenizer_path=tmp_path / f"{style}.json", pack_documents="mask")
        ids, labels, positions = source.sequence(0)
        assert ids.tolist() == tokens and source.doc_starts.tolist() == [0, 3]
        assert labels[3] == IGNORE_INDEX and positions.tolist() == [0, 1, 2, 0, 1, 2]
    plain = make_source(data, seq_len=4, tokenizer_path=tmp_path / "gpt.json", separator="none")
    assert plain.sequence(0)[0].tolist() == [2, 3, 4, 5]


def test_a_token_file_records_its_separator_and_a_run_with_another_is_refused(tmp_path):
    path = _special_tokenizer(tmp_path / "tokenizer.json", "gpt")
    _write_jsonl(tmp_path / "d.jsonl", ["the cat", "dog sat"])
    assert write_token_file(tmp_path / "d.jsonl", tmp_path / "d.bin", path)["document_separator"] == "eos"
    assert read_token_file(tmp_path / "d.bin")[0].tolist() == [2, 3, 1, 4, 5, 1]
    assert token_file_separator(tmp_path / "d.bin") == separator_kind(tmp_path / "d.jsonl", path) == "eos"
    for separator in ("auto", "eos"):
        make_source(tmp_path / "d.bin", seq_len=4, separator=separator)
    with pytest.raises(ValueError, match=r"`--eval-data` '.*d.bin' was written with document separator eos, not"):
        token_dataset(tmp_path / "d.bin", 4, flag="--eval-data", separator="none")
    sidecar = json.loads((tmp_path / "d.json").read_text())
    del sidecar["document_separator"]  # written before separators: it has none
    (tmp_path / "d.json").write_text(json.dumps(sidecar))
    assert token_file_separator(tmp_path / "d.bin") == "none"
    np.save(tmp_path / "t.npy", np.arange(4))
    assert token_file_separator(tmp_path / "t.npy") is None  # does not say: any run may read it


# ----------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_unicode():
    text = "héllo wörld — 你好\n"
    ids = ByteTokenizer().encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert ByteTokenizer().decode(ids) == text


def test_hf_tokenizer_json_encodes_like_the_tokenizers_library(tmp_path):
    path, reference = _word_level_tokenizer(tmp_path)
    tokenizer = HFTokenizer(path)
    assert tokenizer.vocab_size == reference.get_vocab_size()
    assert tokenizer.encode("the dog sat") == reference.encode("the dog sat").ids
    assert tokenizer.decode(tokenizer.encode("the dog sat")) == "the dog sat"


def test_make_source_tokenizes_jsonl_with_a_tokenizer_json(tmp_path):
    path, reference = _word_level_tokenizer(tmp_path)
    data = _write_jsonl(tmp_path / "d.jsonl", ["the cat", "dog sat on"], key="body")
    source = make_source(data, seq_len=5, tokenizer_path=path, text_field="body")
    expected = reference.encode("the cat").ids + reference.encode("dog sat on").ids
    assert source.sequence(0)[0].tolist() == expected
    assert source.sequence(0)[1].tolist() == expected[:2] + [IGNORE_INDEX] + expected[3:]
    assert source.vocab_size_needed == max(expected) + 1


def test_txt_file_is_one_document_and_a_directory_is_many(tmp_path):
    (tmp_path / "a.txt").write_text("ab\n\ncd")  # blank lines do not split a .txt document
    (tmp_path / "b.txt").write_text("ef")
    source = make_source(tmp_path, seq_len=8)
    ids, labels, _ = source.sequence(0)
    assert ids.tolist() == list(b"ab\n\ncdef")
    assert labels.tolist() == list(b"ab\n\ncd") + [IGNORE_INDEX, ord("f")]


# ------------------------------------------------------------------------------------------------- parquet

DOCS = ["first document", "the second — with ünïcode", "3", "and a fourth, longer than the others " * 3]


def test_parquet_and_jsonl_with_a_custom_text_field_give_the_token_stream_of_txt_documents(tmp_path, monkeypatch):
    monkeypatch.setattr("memo.train.data.PARQUET_BATCH_ROWS", 3)  # several record batches and row groups
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(DOCS):
        (tmp_path / "txt" / f"{i}.txt").write_text(text)
    reference = make_source(tmp_path / "txt", seq_len=16, seed=4)
    ids = list(range(len(DOCS)))
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"id": n, "body": t}) + "\n" for n, t in zip(ids, DOCS)))
    parquet = _write_parquet(tmp_path / "d.parquet", DOCS, key="body", row_group_size=2, id=ids)
    (tmp_path / "shards").mkdir()  # a folder of .parquet files reads like a folder of .txt files
    _write_parquet(tmp_path / "shards" / "00.parquet", DOCS[:3], key="body")
    _write_parquet(tmp_path / "shards" / "01.parquet", DOCS[3:], key="body")
    for data in (jsonl, parquet, tmp_path / "shards"):
        source = make_source(data, seq_len=16, seed=4, text_field="body")
        assert _stream(source) == _stream(reference), data
        assert source.doc_starts.tolist() == reference.doc_starts.tolist()
        for step in (1, 2, 5):
            assert _same(source.batch(step, 2), reference.batch(step, 2))


def test_parquet_text_column_streams_in_record_batches_and_tokenizes_to_a_token_file(tmp_path, monkeypatch):
    monkeypatch.setattr("memo.train.data.PARQUET_BATCH_ROWS", 2)
    path = _write_parquet(tmp_path / "d.parquet", DOCS, row_group_size=1)
    sidecar = write_token_file(path, tmp_path / "c.bin")
    assert sidecar["num_documents"] == len(DOCS)
    tokens, starts, _ = read_token_file(tmp_path / "c.bin")
    assert bytes(tokens.tolist()) == "".join(DOCS).encode()
    assert starts.tolist() == np.cumsum([0] + [len(d.encode()) for d in DOCS[:-1]]).tolist()


def test_parquet_errors_name_the_file_and_what_is_wrong(tmp_path):
    import pyarrow as pa

    path = _write_parquet(tmp_path / "d.parquet", ["a", "b"], key="content", url=["u", "v"])
    with pytest.raises(ValueError, match=r"d.parquet: no column 'text' \(columns: content, url\)"):
        make_source(path, seq_len=8)
    _write_parquet(path, [1, 2], key="text")
    with pytest.raises(ValueError, match=r"d.parquet: column 'text' is int64, not a string"):
        make_source(path, seq_len=8)
    _write_parquet(path, ["a", None, "c"], key="text")
    with pytest.raises(ValueError, match=r"d.parquet: column 'text' is null at row 1"):
        make_source(path, seq_len=8)
    _write_parquet(path, pa.array([], pa.string()), key="text")
    with pytest.raises(ValueError, match=r"d.parquet: file is empty"):
        make_source(path, seq_len=8)
    path.write_text('{"text": "json, not parquet"}\n')
    with pytest.raises(ValueError, match=r"d.parquet: not a readable Parquet file \(.*magic bytes"):
        make_source(path, seq_len=8)
    _write_parquet(path, ["x" * 1000] * 50, key="text")
    path.write_bytes(path.read_bytes()[:-100])  # a truncated download
    with pytest.raises(ValueError, match=r"d.parquet: not a readable Parquet file"):
        make_source(path, seq_len=8)


def test_parquet_accepts_large_view_and_dictionary_string_columns(tmp_path):
    import pyarrow as pa

    columns = pa.array(DOCS, pa.large_string()), pa.array(DOCS, pa.string_view()), pa.array(DOCS).dictionary_encode()
    for array in columns:
        source = make_source(_write_parquet(tmp_path / "d.parquet", array), seq_len=16)
        assert bytes(_stream(source)[0]) == "".join(DOCS).encode()


# ------------------------------------------------------------------------------------------- held-out split


def _numbered_documents(n: int) -> list[np.ndarray]:
    """Returns n documents; document i is the token i repeated 1 + i % 5 times (whole documents are countable)."""
    return [np.full(1 + i % 5, i, dtype=np.int64) for i in range(n)]


def _packed(documents: list[np.ndarray], seq_len: int) -> TokenDataset:
    starts = np.cumsum([0] + [len(d) for d in documents[:-1]])
    return TokenDataset(np.concatenate(documents), starts, seq_len)


def test_eval_split_holds_out_whole_documents_and_packs_both_parts_like_separate_corpora():
    documents = _numbered_documents(60)
    train, held_out = split_documents(_packed(documents, seq_len=7), 0.1, seed=3)
    held = sorted(set(_stream(held_out)[0]))
    kept = sorted(set(_stream(train)[0]))
    assert len(held) == 6 and not set(held) & set(kept) and sorted(held + kept) == list(range(60))
    for part, chosen in ((train, kept), (held_out, held)):  # independent reference: pack the documents anew
        assert _stream(part) == _stream(_packed([documents[i] for i in chosen], seq_len=7))
        assert part.document_lengths().tolist() == [len(documents[i]) for i in chosen]  # its own documents only
    assert train.vocab_size_needed == held_out.vocab_size_needed == 60


def test_eval_split_is_a_function_of_the_seed_and_reads_a_token_file_in_place(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i:03d};"}) + "\n" for i in range(200)))
    write_token_file(path, tmp_path / "c.bin")
    from_file = split_documents(make_source(tmp_path / "c.bin", seq_len=32), 0.05, seed=1)
    in_memory = split_documents(make_source(path, seq_len=32), 0.05, seed=1)
    assert isinstance(from_file[1].tokens, np.memmap)
    for a, b in zip(from_file, in_memory):
        assert _stream(a) == _stream(b)
    other = split_documents(make_source(path, seq_len=32), 0.05, seed=2)[1]
    assert _stream(other) != _stream(in_memory[1])
    assert bytes(_stream(in_memory[1])[0]).count(b"document") == 10


def test_eval_split_needs_a_document_left_to_train_on(tmp_path):
    (tmp_path / "one.txt").write_text("a single long document")
    with pytest.raises(ValueError, match=r"`--eval-split` 0.01 of 1 document\(s\) leaves none to train on"):
        split_documents(make_source(tmp_path / "one.txt", seq_len=8), 0.01)


def test_eval_batches_are_the_first_chunks_in_order_padded_to_full_batches():
    source = TokenDataset(np.arange(20), np.array([0]), seq_len=4)  # 5 chunks
    batches = source.eval_batches(n_batches=4, batch_size=2)
    assert len(batches) == 3  # the stream runs out during the third batch
    assert [row[0] for ids, _, _ in batches for row in ids.tolist()] == [0, 4, 8, 12, 16, 0]
    assert (batches[-1][1][1] == IGNORE_INDEX).all()  # the padding row is never a target
    again = source.eval_batches(n_batches=4, batch_size=2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))


# ---------------------------------------------------------------------------------------------- token files


def test_token_file_round_trip_is_memory_mapped_and_matches_in_memory_packing(tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", ["hello", "", "wörld", "x"])
    sidecar = write_token_file(data, tmp_path / "corpus.bin")
    assert sidecar["num_tokens"] == len(b"hello") + len("wörld".encode()) + 1
    assert sidecar["num_documents"] == 3 and sidecar["dtype"] == "uint16"
    tokens, starts, max_id = read_token_file(tmp_path / "corpus.bin")
    assert isinstance(tokens, np.memmap)
    assert bytes(tokens.tolist()) == "hellowörldx".encode()
    assert starts.tolist() == [0, 5, 11] and max_id == max("hellowörldx".encode())
    from_file = make_source(tmp_path / "corpus.bin", seq_len=4, seed=3)
    in_memory = make_source(data, seq_len=4, seed=3)
    for step in range(1, 6):
        assert _same(from_file.batch(step, 2), in_memory.batch(step, 2))


def test_token_file_with_a_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tok.json"))
    _write_jsonl(tmp_path / "d.jsonl", ["w69999"])
    sidecar = write_token_file(tmp_path / "d.jsonl", tmp_path / "c.bin", tmp_path / "tok.json")
    assert sidecar["dtype"] == "uint32"
    assert read_token_file(tmp_path / "c.bin")[0].tolist() == [69999]


def test_npy_token_file_is_one_document(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(6, dtype=np.uint16))
    source = make_source(tmp_path / "t.npy", seq_len=3)
    assert source.sequence(1)[1].tolist() == [3, 4, 5]
    assert source.vocab_size_needed == 6


def test_a_bin_token_file_without_its_document_starts_is_refused_under_mask_packing(tmp_path, capsys):
    from memo.cli import main

    write_token_file(_write_jsonl(tmp_path / "d.jsonl", ["one", "two", "three"]), tmp_path / "c.bin")
    (tmp_path / "c.docs.npy").unlink()
    with pytest.raises(ValueError, match=r"^`--eval-data` '.*c.bin' has no c.docs.npy \(its document boundaries\)"):
        token_dataset(tmp_path / "c.bin", 4, flag="--eval-data", pack_documents="mask")
    concat = make_source(tmp_path / "c.bin", seq_len=4, pack_documents="concat")  # asked for: one document
    assert bytes(concat.tokens.tolist()) == b"onetwothree"
    out = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "c.bin"), "--seq-len", "4", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert "c.bin' has no c.docs.npy" in err and "`--pack-documents mask` needs it" in err
    assert "write_token_file, or give `--pack-documents concat`" in err


# ----------------------------------------------------------------------------------------- determinism


def test_batches_are_a_function_of_seed_and_step_so_resume_replays_them(tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", [f"document number {i}" for i in range(20)])
    run = make_source(data, seq_len=16, seed=7)
    first = {step: run.batch(step, 3) for step in range(1, 13)}  # several epochs of 23 chunks
    resumed = make_source(data, seq_len=16, seed=7)
    for step in (11, 4, 9):
        assert _same(resumed.batch(step, 3), first[step])
    other = make_source(data, seq_len=16, seed=8)
    assert not torch.equal(other.batch(1, 3)[0], first[1][0])


def test_each_epoch_visits_every_chunk_once(tmp_path):
    data = TokenDataset(np.arange(40), np.array([0]), seq_len=4, seed=1)
    seen = torch.cat([data.batch(step, 2)[0][:, 0] for step in range(1, 6)])  # steps count from 1
    assert sorted(seen.tolist()) == list(range(0, 40, 4))


def test_retrieval_task_is_resumable_and_held_out_differs():
    task = RetrievalTask(seq_len=128, seed=5)
    again = RetrievalTask(seq_len=128, seed=5)
    assert _same(task.batch(3, 4), again.batch(3, 4)) and task.batch(3, 4)[2] is None
    assert not torch.equal(task.batch(3, 4)[0], task.batch(4, 4)[0])
    held_out = torch.cat([ids for ids, _, _ in task.eval_batches(2, 4)])
    train = torch.cat([task.batch(s, 4)[0] for s in range(2)])
    assert not torch.equal(held_out, train)


# ----------------------------------------------------------------------------------------------- errors


def test_missing_data_and_tokenizer_files_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_source(tmp_path / "nope.jsonl", seq_len=8)
    with pytest.raises(ValueError, match="does not exist"):
        make_source(tmp_path / "nope.bin", seq_len=8)
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="tokenizer"):
        make_source(tmp_path / "d.txt", seq_len=8, tokenizer_path=tmp_path / "nope.json")


def test_empty_inputs_raise_value_error_naming_the_file(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty.txt: file is empty"):
        make_source(tmp_path / "empty.txt", seq_len=8)
    _write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ValueError, match="no text"):
        make_source(tmp_path / "blank.jsonl", seq_len=8)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="no .txt, .jsonl or .parquet"):
        make_source(tmp_path / "dir", seq_len=8)


def test_bad_utf8_names_file_and_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine\nalso fine\nbroken \xff here\n")
    with pytest.raises(ValueError, match=r"bad.txt:3: not valid UTF-8"):
        make_source(tmp_path / "bad.txt", seq_len=8)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xc3("}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8"):
        make_source(tmp_path / "bad.jsonl", seq_len=8)


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: invalid JSON"):
        make_source(path, seq_len=8)
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: expected an object with a 'text' field"):
        make_source(path, seq_len=8)
    path.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: field 'text' is int"):
        make_source(path, seq_len=8)


def test_token_ids_beyond_the_model_vocabulary_are_rejected(tmp_path):
    path, _ = _word_level_tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("héllo")
    bytes_source = make_source(tmp_path / "d.txt", seq_len=8)
    check_vocab(bytes_source, 256)
    with pytest.raises(ValueError, match=r"token ids up to 195 but `--model small` has vocab_size 128"):
        check_vocab(bytes_source, 128, "small")
    check_vocab(RetrievalTask(seq_len=256), ModelConfig.preset("tiny").vocab_size)


# ---------------------------------------------------------------------------------------- retrieval task


def test_retrieval_labels_sit_only_on_answers_and_answers_match_their_facts():
    task = RetrievalTask(seq_len=200, n_pairs=6, n_keys=10, n_values=5, n_filler=3)
    ids, labels = retrieval_batch(4, 200, torch.Generator().manual_seed(0), 6, 10, 5, 3)
    again = retrieval_batch(4, 200, torch.Generator().manual_seed(0), 6, 10, 5, 3)
    assert torch.equal(ids, again[0]) and torch.equal(labels, again[1])
    n_facts, query0 = 10 * 5, 10 * 5
    answer0, filler0 = query0 + 10, query0 + 15
    context = 200 - 12
    assert ids.shape == labels.shape == (4, 200)
    assert int(ids.max()) < task.vocab_size_needed == 50 + 10 + 5 + 3
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        labelled = [t for t, label in enumerate(row_labels) if label != IGNORE_INDEX]
        assert labelled == list(range(context + 1, 200, 2))
        facts = {t // 5: t % 5 for t in row_ids[:context] if t < n_facts}
        assert len(facts) == 6 and all(filler0 <= t or t < n_facts for t in row_ids[:context])
        for t in labelled:
            key, answer = row_ids[t - 1] - query0, row_labels[t] - answer0
            assert facts[key] == answer
            assert row_ids[t] == row_labels[t]


def test_retrieval_curriculum_keeps_early_tasks_in_a_short_span_and_evaluates_full_length():
    task = RetrievalTask(seq_len=1024, start_span=256, ramp_start=10, ramp_end=20)
    assert [task.span(s) for s in (0, 10, 15, 20, 99)] == [256, 256, 640, 1024, 1024]
    ids, labels, _ = task.batch(0, 2)
    assert ids.shape == (2, 1024)
    assert (labels[:, 256:] == IGNORE_INDEX).all() and (labels[:, 256 - 32 + 1 : 256 : 2] != IGNORE_INDEX).all()
    assert (ids[:, 256:] == task.vocab_size_needed - 1).all()  # filler after the queries
    ids, labels, _ = task.eval_batches(1, 2)[0]
    assert (labels[:, 1024 - 32 + 1 :: 2] != IGNORE_INDEX).all()


def test_retrieval_batch_rejects_too_many_pairs():
    with pytest.raises(ValueError, match="n_pairs"):
        RetrievalTask(seq_len=256, n_pairs=17, n_keys=16)
    with pytest.raises(ValueError, match="seq-len"):
        RetrievalTask(seq_len=32, n_pairs=16)


class _Oracle(torch.nn.Module):
    """Answers every query from the facts it has seen: the accuracy metric must score it 1."""

    def __init__(self, task: RetrievalTask):
        super().__init__()
        self.task = task
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        t = self.task
        n_facts, query0 = t.n_keys * t.n_values, t.n_keys * t.n_values
        logits = torch.zeros(*ids.shape, t.vocab_size_needed)
        for b, row in enumerate(ids.tolist()):
            facts = {}
            for pos, token in enumerate(row):
                if token < n_facts:
                    facts[token // t.n_values] = token % t.n_values
                elif token < query0 + t.n_keys:
                    logits[b, pos, query0 + t.n_keys + facts[token - query0]] = 1.0
        return logits


def test_retrieval_accuracy_scores_an_oracle_one_and_a_constant_at_chance():
    task = RetrievalTask(seq_len=128, n_pairs=8)
    batches = task.eval_batches(2, 4)
    assert retrieval_accuracy(_Oracle(task), batches) == 1.0
    constant = torch.nn.Linear(1, 1)
    constant.forward = lambda ids: torch.zeros(*ids.shape, 256)  # argmax is always id 0, a fact token
    assert retrieval_accuracy(constant, batches) == 0.0


@pytest.mark.slow
def test_tiny_model_learns_retrieval_well_below_chance():
    torch.manual_seed(0)
    task = RetrievalTask(seq_len=256, seed=0, n_pairs=8)
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
    losses = []
    for step in range(400):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
        ids, labels, _ = task.batch(step, 16)
        loss = model(ids, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sum(losses[-25:]) / 25 < 0.6 * task.chance_loss
    assert retrieval_accuracy(model, task.eval_batches(2, 8)) > 0.5


# ------------------------------------------------------------------------------------------ tokenizer identity


def test_a_token_file_records_its_tokenizer_and_refuses_another_one(tmp_path):
    path, _ = _word_level_tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("the cat sat")
    sidecar = write_token_file(tmp_path / "d.txt", tmp_path / "d.bin", path)
    assert sidecar["tokenizer_id"] == tokenizer_identity(path) == HFTokenizer(path).identity
    assert sidecar["tokenizer"] == str(path.absolute())
    assert write_token_file(tmp_path / "d.txt", tmp_path / "b.bin")["tokenizer_id"] == "bytes"
    make_source(tmp_path / "d.bin", seq_len=4, tokenizer=tokenizer_identity(path))
    with pytest.raises(ValueError, match=r"`--eval-data` '.*b.bin' is tokenized by bytes, not by the run's tokenizer "):
        token_dataset(tmp_path / "b.bin", 4, flag="--eval-data", tokenizer=tokenizer_identity(path))
    with pytest.raises(ValueError, match=r"`--data` '.*d.txt' is tokenized by bytes, not by the run's"):
        make_source(tmp_path / "d.txt", seq_len=4, tokenizer=tokenizer_identity(path))


def test_a_sidecar_written_before_tokenizer_identities_is_accepted(tmp_path):
    (tmp_path / "d.txt").write_text("hello world")
    write_token_file(tmp_path / "d.txt", tmp_path / "d.bin")
    sidecar = json.loads((tmp_path / "d.json").read_text())
    del sidecar["tokenizer_id"]
    (tmp_path / "d.json").write_text(json.dumps(sidecar))
    assert token_file_tokenizer(tmp_path / "d.bin") is None
    assert read_token_file(tmp_path / "d.bin", tokenizer="sha256:another")[0].tolist() == list(b"hello world")


def test_pipes_and_devices_are_refused_as_data_not_read(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(ValueError, match=r"`--data` '.*pipe.txt' is not a regular file"):
        make_source(tmp_path / "pipe.txt", seq_len=8)
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"`--data` '.*pipe.txt' is not a regular file"):
        make_source(tmp_path, seq_len=8)  # a folder holding one
    with pytest.raises(ValueError, match=r"`--eval-data` '/dev/null' is not a regular file"):
        text_files("/dev/null", "--eval-data")
    os.mkfifo(tmp_path / "t.bin")
    with pytest.raises(ValueError, match=r"`--data` '.*t.bin' is not a regular file"):
        read_token_file(tmp_path / "t.bin")
