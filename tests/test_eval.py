"""memo.eval and `memo eval`: pass-key prompts, one-row greedy decoding, oracle and random scores, packed pass-key
prompts against one at a time, loss by position against full-logits cross-entropy (within documents against each
document run alone), and the verb on a run directory and a Hugging Face folder."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memo import ModelConfig, Transformer, to_hf
from memo import eval as evaluation
from memo.cli import main
from memo.eval import (
    FILLER,
    NEEDLE,
    QUESTION,
    Defaults,
    PasskeyTask,
    bucket_edges,
    defaults,
    greedy_decode,
    held_out_sequences,
    packed_greedy_decode,
    passkey_accuracy,
    passkey_verdicts,
    perplexity_by_position,
    position_losses,
    spread,
)
from memo.loss import IGNORE_INDEX, shift_labels
from memo.train.data import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer()


def _bpe_tokenizer(path, kind: str):
    """Writes a small tokenizer.json trained on the task's own text: byte-level BPE (GPT-2/Llama 3 style, pieces
    need a spelt-out space) or Metaspace (sentencepiece style, every piece starts a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte-level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])
    tokenizer.train_from_iterator([*FILLER, NEEDLE.format(key="0123456789"), QUESTION], trainer)
    tokenizer.save(str(path))
    return HFTokenizer(path)


# ------------------------------------------------------------------------------------------------------ prompts


def test_the_needle_sits_at_the_requested_depth_of_a_prompt_of_exactly_the_length():
    task = PasskeyTask(BYTES)
    longest_sentence = max(len(s) for s in task.sentences)
    for depth in (0, 0.5, 1):
        p = task.prompt(512, depth, seed=3, trial=1)
        needle = task.encode(NEEDLE.format(key=p.key))
        room = 512 - len(needle) - len(task.question)
        assert p.ids.shape == (512,) and len(p.key) == 5
        assert p.ids[p.needle_at : p.needle_at + len(needle)].tolist() == needle
        assert p.ids[-len(task.question) :].tolist() == task.question
        expected = {0: 0, 1: room}.get(depth, room / 2)
        assert abs(p.needle_at - expected) <= (longest_sentence / 2 if depth == 0.5 else 0)
    text = BYTES.decode(task.prompt(512, 0.5, seed=3, trial=1).ids.tolist())
    assert re.search(r"\w\. The pass key is \d{5}\. Remember it\. \w", text)  # between two whole sentences
    assert not re.search(r"\d", text.replace(re.search(r"\d{5}", text).group(), ""))  # the key is the only number


def test_prompts_are_a_function_of_seed_length_depth_and_trial():
    task = PasskeyTask(BYTES)
    same = [task.prompt(300, 0.25, seed=0, trial=2).ids for _ in range(2)]
    assert torch.equal(*same)
    assert not torch.equal(same[0], task.prompt(300, 0.25, seed=1, trial=2).ids)
    assert not torch.equal(same[0], task.prompt(300, 0.25, seed=0, trial=3).ids)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_a_tokenizer_json_writes_the_prompt_as_running_text(tmp_path, kind):
    task = PasskeyTask(_bpe_tokenizer(tmp_path / "tokenizer.json", kind))
    p = task.prompt(200, 0.5, seed=0, trial=0)
    text = task.tokenizer.decode(p.ids.tolist())
    assert len(p.ids) == 200
    assert f". The pass key is {p.key}. Remember it. " in text and text.endswith(" " + QUESTION)
    assert task.read_key(task.encode(p.key)) == p.key


# ----------------------------------------------------------------------------------------------------- decoding


_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.matmul, torch.ops.aten.linear}


