"""The `memtui` command line: one small function per subcommand.

Nothing heavy is imported at module level, so `memtui report` starts fast and never imports
torch. Every user error ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from memtui.errors import UsageError, UserError
from memtui.exit_codes import EXIT_PARTIAL, EXIT_USAGE
from memtui.terminal_text import json_safe, terminal_safe
from memtui_protocol.config import DEFAULT_METRICS_ADDR, AgentConfig
from memtui_protocol.estimate import Autocast, OptimizerKind
from memtui_protocol.schema import ActivationMode, NanCheck


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage plus error."""

    def error(self, message: str) -> NoReturn:
        print(
            f"memtui: error: {terminal_safe(message)} (see '{self.prog} --help')", file=sys.stderr
        )
        raise SystemExit(EXIT_USAGE)


MAX_WAIT_SECONDS = 86_400.0
"""The longest `attach`/`detach --timeout`: a day (a job's step may be slow, never that slow)."""


def _gpus_limit() -> int:
    from memtui.reports.estimate import MAX_GPUS

    return MAX_GPUS


def _cluster_timeout_limit() -> float:
    from memtui.input.prometheus_api import MAX_TIMEOUT_SECONDS

    return MAX_TIMEOUT_SECONDS


def _shown(text: str) -> str:
    """A value quoted in an error: cut when long (a 400-digit number is not read anyway)."""
    return repr(text if len(text) <= 64 else text[:40] + "...")


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {_shown(text)}")
    return int(text)


MAX_PID = 2**31 - 1


def _pid(text: str) -> int:
    """A process id: ASCII digits, 1 to 2**31 - 1 (`str.isdigit` alone takes '²')."""
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 0 < int(text) <= MAX_PID:
        raise argparse.ArgumentTypeError(f"not a process id: {_shown(text)}")
    return int(text)


def _whole(flag: str, low: int, high: Callable[[], int]) -> Callable[[str], int]:
    """An argparse type for a whole number from `low` to `high()` (`--gpus`; the limit's module
    is imported only when the flag is given)."""

    def parse(text: str) -> int:
        digits = text[1:] if text.startswith("-") else text
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {_shown(text)}")
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {low}, not {value}")
        if value > high():
            raise argparse.ArgumentTypeError(f"{flag} must be at most {high():,}, not {value}")
        return value

    parse.__name__ = "whole number"
    return parse


_RANK_LABEL = re.compile(r"(?:\d{1,9}|(?:proc|pid)-\d{1,9})")


def _rank_label(text: str) -> str:
    """`--rank`: a rank's number, or `proc-N` of a `-- COMMAND` folder (as its file names)."""
    if _RANK_LABEL.fullmatch(text) is None or not text.isascii():
        raise argparse.ArgumentTypeError(f"not a rank: {_shown(text)} (e.g. 0, 3, proc-1)")
    return str(int(text)) if text.isdigit() else text


def _module(text: str) -> str:
    """`-m MODULE`: a dotted name of identifiers, as Python's own `-m` takes (anything else
    would start a job only for Python to say it has no such module)."""
    if not _dotted(text):
        raise argparse.ArgumentTypeError(f"not a module name: {_shown(text)}")
    return text


def _dotted(text: str) -> bool:
    return 0 < len(text) <= 1000 and all(part.isidentifier() for part in text.split("."))


def _spec(flag: str) -> Callable[[str], str]:
    """`--model`/`--batch`/`--loss MODULE:CALLABLE` (or `FILE.py:CALLABLE`), checked here: a
    malformed one is refused before a child interpreter is started to import it (the child
    checks it again)."""

    def parse(text: str) -> str:
        module, sep, attribute = text.partition(":")
        if not (sep and (_dotted(module) or module.endswith(".py")) and _dotted(attribute)):
            raise argparse.ArgumentTypeError(
                f"{flag} expects module:callable, e.g. mypkg.models:build, not {_shown(text)}"
            )
        return text

    parse.__name__ = "module:callable"
    return parse


_ADDRESS = re.compile(r"[A-Za-z0-9._:%-]{1,255}")


def _address(text: str) -> str:
    """`--metrics-addr`: an IPv4 or IPv6 address or a host name (no brackets, no port)."""
    if _ADDRESS.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"not an address to bind: {_shown(text)} (e.g. 127.0.0.1, 0.0.0.0, ::1)"
        )
    return text


