"""Long-context evaluation of a trained model: pass-key retrieval and held-out loss by token position.

Pass key (the "needle in a haystack" of Mohtashami & Jaggi's Landmark Attention paper): a prompt of exactly
`length` tokens is filler text with one needle, "The pass key is 68231. Remember it.", at a relative depth,
then "What is the pass key? The pass key is"; the model's greedy continuation is right when its first run of
digits is the key. Filler sentences are drawn from a small built-in pool rather than from the tokenizer's
vocabulary: they read as text to a pretrained model (random tokens are noise it never saw), every tokenizer
(bytes or a tokenizer.json) spells them, and none holds a digit, so the key is the only number in the prompt.
Every prompt is a pure function of (seed, length, depth, trial): a cell's prompts do not depend on which
other cells were asked for.

Packed pass key (`pack` > 1): that many prompts of a cell share one sequence, each its own document (it attends
only to itself, its positions count from 0), so the model sees what it sees for one prompt alone. Greedy decoding
stays exact: each forward also feeds every prompt its expected answer after what it has decoded so far and keeps the
argmax of each fed row while the answer agrees with it (speculative decoding's check, the answer as draft), so a
prompt answered as expected takes one forward and one that leaves the answer is decoded on, token by token, from
where it left it. The verdict is then the same rule on the same tokens as for the prompt alone (up to rounding:
the masked forward may run another attention kernel, which can matter only where two logits all but tie).

Loss by position: a held-out file is packed as training packs it. Documents concatenated (`concat`) are scored by
a token's index in its sequence; with documents masked (`mask`: each attends only to itself) by its position in
its document, the context it had (a document cut by a sequence boundary starts again there, as the model sees
it), so buckets past the longest document hold no token and are left out.

Decoding and the loss never build the s × V logits: only the rows that are read (decoding) or a chunk of rows
(loss) are multiplied by the head weight. Everything runs under `torch.inference_mode`, so the layers take
their no-grad path, without the activation store.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import device as dev
from .figures import plot_heatmap
from .flags import flag
from .hf import CONFIG_NAME, from_hf
from .lora import merge_adapters
from .loss import IGNORE_INDEX, shift_labels
from .model import Transformer
from .ruler import TASKS
from .ruler_eval import RulerCell, task_names
from .ruler_eval import table as ruler_table
from .train import checkpoint
from .train.config import BEFORE_PACKING, check_inputs
from .train.data import (
    LONG_CONVERSATIONS,
    MAX_DOCUMENTS,
    PACKINGS,
    TOKEN_SUFFIXES,
    TextTokenizer,
    TokenDataset,
    check_vocab,
    holds_conversations,
    load_tokenizer,
    token_dataset,
)
from .units import format_bytes, format_count, parse_length, parse_size

TOKENIZER_NAME = "tokenizer.json"
FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "A river runs through the quiet valley.",
    "The old bridge creaks in the wind.",
    "Birds sing at the edge of the forest.",
    "The baker opens the shop before dawn.",
    "Clouds drift slowly over the hills.",
    "A cat sleeps on the warm windowsill.",
    "The library smells of paper and dust.",
    "Rain taps gently on the roof.",
    "The train leaves the station on time.",
    "Children play in the park after school.",
    "The lighthouse keeps watch over the bay.",
    "Snow covers the mountain in winter.",
    "The market is busy in the morning.",
    "A gardener waters the roses.",
    "The moon rises above the sea.",
)
NEEDLE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key? The pass key is"
EXTRAPOLATION = 64  # lengths up to this many times the longest a model's positions know: far past what RoPE studies try

Progress = Callable[[int], object]


def _no_progress(n: int) -> None:
    pass


@dataclass(frozen=True)
class Defaults:
    """What `memo eval` measures unless told: a grid a small model finishes in minutes on the device: a CPU gets
    short prompts and few trials, and only part of a long held-out file."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    max_sequences: int


DEFAULTS = {
    "cpu": Defaults((1024, 4096), (0.0, 0.5, 1.0), 2, 16),
    "cuda": Defaults((1024, 4096, 16384), (0.0, 0.25, 0.5, 0.75, 1.0), 4, 256),
}


def defaults(device: torch.device) -> Defaults:
    """Returns the defaults for `device`: the GPU's on CUDA, the CPU's on anything else."""
    return DEFAULTS["cuda" if device.type == "cuda" else "cpu"]


def _by_device(name: str, show=str) -> str:
    """Returns a default that depends on the device, as help text: "256,1K on CPU; 1K,4K,16K on CUDA"."""
    spell = lambda v: ",".join(map(show, v)) if isinstance(v, tuple) else show(v)  # noqa: E731
    cpu, cuda = (getattr(DEFAULTS[kind], name) for kind in ("cpu", "cuda"))
    return f"{spell(cpu)} on CPU; {spell(cuda)} on CUDA"