class _HeadProducts(TorchDispatchMode):
    """Records the shape of every matrix product whose last dimension is the vocabulary (under inference mode
    composite ops such as matmul and linear reach the dispatcher whole)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _PRODUCTS and out.shape[-1] == self.vocab:
            self.shapes.append(tuple(out.shape))
        return out


def test_greedy_decoding_multiplies_one_row_per_step_by_the_head_and_matches_full_logits():
    model = Transformer(ModelConfig.preset("tiny", vocab_size=263)).eval()  # 263: no other dimension has it
    ids = torch.randint(0, 263, (2, 40))
    with _HeadProducts(263) as spy:
        out = greedy_decode(model, ids, 3)
    assert spy.shapes == [(2, 263)] * 3  # never (s x V)
    expected = ids
    with torch.no_grad():
        for _ in range(3):
            expected = torch.cat((expected, model(expected)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, expected[:, 40:])


def _off_by_one(key: str) -> str:
    return key[:-1] + str((int(key[-1]) + 1) % 10)


ANSWERS = {  # what an oracle answers to a key, and whether the first run of digits of its answer is the key
    "right": (lambda key: f" {key}.", True),
    "one digit off": (lambda key: f" {_off_by_one(key)}.", False),
    "no space": (lambda key: f"{key}.", True),  # not the tokens expected, but the key: right unpacked, so packed
    "late": (lambda key: f" x{key}", False),  # six bytes: the key's last digit is never written
    "odd keys only": (lambda key: f" {key if int(key) % 2 else _off_by_one(key)}.", None),
}


class _Oracle(torch.nn.Module):
    """Bytes model that answers each prompt with `answer(key)`: the hidden row of every token from the question's
    last one on is the one-hot of the answer's next byte after those written since the question ("?" once they
    leave it), in each document of a packed sequence. With the identity as head, greedy decoding reads it back."""

    def __init__(self, answer=ANSWERS["right"][0]):
        super().__init__()
        self.config = ModelConfig.preset("tiny")  # bytes: vocabulary 256
        self.head_weight = torch.eye(256)
        self.answer = answer

    def greedy(self, ids: torch.Tensor, n_tokens: int, eos=None) -> list[list[int]]:
        """Decodes as a model without a cache would: the whole sequence again for each token."""
        start = ids.shape[1]
        for _ in range(n_tokens):
            next_ids = (self.hidden_states(ids)[:, -1] @ self.head_weight.t()).argmax(dim=-1)
            ids = torch.cat((ids, next_ids[:, None]), dim=1)
        return ids[:, start:].tolist()

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.zeros(*ids.shape, 256)
        for row, seq in enumerate(ids.tolist()):
            starts = [0] if positions is None else (positions[row] == 0).nonzero().flatten().tolist()
            for lo, hi in zip(starts, [*starts[1:], len(seq)]):
                text = BYTES.decode(seq[lo:hi])  # ASCII: a character is a byte
                answer = self.answer(re.search(r"pass key is (\d+)\. Remember", text).group(1))
                asked = lo + text.index(QUESTION) + len(QUESTION)
                for t in range(asked - 1, hi):
                    written = BYTES.decode(seq[asked : t + 1])
                    follows = answer.startswith(written) and len(written) < len(answer)
                    hidden[row, t, ord(answer[len(written)] if follows else "?")] = 1.0
        return hidden


@pytest.mark.parametrize("kind", ["right", "one digit off"])
def test_an_oracle_scores_100_percent_and_one_digit_off_scores_0(kind):
    oracle = _Oracle(ANSWERS[kind][0])
    cells = passkey_accuracy(oracle, BYTES, [128, 300], [0, 0.5, 1], trials=3, seed=5, batch_size=2)
    assert [(c.length, c.depth, c.trials) for c in cells][:2] == [(128, 0, 3), (128, 0.5, 3)] and len(cells) == 6
    assert {c.accuracy for c in cells} == ({1.0} if ANSWERS[kind][1] else {0.0})
    assert passkey_accuracy(oracle, BYTES, [128, 300], [0, 0.5, 1], trials=3, seed=5, pack=2) == cells


@pytest.mark.parametrize("kind", list(ANSWERS))
def test_packed_pass_key_verdicts_equal_one_prompt_at_a_time(kind):
    answer, right = ANSWERS[kind]
    task, oracle = PasskeyTask(BYTES), _Oracle(answer)
    prompts = [task.prompt(n, d, seed=5, trial=t) for n in (128, 300) for d in (0, 1) for t in range(3)]
    alone = [passkey_verdicts(oracle, task, [p])[0] for p in prompts]
    expected = [bool(int(p.key) % 2) if right is None else right for p in prompts]
    assert alone == expected and (right is not None or 0 < sum(expected) < len(prompts))  # some right, some wrong
    assert passkey_verdicts(oracle, task, prompts, packed=True) == alone  # 12 prompts of two lengths, one sequence


def _counting_forwards(model, monkeypatch) -> list:
    calls, real = [], model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_packed_greedy_decoding_gives_each_prompt_its_own_greedy_continuation_whatever_the_draft(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny")).eval()
    prompts = [torch.randint(0, 256, (n,)) for n in (40, 17, 33)]
    alone = [greedy_decode(model, p[None], 5)[0].tolist() for p in prompts]  # unpacked, positions None
    left_at_2 = [*alone[1][:2], (alone[1][2] + 1) % 256, *alone[1][3:]]
    drafts = [alone[0], left_at_2, [(alone[2][0] + 1) % 256] * 5]  # followed; left at token 2; left at once
    forwards = _counting_forwards(model, monkeypatch)
    assert packed_greedy_decode(model, prompts, [5, 5, 5], drafts) == alone
    assert len(forwards) == 5  # the draft left at once is decoded a token a forward
    for prompt, draft, expected, taken in zip(prompts, drafts, alone, (1, 3, 5)):
        forwards.clear()
        assert packed_greedy_decode(model, [prompt], [5], [draft]) == [expected]
        assert len(forwards) == taken  # a draft followed takes one forward, one left at token j, 5 - j more


def test_a_random_model_scores_chance():
    model = Transformer(ModelConfig.preset("tiny")).eval()
    cells = passkey_accuracy(model, BYTES, [128], [0, 1], trials=4)
    assert sum(c.correct for c in cells) == 0  # a five-digit key: chance is 1e-5


def test_bad_depths_and_short_lengths_fail_before_decoding():
    model = _Oracle()
    with pytest.raises(ValueError, match=r"`--depths` must lie in \[0, 1\], got 1.5"):
        passkey_accuracy(model, BYTES, [256], [0, 1.5], trials=1)
    with pytest.raises(ValueError, match="`--lengths` 40 cannot hold the needle and the question"):
        passkey_accuracy(model, BYTES, [256, 40], [0], trials=1)


# ---------------------------------------------------------------------------------------------- loss by position


def test_bucket_edges_double_from_128_or_step_by_the_given_size():
    assert bucket_edges(1000) == [0, 128, 256, 512, 1000]
    assert bucket_edges(100) == [0, 100]
    assert bucket_edges(256, 64) == [0, 64, 128, 192, 256]
    assert bucket_edges(100, 64) == [0, 64, 100]


def test_loss_by_position_equals_full_logits_cross_entropy(tmp_path):
    docs = ["The grass is green and the sky is blue. " * 2, "Here we go.", "There and back again, " * 3]
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    model = Transformer(ModelConfig.preset("tiny")).eval()
    model.loss_chunk_tokens = 5  # many chunks, one of them short
    data = held_out_sequences(path, None, 48, vocab_size=256)
    buckets = perplexity_by_position(model, data, bucket_size=16)

    tokens = [b for d in docs for b in d.encode()]
    starts = set(np.cumsum([0] + [len(d.encode()) for d in docs[:-1]]).tolist())
    losses = {(lo, hi): [] for lo, hi in [(0, 16), (16, 32), (32, 48)]}
    for first in range(0, len(tokens), 48):
        ids = torch.tensor(tokens[first : first + 48])
        with torch.no_grad():
            per_token = F.cross_entropy(model(ids[None])[0, :-1], ids[1:], reduction="none")  # full s x V logits
        for j, loss in enumerate(per_token.tolist(), start=1):  # j: the predicted token's position
            if first + j not in starts:
                losses[next(k for k in losses if k[0] <= j < k[1])].append(loss)
    assert [(b.start, b.end, b.tokens) for b in buckets] == [(lo, hi, len(v)) for (lo, hi), v in losses.items()]
    for b, v in zip(buckets, losses.values()):
        assert b.loss == pytest.approx(sum(v) / len(v), rel=1e-5)
        assert b.perplexity == pytest.approx(math.exp(b.loss))


def _held_out_documents(tmp_path, docs: list[str]):
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_loss_by_position_within_documents_equals_each_document_run_alone(tmp_path):
    docs = ["The grass is green.", "Here we go, there and back again.", "A cat sleeps. " * 2, "Rain.", "The sun."]
    path = _held_out_documents(tmp_path, docs)  # 93 bytes: two sequences of 48, the second document cut by the bound
    model = Transformer(ModelConfig.preset("tiny")).eval()
    model.loss_chunk_tokens = 5
    data = held_out_sequences(path, None, 48, vocab_size=256, pack_documents="mask")

    tokens = [b for d in docs for b in d.encode()]
    starts = set(np.cumsum([0] + [len(d.encode()) for d in docs[:-1]]).tolist())
    alone = {}  # stream index of a predicted token -> (its position in its piece of document, loss)
    for first in range(0, len(tokens), 48):  # a document cut by a sequence bound starts again after it
        cuts = sorted({first, *(s for s in starts if first < s < first + 48), min(first + 48, len(tokens))})
        for lo, hi in zip(cuts, cuts[1:]):
            ids = torch.tensor(tokens[lo:hi])
            with torch.no_grad():  # the piece alone, no positions: full s x V logits
                per_token = F.cross_entropy(model(ids[None])[0, :-1], ids[1:], reduction="none")
            alone.update({lo + j: (j, loss) for j, loss in enumerate(per_token.tolist(), start=1)})

    for i in range(data.num_sequences):  # the masked packed forward gives each token its loss alone
        ids, labels, positions = data.sequence(i)
        targets = shift_labels(labels[None])
        losses = position_losses(model, ids[None], targets, positions[None])[0]
        scored = (targets[0] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert [48 * i + t + 1 for t in scored] == [k for k in sorted(alone) if 48 * i < k <= 48 * i + 47]
        assert losses[scored].tolist() == pytest.approx([alone[48 * i + t + 1][1] for t in scored], abs=1e-5)

    buckets = perplexity_by_position(model, data, bucket_size=8)
    by_bucket = {}
    for j, loss in alone.values():
        by_bucket.setdefault(j // 8, []).append(loss)
    assert max(j for j, _ in alone.values()) == 28  # the longest piece: buckets past 32 hold nothing, left out
    assert [(b.start, b.end, b.tokens) for b in buckets] == [(8 * k, 8 * k + 8, len(by_bucket[k])) for k in range(4)]
    for b, v in zip(buckets, (by_bucket[k] for k in range(4))):
        assert b.loss == pytest.approx(sum(v) / len(v), rel=1e-5)
    concat = perplexity_by_position(model, held_out_sequences(path, None, 48, vocab_size=256), bucket_size=8)
    assert len(concat) == 6 and sum(b.tokens for b in concat) == sum(b.tokens for b in buckets)  # the same tokens


# --------------------------------------------------------------------------------------------------------- CLI


def test_eval_of_a_run_directory_prints_passkey_and_loss_json(run_dir, tmp_path, capsys):
    (tmp_path / "held.txt").write_text("There and back again. " * 30)
    capsys.readouterr()
    argv = ["eval", str(run_dir), "--lengths", "256", "--depths", "0,1", "--trials", "2", "--json"]
    assert main([*argv, "--ppl-file", str(tmp_path / "held.txt")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == f"{run_dir} (step 1)" and report["tokenizer"] == "bytes"
    assert [(c["length"], c["depth"], c["trials"]) for c in report["passkey"]] == [(256, 0.0, 2), (256, 1.0, 2)]
    assert all(0 <= c["accuracy"] <= 1 for c in report["passkey"])
    ppl = report["perplexity"]
    assert ppl["sequences"] == 3 and [b["end"] for b in ppl["buckets"]] == [128, 256]
    assert ppl["pack_documents"] == "concat"  # the run's: the generated task is one document per sequence
    assert sum(b["tokens"] for b in ppl["buckets"]) == 22 * 30 - 3  # every token but each sequence's first


def test_eval_of_a_hugging_face_folder_reads_its_tokenizer_and_draws_the_heatmap(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(vocab_size=320, num_key_value_heads=2, **shape)
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _bpe_tokenizer(folder / "tokenizer.json", "byte-level")
    plot = tmp_path / "needle.png"
    argv = ["eval", str(folder), "--lengths", "128,256", "--depths", "0,0.5,1", "--trials", "1", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {folder / 'tokenizer.json'}" in out
    assert "| depth | 128 | 256 |" in out and "| 0.50 |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_masks_documents_by_default_for_a_hugging_face_folder_and_packs_prompts(tmp_path, capsys):
    to_hf(Transformer(ModelConfig.preset("tiny")), tmp_path / "hf")
    held = _held_out_documents(tmp_path, ["There and back again. " * 3, "Here we go."] * 4)  # 66 and 11 bytes
    argv = ["eval", str(tmp_path / "hf"), "--lengths", "128", "--json"]
    loss = ["--trials", "0", "--ppl-file", str(held), "--bucket-size", "16"]
    assert main([*argv, "--depths", "0,1", "--trials", "2", "--passkey-pack", "2"]) == 0  # two prompts a forward
    cells = json.loads(capsys.readouterr().out)["passkey"]
    assert [(c["length"], c["depth"], c["trials"], c["correct"]) for c in cells] == [(128, 0, 2, 0), (128, 1, 2, 0)]

    assert main([*argv, *loss]) == 0
    ppl = json.loads(capsys.readouterr().out)["perplexity"]
    assert ppl["pack_documents"] == "mask" and [b["end"] for b in ppl["buckets"]] == [16, 32, 48, 64, 80]  # 66 long
    assert main([*argv, *loss, "--pack-documents", "concat"]) == 0
    concat = json.loads(capsys.readouterr().out)["perplexity"]
    assert concat["pack_documents"] == "concat" and [b["end"] for b in concat["buckets"]][-1] == 128
    tokens = 4 * 77 - 8 - 2  # every token but each document's first and each sequence's first
    assert sum(b["tokens"] for b in concat["buckets"]) == sum(b["tokens"] for b in ppl["buckets"]) == tokens
    assert main(argv[:-1] + loss) == 0
    out = capsys.readouterr().out
    assert "by position within document, 3 sequence(s) of 128" in out and "| position within document | tokens |" in out
    assert "| [64, 80) |" in out and "[80, 96)" not in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--depths", "0,2"], r"`--depths` must lie in \[0, 1\], got 2.0"),
        (["--lengths", "32"], "`--lengths` 32 cannot hold the needle and the question"),
        (["--trials", "0"], "nothing to evaluate"),
        (["--ppl-file", "missing.txt"], "`--ppl-file` file 'missing.txt' does not exist"),
        (["--device", "tpu9"], "`--device` 'tpu9' is not a torch device"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, message):
    to_hf(Transformer(ModelConfig.preset("tiny")), tmp_path / "hf")
    assert main(["eval", str(tmp_path / "hf"), "--lengths", "128", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--passkey-pack", "0"], "`--passkey-pack` must be a positive integer, got 0"),
        (["--passkey-pack", "two"], "argument --passkey-pack: invalid int value: 'two'"),
        (["--passkey-pack", "2", "--batch-size", "2"], "`--passkey-pack` 2 packs prompts into one sequence: leave"),
        (["--passkey-pack", "2", "--trials", "0", "--ppl-file", "held.txt"], "`--passkey-pack` packs pass-key"),
        (["--pack-documents", "mask"], "`--pack-documents` packs the documents of `--ppl-file`: give one"),
        (["--pack-documents", "diagonal", "--ppl-file", "held.txt"], "argument --pack-documents: invalid choice"),
        (  # each prompt's positions stay within its 128 tokens: only memory bounds the packed sequence
            ["--passkey-pack", "100000000"],
            r"`--passkey-pack` 100000000 x `--lengths` 128 \(.+ tokens in one sequence\) needs at least .+ of "
            r"activations .+: lower `--lengths` or `--passkey-pack`$",
        ),
    ],
)
def test_bad_packing_flags_exit_2_with_one_line_before_any_work(run_dir, tmp_path, monkeypatch, capsys, argv, message):
    (tmp_path / "held.txt").write_text("There and back again. " * 30)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(evaluation, "passkey_verdicts", None)  # any scoring would fail loudly
    capsys.readouterr()
    try:
        code = main(["eval", str(run_dir), "--lengths", "128", "--trials", "1", *argv])
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert re.search(message, err) and len(err.splitlines()) == 1


def test_a_path_that_is_neither_a_run_nor_a_hugging_face_folder_is_an_error(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "is neither a `memo train` run directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- sized to fit, interruptible


def test_defaults_depend_on_the_device_and_a_cpu_gets_a_smaller_grid(capsys):
    cpu, cuda = defaults(torch.device("cpu")), defaults(torch.device("cuda"))
    assert defaults(torch.device("meta")) == cpu
    assert max(cpu.lengths) < max(cuda.lengths) and cpu.trials < cuda.trials
    assert cpu.max_sequences < cuda.max_sequences
    assert "(default: 1K,4K on CPU; 1K,4K,16K on CUDA)" in " ".join(_help(capsys, "eval").split())


def test_eval_without_grid_flags_runs_the_devices_defaults(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(evaluation.DEFAULTS, "cpu", Defaults((128, 200), (0.5,), 1, 3))
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--device", "cpu", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["passkey"]
    assert [(c["length"], c["depth"], c["trials"]) for c in cells] == [(128, 0.5, 1), (200, 0.5, 1)]


def _help(capsys, verb: str) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return capsys.readouterr().out


def test_spread_picks_distinct_indices_evenly_over_the_file():
    assert spread(10, 3) == [0, 3, 6] and spread(4, None) == spread(4, 8) == list(range(4))
    picked = spread(917, 16)
    gaps = np.diff([*picked, 917])  # to the next pick, the last one to the end of the file
    assert picked[0] == 0 and gaps.min() >= 57 and gaps.max() <= 58


def _held_out(tmp_path) -> str:
    path = tmp_path / "held.txt"
    path.write_text("There and back again. " * 60)  # 1320 bytes: 11 sequences of 128
    return str(path)


def test_max_sequences_caps_the_loss_and_says_how_many_of_how_many(run_dir, tmp_path, capsys):
    argv = ["eval", str(run_dir), "--lengths", "128", "--trials", "0", "--ppl-file", _held_out(tmp_path)]
    capsys.readouterr()
    assert main([*argv, "--max-sequences", "3", "--json"]) == 0
    ppl = json.loads(capsys.readouterr().out)["perplexity"]
    assert (ppl["sequences"], ppl["of"]) == (3, 11)
    assert sum(b["tokens"] for b in ppl["buckets"]) == 3 * 127  # three whole sequences, each less its first token
    assert main([*argv, "--max-sequences", "3"]) == 0
    assert "3 of 11 sequence(s) of 128 (--max-sequences)" in capsys.readouterr().out
    assert main([*argv, "--max-sequences", "0"]) == 2
    assert "`--max-sequences` must be positive, got 0" in capsys.readouterr().err


def _interrupt_after(monkeypatch, name: str, calls: int) -> None:
    """Makes memo.eval's `name` raise KeyboardInterrupt (Ctrl-C) on its call number `calls` + 1."""
    real, seen = getattr(evaluation, name), []

    def counted(*args, **kwargs):
        seen.append(1)
        if len(seen) > calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, name, counted)