def _label(text: str) -> str:
    """`--metrics-job`: a Prometheus label value shown in tables and dashboards: printable,
    at most 256 characters."""
    from memtui_protocol.shown_text import UNSAFE

    if not text or len(text) > 256 or UNSAFE.search(text):
        raise argparse.ArgumentTypeError(
            f"not a job name: {_shown(text)} (1 to 256 printable characters)"
        )
    return text


def _seconds(maximum: float | Callable[[], float]) -> Callable[[str], float]:
    """An argparse type for a duration: a finite number of seconds above 0, at most `maximum`
    (NaN, infinities, negatives and 1e309 are refused here, not deep in a socket call).
    `maximum` may be a function, so the module that owns the limit is imported only when the
    flag is given."""

    def parse(text: str) -> float:
        limit = maximum() if callable(maximum) else maximum
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not 0 < value <= limit:  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0, at most {limit:g}")
        return value

    parse.__name__ = "seconds"  # what argparse names in its own messages
    return parse


def _size(text: str) -> int:
    from memtui_protocol.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their flags."""
    parser = _Parser(prog="memtui", description="Live memory monitor for PyTorch training.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = commands.add_parser(
        "run",
        help="run a training job under the agent",
        description="Run script.py, -m module, or -- COMMAND with the memtui agent injected.",
    )
    run.add_argument("--headless", action="store_true", help="no TUI; print a summary at the end")
    target = run.add_mutually_exclusive_group()
    target.add_argument("-o", "--output", metavar="PATH", help="recording file to write")
    target.add_argument("--no-record", action="store_true", help="write no recording")
    _force_flag(
        run,
        "-o may replace a file that is not a memtui recording (and, in the TUI, a "
        "PATH.log memtui did not write)",
    )
    run.add_argument("--budget", type=_size, metavar="SIZE", help="memory budget, e.g. 24GB")
    run.add_argument(
        "--nan-check",
        choices=[check.value for check in NanCheck],
        default=NanCheck.DEFAULT.value,
        help="NaN/Inf checks: one fused check per step, module outputs armed after an alarm "
        "(default); module outputs every step (full); none (off)",
    )
    run.add_argument(
        "--reset-peaks",
        action="store_true",
        help="CUDA: reset peak counters every step/phase (exact per-step peaks; your own "
        "max_memory_allocated() readings lose their meaning)",
    )
    run.add_argument(
        "--snapshot-on-oom",
        action="store_true",
        help="CUDA: dump a PyTorch memory snapshot beside the recording on out-of-memory",
    )
    run.add_argument(
        "--alloc-events",
        action="store_true",
        help="CUDA: record the allocator's history (bounded ring, Python stacks); each step "
        "lists its largest allocations with the source line, segment growth and any OOM",
    )
    _activations_flag(run)
    run.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics at /metrics, each rank on PORT + LOCAL_RANK (0: a free "
        "port each), and write each rank's file_sd target into the session folder's "
        "prometheus/ (needs pip install 'memtui[metrics]')",
    )
    run.add_argument(
        "--metrics-addr",
        type=_address,
        default=DEFAULT_METRICS_ADDR,
        metavar="ADDR",
        help="address the metrics endpoint binds to (default 127.0.0.1: this machine only; "
        "0.0.0.0 for a Prometheus on another machine)",
    )
    run.add_argument(
        "--metrics-job",
        type=_label,
        metavar="NAME",
        help="the metrics' job label (default: the session folder's name, else the "
        "recording's or the script's)",
    )
    run.add_argument(
        "-m", dest="module", type=_module, metavar="MODULE", help="run a module like python -m"
    )
    run.add_argument("target", nargs="*", help="script.py [args] | -- COMMAND [args]")

    attach = commands.add_parser("attach", help="watch a running job live")
    attach.add_argument(
        "pid",
        nargs="?",
        type=_pid,
        help="the job's pid (default: the only live job; with several, a list to choose from)",
    )
    attach.add_argument("--socket", metavar="PATH", help="a job's socket (e.g. SSH-forwarded)")
    attach.add_argument(
        "--list",
        action="store_true",
        help="print the live jobs with each rank's socket path (to forward over SSH) and exit",
    )
    attach.add_argument(
        "--headless",
        action="store_true",
        help="inject the agent into PID, print the recording's path and return once it records",
    )
    attach.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="where an injected agent records (PID started "
        "without memtui; default: memtui-<script>-<time>.memtui here)",
    )
    attach.add_argument(
        "--timeout",
        type=_seconds(MAX_WAIT_SECONDS),
        default=120.0,
        metavar="S",
        help="seconds to wait for the job's next step, where an injected agent starts",
    )
    attach.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="an injected agent serves Prometheus metrics on PORT + LOCAL_RANK (as memtui run)",
    )
    attach.add_argument(
        "--metrics-addr",
        type=_address,
        metavar="ADDR",
        help="the address it binds to (default 127.0.0.1)",
    )

    detach = commands.add_parser(
        "detach", help="stop the agent in a running job and remove its hooks; the job carries on"
    )
    detach.add_argument("pid", type=_pid, help="the job's pid")
    detach.add_argument(
        "--timeout",
        type=_seconds(MAX_WAIT_SECONDS),
        default=120.0,
        metavar="S",
        help="seconds to wait for the job",
    )

    replay = commands.add_parser("replay", help="open a recording in the TUI")
    replay.add_argument("path", help="a .memtui recording or a PyTorch memory snapshot")

    report = commands.add_parser("report", help="summarise a recording")
    report.add_argument("path", help="a .memtui recording or a PyTorch memory snapshot")
    report.add_argument("--json", action="store_true", help="print the JSON report")
    report.add_argument("--decimal", action="store_true", help="GB/MB instead of GiB/MiB")

    diff = commands.add_parser(
        "diff",
        help="compare two runs",
        description="Two recordings side by side: the piles' highs and ends, the peak, the "
        "modules whose activations moved, dtypes that appeared or vanished, alerts and leaks "
        "new in B, and the steps the runs share (docs/diff.md).",
    )
    diff.add_argument("a", metavar="A", help="the first run: a .memtui recording or a folder")
    diff.add_argument("b", metavar="B", help="the run compared to it: a recording or a folder")
    diff.add_argument(
        "--rank",
        type=_rank_label,
        metavar="R",
        help="in a session folder, the rank (or proc-N) to compare (default: 0, else the first)",
    )
    shown = diff.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print the diff as JSON")
    shown.add_argument("--tui", action="store_true", help="show the diff's table in the TUI")
    diff.add_argument("--decimal", action="store_true", help="GB/MB instead of GiB/MiB")

    export = commands.add_parser(
        "export",
        help="convert a recording for other tools",
        description="chrome-trace and csv write one file (default: beside the recording; "
        "'-o -': stdout). tensorboard writes TensorBoard event files into the folder -o DIR "
        "(default: RECORDING.tensorboard beside it), one run per rank (DIR/rank-N) for a "
        "session folder; open it with `tensorboard --logdir DIR` (needs pip install "
        "'memtui[tensorboard]').",
    )
    export.add_argument("path", help="a .memtui recording, or a session folder (tensorboard)")
    export.add_argument("--format", required=True, choices=["chrome-trace", "csv", "tensorboard"])
    export.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file, '-' for stdout (default: beside the recording, with its name: "
        "run.memtui -> run.trace.json or run.csv); with tensorboard the folder the runs go into",
    )
    _force_flag(export, "replace OUT if it exists (an existing file is refused without it)")

    cluster = commands.add_parser(
        "cluster",
        help="every rank of a job, from Prometheus",
        description="Read Prometheus' HTTP API for the metrics the ranks serve (memtui run "
        "--metrics-port): every rank worst first (least headroom, then highest peak), the "
        "imbalance between ranks, alerts per rank, ranks that stopped reporting. The TUI by "
        "default; --once prints a table, --json the JSON document.",
    )
    cluster.add_argument(
        "--prometheus", required=True, metavar="URL", help="e.g. http://127.0.0.1:9090"
    )
    cluster.add_argument(
        "--job", metavar="NAME", help="the job label (default: the one memtui job reporting)"
    )
    shown = cluster.add_mutually_exclusive_group()
    shown.add_argument("--once", action="store_true", help="print a table once and exit")
    shown.add_argument("--json", action="store_true", help="print the JSON document and exit")
    cluster.add_argument(
        "--timeout",
        type=_seconds(_cluster_timeout_limit),
        metavar="S",
        help="seconds all of Prometheus' answers may take together, one deadline "
        "(default 5; in the TUI, per refresh)",
    )

    estimate = commands.add_parser(
        "estimate",
        help="estimate training memory before training",
        description="Bytes per GPU for weights, gradients and optimizer state; with --batch "
        "also activations and peaks, measured over two training steps on fake tensors.",
    )
    counted = estimate.add_mutually_exclusive_group(required=True)
    counted.add_argument("--params", metavar="N", help="parameter count, e.g. 7B, 1.5B, 10M")
    counted.add_argument(
        "--model",
        type=_spec("--model"),
        metavar="MODULE:CALLABLE",
        help="count a model's parameters on the meta device",
    )
    counted.add_argument(
        "--from",
        dest="from_recording",
        metavar="RECORDING",
        help="with --budget: the checkpoint plan from a recorded run's measured blocks",
    )
    estimate.add_argument("--trainable", metavar="N", help="trainable parameters (default: all)")
    estimate.add_argument(
        "--scheme",
        choices=["fp32-sgd", "fp32-momentum", "fp32-adam", "mixed-adam"],
        help="bytes-per-parameter ledger (default: mixed-adam, 16 bytes; with --model the "
        "model's own dtype: fp32-adam for fp32 parameters)",
    )
    estimate.add_argument(
        "--batch",
        type=_spec("--batch"),
        metavar="MODULE:CALLABLE",
        help="the forward's keyword arguments: train --model two steps on fake tensors",
    )
    estimate.add_argument(
        "--optimizer",
        choices=[kind.value for kind in OptimizerKind],
        help="with --batch: the optimizer (default: adamw)",
    )
    estimate.add_argument(
        "--autocast", choices=[cast.value for cast in Autocast], help="with --batch"
    )
    estimate.add_argument(
        "--checkpointing",
        action="store_true",
        help="with --batch: checkpoint each block of the model's layer list",
    )
    estimate.add_argument(
        "--device-memory",
        type=_size,
        metavar="SIZE",
        help="with --batch: the GPU's memory, e.g. 80GB: verdict and what would fit",
    )
    estimate.add_argument(
        "--budget",
        type=_size,
        metavar="SIZE",
        help="with --batch: memory for the step's peak, e.g. 40GB: which blocks to checkpoint "
        "so it fits (default with --device-memory: the device less its reserve)",
    )
    estimate.add_argument(
        "--gpus",
        type=_whole("--gpus", 1, _gpus_limit),
        default=1,
        metavar="G",
        help="data-parallel GPUs",
    )
    estimate.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    estimate.add_argument(
        "--fsdp", action="store_true", help="with --batch: fully sharded (as ZeRO stage 3)"
    )
    estimate.add_argument(
        "--accum",
        type=_whole("--accum", 1, lambda: 10_000),
        default=1,
        metavar="K",
        help="with --batch: K microbatches of the batch per optimizer step (gradient accumulation)",
    )
    estimate.add_argument(
        "--loss",
        type=_spec("--loss"),
        metavar="MODULE:CALLABLE",
        help="with --batch: loss(output, batch) computes the loss from the forward's output "
        "(MODULE:CALLABLE or FILE.py:CALLABLE)",
    )
    estimate.add_argument(
        "--what-if",
        action="store_true",
        help="with --batch: a table of the same model under other batch, accumulation, "
        "precision, optimizer and sharding choices",
    )
    estimate.add_argument("--json", action="store_true", help="print the JSON estimate")

    from memtui.commands.check_command import add_check_parser

    add_check_parser(commands)

    demo = commands.add_parser(
        "demo",
        help="run the bundled small training job",
        description="Train the bundled tiny language model (CPU, or CUDA where there is one) "
        "under memtui, recorded like any job.",
        epilog=f"The demo's own arguments go to it: --steps N (default: {DEMO_STEPS} headless, "
        f"{DEMO_PACE['--steps']} in the TUI), --sleep S (seconds after each step: none "
        f"headless, {DEMO_PACE['--sleep']} in the TUI, so the screen can be watched), --batch, "
        "--seq, --dim, --layers, --accum, --bf16-from, --quiet, --seed; "
        "e.g. memtui demo --headless --steps 10.",
    )
    demo.add_argument(
        "--headless",
        action="store_true",
        help=f"no TUI: {DEMO_STEPS} steps (unless --steps), then a summary",
    )
    demo.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="recording file to write (default: memtui-demo-<time>.memtui here)",
    )
    _force_flag(demo, "-o may replace a file that is not a memtui recording")
    _activations_flag(demo)
    demo.add_argument("demo_args", nargs="*", help="arguments for the demo job (see below)")
    return parser


def _force_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`-f/--force`: memtui never overwrites a file it did not write unless told so."""
    parser.add_argument("-f", "--force", action="store_true", help=what)


