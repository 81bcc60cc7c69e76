"""Chat data (memo.chat): conversations rendered with the tokenizer's chat template, trained on the assistant's
tokens. The reference is transformers' `return_assistant_tokens_mask` with TRL's `*_training.jinja` templates (the
plain template of a family with `{% generation %}` markers around what the assistant writes), on tiny character
tokenizers that hold each template's special tokens."""

import json
import logging
import re
import shutil
import string
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer

from memo.chat import ChatTemplate, render_conversation, tokenize_rendered
from memo.cli import main
from memo.config import ModelConfig
from memo.eval import position_losses
from memo.loss import IGNORE_INDEX, shift_labels
from memo.model import Transformer
from memo.train.data import HFTokenizer, TokenDataset, split_documents, token_dataset, write_token_file

DATA = Path(__file__).parent / "data" / "chat"
TOKENIZER = DATA / "tokenizer" / "tokenizer.json"  # `char_tokenizer` with TRL's qwen3.jinja
MODEL = Path(__file__).parent / "data" / "pretrained-tiny" / "model"  # vocabulary 256: the char tokenizer fits
SPECIAL = (
    "<unk>", "<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "<|user|>",
    "<|assistant|>", "<|system|>", "<|end|>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
)  # fmt: skip
USER = {"role": "user", "content": "what does the farmer sell?"}
SYSTEM = {"role": "system", "content": "answer briefly."}
CONVERSATIONS = {
    "one turn": [USER, {"role": "assistant", "content": "four goats."}],
    "system": [SYSTEM, USER, {"role": "assistant", "content": "four goats."}],
    "two turns": [
        USER,
        {"role": "assistant", "content": "four goats."},
        {"role": "user", "content": "and on friday?"},
        {"role": "assistant", "content": "two cows."},
    ],
    "reasoning": [USER, {"role": "assistant", "content": "<think>\nsaturday is market day.\n</think>\n\nfour goats."}],
}


def trl_template(name: str) -> str:
    """Returns the text of TRL's chat template `name` (e.g. qwen3, qwen3_training)."""
    return (files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def char_tokenizer(folder: Path, template: str, merges: tuple = ()) -> Path:
    """Writes a tokenizer folder (tokenizer.json and a tokenizer_config.json holding `template`) and returns its
    tokenizer.json: a BPE whose ids for the printable ASCII characters are their bytes (those of the byte-level
    `tests/data/pretrained-tiny`), SPECIAL from 128 on, and `merges`, the pairs it joins, after them."""
    joined = ["".join(pair) for pair in merges]
    vocab = {**{c: ord(c) for c in string.printable}, **{t: 128 + i for i, t in enumerate([*SPECIAL, *joined])}}
    tokenizer = Tokenizer(models.BPE(vocab, list(merges), unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # characters decode back to the text
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "unk_token": "<unk>"}, indent=1) + "\n")
    return folder / "tokenizer.json"


def _memo(tmp_path, family: str, messages: list) -> list[tuple[list, list]]:
    """Returns memo's (ids, trained) of each document of `messages` under `family`'s plain template."""
    path = char_tokenizer(tmp_path / family, trl_template(family))
    rendered = render_conversation(ChatTemplate(path, "test"), messages, "row")
    return [tokenize_rendered(r, HFTokenizer(path).encode, "row") for r in rendered]


def _reference(tmp_path, family: str, messages: list) -> tuple[list, list]:
    """Returns transformers' (input_ids, assistant_masks) of `messages` under `family`'s TRL training template."""
    folder = char_tokenizer(tmp_path / f"{family}_training", trl_template(f"{family}_training")).parent
    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return out["input_ids"], out["assistant_masks"]


