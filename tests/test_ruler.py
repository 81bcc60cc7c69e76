"""RULER's offline tasks: exact lengths, needles at their depth, distinct distractors, seeded prompts, a reference
solver that reads the prompt text (100% on every task, nothing once the needles are gone) and RULER's scoring."""

import re
from collections import Counter

import pytest

from memo.ruler import (
    NIAH_PREFIX_ONE,
    NOISE,
    TASKS,
    Ruler,
    postprocess,
    score,
    solve,
    string_match_all,
)
from memo.train.data import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer()
NEEDLE_TASKS = [t for t, spec in TASKS.items() if spec.has_depth]
# lengths each task fits with bytes (the longest pieces); a BPE fits them more easily
LENGTHS = {"niah": (1000, 1500, 4096), "variable_tracking": (2000, 4096), "common_words_extraction": (2000, 8192)}
LENGTHS["freq_words_extraction"] = (1000, 2000, 4096)
CORPUS = "The river bends past the mill. Farmers bring grain in autumn! Who keeps the ledger? The miller does."
# RULER's scripts/data/synthetic/constants.py
RULER_TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
}


def _lengths(task: str) -> tuple[int, ...]:
    return LENGTHS[TASKS[task].family]


def _depth(task: str, depth: float = 0.5) -> float | None:
    return depth if TASKS[task].has_depth else None


def _text(tokenizer, prompt) -> str:
    return tokenizer.decode(prompt.ids.tolist())


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Returns bytes and two BPE tokenizers trained on byte prompts of every task: byte-level (GPT-2 style, pieces
    need a spelt-out space) and Metaspace (sentencepiece style, every piece starts a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ruler = Ruler(BYTES)
    texts = [_text(BYTES, ruler.prompt(t, _lengths(t)[-1], _depth(t), seed=9, index=0)) for t in TASKS]
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_level.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, show_progress=False)
    )
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    chars = sorted(set("".join(texts)) | set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-"))
    metaspace.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], initial_alphabet=chars, show_progress=False),
    )
    folder = tmp_path_factory.mktemp("tokenizers")
    byte_level.save(str(folder / "byte-level.json"))
    metaspace.save(str(folder / "metaspace.json"))
    return {
        "bytes": BYTES,
        "byte-level": HFTokenizer(folder / "byte-level.json"),
        "metaspace": HFTokenizer(folder / "metaspace.json"),
    }


# ------------------------------------------------------------------------------------------------------ prompts


def test_every_prompt_holds_exactly_the_asked_number_of_tokens(tokenizers):
    for name, tokenizer in tokenizers.items():
        ruler = Ruler(tokenizer)
        for task in TASKS:
            for length in _lengths(task):
                p = ruler.prompt(task, length, _depth(task, 0.3), seed=1, index=2)
                assert p.length == length == len(p.ids), (name, task, length)
                assert p.ids.dtype.kind == "i" and p.context[0] > 0 and p.context[1] < length
                assert p.tokens_to_generate == RULER_TOKENS_TO_GENERATE[TASKS[task].family]
        if name == "byte-level":  # a BPE fits the short lengths too
            assert ruler.prompt("niah_multikey_1", 512, 0.5, seed=1, index=0).length == 512
            assert ruler.prompt("cwe", 4096, None, seed=1, index=0).length == 4096


def test_the_needle_sits_at_the_requested_depth_within_one_haystack_unit(tokenizers):
    rulers = {name: Ruler(tokenizers[name]) for name in ("bytes", "byte-level")}
    rulers["corpus"] = Ruler(BYTES, haystack=CORPUS)
    for name, ruler in rulers.items():
        unit = {
            "noise": len(ruler.tokenizer.encode("\n" + NOISE)),
            "corpus": max(len(BYTES.encode(" " + s)) for s in re.split(r"(?<=[.!?]) ", CORPUS)),
        }
        for task in NEEDLE_TASKS:
            for length in (1500, 4096):
                for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
                    p = ruler.prompt(task, length, depth, seed=4, index=1)
                    start, end = p.needles[p.target]
                    assert f"is: {p.answers[0]}." in ruler.tokenizer.decode(p.ids[start:end].tolist())
                    before = start - p.context[0] - sum(b - a for a, b in p.needles if b <= start)
                    room = p.context[1] - p.context[0] - sum(b - a for a, b in p.needles)
                    if depth in (0.0, 1.0):
                        assert before == depth * room, (name, task, depth)  # the context's first or last boundary
                    needle = max(b - a for a, b in p.needles)  # the needle haystack's units are needles
                    assert abs(before - depth * room) <= unit.get(p.haystack, needle), (name, task, length, depth)