CHAT_CHOICES = ("auto", "on", "off")


def numbers(text: str) -> tuple[float, ...]:
    """Returns numbers written separated by commas."""
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"expected numbers separated by commas, got {text!r}") from None


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """`memo eval`'s flags, checked before any work; `lengths`, `depths`, `trials` and `max_sequences` left None
    take the device's defaults (`with_defaults`)."""

    path: str = flag(
        help="a `memo train` run directory, or a Hugging Face folder (config.json + safetensors)",
        path=True,
        positional=True,
    )
    tokenizer: str | None = flag(
        None, "Hugging Face tokenizer.json (default: the run's, the folder's tokenizer.json, else bytes)", path=True
    )
    lengths: tuple[int, ...] | None = flag(
        None,
        f"prompt lengths in tokens (default: {_by_device('lengths', format_count)})",
        parse=lambda text: tuple(parse_length(t) for t in text.split(",")),
    )
    depths: tuple[float, ...] | None = flag(
        None,
        "needle depths in [0, 1]; 0 opens the prompt, 1 ends it before the question "
        f"(default: {_by_device('depths', '{:g}'.format)})",
        parse=numbers,
    )
    tasks: tuple[str, ...] = flag(
        ("passkey",),
        "what to score, separated by commas: passkey, ruler (RULER's 11 offline tasks: memo.ruler) or RULER task "
        "names (default: passkey)",
        parse=lambda text: tuple(t.strip() for t in text.split(",")),
    )
    trials: int | None = flag(
        None,
        f"prompts per length and depth of each task; 0: no pass key (default: {_by_device('trials')})",
        parse=int,
    )
    haystack: str | None = flag(
        None, "a text file whose sentences replace RULER's essay haystack (its own variant of the tasks)", path=True
    )
    chat: str = flag(
        "auto",
        "RULER's prompt as a user turn of the tokenizer's chat template, its answer prefix after the generation "
        "prompt: auto (when the tokenizer's folder has a template), on (required), off (default: %(default)s)",
        choices=CHAT_CHOICES,
    )
    seed: int = flag(0, "seed of keys and filler (default: %(default)s)", parse=int)
    batch_size: int = flag(1, "prompts decoded together (default: %(default)s)", parse=int)
    passkey_pack: int = flag(
        1,
        "pass-key prompts of a cell packed in one sequence, each its own document (it attends only to itself, "
        "positions from 0): the same answers as one at a time, most in one forward (default: %(default)s)",
        parse=int,
    )
    ppl_file: str | None = flag(
        None,
        "held-out text (as --data takes it): loss by position over sequences of max(--lengths); conversations "
        "(`messages`) are scored on the assistant's tokens, as `memo train` trains them",
        path=True,
    )
    long_conversations: str = flag(
        "refuse",
        "conversations of --ppl-file longer than max(--lengths): refuse (an error naming the row) or truncate (keep "
        "their first tokens) (default: %(default)s)",
        choices=LONG_CONVERSATIONS,
    )
    pack_documents: str | None = flag(
        None,
        "how --ppl-file's documents share a sequence, as `memo train --pack-documents`: mask (each attends "
        "only to itself; loss by position within its document) or concat (loss by position in the sequence) "
        "(default: the run's; concat for a run from before the option, mask for a Hugging Face folder)",
        choices=PACKINGS,
    )
    max_sequences: int | None = flag(
        None,
        "score at most this many sequences of --ppl-file, spread evenly over it "
        f"(default: {_by_device('max_sequences')})",
        parse=int,
    )
    bucket_size: int | None = flag(
        None, "positions per loss bucket (default: doubling from 128)", parse=parse_size, name="size"
    )
    device: str = flag("cuda" if torch.cuda.is_available() else "cpu", "(default: %(default)s)")
    dtype: str = flag("float32", "(default: %(default)s)", choices=tuple(dev.DTYPES))
    plot: str | None = flag(
        None,
        "write the pass-key heatmap (length x depth) to this PNG, and each RULER needle task's beside it "
        "(PATH-<task>.png)",
        path=True,
    )

    def with_defaults(self, device: torch.device) -> "EvalRequest":
        """Returns the request with the unset flags at `device`'s defaults, checked (flags given where they cannot
        take effect first: the defaults hide which were given)."""
        for name in ("max_sequences", "bucket_size"):
            if getattr(self, name) is not None and not self.ppl_file:
                raise ValueError(f"`--{name.replace('_', '-')}` applies to the loss by position: give `--ppl-file`")
        if self.depths is not None and self.trials == 0:
            raise ValueError("`--depths` places the needles: it needs `--trials` > 0")
        chosen = defaults(device)
        unset = ("lengths", "depths", "trials", "max_sequences")
        request = dataclasses.replace(
            self, **{name: getattr(chosen, name) for name in unset if getattr(self, name) is None}
        )
        request.check()
        return request

    @property
    def passkey(self) -> bool:
        """Whether the pass key is scored."""
        return "passkey" in self.tasks and self.trials > 0

    @property
    def ruler_tasks(self) -> list[str]:
        """Returns the RULER tasks `--tasks` names (none: RULER is not scored)."""
        return task_names([t for t in self.tasks if t != "passkey"])

    def check(self) -> None:
        if self.ruler_tasks and self.trials == 0:
            raise ValueError("`--tasks` names RULER tasks: they need `--trials` > 0 (prompts per cell)")
        if self.chat == "on" and not self.ruler_tasks:
            raise ValueError("`--chat on` wraps RULER's prompts: give `--tasks ruler`")
        if self.haystack and not self.ruler_tasks:
            raise ValueError("`--haystack` replaces RULER's essay haystack: give `--tasks ruler`")
        if self.haystack and not Path(self.haystack).is_file():
            raise ValueError(f"`--haystack` {self.haystack}: no such file")
        if not (self.passkey or self.ruler_tasks or self.ppl_file):
            raise ValueError("nothing to evaluate: no pass key (`--trials 0` or `--tasks` without it), no `--ppl-file`")
        if self.plot and not (self.passkey or any(TASKS[t].has_depth for t in self.ruler_tasks)):
            raise ValueError("`--plot` draws needle heatmaps: it needs the pass key or a RULER needle task")
        if self.max_sequences < 1:
            raise ValueError(f"`--max-sequences` must be positive, got {self.max_sequences}")
        if self.passkey_pack != 1 and not self.passkey:
            raise ValueError("`--passkey-pack` packs pass-key prompts: it needs `--trials` > 0")
        if self.pack_documents and not self.ppl_file:
            raise ValueError("`--pack-documents` packs the documents of `--ppl-file`: give one")
        if self.long_conversations != "refuse" and not self.ppl_file:
            raise ValueError(f"`--long-conversations {self.long_conversations}` applies to `--ppl-file`: give one")
        check_pack(self.passkey_pack, self.batch_size)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during an evaluation, carrying what was finished before it: the whole pass-key cells, or the loss by
    position over the sequences scored (`done` of them)."""

    def __init__(self, results: list, done: int):
        super().__init__()
        self.results, self.done = results, done


# ------------------------------------------------------------------------------------------------------- loading


@dataclass
class Loaded:
    """A model ready to evaluate, the tokenizer that writes its prompts (and its tokenizer.json; None: bytes),
    where the model came from, the sequence length a run trained at (None: a Hugging Face folder), and how its
    data packed documents (`PACKINGS`, SEPARATORS): a run's `pack_documents` and `document_separator` (concat
    and none for a run from before them), mask and auto for a Hugging Face folder (a served model reads each
    document alone, with its tokenizer's separator)."""

    model: Transformer
    tokenizer: TextTokenizer
    tokenizer_path: str | None
    source: str
    trained_length: int | None = None
    pack_documents: str = "mask"
    document_separator: str = "auto"
    max_documents: int = MAX_DOCUMENTS  # a run's `--max-documents-per-sequence`


def load(path: str | Path, device: torch.device, dtype: torch.dtype, tokenizer: str | Path | None = None) -> Loaded:
    """Returns the model in `path`: the newest checkpoint of a `memo train` run directory (its saved model
    config and tokenizer), or a Hugging Face Llama folder (config.json + safetensors, its tokenizer.json if
    there is one); `tokenizer` replaces theirs, and without any the byte tokenizer is used."""
    path = Path(path)
    trained = {"pack_documents": "mask", "document_separator": "auto", "max_documents_per_sequence": MAX_DOCUMENTS}
    if (path / "checkpoints").is_dir():
        model, saved_tokenizer, source, trained = _load_run(path, tokenizer is None)
        trained = {**BEFORE_PACKING, **trained}  # a run from before packing options concatenated documents
    elif (path / CONFIG_NAME).is_file():
        try:
            model = from_hf(path, dtype=dtype)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
        found = path / TOKENIZER_NAME
        saved_tokenizer, source = (found if found.is_file() else None), f"{path} (Hugging Face)"
    else:
        raise ValueError(
            f"{path} is neither a `memo train` run directory (with checkpoints/) nor a Hugging Face folder "
            f"(with {CONFIG_NAME})"
        )
    model = model.to(device=device, dtype=dtype).eval()
    chosen = tokenizer or saved_tokenizer
    tokenizer_path = str(chosen) if chosen else None
    packing = trained["pack_documents"], trained["document_separator"], trained["max_documents_per_sequence"]
    return Loaded(model, load_tokenizer(tokenizer_path), tokenizer_path, source, trained.get("seq_len"), *packing)


def _load_run(run_dir: Path, own_tokenizer: bool) -> tuple[Transformer, str | None, str, dict]:
    """Returns (model, its tokenizer path, description, the run's config) of the newest checkpoint: the weights
    the run computed with (bf16 for a bf16 run; `memo export` writes its fp32 masters), read whole from either
    layout. With `own_tokenizer`, the files naming the run's tokenizer must be those it trained with."""
    saved = checkpoint.load_latest(run_dir)
    trained = saved.state["config"]
    if own_tokenizer:
        check_inputs(trained, ("tokenizer",), f"run {run_dir}", "restore it, or give `--tokenizer`")
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = Transformer(checkpoint.saved_model_config(saved.state, run_dir))
    lora = checkpoint.saved_lora(saved.state, run_dir)
    weights = saved.model if lora is None else merge_adapters(saved.model, lora.scaling)  # one matmul a projection
    try:
        model.load_state_dict(weights, assign=True)
    except RuntimeError as err:
        raise ValueError(f"checkpoint {saved.path} does not fit model {trained['model']!r}: {err}") from None
    return model, checkpoint.run_tokenizer(trained), f"{run_dir} (step {saved.step})", trained


def check_lengths(loaded: Loaded, lengths: Sequence[int], batch: int, pack: int = 1) -> None:
    """Raises ValueError, before any work, for a length past `length_limit`, or one whose activations alone
    (`activation_lower_bound`, `batch` prompts) exceed the memory free where the model is. `pack` prompts packed in
    one sequence, each its own document, are bounded as that sequence, pack × length tokens, for memory; their
    positions, each prompt's own, stay within its length."""
    model = loaded.model
    limit = length_limit(model.config, loaded.trained_length)
    free = dev.free_memory_bytes(model.head_weight.device)
    for length in sorted(set(lengths)):
        tokens = pack * length
        what = f"`--lengths` {format_count(length)}"
        lower = "lower `--lengths`"
        if pack > 1:
            what = f"`--passkey-pack` {pack} x {what} ({format_count(tokens)} tokens in one sequence)"
            lower += " or `--passkey-pack`"
        if limit is not None and length > limit:
            raise ValueError(
                f"`--lengths` {format_count(length)} is past {EXTRAPOLATION}x the length the model's positions "
                f"know (at most {format_count(limit)} here): lower `--lengths`"
            )
        need = activation_lower_bound(model.config, batch * tokens, model.head_weight.dtype.itemsize)
        if free is not None and need > free:
            raise ValueError(
                f"{what} needs at least {format_bytes(need)} of activations ({batch * pack} prompt(s)), "
                f"{format_bytes(free)} free on {model.head_weight.device}: {lower}"
                f"{' or `--batch-size`' if batch > 1 else ''}"
            )


def check_pack(pack: int, batch_size: int) -> None:
    """Raises ValueError unless `pack` (prompts packed in one sequence) is a positive integer, and 1 when prompts
    are decoded as a batch (`batch_size` > 1): one or the other."""
    if isinstance(pack, bool) or not isinstance(pack, int) or pack < 1:
        raise ValueError(f"`--passkey-pack` must be a positive integer, got {pack!r}")
    if pack > 1 and batch_size > 1:
        raise ValueError(
            f"`--passkey-pack` {pack} packs prompts into one sequence: leave `--batch-size` at 1 (got {batch_size})"
        )


def length_limit(config, trained: int | None) -> int | None:
    """Returns the longest prompt worth running: EXTRAPOLATION times the longer of the length a run trained at and
    `max_position_embeddings`, never below the GPU's default grid; None when neither is known."""
    known = max((n for n in (trained, config.max_position_embeddings) if n), default=None)
    return None if known is None else max(EXTRAPOLATION * known, *DEFAULTS["cuda"].lengths)


def activation_lower_bound(config, tokens: int, itemsize: int) -> int:
    """Returns bytes that a forward over `tokens` tokens needs at once however it runs: the residual stream, a
    layer's output and its MLP's hidden activation (no attention scores, no logits: a lower bound)."""
    return tokens * (2 * config.hidden_size + config.ffn_hidden_size) * itemsize


# ------------------------------------------------------------------------------------------------------ pass key


@dataclass(frozen=True)
class PasskeyPrompt:
    """One trial: the prompt (length,), its key, and the token index where the needle starts."""

    ids: torch.Tensor
    key: str
    needle_at: int


class PasskeyTask:
    """Pass-key prompts for one tokenizer; the filler sentences and the question are tokenised once."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        # a tokenizer that starts every piece with a word boundary (sentencepiece's "▁") reads concatenated
        # pieces with spaces between; others (bytes, byte-level BPE) need the space spelt out
        self._space = "" if tokenizer.decode(tokenizer.encode("a") + tokenizer.encode("b")) == "a b" else " "
        self.sentences = [np.asarray(self.encode(s), dtype=np.int64) for s in FILLER]
        self.question = self.encode(QUESTION)

    def encode(self, text: str) -> list[int]:
        """Returns the ids of `text` as a piece of running text, so that pieces join with a space."""
        return self.tokenizer.encode(self._space + text)

    def key(self, length: int, depth: float, seed: int, trial: int) -> str:
        return _key(_rng(length, depth, seed, trial))

    def room(self, key: str, length: int) -> int:
        """Returns how many filler tokens a prompt of `length` holds beside this key's needle and the question."""
        return length - len(self.encode(NEEDLE.format(key=key))) - len(self.question)

    def prompt(self, length: int, depth: float, seed: int, trial: int) -> PasskeyPrompt:
        """Returns the prompt of exactly `length` tokens; the needle goes to the sentence boundary nearest
        `depth` × filler tokens: depth 0 opens the prompt, depth 1 comes right before the question."""
        rng = _rng(length, depth, seed, trial)
        key = _key(rng)
        room = self.room(key, length)
        if room < 0:
            raise ValueError(f"`--lengths` {length} cannot hold the needle and the question ({length - room} tokens)")
        filler, bounds = self._filler(room, rng)
        at = int(bounds[np.abs(bounds - depth * room).argmin()])
        needle = self.encode(NEEDLE.format(key=key))
        ids = np.concatenate((filler[:at], needle, filler[at:], self.question)).astype(np.int64)
        return PasskeyPrompt(torch.from_numpy(ids), key, at)

    def _filler(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Returns (n random filler tokens, the sentence boundaries in them including 0 and n); the last
        sentence is cut to fit."""
        sizes = np.array([len(s) for s in self.sentences])
        picks = rng.integers(0, len(self.sentences), size=n // sizes.min() + 1)
        ends = np.cumsum(sizes[picks])
        used = picks[: int(np.searchsorted(ends, n)) + 1]
        tokens = np.concatenate([self.sentences[i] for i in used])[:n]
        inner = ends[: len(used)]
        return tokens, np.concatenate(([0], inner[inner < n], [n]))

    def answer_tokens(self, key: str) -> int:
        """Returns how many tokens to decode: the key as the tokenizer spells it after the question."""
        return len(self.encode(key))

    def read_key(self, ids: Sequence[int]) -> str:
        """Returns the first run of digits in decoded `ids`; ids the tokenizer does not know end the answer."""
        known = list(itertools.takewhile(lambda i: i < self.tokenizer.vocab_size, ids))
        found = re.search(r"\d+", self.tokenizer.decode(known))
        return found.group() if found else ""

    def check(self, model: torch.nn.Module, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int):
        """Raises ValueError, before any decoding, for depths outside [0, 1], lengths too short for the needle
        and question, and token ids beyond the model's vocabulary."""
        bad = [d for d in depths if not 0 <= d <= 1]
        if bad:
            raise ValueError(f"`--depths` must lie in [0, 1], got {bad[0]}")
        if trials < 1:
            raise ValueError(f"`--trials` must be positive, got {trials}")
        for length in lengths:
            keys = [self.key(length, d, seed, t) for d in depths for t in range(trials)]
            need = max((length - self.room(k, length) for k in keys), default=0)
            if length < need:
                raise ValueError(f"`--lengths` {length} cannot hold the needle and the question ({need} tokens)")
        pieces = [*self.sentences, self.question, self.encode(NEEDLE.format(key="0123456789"))]
        top = max(int(max(p)) for p in pieces)
        if top >= model.config.vocab_size:
            raise ValueError(
                f"the tokenizer ({self.tokenizer.name}) writes id {top} but the model's vocabulary has "
                f"{model.config.vocab_size}: give the model's own tokenizer.json with `--tokenizer`"
            )


def _rng(length: int, depth: float, seed: int, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, length, round(depth * 1_000_000), trial])


def _key(rng: np.random.Generator) -> str:
    return str(rng.integers(10_000, 100_000))  # five digits: chance of guessing is 1e-5


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Returns the greedy continuation (b, n_tokens) of `ids` (b, s): the model's own decoding (`greedy`; memo's
    caches keys and values, `memo.decode`), only the last rows multiplied by the head weight, never s × V."""
    return torch.tensor(model.greedy(ids, n_tokens), dtype=torch.long, device=ids.device)


@torch.inference_mode()
def packed_greedy_decode(
    model: torch.nn.Module, prompts: Sequence[torch.Tensor], n_tokens: Sequence[int], drafts: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Returns each prompt's greedy continuation of n_tokens[k] tokens, the prompts packed in one sequence as
    documents (each attends only to itself, its positions from 0): what `greedy_decode` gives a prompt alone.

    Each forward feeds a prompt what it decoded so far and, while that agrees with its draft (the tokens it is
    expected to answer), the rest of the draft; the argmax of every fed row is kept up to and including the first
    that differs from the draft token after it, as speculative decoding checks a draft. A prompt that answers its
    draft takes one forward; one that leaves it at token j takes one more forward per token after j. Only the
    rows read are multiplied by the head weight: (rows, h) × (h, V).
    """
    device = model.head_weight.device
    out: list[list[int]] = [[] for _ in prompts]
    while todo := [k for k in range(len(prompts)) if len(out[k]) < n_tokens[k]]:
        docs, rows, fed, end = [], [], [], 0
        for k in todo:
            done = out[k]
            rest = list(drafts[k][len(done) : n_tokens[k] - 1]) if list(drafts[k][: len(done)]) == done else []
            docs.append(torch.cat((prompts[k].cpu(), torch.tensor(done + rest, dtype=torch.long))))
            end += len(docs[-1])
            rows.extend(range(end - len(rest) - 1, end))  # the row of the last decoded token, then the draft's
            fed.append(rest)
        ids = torch.cat(docs)[None].to(device)  # (1, Σ doc lengths)
        positions = torch.cat([torch.arange(len(d)) for d in docs])[None]  # on the host, where the model reads them
        hidden = model.hidden_states(ids, positions=positions)[0, rows]  # (rows, h)
        predicted = iter((hidden @ model.head_weight.t()).argmax(dim=-1).tolist())
        for k, rest in zip(todo, fed):
            guesses = [next(predicted) for _ in range(len(rest) + 1)]
            for i, token in enumerate(guesses):
                out[k].append(token)
                if i == len(rest) or token != rest[i]:  # past here the rows followed a token greedy did not emit
                    break
    return out


