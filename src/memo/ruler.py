"""RULER's synthetic long-context tasks generated offline: prompts of an exact token length, RULER's scores, and a
reference solver that reads the prompt text.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv 2404.06654)
is what long-context model cards quote per length. Thirteen tasks; the eleven here need no download: the needle
tasks (`niah_*`: one or several "One of the special magic numbers for <key> is: <value>." in a haystack, the model
asked for the values of one or several keys), variable tracking (`vt`: follow `VAR B = VAR A` chains back to a
value), common-word extraction (`cwe`: the 10 words of a numbered list that appear most often) and frequent-word
extraction (`fwe`: the three most frequent coded words of a Zipf-distributed text). The two QA tasks need SQuAD and
HotpotQA and are left out; so is their metric (`string_match_part`).

A prompt is a pure function of (task, length, depth, seed, index): its draws come from
`np.random.default_rng([crc32(task), seed, length, index, depth in millionths])`. It holds exactly `length` token
ids: the user message (few-shot example, template and context, wrapped by the `chat` hook when one is given), then
RULER's answer prefix; the model's continuation is the prediction. The context is built from pieces tokenised
once (haystack units, needles, list entries); its last unit is cut at a token to fill the length exactly. Depth is
relative to the haystack tokens: depth 0 opens the context, depth 1 comes right before the question.

Scoring is RULER's (scripts/eval/evaluate.py `postprocess_pred`, scripts/eval/synthetic/constants.py
`string_match_all`): the fraction of references found, case-insensitive, anywhere in the prediction, per sample.
`solve` answers every task from the decoded prompt text; with `control=True` the answers' carriers are left out
(needles, the chain, the common or frequent words replaced by others), and it finds nothing.

Read before writing (github.com/NVIDIA/RULER): scripts/synthetic.yaml (the tasks' settings),
scripts/data/synthetic/constants.py (templates, answer prefixes, tokens to generate), scripts/data/synthetic/niah.py,
variable_tracking.py, common_words_extraction.py, freq_words_extraction.py (the generators),
scripts/data/prepare.py (template + answer prefix, model templates), scripts/pred/call_api.py (the model is given
input + answer prefix), scripts/eval/evaluate.py and scripts/eval/synthetic/constants.py (scoring). The generators
here are memo's own code written from those task definitions.

Where this differs from RULER, and why:
- Length: `length` counts every id the model is given (template and answer prefix included) and is met exactly.
  RULER keeps prompt + tokens_to_generate <= max_seq_length with whole haystack units, so its column "4K" holds
  prompts of up to 4096 - tokens_to_generate tokens: ask for that length to compare.
- Depth: the needle carrying the first answer sits at the unit boundary nearest `depth`; other needles (other keys,
  values, queried keys) at distinct seeded random boundaries. RULER draws every needle's depth at random.
- Haystack: the Paul Graham essays RULER downloads for five needle tasks are not available offline: those tasks use
  the built-in noise haystack, or a user corpus (`Ruler(haystack=...)`), and say so in their name
  (`niah_single_2/noise`, `niah_single_2/corpus`). Corpus sentences join with spaces as RULER joins essay sentences
  (the first keeps its space after the template's newline).
- Words: RULER draws keys and CWE words from wonderwords' noun, adjective and verb lists and, past their size, from
  its english_words.json. Here they come from memo's own lists (ruler_data/*.txt, about 2,400 common English words
  written for memo); past them CWE uses compounds of two listed words ("oaklantern").
- Distinct draws: keys and values never repeat within a prompt (haystack needles included); no CWE word contains a
  common word, so a listed word can never match a reference by substring. RULER draws independently.
- Few-shot examples sit inside the user message, so a chat hook wraps the prompt once (RULER's CWE repeats its model
  template around the example). VT's example is sized to about 500 tokens (at least 5 noise lines) as RULER's; its
  variables and value are drawn fresh rather than substituted into a generated example.
- CWE and FWE fill the length with the most words that fit, then words that appear once (never an answer), the last
  cut at a token; RULER searches for a word count and stops below the limit.
- Pieces are tokenised apart (a piece starting with a space loses it for tokenizers that start every piece with a
  word boundary, as `eval.PasskeyTask` does), so the ids can differ from tokenising the decoded text at the joins:
  the model sees the ids, the solver reads their decoding.
- Seeds: numpy's generator per prompt, not Python's `random` with one seed per run: the prompts are draws from
  RULER's task distributions, not RULER's own samples.

The prompt templates, answer prefixes, noise sentence and needle sentence below are RULER's, reproduced verbatim as
benchmark data. Copyright (c) 2024, NVIDIA CORPORATION. Licensed under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0); distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF
ANY KIND. Changes: the singular needle template is written out (RULER derives it by string replacement), and the
answer prefixes are kept apart from the templates as in RULER's constants.py.
"""

