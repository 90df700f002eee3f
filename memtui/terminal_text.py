"""Recorded text made safe to show: control characters escaped, never markup.

Everything a recording, a sidecar or a snapshot says (the job's argv, alert messages, module and
dtype names, exception text, file names) was written by someone else and reaches a terminal.
Printed raw, an escape sequence in it can retitle the window, move the cursor, hide lines or
write to the clipboard; parsed as Rich markup, a stray `[/]` crashes the TUI and `[enforce fail
at alloc_cpu.cpp:127]` disappears. Every text output (report, `attach --list`, errors and
warnings, TUI cells) goes through this one module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""C0 and C1 controls, DEL, the Unicode line separators and the bidi overrides that reorder
what a terminal shows. Newline and tab are kept only where a caller asks for them."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def terminal_safe(text: object, keep_newlines: bool = False) -> str:
    """`text` with every control character written as a visible escape (`\\x1b`).

    Args:
        keep_newlines: keep `\\n` and `\\t` (for multi-line output that memtui itself composed,
            where every recorded piece inside it is escaped by this same rule).
    """
    value = str(text)
    if keep_newlines:
        return _UNSAFE.sub(lambda m: m.group() if m.group() in "\n\t" else _escape(m), value)
    return _UNSAFE.sub(_escape, value)


def plain(text: object, style: str = "", justify: str | None = None) -> Text:
    """A Rich `Text` that shows recorded text literally: no markup parsed, controls escaped.

    Rich is imported here, not at module level, so `memtui report` never loads it.
    """
    from rich.text import Text

    return Text(terminal_safe(text), style=style, justify=justify)  # type: ignore[arg-type]
