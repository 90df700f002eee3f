"""What a process of `memtui run -- COMMAND` says to `memtui run` when it cannot say it itself.

`memtui run` makes a private empty file and names it in `MEMTUI_NOTES`; a process that trained
but was not recorded (`memtui_agent.startup.children`), or an interpreter where the agent could
not be armed (the bootstrap `sitecustomize`), appends one line to it, and `memtui run` prints
each distinct line once at the end, instead of the line landing in the command's own output.
Without a notes file the line goes to stderr, its control characters escaped.

The line is appended through `safe_open.append_own`: the file must still be the regular file of
ours `memtui run` made, so a link, a FIFO or another user's file planted at the name is never
written (and never blocks the job). The bootstrap runs in interpreters that may not have memtui
at all, so it keeps a copy of `note` in plain standard-library code (`_note` in
`memtui_agent/startup/bootstrap/sitecustomize.py`);
`tests/integration/test_reliability_planted.py` holds both to the same lines and the same refusals.
"""

from __future__ import annotations

import os
import sys

from memtui_protocol.safe_open import append_own
from memtui_protocol.shown_text import terminal_safe

NOTES_VARIABLE = "MEMTUI_NOTES"
"""The variable naming the notes file (`memtui run` sets it for the whole command)."""
MAX_NOTE_CHARS = 500
"""A note is one line: longer ones are cut (a traceback's repr has no place there)."""


def note_line(message: str) -> bytes:
    """The line `message` becomes in the notes file: the interpreter that says it, then it."""
    line = f"{sys.executable}: {message}".replace("\n", " ")[:MAX_NOTE_CHARS] + "\n"
    return line.encode("utf-8", "replace")


def note(message: str) -> None:
    """Say `message` once: a line in `memtui run`'s notes file, else on stderr. Never raises:
    a note is worth less than the job."""
    path = os.environ.get(NOTES_VARIABLE)
    try:
        if not path:
            print(f"memtui: {terminal_safe(message)}", file=sys.stderr)
            return
        append_own(path, note_line(message))
    except Exception:
        pass
