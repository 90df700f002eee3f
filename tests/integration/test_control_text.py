"""No raw control, format or bidi character reaches a terminal or a JSON document (issue 27, R1).

The adversarial round found the TUI header and `memtui run`'s summary printing an `End`'s status
and phase raw (a complete OSC 52 clipboard write and an OSC 0 title), the Job output pane passing
the job's own escapes (OSC 52, cursor moves), `report --json` passing C1 and bidi controls
(U+0085, U+009B, U+202E, U+2066) and the text report passing zero-width and format characters.
One rule (`terminal_text.UNSAFE`) and three functions now cover every place such text is shown.
"""

from __future__ import annotations

import json
import subprocess
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui
from recording_files import write_recording
from rich.text import Text

from memtui.terminal_text import UNSAFE, job_output, json_safe, terminal_safe
from memtui_protocol import schema

OSC52 = "\x1b]52;c;cHduZWQ=\x07"
OSC0 = "\x1b]0;owned\x1b\\"
CURSOR = "\x1b[2A\x1b[2K\x1b[10;10H"
C1_BIDI = "\x85\x9b31m\u202e\u2066"
INVISIBLE = "\u200b\ufeff\u00ad\u2060\U000e0041\u061c"
EVIL = OSC52 + OSC0 + CURSOR + C1_BIDI + INVISIBLE + "\x7f"
ZERO = schema.Piles()


def _unsafe_in(text: str) -> list[str]:
    """The unsafe characters of `text`, newlines apart (memtui's own line breaks)."""
    return sorted({hex(ord(char)) for char in text if char != "\n" and UNSAFE.fullmatch(char)})


def test_the_rule_covers_every_control_format_and_separator_code_point() -> None:
    """Every Cc, Cf, Zl, Zp and Cs code point of this Python's Unicode is unsafe, and nothing
    unsafe is a character a terminal shows (letters, marks, spaces, symbols)."""
    for code in range(0x110000):
        char = chr(code)
        category = unicodedata.category(char)
        unsafe = UNSAFE.fullmatch(char) is not None
        if category in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            assert unsafe, hex(code)
        elif unsafe:
            assert category == "Cn", (hex(code), category)  # format controls of newer Unicode


def test_terminal_and_json_escapes() -> None:
    shown = terminal_safe(EVIL + " ok")
    assert not _unsafe_in(shown) and shown.endswith(" ok")
    assert "\\x1b]52" in shown and "\\u202e" in shown and "\\U000e0041" in shown
    document = json.dumps({"text": EVIL}, ensure_ascii=False)
    safe = json_safe(document)
    assert not _unsafe_in(safe)
    assert json.loads(safe) == {"text": EVIL}  # the same value, escaped
    assert "\\udb40\\udc41" in safe  # beyond the BMP: a surrogate pair, as JSON spells it


def test_job_output_keeps_colours_and_drops_every_other_sequence() -> None:
    line = job_output(f"\x1b[31mred\x1b[0m {OSC52}{CURSOR}done\x9b2J{INVISIBLE}\x1b")
    assert isinstance(line, Text)
    assert not _unsafe_in(line.plain)
    assert line.plain.startswith("red done")
    assert "\\u200b" in line.plain
    assert [(span.start, span.end, str(span.style)) for span in line.spans] == [(0, 3, "color(1)")]


def _hello() -> schema.Hello:
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version=f"v{EVIL}",
        pid=1,
        argv=["python", f"train{EVIL}.py"],
        started="2026-01-01T00:00:00+00:00",
        started_unix=1.0,
        hostname=f"host{EVIL}",
        device=f"cpu{EVIL}",
        torch=f"2{EVIL}",
    )


def _messages() -> list[schema.Message]:
    alert = schema.Alert(kind=f"oom{EVIL}", message=f"boom{EVIL}", where=f"layer{EVIL}")
    step = schema.Step(
        1,
        1.0,
        1.5,
        schema.Piles(1, 2, 3, 4),
        schema.Piles(1, 2, 3, 4),
        schema.Piles(1, 2, 3, 4),
        dtypes={"weights": {f"float32{EVIL}": schema.DtypeStat(1, 1)}},
        alerts=[alert],
        top_activations=[schema.ModuleBytes(0, 4)],
        optimizer=f"Adam{EVIL}#1",
        optimizer_step=1,
        leaks=[schema.Leak(f"cache{EVIL}", f"tensors{EVIL}", 8, 1, 1, 1)],
    )
    second = schema.Step(2, 2.0, 2.5, ZERO, ZERO, ZERO, optimizer="SGD#2", optimizer_step=1)
    return [
        _hello(),
        schema.Names(kind="module", first_id=0, names=[f"encoder{EVIL}"]),
        step,
        second,
        schema.AgentError(time=2.0, component=f"c{EVIL}", message=f"m{EVIL}"),
        schema.End(
            time=3.0,
            status=f"error{OSC52}",
            code=1,
            error_type=f"E{EVIL}",
            error=f"x{EVIL}",
            step=2,
            phase=f"forward{OSC0}",
        ),
    ]


