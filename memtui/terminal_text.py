"""Recorded text made safe to show: control characters escaped, never markup.

Everything a recording, a sidecar or a snapshot says (the job's argv, alert messages, module and
dtype names, exception text, file names, how the job ended) and everything the job printed was
written by someone else and reaches a terminal or a JSON consumer. Printed raw, an escape
sequence in it can retitle the window (OSC 0), write to the clipboard (OSC 52), move the cursor,
hide lines; a bidi override (U+202E) or a zero-width character makes what is shown differ from
what is there; parsed as Rich markup, a stray `[/]` crashes the TUI and `[enforce fail at
alloc_cpu.cpp:127]` disappears.

Three functions, one rule (`UNSAFE`, in `memtui_protocol.shown_text`, which the agent's own
notes use too), used wherever such text is shown:

- `terminal_safe` for terminal text (reports, warnings and errors, `memtui run`'s summary,
  `attach --list`, TUI cells through `plain`): each unsafe character becomes a visible escape;
- `json_safe` for JSON documents (`report --json`, exports): each becomes a `\\uXXXX` escape,
  so the value a JSON parser reads is the recorded one, and no raw control reaches a terminal;
- `job_output` for the job's own output in the TUI's output pane: its colours (SGR) are kept,
  every other escape sequence (cursor moves, OSC 52, titles) is dropped, the rest escaped.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from memtui_protocol.shown_text import UNSAFE, UNSAFE_RANGES, terminal_safe

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["UNSAFE", "UNSAFE_RANGES", "job_output", "json_safe", "plain", "terminal_safe"]


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_safe(document: str) -> str:
    """An encoded JSON document with every unsafe character inside its strings written as a
    `\\uXXXX` escape. An encoder escapes the C0 controls inside strings itself, so a newline,
    tab or carriage return left in the document is layout between tokens and stays; every
    other unsafe character can only be inside a string, where the escape means the same
    character to any parser."""
    return UNSAFE.sub(lambda m: m.group() if m.group() in "\n\t\r" else _json_escape(m), document)


def plain(text: object, style: str = "", justify: str | None = None) -> Text:
    """A Rich `Text` that shows recorded text literally: no markup parsed, controls escaped.

    Rich is imported here, not at module level, so `memtui report` never loads it.
    """
    from rich.text import Text

    return Text(terminal_safe(text), style=style, justify=justify)  # type: ignore[arg-type]


_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erasing
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"  # OSC, DCS, APC...
    r"|\x1b[ -/]*[0-~]?",  # any other escape (and a lone ESC)
    re.DOTALL,
)
_COLOURS = re.compile(r"\x1b\[[0-9;:]*m")
"""SGR: the only sequence the output pane keeps (it styles text and moves nothing)."""


def job_output(line: str) -> Text:
    """One line the job printed, for the TUI's output pane: its colours as Rich styles, every
    other escape sequence dropped (cursor moves, erasing, OSC 52 clipboard writes, titles,
    hyperlinks), every other unsafe character escaped."""
    from rich.text import Text

    parts = []
    position = 0
    for match in _SEQUENCE.finditer(line):
        parts.append(terminal_safe(line[position : match.start()], keep_newlines=True))
        if _COLOURS.fullmatch(match.group()):
            parts.append(match.group())
        position = match.end()
    parts.append(terminal_safe(line[position:], keep_newlines=True))
    return Text.from_ansi("".join(parts), no_wrap=True, end="")