@dataclass(frozen=True)
class PasskeyCell:
    """How many of the `trials` prompts of one (length, depth) were answered with the exact key."""

    length: int
    depth: float
    trials: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials

    def as_dict(self) -> dict:
        fields = {"length": self.length, "depth": self.depth, "trials": self.trials, "correct": self.correct}
        return {**fields, "accuracy": self.accuracy}


def passkey_accuracy(
    model: torch.nn.Module,
    tokenizer: TextTokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
    batch_size: int = 1,
    progress: Progress = _no_progress,
    pack: int = 1,
) -> list[PasskeyCell]:
    """Returns the accuracy of every (length, depth) cell over `trials` greedy-decoded prompts, lengths outer;
    `progress(n)` is called as each group of n trials is scored: `batch_size` decoded as a batch, or `pack`
    packed in one sequence (the same verdicts, see `passkey_verdicts`). Ctrl-C raises `Interrupted` with the whole
    cells scored before it."""
    if batch_size < 1:
        raise ValueError(f"`--batch-size` must be positive, got {batch_size}")
    check_pack(pack, batch_size)
    task = PasskeyTask(tokenizer)
    task.check(model, lengths, depths, trials, seed)
    group = max(batch_size, pack)
    cells = []
    try:
        for length, depth in itertools.product(lengths, depths):
            correct = 0
            for first in range(0, trials, group):
                prompts = [task.prompt(length, depth, seed, t) for t in range(first, min(first + group, trials))]
                correct += sum(passkey_verdicts(model, task, prompts, packed=pack > 1))
                progress(len(prompts))
            cells.append(PasskeyCell(length, depth, trials, correct))
    except KeyboardInterrupt:
        raise Interrupted(cells, len(cells)) from None
    return cells


