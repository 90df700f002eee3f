"""Text the operating system handed Python, made fit for UTF-8 files and frames.

Python decodes what the OS gives it (`sys.argv`, file names, `os.getcwd()`, the host name, the
environment) with `surrogateescape`: a byte that is not UTF-8 becomes a lone surrogate
(`b"\\xff"` -> `"\\udcff"`), which no UTF-8 encoder accepts. msgspec refuses such a string, so a
job started with one in its arguments, script path or host name used to lose its recording
("agent not started: surrogates not allowed"). The bytes are carried instead as the text
`\\xff` (backslash, x, two hex digits): readable in every viewer, never a control character,
and the same byte a user sees in `ls -b`. A surrogate that is not a smuggled byte (a str the job
built itself) becomes `\\udXXX` the same way.

Standard library and msgspec only: the agent and the viewer both use it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

_T = TypeVar("_T")


def os_text(text: str) -> str:
    """`text` with every byte smuggled in as a lone surrogate written as `\\xNN` (valid UTF-8)."""
    try:
        text.encode("utf-8")
        return text  # the common case costs one encode
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no OS byte made: escaped as a code point
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _escaped(value: Any) -> Any:
    """Every string in a builtins tree (as `msgspec.to_builtins` makes it) through `os_text`."""
    if isinstance(value, str):
        return os_text(value)
    if isinstance(value, list):
        return [_escaped(item) for item in value]
    if isinstance(value, dict):
        return {_escaped(key): _escaped(item) for key, item in value.items()}
    return value


def carried(message: _T) -> _T:
    """A copy of the struct `message` whose strings all encode as UTF-8 (`os_text`).

    Only called after an encoder refused the original (`UnicodeEncodeError`): the common path
    pays nothing for it.
    """
    builtins = msgspec.to_builtins(message)
    return msgspec.convert(_escaped(builtins), type(message))