def test_ctrl_c_during_the_pass_key_prints_and_draws_the_cells_finished_and_exits_130(
    run_dir, tmp_path, monkeypatch, capsys
):
    _interrupt_after(monkeypatch, "passkey_verdicts", 5)  # 2 trials per cell, one per batch: cells 1, 2 whole
    plot = tmp_path / "passkey.png"
    argv = ["eval", str(run_dir), "--lengths", "128,200", "--depths", "0,1", "--trials", "2", "--plot", str(plot)]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 130
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["interrupted"] and [(c["length"], c["depth"]) for c in report["passkey"]] == [(128, 0), (128, 1)]
    assert err.strip().splitlines()[-1] == "memo eval: interrupted"
    assert plot.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.undo()
    _interrupt_after(monkeypatch, "passkey_verdicts", 5)
    assert main(argv) == 130
    out = capsys.readouterr().out
    assert (
        "interrupted: the results finished before Ctrl-C" in out and "| 0.00 | " in out and "| 128 | 200 |" not in out
    )
    monkeypatch.undo()
    _interrupt_after(monkeypatch, "passkey_verdicts", 0)
    assert main(argv) == 130
    assert "interrupted: nothing was finished before Ctrl-C" in capsys.readouterr().out


def test_ctrl_c_during_the_loss_keeps_the_pass_key_and_the_sequences_scored(run_dir, tmp_path, monkeypatch, capsys):
    _interrupt_after(monkeypatch, "position_losses", 4)
    argv = [
        "eval",
        str(run_dir),
        "--lengths",
        "128",
        "--depths",
        "0",
        "--trials",
        "1",
        "--ppl-file",
        _held_out(tmp_path),
    ]
    capsys.readouterr()
    assert main([*argv, "--json"]) == 130
    report = json.loads(capsys.readouterr().out)
    assert report["interrupted"] and len(report["passkey"]) == 1
    ppl = report["perplexity"]
    assert (ppl["sequences"], ppl["of"]) == (4, 11) and sum(b["tokens"] for b in ppl["buckets"]) == 4 * 127


