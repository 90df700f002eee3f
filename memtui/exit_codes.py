"""memtui's own exit codes, defined once (a job's exit code passes through `memtui run` as is)."""

from __future__ import annotations

EXIT_BAD_INPUT = 1
"""A file, socket or job that cannot be used: one line on stderr says why."""
EXIT_USAGE = 2
"""A bad command line."""
EXIT_PARTIAL = 3
"""A damaged recording: everything readable was shown or written, with a warning."""
EXIT_RULE_BROKEN = 1
"""`memtui check`: the recording breaks a rule (a recording it cannot judge is `EXIT_USAGE`)."""