def passkey_verdicts(
    model: torch.nn.Module, task: PasskeyTask, prompts: Sequence[PasskeyPrompt], packed: bool = False
) -> list[bool]:
    """Returns, for each prompt, whether the first run of digits of its greedy answer (as many tokens as the
    tokenizer spells its key in) is its key; the prompts are decoded as a batch, or `packed` in one sequence with
    their answers as drafts (`packed_greedy_decode`): the same tokens, so the same verdicts."""
    counts = [task.answer_tokens(p.key) for p in prompts]  # a BPE may spell keys in different numbers of tokens
    if packed:
        out = packed_greedy_decode(model, [p.ids for p in prompts], counts, [task.encode(p.key) for p in prompts])
    else:
        device = model.head_weight.device
        out = greedy_decode(model, torch.stack([p.ids for p in prompts]).to(device), max(counts)).tolist()
    return [task.read_key(row[:n]) == p.key for row, n, p in zip(out, counts, prompts)]


def plot_passkey(cells: Sequence[PasskeyCell], path: str | Path, title: str) -> None:
    """Writes the needle-in-a-haystack heatmap of the pass key as PNG (`plot_heatmap`)."""
    plot_heatmap({(c.length, c.depth): c.accuracy for c in cells}, path, title, "accuracy")


# ---------------------------------------------------------------------------------------------- loss by position


