"""`memtui check RECORDING [rules]`: a CI gate over a recording (docs/check.md).

Exit 0 when every rule holds, `EXIT_RULE_BROKEN` (1) when any is broken, `EXIT_USAGE` (2) for a
command line or a recording it cannot judge (missing, not a recording, damaged or truncated): a
CI job must never read "could not look" as "broke a rule", nor as a pass.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import msgspec

from memtui.errors import UsageError, UserError
from memtui.exit_codes import EXIT_RULE_BROKEN
from memtui.reports.check_rules import Limits, SizeLimit, check, check_lines
from memtui.terminal_text import terminal_safe
from memtui_protocol.schema import Pile
from memtui_protocol.units import parse_size


class CheckInputError(UsageError):
    """A recording `memtui check` cannot judge: exit 2, like a bad command line."""


def _shown(text: str) -> str:
    """A value quoted in an error, cut when long (the line stays one readable line)."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def size_limit(text: str) -> SizeLimit:
    """`--max-peak SIZE`: bytes, KB/MB/GB (decimal) or KiB/MiB/GiB (binary)."""
    try:
        return SizeLimit(parse_size(text), text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


size_limit.__name__ = "size"


def pile_limit(text: str) -> tuple[Pile, SizeLimit]:
    """`--max PILE=SIZE`, PILE one of the piles' names (`Pile`)."""
    name, sep, size = text.partition("=")
    names = ", ".join(pile.value for pile in Pile)
    if not sep:
        raise argparse.ArgumentTypeError(f"give PILE=SIZE (PILE: {names}), not {_shown(text)}")
    try:
        pile = Pile(name.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"no pile {_shown(name)}: the piles are {names}") from None
    return pile, size_limit(size)


pile_limit.__name__ = "PILE=SIZE"


def percent(text: str) -> float:
    """`--max-not-known PCT`: a percent of the steps, 0 to 100."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        value = math.nan
    if not 0 <= value <= 100:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"give a percent from 0 to 100, not {_shown(text)}")
    return value


percent.__name__ = "percent"


def add_check_parser(commands: argparse._SubParsersAction[Any]) -> None:
    """The `check` subcommand and its flags."""
    parser = commands.add_parser(
        "check",
        help="exit 1 when a recording breaks a memory rule (a CI gate)",
        description="Hold a recording against memory rules: exit 0 when every rule holds, 1 "
        "with one line per broken rule, 2 for a bad command line or a recording that cannot "
        "be judged. Sizes: bytes, KB/MB/GB (decimal) or KiB/MiB/GiB (binary).",
    )
    parser.add_argument("path", help="a .memtui recording")
    parser.add_argument(
        "--max-peak", type=size_limit, metavar="SIZE", help="every step's peak at most SIZE"
    )
    parser.add_argument(
        "--max",
        type=pile_limit,
        action="append",
        default=[],
        dest="max_piles",
        metavar="PILE=SIZE",
        help="every step's high of PILE at most SIZE (PILE: "
        + ", ".join(pile.value for pile in Pile)
        + "); repeat for several piles",
    )
    parser.add_argument("--no-leak", action="store_true", help="fail on any named leak")
    parser.add_argument("--no-nan", action="store_true", help="fail on any NaN/Inf alert")
    parser.add_argument(
        "--max-not-known",
        type=percent,
        default=0.0,
        metavar="PCT",
        help="percent of the steps on which --max-peak/--max may not know their figure "
        "(default 0: any such step breaks the rule)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"ok", "violations", "rules", ...} as JSON'
    )


def limits_of(args: argparse.Namespace) -> Limits:
    """The rules from the command line; none at all is a usage error."""
    piles: dict[Pile, SizeLimit] = {}
    for pile, limit in args.max_piles:
        if pile in piles:
            raise UsageError(f"--max {pile}= given twice")
        piles[pile] = limit
    limits = Limits(
        max_peak=args.max_peak,
        max_piles=tuple(piles.items()),
        no_leak=args.no_leak,
        no_nan=args.no_nan,
        max_not_known=args.max_not_known,
    )
    if not limits.any_rule:
        raise UsageError("give at least one rule: --max-peak, --max, --no-leak or --no-nan")
    return limits


def run_check(args: argparse.Namespace) -> int:
    """`memtui check`: the lines (or the JSON) on stdout, the exit code by the rules."""
    from memtui.model.recording import read_recording

    limits = limits_of(args)
    try:
        recording = read_recording(args.path)
    except UserError as exc:
        raise CheckInputError(str(exc)) from None
    if recording.warning:
        raise CheckInputError(
            f"{args.path}: {recording.warning}: memtui check judges whole recordings only "
            "(memtui report shows what is readable)"
        )
    status = recording.how_it_ended()
    result = msgspec.structs.replace(check(recording, limits), job=str(status))
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        lines = check_lines(result)
        broken = sum(not rule.ok for rule in result.rules)
        count = len(result.rules)
        closing = (
            f"memtui check: {'the rule holds' if count == 1 else f'all {count} rules hold'}"
            if result.ok
            else f"memtui check: {broken} of {count} {'rule' if count == 1 else 'rules'} broken"
        )
        lines.append(f"{closing} over {result.steps} steps (job {status})")
        print(terminal_safe("\n".join(lines), keep_newlines=True))
    return 0 if result.ok else EXIT_RULE_BROKEN
