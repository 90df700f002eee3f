"""The one rule for text that is shown: which characters are never written raw.

Both halves show text someone else wrote: the viewer shows what a recording, a sidecar or a
job says (`memtui/terminal_text.py` builds its three functions on this rule), and the agent
quotes paths, addresses and job labels the user gave in its notes on the job's stderr. Printed
raw, an escape sequence there can retitle the window (OSC 0), write to the clipboard (OSC 52)
or move the cursor; a bidi override or a zero-width character makes what is shown differ from
what is there. Standard library only: the agent imports it in the job.
"""

from __future__ import annotations

import re

UNSAFE_RANGES = (
    (0x00, 0x1F),  # C0 controls (ESC, BEL, ...)
    (0x7F, 0x9F),  # DEL and C1 controls (U+0085 NEL, U+009B CSI, U+009D OSC)
    (0xAD, 0xAD),  # soft hyphen
    (0x600, 0x605),
    (0x61C, 0x61C),  # Arabic letter mark
    (0x6DD, 0x6DD),
    (0x70F, 0x70F),
    (0x890, 0x891),
    (0x8E2, 0x8E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),  # zero-width space, joiners, LRM, RLM
    (0x2028, 0x202E),  # line and paragraph separators, bidi embeddings and overrides
    (0x2060, 0x2064),  # word joiner, invisible operators
    (0x2066, 0x206F),  # bidi isolates, deprecated format characters
    (0xD800, 0xDFFF),  # lone surrogates
    (0xFEFF, 0xFEFF),  # zero-width no-break space (BOM)
    (0xFFF9, 0xFFFB),  # interlinear annotation
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),  # tag characters
)
"""Every control (Cc), format (Cf), line and paragraph separator (Zl, Zp) and surrogate (Cs)
code point: what a terminal acts on or hides instead of showing.
`tests/integration/test_control_text.py` checks the ranges against `unicodedata` for every
code point."""

UNSAFE = re.compile(
    "[" + "".join(f"\\U{low:08x}-\\U{high:08x}" for low, high in UNSAFE_RANGES) + "]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def terminal_safe(text: object, keep_newlines: bool = False) -> str:
    """`text` with every unsafe character written as a visible escape (`\\x1b`, `\\u202e`).

    Args:
        keep_newlines: keep `\\n` and `\\t` (for multi-line output that memtui itself composed,
            where every recorded piece inside it is escaped by this same rule).
    """
    value = str(text)
    if keep_newlines:
        return UNSAFE.sub(lambda m: m.group() if m.group() in "\n\t" else _escape(m), value)
    return UNSAFE.sub(_escape, value)


__all__ = ["UNSAFE", "UNSAFE_RANGES", "terminal_safe"]
