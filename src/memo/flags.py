"""A verb's flags are the fields of one typed record: each field says its help, how its text is read and its
choices, and the CLI makes the flag from it (`memo.cli`), so a record and its flags cannot drift apart."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def flag(
    default: Any = dataclasses.MISSING,
    help: str = "",
    parse: Callable[[str], Any] | None = None,
    choices: tuple | None = None,
    **more,
) -> Any:
    """Returns a dataclass field that is also a flag: `parse` reads its text (default: the text itself), `choices`
    bound it; `more` says how it is given (`path`: a file or folder, `append`: repeatable, `positional`,
    `number`: a finite float, `name`: what its parse errors call it). No default: a required flag."""
    metadata = {"help": help, "parse": parse, "choices": choices, **more}
    return dataclasses.field(default=default, metadata=metadata)