def _activations_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--activations",
        choices=[mode.value for mode in ActivationMode],
        default=ActivationMode.AUTO.value,
        help="measure saved activations on the steps where they can change, carried to the "
        "steps that repeat them (auto, default); on every step (every); never (off)",
    )


def agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent's options from `memtui run`/`demo` flags (what a subcommand lacks: default):
    the flags' strings become `NanCheck` and `ActivationMode` here, once."""
    return AgentConfig(
        budget=getattr(args, "budget", None),
        nan_check=NanCheck(getattr(args, "nan_check", NanCheck.DEFAULT.value)),
        reset_peaks=getattr(args, "reset_peaks", False),
        snapshot_on_oom=getattr(args, "snapshot_on_oom", False),
        alloc_events=getattr(args, "alloc_events", False),
        activations=ActivationMode(args.activations),
        metrics_port=getattr(args, "metrics_port", None),
        metrics_addr=getattr(args, "metrics_addr", DEFAULT_METRICS_ADDR),
        metrics_job=getattr(args, "metrics_job", None),
    )


RUN_VALUE_FLAGS = {
    "-o",
    "--output",
    "--budget",
    "--nan-check",
    "--activations",
    "--metrics-port",
    "--metrics-addr",
    "--metrics-job",
}
"""Flags of `memtui run` that take a value (the splitter must skip that value too)."""


