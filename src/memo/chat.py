"""Conversations rendered with a tokenizer's own chat template, and which of their tokens the assistant writes.

A conversation is a list of messages {role, content} (the `messages` column of TRL's and `datasets`' chat data).
It is rendered as transformers renders it (`apply_chat_template`, with the template of the tokenizer's folder),
and the assistant's tokens, the only targets of the loss, are found by rendering, for any template:

    prompt_i = render(messages[:i], add_generation_prompt=True)    what the model is given before assistant turn i
    turn_i   = render(messages[:i + 1])                             the conversation up to and with that turn

turn_i must begin with prompt_i; what follows, turn_i[len(prompt_i):], is what the assistant writes: its content,
the end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`) and what the template writes after it before
the next message (ChatML's and Gemma's newline), and any block the template writes into the turn (Qwen3's empty
`<think>\\n\\n</think>\\n\\n`). What the generation prompt holds (`<|im_start|>assistant\\n`, or an empty think
block that a template puts there when thinking is off) is given to the model at inference, so it is not trained.

A template that rewrites earlier turns as a conversation goes on (Qwen3 drops the reasoning of the turns before the
last user message; Phi-3 ends a conversation with its EOS) renders some turn_i that does not begin the whole
conversation: then every assistant turn is a document of its own, turn_i, trained on that turn alone, with the
earlier turns as the model sees them at inference. A template whose generation prompt does not begin the turn it
renders (R1-style ones prompt with `<think>\\n` and drop the reasoning from the turn) is refused.

The spans are cut in text, so they must fall on token boundaries: the pieces between them, tokenized alone, must
give the ids of the whole rendering, or the conversation is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Callable

ROLES = ("system", "user", "assistant", "tool")
INSTALL = "pip install 'memo-train[chat]'"  # transformers and jinja2, which render the templates


@dataclass(frozen=True)
class Rendered:
    """One document of a conversation: its text and the [start, end) character ranges the assistant wrote."""

    text: str
    spans: tuple[tuple[int, int], ...]


class ChatTemplate:
    """The chat template of the folder that holds a tokenizer.json (its tokenizer_config.json `chat_template`, or
    chat_template.jinja), rendered by transformers with the special tokens that folder declares."""

    def __init__(self, tokenizer_path: str | Path | None, data: str):
        """`data` names the conversations in errors (the flag and the file)."""
        if tokenizer_path is None:
            raise ValueError(
                f"{data} holds conversations (`messages`): they are rendered with a chat template; give `--tokenizer` "
                "(a tokenizer.json beside the tokenizer_config.json that holds the template) or a `--model` folder "
                "with one"
            )
        self.folder = Path(tokenizer_path).parent
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"{data} holds conversations (`messages`): rendering them needs transformers: {INSTALL}")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"transformers cannot load the tokenizer folder {self.folder}: {e}") from None
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"{data} holds conversations (`messages`) but tokenizer {self.folder} has no chat template "
                "(`chat_template` in tokenizer_config.json, or chat_template.jinja)"
            )

    def render(self, messages: list[dict], where: str, prompt: bool = False) -> str:
        """Returns `messages` rendered as text, with the generation prompt after them when `prompt`."""
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        except ImportError as e:  # transformers renders with jinja2, an extra of its own
            raise ValueError(f"rendering chat templates needs jinja2 ({e}): {INSTALL}") from None
        except Exception as e:  # the template's own `raise_exception`, or a message it cannot read
            raise ValueError(f"{where}: the chat template of {self.folder} fails on it: {type(e).__name__}: {e}")


def check_conversation(messages: list, where: str) -> None:
    """Raises ValueError, naming `where` (file and row), unless `messages` is a conversation to train on: messages
    {role (one of ROLES), content (a string), ...}, not opening with the assistant (nothing would prompt it), and
    at least one assistant message (else nothing is trained)."""
    if not messages:
        raise ValueError(f"{where}: the conversation has no messages")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {k} is not an object with a `role` and a string `content`")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}: message {k} has role {message.get('role')!r}; roles are {', '.join(ROLES)}")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: the conversation opens with an assistant message: nothing prompts it")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant message: nothing to train on")


def render_conversation(template: ChatTemplate, messages: list[dict], where: str) -> list[Rendered]:
    """Returns the documents of a checked conversation (`check_conversation`): the whole of it with every
    assistant turn's span, or, when the template rewrites earlier turns, one document per assistant turn with its
    span alone (see the module docstring). Raises ValueError when the template's generation prompt does not begin
    the turn it renders."""
    turns = [_turn(template, messages, i, where) for i, m in enumerate(messages) if m["role"] == "assistant"]
    whole = template.render(messages, where)
    if all(whole.startswith(turn) for turn, _ in turns):
        return [Rendered(whole, tuple(span for _, span in turns))]
    return [Rendered(turn, (span,)) for turn, span in turns]


def _turn(template: ChatTemplate, messages: list[dict], i: int, where: str) -> tuple[str, tuple[int, int]]:
    """Returns (turn_i, the span of assistant message i in it)."""
    prompt = template.render(messages[:i], where, prompt=True)
    turn = template.render(messages[: i + 1], where)
    if not turn.startswith(prompt):
        same = next((k for k, (a, b) in enumerate(zip(prompt, turn)) if a != b), min(len(prompt), len(turn)))
        raise ValueError(
            f"{where}: the chat template renders assistant message {i} as {turn[same:][:40]!r} where its generation "
            f"prompt goes on {prompt[same:][:40]!r}: it rewrites the assistant's messages (R1-style templates drop "
            "the reasoning); give a tokenizer folder whose template renders them whole (TRL's *_training.jinja)"
        )
    return turn, (len(prompt), len(turn))


def tokenize_rendered(rendered: Rendered, encode: Callable[[str], list[int]], where: str) -> tuple[list, list]:
    """Returns (ids, trained) of a rendered document: its token ids, and whether each is the assistant's. Raises
    ValueError when its pieces (before, in and after the spans), tokenized alone, do not give the ids of the
    whole text: a span would begin or end inside a token."""
    cuts = [0, *(edge for span in rendered.spans for edge in span), len(rendered.text)]
    ids, trained = [], []
    for k, (lo, hi) in enumerate(pairwise(cuts)):
        piece = encode(rendered.text[lo:hi])
        ids += piece
        trained += [k % 2 == 1] * len(piece)
    whole = encode(rendered.text)
    if ids != whole:
        at = next((k for k, (a, b) in enumerate(zip(ids, whole)) if a != b), min(len(ids), len(whole)))
        raise ValueError(
            f"{where}: the assistant's text does not begin and end on token boundaries (its pieces, tokenized alone, "
            f"give other ids than the whole conversation from token {at} on): memo cannot tell which tokens are the "
            "assistant's"
        )
    return ids, trained