def test_needles_never_repeat_a_value_and_distractors_never_share_a_key_or_value_with_the_answers():
    ruler = Ruler(BYTES)
    for task in ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery"):
        for index in range(4):
            p = ruler.prompt(task, 4096, 0.5, seed=7, index=index)
            text = _text(BYTES, p)
            asked = re.search(r"for (.+?) mentioned", text).group(1)
            asked = re.split(r",? and |, ", asked)
            needles = re.findall(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.", text)
            values = [v for _, v in needles]
            assert len(values) == len(set(values)), task  # every value once
            assert Counter(k for k, _ in needles).most_common(1)[0][1] == TASKS[task].num_values  # a key per value set
            answers = [v for k, v in needles if k in asked]
            assert sorted(answers) == sorted(p.answers), task
            if task.startswith("niah_multikey"):
                assert len(needles) > len(answers), task  # distractors (multivalue and multiquery ask every key)
            assert all(k not in asked and v not in p.answers for k, v in needles if v not in answers)
            if TASKS[task].haystack == "needle":
                assert len(needles) > 20  # the haystack itself is needles


def test_the_same_seed_gives_the_same_prompt_and_another_seed_or_index_another(tokenizers):
    ruler = Ruler(tokenizers["byte-level"])
    for task in TASKS:
        length, depth = _lengths(task)[0], _depth(task)
        a = ruler.prompt(task, length, depth, seed=3, index=0)
        again = Ruler(tokenizers["byte-level"]).prompt(task, length, depth, seed=3, index=0)
        assert a.ids.tolist() == again.ids.tolist() and a.answers == again.answers, task
        for other in (
            ruler.prompt(task, length, depth, seed=4, index=0),
            ruler.prompt(task, length, depth, seed=3, index=1),
        ):
            assert other.answers != a.answers and other.ids.tolist() != a.ids.tolist(), task


def test_the_prompt_is_rulers_template_with_the_answer_prefix_last():
    ruler = Ruler(BYTES)
    p = ruler.prompt("niah_single_1", 1000, 0.5, seed=0, index=0)
    text = _text(BYTES, p)
    key = re.search(r"for ([\w-]+) is:", text).group(1)
    head = "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
    assert text.startswith(head + f"about the number afterwards.\n{NOISE}\n")
    assert text.endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
        + NIAH_PREFIX_ONE.format(type_needle_v="number", query=key)
    )
    assert p.answer_prefix == NIAH_PREFIX_ONE.format(type_needle_v="number", query=key)
    assert f"\nOne of the special magic numbers for {key} is: {p.answers[0]}.\n" in text
    vt = _text(BYTES, ruler.prompt("vt", 4096, None, seed=0, index=0))
    assert vt.count("Memorize and track the chain(s) of variable assignment") == 2  # a solved example, then the task
    value = re.findall(r"Find all variables that are assigned the value (\d+) in the text above\.", vt)[-1]
    assert vt.endswith(
        "in the text above. Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
        f"are assigned the value {value}, they are: "
    )


def test_cwe_lists_the_common_words_30_times_and_the_others_at_most_3_and_6_against_1_below_4k():
    ruler = Ruler(BYTES)
    for length, common, rare in ((8192, 30, 3), (2000, 6, 1)):
        p = ruler.prompt("cwe", length, None, seed=2, index=0)
        text = _text(BYTES, p)
        listed = re.findall(r"\d+\.\s+([a-z]+)", text[text.rfind("Below is") : text.rfind("Question:")])
        counts = Counter(listed)
        assert all(counts[w] == common for w in p.answers)
        assert max(n for w, n in counts.items() if w not in p.answers) == rare
    for index in range(30):  # no word of the prompt holds an answer, which would match it as a substring
        p = ruler.prompt("cwe", 8192, None, seed=2, index=index)
        words = set(re.findall(r"\d+\.\s+([a-z]+)", _text(BYTES, p)))
        assert not any(a in w for a in p.answers for w in words if w != a), index


def test_fwe_answers_are_the_three_most_frequent_coded_words_after_the_dots():
    ruler = Ruler(BYTES)
    p = ruler.prompt("fwe", 4096, None, seed=2, index=0)
    text = _text(BYTES, p)
    counts = Counter(text[text.find("coded words. ") : text.rfind("Question:")].split()).most_common(4)
    assert counts[0][0] == "..." and [w for w, _ in counts[1:]] == list(p.answers)


# -------------------------------------------------------------------------------------------- reference solver