from __future__ import annotations

import itertools
import math
import re
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

# --------------------------------------------------------------- RULER's prompt text (Apache-2.0, NVIDIA: see above)

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for "
    "{query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# one key asked, one value: RULER's niah.py rewrites Some -> A, are all -> is, are -> is and drops the plural "s"
NIAH_TEMPLATE_ONE = (
    "A special magic {type_needle_v} is hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\nWhat is the special magic {type_needle_v} for "
    "{query} mentioned in the provided text?"
)
NIAH_PREFIX_ONE = " The special magic {type_needle_v} for {query} mentioned in the provided text is"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
VT_VALUE = "VAR {var} = {value}"
VT_LINK = "VAR {var} = VAR {source} "  # RULER's links end with a space

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}

# ------------------------------------------------------------------ the tasks' settings (scripts/synthetic.yaml)

VT_HOPS = 4  # one chain of 4 hops: 5 variables
VT_EXAMPLE_TOKENS = 500  # RULER sizes its few-shot example for max_seq_length 500
CWE_COMMON = 10
CWE_SHORT = 4096  # below this max_seq_length RULER's CWE uses smaller counts
CWE_COUNTS = {False: ((40, 10, 3), (30, 3)), True: ((20, 3, 1), (6, 1))}  # short: (example words, its counts), ours
FWE_ALPHA = 2.0
FWE_WORD = 6  # letters of a coded word
FWE_VOCAB = 50  # tokens per vocabulary word: RULER's vocab_size = max_seq_length // 50

CONTEXT = "\x00RULER-CONTEXT\x00"  # stands for the context while the template is wrapped and split


@dataclass(frozen=True, kw_only=True)
class RulerTask:
    """One task of RULER's scripts/synthetic.yaml: its generator (`family`, RULER's script), the haystack it was
    published with and, for the needle tasks, what the needles hold and how many are asked."""

    name: str
    family: str  # niah, variable_tracking, common_words_extraction, freq_words_extraction
    haystack: str | None = None  # noise, essay or needle; None for cwe and fwe
    keys: str = "words"  # words or uuids
    values: str = "numbers"  # numbers or uuids
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    @property
    def tokens_to_generate(self) -> int:
        return TOKENS_TO_GENERATE[self.family]

    @property
    def has_depth(self) -> bool:
        """Whether prompts take a needle depth: the needle tasks do, vt, cwe and fwe do not."""
        return self.family == "niah"


TASKS = {
    t.name: t
    for t in (
        RulerTask(name="niah_single_1", family="niah", haystack="noise"),
        RulerTask(name="niah_single_2", family="niah", haystack="essay"),
        RulerTask(name="niah_single_3", family="niah", haystack="essay", values="uuids"),
        RulerTask(name="niah_multikey_1", family="niah", haystack="essay", num_keys=4),
        RulerTask(name="niah_multikey_2", family="niah", haystack="needle"),
        RulerTask(name="niah_multikey_3", family="niah", haystack="needle", keys="uuids", values="uuids"),
        RulerTask(name="niah_multivalue", family="niah", haystack="essay", num_values=4),
        RulerTask(name="niah_multiquery", family="niah", haystack="essay", num_queries=4),
        RulerTask(name="vt", family="variable_tracking", haystack="noise"),
        RulerTask(name="cwe", family="common_words_extraction"),
        RulerTask(name="fwe", family="freq_words_extraction"),
    )
}