@dataclass(frozen=True)
class BucketLoss:
    """Mean next-token loss over the predicted tokens at positions [start, end) of their sequence, or of their
    document when documents are masked."""

    start: int
    end: int
    tokens: int
    loss: float  # nan without tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict:
        seen = self.tokens > 0  # JSON has no nan
        fields = {"start": self.start, "end": self.end, "tokens": self.tokens}
        return {**fields, "loss": self.loss if seen else None, "perplexity": self.perplexity if seen else None}


def bucket_edges(length: int, size: int | None = None) -> list[int]:
    """Returns the bucket boundaries over positions [0, length): every `size` tokens, or by default doubling
    from 128 (what changes with context is a matter of orders of magnitude of distance)."""
    if size is not None and size <= 0:
        raise ValueError(f"`--bucket-size` must be positive, got {size}")
    if size:
        return [*range(0, length, size), length]
    edges = [0, *itertools.takewhile(lambda e: e < length, (128 << i for i in itertools.count()))]
    return edges + [length]


def held_out_sequences(
    path: str | Path,
    tokenizer_path: str | None,
    length: int,
    vocab_size: int,
    tokenizer: str | None = None,
    pack_documents: str = "concat",
    separator: str = "auto",
    max_documents: int = MAX_DOCUMENTS,
    long_conversations: str = "refuse",
) -> TokenDataset:
    """Returns a held-out file (.txt, .jsonl, .parquet, a folder of them, or a pre-tokenised .bin/.npy) packed
    the way training packs data: documents, each bounded by `separator` (SEPARATORS), concatenated and cut into
    sequences of `length` tokens, the last one padded, each document attending to those before it (`concat`) or
    only to itself (`mask`: the sequences carry each token's position in its document, at most `max_documents`
    apart a sequence, as `--max-documents-per-sequence`); ids beyond
    `vocab_size`, a token file of another tokenizer than `tokenizer` (an identity) or written with another
    separator, are errors. Conversations are rendered and packed as training reads them (`token_dataset`: the
    assistant's tokens are the targets, each conversation whole in a sequence, one longer than `length` refused
    or truncated by `long_conversations`)."""
    if long_conversations != "refuse" and (Path(path).suffix in TOKEN_SUFFIXES or not holds_conversations(path)):
        raise ValueError(f"`--long-conversations {long_conversations}` applies to conversations; {path} holds none")
    data = token_dataset(
        path, length, tokenizer_path=tokenizer_path, flag="--ppl-file", tokenizer=tokenizer,
        pack_documents=pack_documents, separator=separator, max_documents=max_documents,
        long_conversations=long_conversations,
    )  # fmt: skip
    check_vocab(data, vocab_size)
    return data