def split_job_argv(
    tokens: list[str], value_flags: set[str], own_flags: set[str] | None, module_flag: bool
) -> tuple[list[str], list[str]]:
    """Split arguments into memtui's own and the job's.

    The job's part starts at `--`, at the first token that is not one of memtui's flags, or (with
    `module_flag`) right after `-m MODULE`; everything from there on belongs to the job, flags
    included, so `memtui run -m mod --lr 3` passes `--lr 3` to the module.

    Args:
        value_flags: memtui's flags that take a value (the value is skipped too).
        own_flags: memtui's other flags; None means every flag before the job is memtui's
            (argparse then rejects the unknown ones).
        module_flag: whether `-m MODULE` ends memtui's part.
    """
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--":
            return tokens[:index], tokens[index + 1 :]
        if token in value_flags:
            index += 2
            continue
        if module_flag and token == "-m":
            return tokens[: index + 2], tokens[index + 2 :]
        if module_flag and token.startswith("-m") and len(token) > 2:
            return tokens[: index + 1], tokens[index + 1 :]
        is_own = token.startswith("-") if own_flags is None else token in own_flags
        if not is_own:
            return tokens[:index], tokens[index:]
        index += 1
    return tokens, []


DEMO_PACE = {"--steps": "60", "--sleep": "0.15"}
"""The demo's pace in the TUI: slow enough to watch live (about 20 s on a 2-core CPU)."""
DEMO_FLAGS = {"--headless", "-h", "--help", "-f", "--force"}
DEMO_VALUE_FLAGS = {"-o", "--output", "--activations"}
DEMO_STEPS = 30
"""The demo job's own default (`memtui_agent.demo.tiny_lm`), what a headless demo runs."""