def _runs(mask: list) -> list[tuple[int, int]]:
    """Returns the [start, end) ranges of the runs of 1s (True) in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], np.asarray(mask, dtype=int), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


# ---------------------------------------------------------------------------------------- spans vs the reference

SAME = [
    ("qwen3", "one turn"), ("qwen3", "system"), ("qwen3", "reasoning"), ("llama3", "system"),
    ("llama3", "two turns"), ("gemma", "two turns"), ("phi3", "system"), ("cohere2", "two turns"),
    ("qwen3_instruct_2507", "two turns"),
]  # fmt: skip


@pytest.mark.parametrize("family,conversation", SAME)
def test_spans_of_the_plain_template_equal_transformers_assistant_mask_of_trl_training_template(
    tmp_path, family, conversation
):
    messages = CONVERSATIONS[conversation]
    [(ids, trained)] = _memo(tmp_path, family, messages)
    reference_ids, mask = _reference(tmp_path, family, messages)
    assert ids == reference_ids
    assert trained == [bool(m) for m in mask]
    end = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "phi3": "<|end|>"}
    if family in end:  # the end-of-turn token is the assistant's: the model learns to stop
        spelled = Tokenizer.from_file(str(tmp_path / family / "tokenizer.json")).id_to_token
        assert end[family] in {spelled(i) for i, t in zip(ids, trained) if t}


@pytest.mark.parametrize(
    "family,conversation,prompt",
    [("qwen2_5", "two turns", "\n"), ("qwen3_5_nothink", "one turn", "<think>\n\n</think>\n\n")],
)
def test_where_trl_also_trains_the_generation_prompt_memo_leaves_out_just_that_text(
    tmp_path, family, conversation, prompt
):
    messages = CONVERSATIONS[conversation]
    [(ids, trained)] = _memo(tmp_path, family, messages)
    reference_ids, mask = _reference(tmp_path, family, messages)
    assert ids == reference_ids
    extra = [bool(m) and not t for m, t in zip(mask, trained)]
    assert not any(t and not m for m, t in zip(mask, trained))  # memo's spans lie within the reference's
    decode = HFTokenizer(tmp_path / family / "tokenizer.json").decode
    turns = sum(m["role"] == "assistant" for m in messages)
    assert [decode(ids[lo:hi]) for lo, hi in _runs(extra)] == [prompt] * turns  # what the generation prompt ends with
    plain = AutoTokenizer.from_pretrained(tmp_path / family)
    assert plain.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith(prompt)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_a_template_that_rewrites_earlier_turns_trains_each_turn_in_a_document_of_its_own(tmp_path, family):
    messages = CONVERSATIONS["two turns"]
    documents = _memo(tmp_path, family, messages)
    plain = AutoTokenizer.from_pretrained(tmp_path / family)
    assert len(documents) == 2
    for (ids, trained), end in zip(documents, (2, 4)):  # each turn after the conversation as the model saw it
        text = plain.apply_chat_template(messages[:end], tokenize=False)
        assert ids == HFTokenizer(tmp_path / family / "tokenizer.json").encode(text)
        reference_ids, mask = _reference(tmp_path, family, messages[:end])
        lo, hi = _runs(mask)[-1]  # the reference's last assistant turn: the one this document trains
        assert [i for i, t in zip(ids, trained) if t] == reference_ids[lo:hi]
    if family == "qwen3":  # the first turn's empty think block is dropped once a user speaks again
        assert "<think>" in plain.apply_chat_template(messages[:2], tokenize=False)
        assert plain.apply_chat_template(messages, tokenize=False).count("<think>") == 1


def test_a_template_whose_prompt_does_not_begin_the_turn_it_renders_is_refused(tmp_path):
    path = char_tokenizer(tmp_path / "r1", trl_template("deepseek_r1_distill"))  # prompts <think>, drops it
    messages = CONVERSATIONS["reasoning"]
    with pytest.raises(ValueError, match=r"row: the chat template renders assistant message 1 as .* rewrites"):
        render_conversation(ChatTemplate(path, "test"), messages, "row")


def test_spans_that_cut_a_token_are_refused(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    path = char_tokenizer(tmp_path / "merging", template, merges=(("\n", "n"),))  # "?\nno": "\nn" is one token
    messages = [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "no"}]
    [rendered] = render_conversation(ChatTemplate(path, "test"), messages, "row")
    with pytest.raises(ValueError, match=r"row: the assistant's text does not begin and end on token boundaries"):
        tokenize_rendered(rendered, HFTokenizer(path).encode, "row")


# ------------------------------------------------------------------------------------------- data and refusals


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conversation(*contents: str) -> dict:
    roles = ["user", "assistant"] * len(contents)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}


BAD = [
    ({"text_": "x"}, r"c.jsonl:2: expected an object with a 'text' field \(or 'messages', a conversation\)"),
    ({"messages": [{"role": "human", "content": "hi"}]}, r"c.jsonl:2: message 0 has role 'human'; roles are"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"c.jsonl:2: message 0 is not an object with a `role`"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"c.jsonl:2: the conversation has no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, r"c.jsonl:2: the conversation opens with an assistant"),
    ({"messages": []}, r"c.jsonl:2: the conversation has no messages"),
    ({"messages": "hi"}, r"c.jsonl:2: field 'messages' is str, not a list of messages"),
    ({"text": "plain text"}, r"c.jsonl:2: text among conversations: give conversations and text apart"),
]


@pytest.mark.parametrize("record,message", BAD)
def test_bad_conversations_are_refused_naming_the_file_and_row(tmp_path, record, message):
    path = _jsonl(tmp_path / "c.jsonl", [_conversation("hi", "yo"), record])
    with pytest.raises(ValueError, match=message):
        token_dataset(path, 64, tokenizer_path=TOKENIZER)


def test_a_parquet_column_of_conversations_reads_as_the_jsonl_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line)["messages"] for line in (DATA / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"text": ["x"] * len(records), "messages": records}), tmp_path / "c.parquet")
    jsonl = token_dataset(DATA / "train.jsonl", 128, tokenizer_path=TOKENIZER)
    parquet = token_dataset(tmp_path / "c.parquet", 128, tokenizer_path=TOKENIZER, text_field="messages")
    assert np.array_equal(jsonl.tokens, parquet.tokens) and np.array_equal(jsonl.trained, parquet.trained)


def test_conversations_need_a_chat_template_and_transformers(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "c.jsonl", [_conversation("hi", "yo")])
    with pytest.raises(ValueError, match=r"`--data` '.*c.jsonl' holds conversations .* give `--tokenizer`"):
        token_dataset(path, 64)  # bytes: no template
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    with pytest.raises(ValueError, match=r"tokenizer .*bare has no chat template"):
        token_dataset(path, 64, tokenizer_path=bare / "tokenizer.json")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"rendering them needs transformers: pip install 'memo-train\[chat\]'"):
        token_dataset(path, 64, tokenizer_path=TOKENIZER)
    with pytest.raises(ValueError, match=r"a conversation among text documents"):
        token_dataset(_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, _conversation("hi", "yo")]), 64)
    with pytest.raises(ValueError, match=r"holds conversations .* a token file cannot hold"):
        write_token_file(path, tmp_path / "c.bin", TOKENIZER)


def test_a_conversation_longer_than_a_sequence_is_refused_or_truncated_with_a_warning(tmp_path, caplog):
    path = _jsonl(tmp_path / "c.jsonl", [_conversation("hi", "yo"), _conversation("hi", "a long answer " * 8)])
    with pytest.raises(ValueError, match=r"c.jsonl:2: the conversation is 141 tokens, longer than a sequence \(64\)"):
        token_dataset(path, 64, tokenizer_path=TOKENIZER)
    with caplog.at_level(logging.WARNING, "memo"):
        data = token_dataset(path, 64, tokenizer_path=TOKENIZER, long_conversations="truncate")
    assert "1 conversation(s) longer than a sequence cut to its 64 tokens" in caplog.text
    assert "77 assistant token(s) left out" in caplog.text  # 141 - 64 tokens, all the assistant's
    assert data.document_lengths().tolist() == [31, 64] and data.num_sequences == 2


# ------------------------------------------------------------------------------------------------------ packing


def test_chunks_hold_whole_documents_and_label_only_the_trained_tokens():
    lengths = [3, 4, 2, 5]  # chunks of 6: [d0 pad pad pad] [d1 d2] [d3 pad]
    tokens = np.arange(10, 24)
    trained = np.isin(np.arange(14), [2, 5, 6, 8, 12, 13])
    data = TokenDataset(tokens, np.cumsum([0, *lengths[:-1]]), 6, trained=trained, pack_documents="mask")
    assert data.num_sequences == 3
    rows = [data.sequence(i) for i in range(3)]
    assert [r[0].tolist() for r in rows] == [[10, 11, 12, 0, 0, 0], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 0]]
    I = IGNORE_INDEX  # noqa: E741
    assert [r[1].tolist() for r in rows] == [[I, I, 12, I, I, I], [I, I, 15, 16, I, 18], [I, I, I, 22, 23, I]]
    assert [r[2].tolist() for r in rows] == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 0]]
    concat = TokenDataset(tokens, np.cumsum([0, *lengths[:-1]]), 6, trained=trained)
    assert [concat.sequence(i)[1].tolist() for i in range(3)] == [r[1].tolist() for r in rows]  # no positions
    assert concat.sequence(0)[2] is None


def test_packed_conversations_score_each_assistant_token_as_alone_on_transformers_mask(tmp_path):
    data = token_dataset(DATA / "heldout.jsonl", 128, tokenizer_path=TOKENIZER, pack_documents="mask")
    model = Transformer(ModelConfig.preset("tiny")).eval()
    reference = AutoTokenizer.from_pretrained(
        char_tokenizer(tmp_path / "training", trl_template("qwen3_training")).parent
    )
    alone = []  # each conversation of the file alone: the loss on the reference's assistant tokens
    for line in (DATA / "heldout.jsonl").read_text().splitlines():
        out = reference.apply_chat_template(
            json.loads(line)["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = torch.tensor(out["input_ids"]), torch.tensor(out["assistant_masks"], dtype=torch.bool)
        with torch.no_grad():
            losses = F.cross_entropy(model(ids[None])[0, :-1], ids[1:], reduction="none")
        alone += losses[mask[1:]].tolist()
    packed = []
    for i in range(data.num_sequences):
        ids, labels, positions = data.sequence(i)
        targets = shift_labels(labels[None])
        losses = position_losses(model, ids[None], targets, positions[None])[0]
        packed += losses[targets[0] != IGNORE_INDEX].tolist()
    assert data.num_sequences < 8  # several conversations a sequence
    assert packed == pytest.approx(alone, abs=1e-5)
    train, held = split_documents(data, 0.25)  # a held-out split keeps the masks and whole conversations
    parts = [part.sequence(i)[1] for part in (train, held) for i in range(part.num_sequences)]
    assert sum(int((labels != IGNORE_INDEX).sum()) for labels in parts) == len(alone)


# ---------------------------------------------------------------------------------------------------------- CLI


def test_memo_train_and_eval_on_conversations_and_a_changed_template_is_refused(tmp_path, capsys):
    run, tokenizer = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER.parent, tokenizer)
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    template = settings.pop("chat_template")  # where transformers >= 4.43 saves it: chat_template.jinja
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    (tokenizer / "chat_template.jinja").write_text(template)
    flags = ["--model", str(MODEL), "--tokenizer", str(tokenizer / "tokenizer.json"), "--seq-len", "128"]
    flags += ["--batch-size", "2", "--steps", "2", "--strategy", "none", "--eval-every", "1000", "--out", str(run)]
    assert main(["train", "--data", str(DATA / "train.jsonl"), *flags, "--json"]) == 0
    assert "12 conversation(s) are one document per assistant turn" in capsys.readouterr().err
    saved = json.loads((run / "config.json").read_text())
    assert [saved[k] for k in ("document_separator", "pack_documents", "long_conversations")] == [
        "none",
        "mask",
        "refuse",
    ]
    evaluate = ["eval", str(run), "--ppl-file", str(DATA / "heldout.jsonl"), "--trials", "0", "--lengths", "128"]
    assert main(evaluate) == 0
    out = capsys.readouterr().out
    assert f"loss of the assistant tokens of {DATA / 'heldout.jsonl'} by position within document" in out
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0  # the template goes with the model
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == template
    (tokenizer / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_start|> "))
    assert main(evaluate) == 2
    assert re.search(
        r"changed since run .* started \(another tokenizer_config.json or chat template", capsys.readouterr().err
    )


def test_memo_train_refuses_a_conversation_longer_than_seq_len_or_truncates_it_as_asked(tmp_path, capsys):
    path = _jsonl(tmp_path / "long.jsonl", [_conversation("hi", "a long answer " * 8), _conversation("hi", "yo")])
    flags = ["--data", str(path), "--model", str(MODEL), "--tokenizer", str(TOKENIZER), "--seq-len", "64"]
    flags += ["--batch-size", "2", "--steps", "1", "--strategy", "none", "--eval-every", "1000"]
    assert main(["train", *flags, "--out", str(tmp_path / "refused")]) == 2
    assert "long.jsonl:1: the conversation is 141 tokens, longer than a sequence (64)" in capsys.readouterr().err
    assert main(["train", *flags, "--out", str(tmp_path / "cut"), "--long-conversations", "truncate"]) == 0
    assert "1 conversation(s) longer than a sequence cut to its 64 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--document-separator", "eos"], "`--document-separator eos`: `--data` .* holds conversations"),
        (["--data", str(MODEL.parent / "finetune.txt"), "--long-conversations", "truncate"], "holds none"),
    ],
)
def test_flags_that_cannot_apply_to_the_data_are_refused_in_one_line(tmp_path, capsys, argv, message):
    flags = ["--model", str(MODEL), "--tokenizer", str(TOKENIZER), "--seq-len", "128", "--out", str(tmp_path / "r")]
    assert main(["train", "--data", str(DATA / "train.jsonl"), *flags, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0])