@torch.inference_mode()
def position_losses(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns the cross-entropy (b, s) float32 of each position t predicting targets[t] (0 where ignored),
    from the hidden states times the head weight `model.loss_chunk_tokens` rows at a time. `positions` (b, s):
    each token's position in its document, which attends only to itself (None: one document per sequence)."""
    hidden = model.hidden_states(ids, positions=positions)  # (b, s, h)
    losses = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    step = model.loss_chunk_tokens
    for lo in range(0, ids.shape[1], step):
        logits = (hidden[:, lo : lo + step] @ model.head_weight.t()).float()  # (b, chunk, V)
        chunk = targets[:, lo : lo + step]
        losses[:, lo : lo + step] = F.cross_entropy(
            logits.transpose(1, 2), chunk, ignore_index=IGNORE_INDEX, reduction="none"
        )
    return losses


def spread(total: int, limit: int | None) -> list[int]:
    """Returns `limit` (positive) indices spread evenly over range(total), or all of them without a limit or below
    it: a file's documents often come in order (by source, by date), and its first sequences would stand for the
    whole badly."""
    if limit is None or limit >= total:
        return list(range(total))
    return [i * total // limit for i in range(limit)]


def perplexity_by_position(
    model: torch.nn.Module,
    data: TokenDataset,
    bucket_size: int | None = None,
    progress: Progress = _no_progress,
    sequences: Sequence[int] | None = None,
) -> list[BucketLoss]:
    """Returns the mean loss per position bucket over the `sequences` of `data` (default: all), one at a time. A
    token's position is the context it had: its index in its sequence, or with documents masked (`data` gives
    positions) its position in its document, the model attending within documents. As in training, no loss is
    taken on a document's first token, so none predicts across a boundary. Buckets past the last position scored
    are left out. Ctrl-C raises `Interrupted` with the buckets of the sequences scored before it."""
    edges = bucket_edges(data.seq_len, bucket_size)
    device = model.head_weight.device
    scored = []  # (loss sums, token counts) per bucket of each sequence: one append, whole even under Ctrl-C
    try:
        for i in range(data.num_sequences) if sequences is None else sequences:
            ids, labels, positions = data.sequence(i)
            targets = shift_labels(labels[None])  # (1, s): position t predicts token t + 1
            masked = None if positions is None else positions[None]  # on the host, where the model reads them
            losses = position_losses(model, ids[None].to(device), targets.to(device), masked)[0].cpu()
            # the predicted token's position; a target is never a document's first token, so it is t's plus one
            predicted = torch.arange(1, data.seq_len + 1) if positions is None else positions + 1  # (s,)
            bucket = torch.bucketize(predicted, torch.tensor(edges), right=True) - 1
            valid = targets[0] != IGNORE_INDEX
            sums = torch.zeros(len(edges) - 1, dtype=torch.float64).index_add_(0, bucket[valid], losses[valid].double())
            scored.append((sums, torch.bincount(bucket[valid], minlength=len(edges) - 1)))
            progress(1)
    except KeyboardInterrupt:
        raise Interrupted(_buckets(edges, scored), len(scored)) from None
    return _buckets(edges, scored)


def _buckets(edges: list[int], scored: list[tuple[torch.Tensor, torch.Tensor]]) -> list[BucketLoss]:
    """Returns the mean loss of each bucket over the scored sequences, up to the last bucket holding a token:
    those after it (past the longest document, or past a file shorter than a sequence) say nothing."""
    sums = sum((s for s, _ in scored), torch.zeros(len(edges) - 1, dtype=torch.float64))
    counts = sum((n for _, n in scored), torch.zeros(len(edges) - 1, dtype=torch.int64))
    kept = int(counts.nonzero().max()) + 1 if counts.any() else 0
    return [
        BucketLoss(lo, hi, int(n), float(s / n) if n else math.nan)
        for lo, hi, s, n in zip(edges[:kept], edges[1 : kept + 1], sums.tolist(), counts.tolist())
    ]


def report_lines(report: dict, seed: int) -> str:
    """Returns the tables `memo eval` prints of its `report`: pass-key accuracy by length and depth, and the loss by
    position."""
    lines = [f"model {report['model']}  tokenizer {report['tokenizer']}  {report['device']} {report['dtype']}"]
    if report.get("interrupted"):
        finished = report.get("passkey") or report.get("ruler") or report.get("perplexity", {}).get("sequences")
        lines.append(f"interrupted: {'the results finished' if finished else 'nothing was finished'} before Ctrl-C")
    if report.get("ruler"):
        cells = [RulerCell(**c) for c in report["ruler"]]
        chat = ", prompts in the chat template" if report.get("ruler_chat") else ""
        lines.append(
            f"\nRULER score (%), {cells[0].samples or '-'} samples per cell, mean over depths{chat} (seed {seed})"
        )
        lines.append(ruler_table(cells))
    if report.get("passkey"):
        cells = report["passkey"]
        lengths = list(dict.fromkeys(c["length"] for c in cells))
        accuracy = {(c["length"], c["depth"]): f"{c['accuracy']:.0%}" for c in cells}
        lines.append(f"\npass key accuracy, {cells[0]['trials']} trials per cell (seed {seed})")
        lines.append("| depth | " + " | ".join(format_count(n) for n in lengths) + " |")
        lines.append("|---:" * (len(lengths) + 1) + "|")
        for depth in dict.fromkeys(c["depth"] for c in cells):
            lines.append(f"| {depth:.2f} | " + " | ".join(accuracy.get((n, depth), "-") for n in lengths) + " |")
    if "perplexity" in report:
        ppl = report["perplexity"]
        of = f" of {ppl['of']}" if ppl["sequences"] < ppl["of"] else ""
        within = ppl["pack_documents"] == "mask"
        scored = f"the assistant tokens of {ppl['file']}" if ppl.get("targets") == "assistant" else ppl["file"]
        lines.append(
            f"\nloss of {scored} by position{' within document' if within else ''}, {ppl['sequences']}{of} "
            f"sequence(s) of {format_count(ppl['length'])}"
            + (" (--max-sequences)" if of and not report.get("interrupted") else "")
        )
        lines.append(f"| {'position within document' if within else 'positions'} | tokens | loss | perplexity |")
        lines.append("|---|---:|---:|---:|")
        for b in ppl["buckets"]:
            loss, perplexity = (f"{b['loss']:.4f}", f"{b['perplexity']:.2f}") if b["tokens"] else ("-", "-")
            lines.append(
                f"| [{format_count(b['start'])}, {format_count(b['end'])}) | {b['tokens']} | {loss} | {perplexity} |"
            )
    return "\n".join(lines)