def split_run_argv(tokens: list[str]) -> tuple[list[str], list[str]]:
    """`memtui run` arguments: memtui's, then the script, module or command with its own."""
    return split_job_argv(tokens, RUN_VALUE_FLAGS, None, module_flag=True)


def split_demo_argv(tokens: list[str]) -> tuple[list[str], list[str]]:
    """`memtui demo` arguments: memtui's own flags wherever they are (the demo has none of
    those names, so `memtui demo --steps 10 --headless` is what it reads as), anything else
    goes to the demo job; after `--`, everything does."""
    own: list[str] = []
    job: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        name = token.split("=", 1)[0]
        if token == "--":
            job.extend(tokens[index + 1 :])
            break
        if token in DEMO_FLAGS or (name in DEMO_VALUE_FLAGS and "=" in token):
            own.append(token)
        elif token in DEMO_VALUE_FLAGS:
            own.extend(tokens[index : index + 2])
            index += 1
        else:
            job.append(token)
        index += 1
    return own, job


def cmd_run(args: argparse.Namespace) -> int:
    """`memtui run`: the job as a child, the TUI in this process (or a summary, headless)."""
    from memtui.commands.bytecode import write_bytecode
    from memtui.commands.run_command import build_job, run_headless

    write_bytecode()  # the job imports the agent: compiled once, not at every start
    target = list(args.target)
    job = build_job(
        target, args.module, args.output, args.no_record, agent_config(args), args.force
    )
    if args.headless:
        return run_headless(job)
    from memtui.commands.tui_commands import run_tui

    return run_tui(job)