def test_the_reference_solver_answers_every_task_and_nothing_once_the_needles_are_removed(tokenizers):
    for name, tokenizer in tokenizers.items():
        ruler = Ruler(tokenizer)
        for task in TASKS:
            depths = (0.0, 0.5, 1.0) if TASKS[task].has_depth else (None,)
            for length in _lengths(task):
                for depth in depths:
                    p = ruler.prompt(task, length, depth, seed=5, index=0)
                    assert score(p, solve(task, _text(tokenizer, p))) == 1.0, (name, task, length, depth)
                    control = ruler.prompt(task, length, depth, seed=5, index=0, control=True)
                    text = _text(tokenizer, control).lower()
                    assert control.length == length and control.answers == p.answers
                    assert not any(a.lower() in text for a in control.answers), (name, task, length, depth)
                    assert score(control, solve(task, _text(tokenizer, control))) <= 0.05, (name, task, length)


def test_the_chat_hook_wraps_the_user_message_and_the_answer_prefix_follows_it():
    ruler = Ruler(BYTES, chat=lambda message: f"<|user|>\n{message}<|end|>\n<|assistant|>\n")
    for task in TASKS:
        p = ruler.prompt(task, _lengths(task)[-1], _depth(task), seed=1, index=0)
        text = _text(BYTES, p)
        assert text.startswith("<|user|>\n") and text.endswith("<|end|>\n<|assistant|>\n" + p.answer_prefix)
        assert p.length == _lengths(task)[-1] and score(p, solve(task, text)) == 1.0
    with pytest.raises(ValueError, match="chat hook"):
        Ruler(BYTES, chat=lambda message: "hello").prompt("niah_single_1", 1000, 0.5, seed=0, index=0)


def test_a_user_corpus_replaces_the_essay_haystack_and_names_the_variant():
    ruler = Ruler(BYTES, haystack=CORPUS)
    p = ruler.prompt("niah_single_2", 1500, 0.5, seed=0, index=0)
    text = _text(BYTES, p)
    assert p.name == "niah_single_2/corpus" and p.length == 1500 and "Farmers bring grain in autumn! Who" in text
    assert score(p, solve("niah_single_2", text)) == 1.0
    control = ruler.prompt("niah_single_2", 1500, 0.5, seed=0, index=0, control=True)
    assert (
        p.answers[0] not in _text(BYTES, control) and score(control, solve("niah_single_2", _text(BYTES, control))) == 0
    )
    assert ruler.prompt("niah_single_1", 1500, 0.5, seed=0, index=0).name == "niah_single_1"  # published on noise
    assert Ruler(BYTES).prompt("niah_single_2", 1500, 0.5, seed=0, index=0).name == "niah_single_2/noise"
    assert Ruler(BYTES).prompt("niah_multikey_2", 1500, 0.5, seed=0, index=0).name == "niah_multikey_2"


# ---------------------------------------------------------------------------------------------------- scoring


def test_string_match_all_counts_each_reference_found_case_insensitive_in_any_order():
    assert string_match_all("1234567 and 7654321", ["7654321", "1234567"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert string_match_all("1. APPLE 2. Pear", ["apple", "pear", "plum", "fig"]) == 0.5
    assert string_match_all("nothing here", ["apple"]) == 0.0
    assert string_match_all("", ["apple"]) == 0.0
    assert postprocess("  a\tb\x00c \n") == "a\nb\nc"


def test_score_reads_the_continuation_after_the_answer_prefix():
    p = Ruler(BYTES).prompt("niah_multivalue", 1500, 0.5, seed=0, index=0)
    assert score(p, ": " + ", ".join(p.answers) + ".") == 1.0
    assert score(p, " " + p.answers[1] + " and " + p.answers[3].upper()) == 0.5
    assert score(p, " I do not know.") == 0.0


# ------------------------------------------------------------------------------------------------ bad inputs


def test_a_length_too_short_is_refused_in_one_line_naming_the_length():
    ruler = Ruler(BYTES)
    for task in TASKS:
        with pytest.raises(ValueError, match=r"`--lengths` 200 is too short") as e:
            ruler.prompt(task, 200, _depth(task), seed=0, index=0)
        assert "\n" not in str(e.value) and task in str(e.value)


def test_depths_are_asked_of_the_needle_tasks_only_and_within_0_1():
    ruler = Ruler(BYTES)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1.5"):
        ruler.prompt("niah_single_1", 1000, 1.5, seed=0, index=0)
    with pytest.raises(ValueError, match="needs `--depths`"):
        ruler.prompt("niah_single_1", 1000, None, seed=0, index=0)
    with pytest.raises(ValueError, match="vt has no needle depth"):
        ruler.prompt("vt", 4096, 0.5, seed=0, index=0)
    with pytest.raises(ValueError, match="unknown RULER task 'qa_1'"):
        ruler.prompt("qa_1", 4096, None, seed=0, index=0)
