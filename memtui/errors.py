"""The one kind of failure the CLI tells the user about: a line and an exit code.

Every command raises a `UserError` subclass (a recording it cannot read, a socket it cannot
use, a bad command line) and `memtui.commands.cli.main` prints it once, escaped, as
`memtui: error: ...` with the class's exit code. No command prints its own errors.
"""

from __future__ import annotations

from memtui.exit_codes import EXIT_BAD_INPUT, EXIT_USAGE


class UserError(Exception):
    """A failure to tell in one line (`str()`), with the exit code that says which kind."""

    exit_code = EXIT_BAD_INPUT


class UsageError(UserError):
    """A bad command line (or no terminal for a command that needs one)."""

    exit_code = EXIT_USAGE