class Tokenizer(Protocol):
    """What prompts need of a tokenizer (memo's `TextTokenizer`: bytes or a tokenizer.json)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True, kw_only=True)
class RulerPrompt:
    """One prompt: the ids the model is given (the answer prefix last), what a right continuation holds, and where
    the needles are, as spans [start, end) of `ids`."""

    task: str
    haystack: str | None  # the haystack used: noise, needle, corpus; None for cwe and fwe
    ids: np.ndarray  # (length,) int64
    answers: tuple[str, ...]
    tokens_to_generate: int
    answer_prefix: str
    context: tuple[int, int]  # the context (haystack, needles, list) between the template's head and its question
    needles: tuple[tuple[int, int], ...]  # needles (niah) or chain lines (vt), in prompt order
    target: int | None  # which of `needles` sits at `depth`; None without a depth or in a control
    depth: float | None
    seed: int
    index: int
    control: bool

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def name(self) -> str:
        """The task, with the haystack when it is not the one RULER published: "niah_single_2/noise"."""
        published = TASKS[self.task].haystack
        return self.task if self.haystack == published else f"{self.task}/{self.haystack}"


@dataclass(frozen=True, kw_only=True)
class _Parts:
    """What a generator builds: the ids before, of and after the context, and the needles' spans in the context
    (in needle order; `target` the one at the depth)."""

    head: np.ndarray
    context: np.ndarray
    tail: np.ndarray
    answers: Sequence[str]
    answer_prefix: str
    spans: Sequence[tuple[int, int]] = ()
    target: int | None = None
    haystack: str | None = None


class Ruler:
    """RULER prompts for one tokenizer. `haystack` (a text or its sentences) replaces the essay haystack; `chat`
    wraps a user message in a chat template (memo.chat's renderer with a generation prompt), RULER's answer prefix
    then follows it as RULER appends it after its model template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        haystack: str | Sequence[str] | None = None,
        chat: Callable[[str], str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat = chat
        self.corpus = None if haystack is None else _sentences(haystack)
        # a tokenizer that starts every piece with a word boundary (sentencepiece's "▁") spells a leading space itself
        self._spaced = tokenizer.decode(tokenizer.encode("a") + tokenizer.encode("b")) == "a b"
        self._pieces: dict[str, np.ndarray] = {}

    def prompt(
        self, task: str, length: int, depth: float | None, seed: int, index: int, control: bool = False
    ) -> RulerPrompt:
        """Returns prompt `index` of `task` with exactly `length` ids; `depth` in [0, 1] for the needle tasks, None
        for the others. `control` leaves out what carries the answers. Raises ValueError for a length too short."""
        spec = _check(task, length, depth, seed, index)
        rng = _rng(task, length, depth, seed, index)
        build = {
            "niah": self._niah,
            "variable_tracking": self._vt,
            "common_words_extraction": self._cwe,
            "freq_words_extraction": self._fwe,
        }[spec.family]
        parts = build(spec, length, depth, rng, control)
        ids = np.concatenate((parts.head, parts.context, parts.tail)).astype(np.int64)
        spans = [(len(parts.head) + a, len(parts.head) + b) for a, b in parts.spans]
        return RulerPrompt(
            task=task,
            haystack=parts.haystack,
            ids=ids,
            answers=tuple(parts.answers),
            tokens_to_generate=spec.tokens_to_generate,
            answer_prefix=parts.answer_prefix,
            context=(len(parts.head), len(parts.head) + len(parts.context)),
            needles=tuple(sorted(spans)),
            target=None if parts.target is None else sorted(spans).index(spans[parts.target]),
            depth=depth,
            seed=seed,
            index=index,
            control=control,
        )

    # --------------------------------------------------------------------------------------------- generators

    def _niah(
        self, spec: RulerTask, length: int, depth: float | None, rng: np.random.Generator, control: bool
    ) -> _Parts:
        """Needles "One of the special magic numbers for <key> is: <value>." in a haystack; the question asks for
        the values of `num_queries` keys (scripts/data/synthetic/niah.py)."""
        used: set[str] = set()
        keys = [_draw(spec.keys, rng, used) for _ in range(max(spec.num_keys, spec.num_queries))]
        values = [[_draw(spec.values, rng, used) for _ in range(spec.num_values)] for _ in keys]
        asked = [int(i) for i in rng.choice(len(keys), spec.num_queries, replace=False)]
        answers = [v for i in asked for v in values[i]]
        one = spec.num_queries * spec.num_values == 1
        noun = spec.values[:-1] if one else spec.values
        query = _and([keys[i] for i in asked])
        template, prefix = (NIAH_TEMPLATE_ONE, NIAH_PREFIX_ONE) if one else (NIAH_TEMPLATE, NIAH_PREFIX)
        haystack = spec.haystack
        if haystack == "essay":
            haystack = "corpus" if self.corpus else "noise"
        sep = " " if haystack == "corpus" else "\n"
        pairs = [(k, v) for k, vs in zip(keys, values) for v in vs if not (control and v in answers)]
        pairs.sort(key=lambda p: p[1] != answers[0])  # the needle that goes to `depth` first
        needles = [
            self._piece(sep + NEEDLE.format(type_needle_v=spec.values, key=k, value=v), keep=False) for k, v in pairs
        ]
        answer_prefix = prefix.format(type_needle_v=noun, query=query)
        head, tail = self._frame(template.format(type_needle_v=noun, context=CONTEXT, query=query), answer_prefix, sep)
        units = _fill(self._room(spec, length, head, tail, needles), self._hay(haystack, spec, rng, used))
        slots = _depth_slots(units, len(needles), None if control else depth, rng, spec.name, length)
        context, spans = _weave(units, needles, slots)
        return _Parts(
            head=head,
            context=context,
            tail=tail,
            answers=answers,
            answer_prefix=answer_prefix,
            spans=spans,
            target=None if control else 0,
            haystack=haystack,
        )

    def _vt(self, spec: RulerTask, length: int, depth: float | None, rng: np.random.Generator, control: bool) -> _Parts:
        """A chain VAR A = 12345, VAR B = VAR A, ... hidden line by line in noise; the answer is every variable
        that holds the value. A solved example comes first (scripts/data/synthetic/variable_tracking.py)."""
        used: set[str] = set()
        example = self._vt_example(rng, used)
        names = [_letters(rng, 5, used, upper=True) for _ in range(VT_HOPS + 1)]
        value = _fresh(lambda: str(rng.integers(10_000, 99_999)), used)
        needles = [] if control else [self._piece("\n" + line, keep=False) for line in _chain(names, value)]
        answer_prefix = VT_PREFIX.format(num_v=len(names), query=value)
        message = example + "\n" + VT_TEMPLATE.format(context=CONTEXT, query=value)
        head, tail = self._frame(message, answer_prefix, "\n")
        units = _fill(self._room(spec, length, head, tail, needles), itertools.repeat(self._piece("\n" + NOISE)))
        context, spans = _weave(units, needles, _ordered_slots(units, len(needles), rng, spec.name, length))
        return _Parts(
            head=head,
            context=context,
            tail=tail,
            answers=names,
            answer_prefix=answer_prefix,
            spans=spans,
            haystack="noise",
        )

    def _vt_example(self, rng: np.random.Generator, used: set[str]) -> str:
        """Returns VT's solved example: 3-letter variables, about VT_EXAMPLE_TOKENS tokens, its answer, a newline."""
        names = [_letters(rng, 3, used, upper=True) for _ in range(VT_HOPS + 1)]
        value = _fresh(lambda: str(rng.integers(10_000, 99_999)), used)
        chain = _chain(names, value)
        text = VT_TEMPLATE.format(context=CONTEXT, query=value) + VT_PREFIX.format(num_v=len(names), query=value)
        fixed = len(self.tokenizer.encode(text.replace(CONTEXT, "\n".join(chain))))
        lines = [NOISE] * max(len(chain), (VT_EXAMPLE_TOKENS - fixed) // len(self._piece("\n" + NOISE)))
        for j, at in enumerate(sorted(rng.choice(len(lines) + 1, len(chain), replace=False))):
            lines.insert(at + j, chain[j])
        return text.replace(CONTEXT, "\n".join(lines)) + " " + " ".join(names) + "\n"

    def _cwe(
        self, spec: RulerTask, length: int, depth: float | None, rng: np.random.Generator, control: bool
    ) -> _Parts:
        """A numbered list where 10 words appear often (30 times; 6 below RULER's 4K) and the rest a few times (3;
        1), after a solved smaller example (scripts/data/synthetic/common_words_extraction.py)."""
        short = length + spec.tokens_to_generate < CWE_SHORT
        (n_example, example_common, example_rare), (n_common, n_rare) = CWE_COUNTS[short]
        words = _word_stream(rng)
        common = _unrelated(words, CWE_COMMON)
        decoys = _unrelated(words, CWE_COMMON, common) if control else []
        stream = (w for w in words if not any(c in w for c in common))
        example = [next(stream) for _ in range(n_example)]
        shown = example[:CWE_COMMON] * example_common + example[CWE_COMMON:] * example_rare
        shot = CWE_TEMPLATE.format(context=_numbered([shown[i] for i in rng.permutation(len(shown))]))
        message = (
            shot + CWE_PREFIX + " " + _numbered(example[:CWE_COMMON]) + "\n" + CWE_TEMPLATE.format(context=CONTEXT)
        )
        head, tail = self._frame(message, CWE_PREFIX, "")
        room = length - len(head) - len(tail)
        listed = (decoys or common) * n_common
        cost = sum(len(self._word(w)) + len(self._number(i)) for i, w in enumerate(listed, 1))
        while True:  # one more word that appears n_rare times while it fits
            word = next(stream)
            more = sum(len(self._word(word)) + len(self._number(len(listed) + j)) for j in range(1, n_rare + 1))
            if cost + more > room:
                break
            listed += [word] * n_rare
            cost += more
        if len(listed) == CWE_COMMON * n_common:
            raise ValueError(
                f"`--lengths` {length} is too short for {spec.name}: its example, template and common words take "
                f"{length - room + cost} tokens"
            )
        entries = itertools.chain((listed[i] for i in rng.permutation(len(listed))), [word], stream)  # then once each
        pieces = (p for i, w in enumerate(entries, 1) for p in (self._number(i), self._word(w)))
        context, _ = _weave(_fill(room, pieces), [], [])
        return _Parts(head=head, context=context, tail=tail, answers=common, answer_prefix=CWE_PREFIX)

    def _fwe(
        self, spec: RulerTask, length: int, depth: float | None, rng: np.random.Generator, control: bool
    ) -> _Parts:
        """Coded words drawn from a Zipf law of exponent 2 ("..." the most frequent, to ignore); the answer is the
        next three (scripts/data/synthetic/freq_words_extraction.py)."""
        size = length // FWE_VOCAB
        if size < 5:
            raise ValueError(f"`--lengths` {length} is too short for {spec.name}: it needs {5 * FWE_VOCAB} tokens")
        used: set[str] = set()
        vocab = ["..."] + [_letters(rng, FWE_WORD, used) for _ in range(size - 1)]
        shown = vocab[:1] + [_letters(rng, FWE_WORD, used) for _ in range(3)] + vocab[4:] if control else vocab
        head, tail = self._frame(FWE_TEMPLATE.format(context=CONTEXT), FWE_PREFIX, " ")
        room = length - len(head) - len(tail)
        pieces = [self._piece(" " + w, keep=False) for w in shown]
        counts = _zipf_counts(room, np.array([len(p) for p in pieces]))
        if not counts[3] > max(counts[4], 1):  # the third answer must beat every other word and the fillers
            raise ValueError(
                f"`--lengths` {length} is too short for {spec.name}: its {int(counts.sum())} words do not single out "
                "three most frequent"
            )
        order = rng.permutation(np.repeat(np.arange(size), counts))
        once = (self._piece(" " + _letters(rng, FWE_WORD, used), keep=False) for _ in itertools.count())
        context, _ = _weave(_fill(room, itertools.chain((pieces[i] for i in order), once)), [], [])
        return _Parts(head=head, context=context, tail=tail, answers=vocab[1:4], answer_prefix=FWE_PREFIX)

    # ------------------------------------------------------------------------------------------------- pieces

    def _hay(self, haystack: str, spec: RulerTask, rng: np.random.Generator, used: set[str]) -> Iterator[np.ndarray]:
        """Returns the haystack's units: noise lines, corpus sentences, or needles with keys and values never used."""
        if haystack == "noise":
            return itertools.repeat(self._piece("\n" + NOISE))
        if haystack == "corpus":
            return (self._piece(" " + s) for s in itertools.cycle(self.corpus))
        return (
            self._piece("\n" + NEEDLE.format(type_needle_v=spec.values, key=k, value=v), keep=False)
            for k, v in ((_draw(spec.keys, rng, used), _draw(spec.values, rng, used)) for _ in itertools.count())
        )

    def _frame(self, message: str, answer_prefix: str, sep: str) -> tuple[np.ndarray, np.ndarray]:
        """Returns the ids before and after the context: the user message, chat-wrapped, split where the context
        goes (less the separator the context's units begin with), then the answer prefix."""
        text = self.chat(message) if self.chat else message
        if text.count(CONTEXT) != 1:
            raise ValueError("the chat hook must return the user message it is given, once and unchanged")
        head, tail = text.split(CONTEXT)
        head = head[: -len(sep)] if sep and head.endswith(sep) else head
        return self._encode(head), self._encode(tail + answer_prefix)

    def _room(self, spec: RulerTask, length: int, head: np.ndarray, tail: np.ndarray, needles: list) -> int:
        """Returns the haystack tokens a prompt of `length` holds beside the frame and the needles."""
        room = length - len(head) - len(tail) - sum(len(n) for n in needles)
        if room < 0:
            raise ValueError(
                f"`--lengths` {length} is too short for {spec.name}: its template and needles take "
                f"{length - room} tokens"
            )
        return room

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def _piece(self, text: str, keep: bool = True) -> np.ndarray:
        """Returns the ids of `text` as a piece of running text (a leading space left to tokenizers that spell it
        themselves); `keep` caches those of pieces that recur."""
        if text in self._pieces:
            return self._pieces[text]
        ids = self._encode(text[1:] if self._spaced and text.startswith(" ") else text)
        if keep:
            self._pieces[text] = ids
        return ids

    def _word(self, word: str) -> np.ndarray:
        return self._piece(" " + word)

    def _number(self, i: int) -> np.ndarray:
        """Returns the ids of list entry i's number: "1." opens the list, " 2." and on follow a word."""
        return self._piece("1." if i == 1 else f" {i}.")


# ------------------------------------------------------------------------------------------------ scoring


def postprocess(prediction: str) -> str:
    """Returns the prediction as RULER scores it: stripped, control characters made newlines (evaluate.py)."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Returns the fraction of `references` found in `prediction`, case-insensitive, in any order: RULER's metric for
    every offline task, per sample in [0, 1] (RULER averages it over samples as a percentage)."""
    found = prediction.lower()
    return sum(r.lower() in found for r in references) / len(references)


def score(prompt: RulerPrompt, prediction: str) -> float:
    """Returns the score of `prediction`, the model's continuation of `prompt` (after its answer prefix)."""
    return string_match_all(postprocess(prediction), prompt.answers)


# ------------------------------------------------------------------------------------------ reference solver


def solve(task: str, text: str) -> str:
    """Returns the right continuation of a prompt's decoded `text`, read from the text alone: the needle values of
    the asked keys, the variables of the chain, the most frequent words. Empty when the text holds no answer."""
    family = TASKS[task].family
    return {
        "niah": _solve_niah,
        "variable_tracking": _solve_vt,
        "common_words_extraction": _solve_cwe,
        "freq_words_extraction": _solve_fwe,
    }[family](text)


def _solve_niah(text: str) -> str:
    question = list(re.finditer(r"What (?:is|are all) the special magic \w+ for (.+?) mentioned in the", text))[-1]
    asked = re.split(r",? and |, ", question.group(1))
    found = re.findall(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.", text[: question.start()])
    values = [v for key in asked for k, v in found if k == key]
    return " " + ", ".join(values) + "." if values else ""


def _solve_vt(text: str) -> str:
    main = text[text.rfind("Memorize and track the chain(s)") :]  # after the solved example
    question = re.search(r"assigned the value (\d+) in the text above", main)
    context = main[: question.start()]
    names = [v for v, value in re.findall(r"VAR (\w+) = (\d+)", context) if value == question.group(1)]
    links = re.findall(r"VAR (\w+) = VAR (\w+)", context)
    grew = True
    while grew:
        new = [v for v, source in links if source in names and v not in names]
        names += new
        grew = bool(new)
    return " ".join(names)


def _solve_cwe(text: str) -> str:
    start = text.rfind("Below is a numbered list of words.")
    listed = re.findall(r"\d+\.\s+([a-z]+)", text[start : text.find("Question:", start)])
    top = [w for w, _ in Counter(listed).most_common(CWE_COMMON)]
    return " " + _numbered(top)


def _solve_fwe(text: str) -> str:
    header = "Find the three most frequently appeared coded words."
    start = text.rfind(header) + len(header)
    coded = [w for w in text[start : text.find("Question:", start)].split() if w.strip(".")]
    return " " + ", ".join(w for w, _ in Counter(coded).most_common(3))


# ----------------------------------------------------------------------------------------- layout helpers


def _fill(room: int, units: Iterator[np.ndarray]) -> list[np.ndarray]:
    """Returns units from `units` of exactly `room` tokens in all: whole units, the last cut to fit."""
    taken, total = [], 0
    while total < room:
        taken.append(next(units))
        total += len(taken[-1])
    if total > room:
        taken[-1] = taken[-1][: len(taken[-1]) - (total - room)]
    return taken


def _weave(units: list[np.ndarray], needles: list[np.ndarray], slots: list[int]) -> tuple[np.ndarray, list]:
    """Returns the units with needle i before unit slots[i] (len(units): after the last), and each needle's span."""
    at = {slot: i for i, slot in enumerate(slots)}
    pieces, spans, end = [], [(0, 0)] * len(needles), 0
    for slot in range(len(units) + 1):
        if slot in at:
            needle = needles[at[slot]]
            spans[at[slot]] = (end, end + len(needle))
            pieces.append(needle)
            end += len(needle)
        if slot < len(units):
            pieces.append(units[slot])
            end += len(units[slot])
    return np.concatenate(pieces or [np.zeros(0, np.int64)]), spans


def _depth_slots(
    units: list, n: int, depth: float | None, rng: np.random.Generator, task: str, length: int
) -> list[int]:
    """Returns distinct slots (unit boundaries) for n needles: the first at the boundary nearest `depth` of the
    haystack tokens (random without a depth), the others random."""
    _enough(units, n, task, length)
    if n == 0:
        return []
    if depth is None:
        return [int(s) for s in rng.choice(len(units) + 1, n, replace=False)]
    bounds = np.cumsum([0] + [len(u) for u in units])
    first = int(np.abs(bounds - depth * bounds[-1]).argmin())
    others = [s for s in range(len(units) + 1) if s != first]
    return [first] + [int(s) for s in rng.choice(others, n - 1, replace=False)]


def _ordered_slots(units: list, n: int, rng: np.random.Generator, task: str, length: int) -> list[int]:
    """Returns distinct random slots for n needles, in increasing order (a chain keeps its order)."""
    _enough(units, n, task, length)
    return sorted(int(s) for s in rng.choice(len(units) + 1, n, replace=False))


def _enough(units: list, n: int, task: str, length: int) -> None:
    if len(units) + 1 < n:
        raise ValueError(
            f"`--lengths` {length} is too short for {task}: its haystack has no room for {n} needles apart"
        )


def _zipf_counts(room: int, sizes: np.ndarray) -> np.ndarray:
    """Returns how often each vocabulary word appears, int(n k^-alpha / zeta(alpha)) for rank k, for the largest n
    whose words fit in `room` tokens (RULER's freq_words_extraction.py counts)."""
    share = np.arange(1, len(sizes) + 1) ** -FWE_ALPHA / (math.pi**2 / 6)  # zeta(2)
    counts = lambda n: (n * share).astype(np.int64)
    lo, hi = 0, 1
    while counts(hi) @ sizes <= room:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if counts(mid) @ sizes <= room else (lo, mid)
    return counts(lo)


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def _and(keys: Sequence[str]) -> str:
    """Returns "a", or "a, b, and c" as RULER's niah.py joins the asked keys."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _chain(names: Sequence[str], value: str) -> list[str]:
    return [VT_VALUE.format(var=names[0], value=value)] + [
        VT_LINK.format(var=b, source=a) for a, b in itertools.pairwise(names)
    ]


def _sentences(haystack: str | Sequence[str]) -> list[str]:
    """Returns a corpus as sentences, whitespace collapsed: a text is split after . ! or ?."""
    parts = re.split(r"(?<=[.!?])\s+", haystack) if isinstance(haystack, str) else haystack
    sentences = [" ".join(p.split()) for p in parts if p.strip()]
    if not sentences:
        raise ValueError("the haystack corpus holds no text")
    return sentences


def _check(task: str, length: int, depth: float | None, seed: int, index: int) -> RulerTask:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: choose from {', '.join(TASKS)}")
    spec = TASKS[task]
    if length < 1:
        raise ValueError(f"`--lengths` must be positive, got {length}")
    if spec.has_depth and (depth is None or not 0 <= depth <= 1):
        raise ValueError(f"{task} needs `--depths` in [0, 1], got {depth}")
    if not spec.has_depth and depth is not None:
        raise ValueError(f"{task} has no needle depth: give None, got {depth}")
    if seed < 0 or index < 0:
        raise ValueError(f"`--seed` and the prompt index must be non-negative, got {seed} and {index}")
    return spec


# ---------------------------------------------------------------------------------------------------- draws


def _rng(task: str, length: int, depth: float | None, seed: int, index: int) -> np.random.Generator:
    where = [zlib.crc32(task.encode()), seed, length, index]
    return np.random.default_rng(where + ([] if depth is None else [round(depth * 1_000_000)]))


def _fresh(draw: Callable[[], str], used: set[str]) -> str:
    """Returns the first draw not in `used`, and adds it."""
    while (value := draw()) in used:
        pass
    used.add(value)
    return value


def _draw(kind: str, rng: np.random.Generator, used: set[str]) -> str:
    """Returns a fresh key or value: an adjective-noun pair, a 7-digit number or a UUID (RULER's niah.py kinds)."""
    adjectives, nouns = _words("adjectives"), _words("nouns")
    draws = {
        "words": lambda: f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}",
        "numbers": lambda: str(rng.integers(1_000_000, 10_000_000)),
        "uuids": lambda: str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4)),
    }
    return _fresh(draws[kind], used)


def _letters(rng: np.random.Generator, k: int, used: set[str], upper: bool = False) -> str:
    """Returns a fresh word of k random letters: VT's variables (upper case), FWE's coded words (lower case)."""
    alphabet = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ" if upper else "abcdefghijklmnopqrstuvwxyz"))
    return _fresh(lambda: "".join(rng.choice(alphabet, k)), used)


def _word_stream(rng: np.random.Generator) -> Iterator[str]:
    """Yields distinct words: the built-in list in a random order, then compounds of two of its words."""
    pool = _pool()
    yield from (pool[i] for i in rng.permutation(len(pool)))
    seen = set(pool)
    while True:
        a, b = rng.integers(len(pool), size=2)
        if a != b and (word := pool[a] + pool[b]) not in seen:
            seen.add(word)
            yield word


def _unrelated(words: Iterator[str], n: int, avoid: Sequence[str] = ()) -> list[str]:
    """Returns the next n words of `words` that neither contain nor lie inside one another or a word of `avoid`."""
    chosen: list[str] = []
    for word in words:
        if not any(word in c or c in word for c in [*avoid, *chosen]):
            chosen.append(word)
            if len(chosen) == n:
                return chosen
    raise AssertionError("the word stream is endless")


@cache
def _words(name: str) -> tuple[str, ...]:
    """Returns a built-in word list (ruler_data/<name>.txt: memo's own, one word a line)."""
    return tuple((Path(__file__).with_name("ruler_data") / f"{name}.txt").read_text().split())


@cache
def _pool() -> tuple[str, ...]:
    """Returns CWE's words: the nouns, adjectives and verbs, each once, sorted."""
    return tuple(sorted({*_words("nouns"), *_words("adjectives"), *_words("verbs")}))