def demo_pace(extra: list[str]) -> list[str]:
    """The demo's arguments with the TUI pace added where the user gave none, so each
    argument appears once and the header shows what the demo really ran with."""
    given = {arg.split("=", 1)[0] for arg in extra}
    return [*(f"{flag}={value}" for flag, value in DEMO_PACE.items() if flag not in given), *extra]


def cmd_demo(args: argparse.Namespace) -> int:
    """`memtui demo`: the bundled tiny language model, recorded like any other job.

    In the TUI the demo runs a little slower (a pause per step) so it can be watched live.
    """
    from memtui.commands.bytecode import write_bytecode
    from memtui.commands.run_command import build_job, default_recording_name, run_headless

    write_bytecode()
    extra = list(args.demo_args)
    output = args.output or str(default_recording_name("demo"))
    if not args.headless:
        extra = demo_pace(extra)
    job = build_job(
        extra, "memtui_agent.demo.tiny_lm", output, False, agent_config(args), args.force
    )
    if args.headless:
        return run_headless(job)
    from memtui.commands.tui_commands import run_tui

    return run_tui(job, "demo")


def cmd_attach(args: argparse.Namespace) -> int:
    """`memtui attach [PID]`; a job started without memtui gets the agent injected first."""
    from memtui.commands.tui_commands import attach

    if args.list:
        from memtui.commands.tui_commands import list_live_jobs

        return list_live_jobs()
    if (args.headless or args.output) and args.pid is None:
        print("memtui: error: --headless and -o need a PID", file=sys.stderr)
        return EXIT_USAGE
    metrics = {"metrics_port": args.metrics_port, "metrics_addr": args.metrics_addr}
    if args.headless:
        from memtui.commands.attach_command import attach_headless

        return attach_headless(args.pid, args.output, args.timeout, **metrics)
    if args.pid is not None and args.socket is None:
        from memtui.commands.attach_command import (
            attach_for_viewer,
            job_below,
            launcher_refusal,
            refuse,
            running_agent,
        )

        if running_agent(args.pid) is None:
            below = job_below(args.pid)
            if below is not None and below.agent is not None:
                # `memtui run`'s launcher: its job is the child, already monitored. (Without a
                # terminal, attach's one-line refusal names the child and its recording.)
                if sys.stdin.isatty() and sys.stdout.isatty():
                    print(
                        f"memtui: pid {args.pid} is the launcher of its job, pid {below.pid}: "
                        f"attaching to pid {below.pid}",
                        file=sys.stderr,
                    )
                return attach(below.pid, None)
            if below is not None:
                return refuse(launcher_refusal(args.pid, below, headless=False))
            if not (sys.stdin.isatty() and sys.stdout.isatty()):
                print(
                    "memtui: error: memtui attach needs a terminal for its UI; without one, "
                    f"memtui attach {args.pid} --headless -o OUT records the job to OUT",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            injected = attach_for_viewer(args.pid, args.output, args.timeout, **metrics)
            if isinstance(injected, int):
                return injected
            return attach(None, injected, injected=True)
    return attach(args.pid, args.socket)


def cmd_detach(args: argparse.Namespace) -> int:
    """`memtui detach PID`."""
    from memtui.commands.attach_command import detach

    return detach(args.pid, args.timeout)


def cmd_replay(args: argparse.Namespace) -> int:
    """`memtui replay PATH`."""
    from memtui.commands.tui_commands import replay

    return replay(args.path)


def cmd_report(args: argparse.Namespace) -> int:
    """`memtui report PATH [--json]`."""
    from memtui.input.torch_snapshot import looks_like_snapshot
    from memtui.model.recording import read_recording
    from memtui.reports.report import render_text
    from memtui.reports.report_json import write_report_json

    if looks_like_snapshot(args.path):
        from memtui.reports.snapshot_report import report_snapshot

        return report_snapshot(args.path, args.json, binary=not args.decimal)
    if Path(args.path).is_dir():
        return report_session(Path(args.path), args.json, binary=not args.decimal)
    recording = read_recording(args.path)
    if args.json:
        write_report_json(recording, sys.stdout.write)  # streamed: its steps are not held
    else:
        print(terminal_safe(render_text(recording, binary=not args.decimal), keep_newlines=True))
    if recording.warning:
        warning = terminal_safe(f"{args.path}: {recording.warning}")
        print(f"memtui: warning: {warning}", file=sys.stderr)
        return EXIT_PARTIAL
    return 0


def report_session(folder: Path, as_json: bool, binary: bool) -> int:
    """`memtui report DIR`: a session folder with one recording per rank."""
    from memtui.reports.rank_report import build_session_report, read_session, render_session_text
    from memtui.reports.report_format import strict_json

    recordings, warnings = read_session(folder)
    if as_json:
        print(strict_json(build_session_report(recordings)))
    else:
        print(terminal_safe(render_session_text(recordings, binary), keep_newlines=True))
    for warning in warnings:
        print(f"memtui: warning: {terminal_safe(warning)}", file=sys.stderr)
    return EXIT_PARTIAL if warnings else 0


def cmd_check(args: argparse.Namespace) -> int:
    """`memtui check PATH [--max-peak SIZE] [--max PILE=SIZE]... [--no-leak] [--no-nan]`."""
    from memtui.commands.check_command import run_check

    return run_check(args)


def cmd_diff(args: argparse.Namespace) -> int:
    """`memtui diff A B [--rank R] [--json | --tui] [--decimal]`."""
    from memtui.commands.diff_command import diff_command

    return diff_command(args.a, args.b, args.rank, args.json, args.tui, not args.decimal)


def cmd_export(args: argparse.Namespace) -> int:
    """`memtui export PATH --format chrome-trace|csv|tensorboard [-o OUT] [--force]`."""
    from memtui.reports.export import export_command

    return export_command(args.path, args.format, args.output, args.force)


def cmd_cluster(args: argparse.Namespace) -> int:
    """`memtui cluster --prometheus URL [--job NAME] [--once|--json]`."""
    from memtui.commands.cluster_command import run_cluster
    from memtui.input.prometheus_api import TIMEOUT_SECONDS

    timeout = TIMEOUT_SECONDS if args.timeout is None else args.timeout
    return run_cluster(args.prometheus, args.job, args.once, args.json, timeout)


def cmd_estimate(args: argparse.Namespace) -> int:
    """`memtui estimate`: training memory per GPU, before renting any."""
    from memtui.reports.estimate import DEFAULT_SCHEME, estimate, parse_count, render_text
    from memtui.reports.model_count import ModelCountError, count_model

    if args.from_recording is not None:
        return cmd_estimate_from(args)
    if args.batch is not None:
        return cmd_estimate_step(args)
    step_only = (
        "--optimizer",
        "--autocast",
        "--checkpointing",
        "--device-memory",
        "--budget",
        "--fsdp",
        "--loss",
        "--what-if",
    )
    given = [flag for flag in step_only if getattr(args, flag[2:].replace("-", "_"))]
    if args.accum != 1:
        given.append("--accum")
    if given:
        raise UsageError(f"{given[0]} needs --model and --batch (a training step to measure)")
    try:
        trainable = None if args.trainable is None else parse_count(args.trainable)
        scheme, buffer_bytes = args.scheme or DEFAULT_SCHEME, 0
        if args.model is not None:
            # One weights figure for one model: its own dtype and its buffers, as --batch
            # measures them (a fp32 model's weights are not 2 bytes a parameter).
            model = count_model(args.model)
            params, buffer_bytes = model.params, model.buffer_bytes
            trainable = model.trainable if trainable is None else trainable
            scheme = args.scheme or model.scheme
        else:
            params = parse_count(args.params)
        result = estimate(params, trainable, scheme, args.gpus, args.zero or 0, buffer_bytes)
    except (ValueError, ModelCountError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json_safe(json.dumps(result.as_dict())))
    else:
        print(terminal_safe(render_text(result, args.model), keep_newlines=True))
    return 0


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cmd_estimate_from(args: argparse.Namespace) -> int:
    """`memtui estimate --from RECORDING --budget B`: the checkpoint plan from a real run's
    measured blocks (predicted, nothing trained: `memtui.reports.recorded_plan`)."""
    from memtui.model.recording import read_recording
    from memtui.reports.checkpoint_plan import budget_for
    from memtui.reports.recorded_plan import recorded_plan, recorded_plan_lines

    budget = budget_for(args.budget, args.device_memory)
    if budget is None:
        raise UsageError("--from needs --budget (or --device-memory): the plan fits a budget")
    for flag in ("batch", "scheme", "trainable", "optimizer", "autocast", "loss", "zero"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} is for a model's step; --from reads a recorded run")
    extra = [
        flag
        for flag, given in (
            ("--checkpointing", args.checkpointing),
            ("--fsdp", args.fsdp),
            ("--what-if", args.what_if),
            ("--accum", args.accum != 1),
            ("--gpus", args.gpus != 1),
        )
        if given
    ]
    if extra:
        raise UsageError(f"{extra[0]} is for a model's step; --from reads a recorded run")
    result = recorded_plan(read_recording(args.from_recording), budget)
    if args.json:
        print(json_safe(json.dumps(result)))
    else:
        print(terminal_safe("\n".join(recorded_plan_lines(result)), keep_newlines=True))
    return 0


def cmd_estimate_step(args: argparse.Namespace) -> int:
    """`memtui estimate --model M:F --batch M:F`: a training step measured on fake tensors."""
    from memtui.reports.checkpoint_plan import add_plan, budget_for, plan_lines
    from memtui.reports.model_estimate import (
        ModelEstimateError,
        Sharding,
        build_result,
        measure,
        render_model_text,
        variants_for,
    )
    from memtui.reports.what_if import render_what_if, what_if_table
    from memtui_protocol.estimate import FakeStepRequest, Variant, WhatIf

    if args.model is None:
        raise UsageError("--batch needs --model (the module whose step it feeds)")
    for flag, value in (("--scheme", args.scheme), ("--trainable", args.trainable)):
        if value is not None:
            raise UsageError(f"{flag} is for parameter counts; with --batch the step is measured")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be at least 1, not {args.gpus}")
    if args.fsdp and args.zero is not None:
        raise UsageError("give --fsdp or --zero, not both")
    request = FakeStepRequest(
        model=args.model,
        batch=args.batch,
        optimizer=OptimizerKind(args.optimizer or OptimizerKind.ADAMW.value),
        autocast=Autocast(args.autocast) if args.autocast else None,
        checkpointing=args.checkpointing,
        variants=variants_for(args.checkpointing, args.device_memory),
        accum=args.accum,
        loss=args.loss,
        what_ifs=list(WhatIf) if args.what_if else [],
    )
    budget = budget_for(args.budget, args.device_memory)
    if budget is not None:
        request.variants.append(Variant.BLOCKS)
    try:
        runs = measure(request)
    except ModelEstimateError as exc:
        raise UsageError(str(exc)) from None
    sharding = Sharding(args.gpus, args.zero or 0, args.fsdp)
    own = [run for run in runs if not run.get("what_if")]
    result = build_result(request, own, sharding, args.device_memory)
    if budget is not None:
        add_plan(result, request, own, sharding, budget, measure)
    text = render_model_text(result)
    if budget is not None:
        text += "\n\n" + "\n".join(plan_lines(result))
    if args.what_if:
        table = what_if_table(runs, result, args.device_memory, args.budget)
        result["what_if"] = table
        text += "\n\n" + "\n".join(render_what_if(table))
    if args.json:
        print(json_safe(json.dumps(result)))
    else:
        print(terminal_safe(text, keep_newlines=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `memtui` console script."""
    parser = build_parser()
    tokens = list(sys.argv[1:] if argv is None else argv)
    job_tokens: list[str] | None = None
    splitters = {"run": split_run_argv, "demo": split_demo_argv}
    if tokens and tokens[0] in splitters:
        own, job_tokens = splitters[tokens[0]](tokens[1:])
        tokens = [tokens[0], *own]
    args, unknown = parser.parse_known_args(tokens)
    if unknown:
        # Point at the subcommand's own help (`memtui run --help`), not the top level's.
        commands = _subcommands(parser)
        where = commands.get(args.command or "", parser)
        where.error(f"unrecognized arguments: {' '.join(unknown)}")
    if job_tokens is not None:
        setattr(args, "target" if args.command == "run" else "demo_args", job_tokens)
    if args.version:
        from memtui import __version__

        print(f"memtui {__version__}")
        return 0
    handlers = {
        "run": cmd_run,
        "report": cmd_report,
        "estimate": cmd_estimate,
        "demo": cmd_demo,
        "attach": cmd_attach,
        "detach": cmd_detach,
        "replay": cmd_replay,
        "export": cmd_export,
        "check": cmd_check,
        "diff": cmd_diff,
        "cluster": cmd_cluster,
    }
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return handlers[args.command](args)
    except UserError as exc:  # the one place a command's failure reaches the user
        print(f"memtui: error: {terminal_safe(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a path the system refuses outright (a name too long): one line
        named = f"{exc.filename}: " if exc.filename is not None else ""
        reason = exc.strerror or str(exc)
        print(f"memtui: error: {terminal_safe(named + reason)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