# ---------------------------------------------------------------------------------------------- length bounds


def test_lengths_far_past_the_trained_length_are_refused_in_one_line_before_any_work(run_dir, capsys):
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--lengths", "1K,64M", "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "memo eval: error: `--lengths` 64M is past 64x the length the model's positions know (at most 16K "
        "here): lower `--lengths`"
    )


def test_the_length_limit_counts_from_the_longer_known_length_and_keeps_the_default_grid():
    config = ModelConfig.preset("tiny")
    assert evaluation.length_limit(config, None) is None  # nothing known: only memory bounds it
    assert evaluation.length_limit(config, 64) == 16384
    assert evaluation.length_limit(dataclasses.replace(config, max_position_embeddings=4096), 1024) == 64 * 4096


def test_lengths_whose_activations_cannot_fit_are_refused(monkeypatch):
    model = Transformer(ModelConfig.preset("tiny"))
    loaded = evaluation.Loaded(model, BYTES, None, "tiny")
    monkeypatch.setattr(evaluation.dev, "free_memory_bytes", lambda device: 1 << 20)
    evaluation.check_lengths(loaded, [256], batch=1)  # 256 x (2 x 64 + 176) x 4 B = 304 KiB
    with pytest.raises(ValueError, match=r"`--lengths` 1K needs at least 4.75MiB of activations \(4 prompt\(s\)\)"):
        evaluation.check_lengths(loaded, [1024], batch=4)
    packed = r"`--passkey-pack` 16 x `--lengths` 256 \(4K tokens in one sequence\) needs at least 4.75MiB"
    with pytest.raises(ValueError, match=packed + r" of activations \(16 prompt\(s\)\).*or `--passkey-pack`$"):
        evaluation.check_lengths(loaded, [256], batch=1, pack=16)