def _memtui(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, cwd=cwd, timeout=120)


@pytest.mark.slow  # starts an interpreter
def test_report_json_escapes_c1_bidi_and_format_characters(tmp_path: Path) -> None:
    path = write_recording(tmp_path / "evil.memtui", _messages())
    result = _memtui("report", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert not _unsafe_in(result.stdout + result.stderr)
    document = json.loads(result.stdout)
    assert document["job"]["argv"][1] == f"train{EVIL}.py"  # the recorded value, unchanged
    assert document["exit"]["phase"] == f"forward{OSC0}"


@pytest.mark.parametrize("extra", [[], ["--decimal"]])
@pytest.mark.slow  # starts an interpreter
def test_text_report_escapes_zero_width_and_format_characters(
    tmp_path: Path, extra: list[str]
) -> None:
    path = write_recording(tmp_path / "evil.memtui", _messages())
    result = _memtui("report", str(path), *extra)
    assert result.returncode == 0, result.stderr
    assert not _unsafe_in(result.stdout + result.stderr)
    assert "\\u200b" in result.stdout and "\\x1b]52" in result.stdout


@pytest.mark.parametrize("fmt", ["csv", "chrome-trace"])
@pytest.mark.slow  # starts an interpreter
def test_exports_to_stdout_escape_recorded_text(tmp_path: Path, fmt: str) -> None:
    path = write_recording(tmp_path / "evil.memtui", _messages())
    result = _memtui("export", str(path), "--format", fmt, "-o", "-")
    assert result.returncode == 0, result.stderr
    assert not _unsafe_in(result.stdout + result.stderr)


WRITER = """
import sys
from memtui_protocol import schema, wire
messages = [schema.Hello(format_version=schema.FORMAT_VERSION, agent_version="x", pid=1,
                         argv=["python"], started="", started_unix=1.0),
            schema.End(time=2.0, status=sys.argv[2], phase=sys.argv[3])]
open(sys.argv[1], "wb").write(wire.preamble() + b"".join(wire.encode(m) for m in messages))
"""


@pytest.mark.slow  # starts an interpreter
def test_run_summary_escapes_the_recorded_status_and_phase(tmp_path: Path) -> None:
    """The job's recording says how it ended; the summary printed it raw."""
    script = tmp_path / "writes_its_own.py"
    script.write_text(WRITER)
    out = tmp_path / "out.memtui"
    result = _memtui(
        "run", "--headless", "-o", str(out), str(script), str(out), f"done{OSC52}", f"p{OSC0}"
    )
    assert result.returncode == 0, result.stderr
    assert "memtui: job done\\x1b]52" in result.stderr
    assert not _unsafe_in(result.stderr)


def test_tui_header_and_output_pane_show_no_raw_escapes(tui: Any) -> None:
    """The header showed the End's status and phase raw; the output pane the job's escapes.
    Every cell of the screen is checked, so any widget that shows recorded text raw fails."""
    from textual.widgets import RichLog

    from memtui.tui.app import MemtuiApp
    from memtui.tui.widgets import JobHeader

    job = tui.FakeJob([f"\x1b[32mloss 0.5\x1b[0m{OSC52}", f"{CURSOR}epoch 2{OSC0}{C1_BIDI}"])
    app = MemtuiApp(tui.source(_messages(), live=False), job=job)

    async def body(pilot: Any) -> None:
        await pilot.pause()
        header = tui.plain(app.query_one(JobHeader))
        assert "\\x1b]52" in header and not _unsafe_in(header)
        output = app.query_one("#output", RichLog)
        texts = ["".join(segment.text for segment in line) for line in output.lines]
        assert any(text.startswith("loss 0.5") for text in texts), texts
        assert any("epoch 2" in text for text in texts), texts
        styles = [str(seg.style) for line in output.lines for seg in line if "loss" in seg.text]
        assert "color(2)" in styles, styles  # the job's green, kept
        screen = app.export_screenshot()
        assert not _unsafe_in(screen), _unsafe_in(screen)

    tui.drive(app, body)
