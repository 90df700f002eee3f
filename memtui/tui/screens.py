"""Modal screens: the key help, the quit confirmation, and the list of live jobs to attach to."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Static

from memtui.model.job_state import QuitChoice
from memtui.model.step_rows import AlertRow, format_age
from memtui.terminal_text import plain
from memtui.tui.palette import SEVERITY_STYLES, alert_style

HELP_KEYS = (
    ("q / Ctrl+C", "quit (asks first if the job or an attached agent runs)"),
    ("space", "pause / resume the live view"),
    ("← / →", "previous / next step (not while in the alerts table)"),
    ("Home / End", "first / newest step (End follows live frames again)"),
    ("n / N", "next / previous step with an alert"),
    ("Enter / a", "the chosen alert whole; the cursor goes to its step"),
    ("o", "alerts: show the notes too (healthy runs raise them)"),
    ("u", "binary units (GiB) / decimal units (GB)"),
    ("r", "next rank (a job with several ranks)"),
    ("Tab", "focus the next panel (alerts table: ↑/↓ pick an alert)"),
    ("↑↓ PgUp PgDn", "scroll the screen, or the table with focus"),
    ("?", "this help; Esc closes it"),
)
HELP_NOTES = (
    "Piles: each storage once. The peak: the piles at their highest plus DDP/FSDP buffers, in "
    'every view; "other" (GPU only): the allocator\'s peak minus it. Gap rows: what each '
    "difference is made of.",
    "≈ next to activations: the step repeated a measured one and carries its figures.",
)
"""Paragraphs, one string each: the dialog wraps them at word boundaries to its own width
(hard line breaks cut phrases in two as soon as the dialog is narrower than the text)."""


def help_renderable() -> Group:
    """The keys as a two-column grid (descriptions wrap under themselves), then the notes."""
    keys = Table.grid(padding=(0, 2))
    keys.add_column(no_wrap=True, style="bold")
    keys.add_column(ratio=1)
    for key, meaning in HELP_KEYS:
        keys.add_row(key, meaning)
    notes = [Text(note) for note in HELP_NOTES]
    return Group(Text("memtui keys", style="bold"), Text(""), keys, Text(""), *notes)


class HelpScreen(ModalScreen[None]):
    """Every key, and how to read the numbers."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        # Scrolls where the terminal is shorter than the help: no line is ever cut off.
        with VerticalScroll(id="help-dialog", classes="dialog"):
            yield Static(help_renderable(), id="help-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class AlertScreen(ModalScreen[None]):
    """One alert whole: its step and kind, the whole message, and every name in `where` (a
    list of parameters can be longer than any panel). It scrolls where the screen is short."""

    BINDINGS = [Binding("escape,enter,q,a", "dismiss", "Close")]

    def __init__(self, alert: AlertRow) -> None:
        super().__init__()
        self.alert = alert

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="alert-dialog", classes="dialog"):
            yield Static(alert_renderable(self.alert), id="alert-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


def alert_renderable(alert: AlertRow) -> Group:
    """The alert as the dialog shows it: a title line, the message, then `where`."""
    title = Text(f"{alert.severity} at step {alert.step}: ", style=SEVERITY_STYLES[alert.severity])
    title.append_text(plain(alert.kind, style=alert_style(alert.kind)))
    parts: list[Text] = [title, Text(""), plain(alert.message)]
    if alert.where:
        parts += [Text(""), Text("where: ", style="bold") + plain(alert.where, style="cyan")]
    parts += [
        Text(""),
        Text(f"The step cursor is on step {alert.step}. Esc or Enter closes.", style="dim"),
    ]
    return Group(*parts)


class ConfirmQuit(ModalScreen[bool]):
    """Quitting while the job runs would kill it: ask first."""

    BINDINGS = [
        Binding("y", "answer(True)", "Kill the job"),
        Binding("n,escape", "answer(False)", "Keep it running"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog", classes="dialog"):
            yield Static("The job is still running. Quit and stop it? [b]y[/b] / [b]n[/b]")
            with Horizontal(id="confirm-buttons"):
                yield Button("Stop the job and quit", id="yes", variant="error")
                yield Button("Keep watching", id="no", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class ConfirmDetach(ModalScreen[QuitChoice | None]):
    """Quitting a viewer of a job `memtui attach` put the agent into: the agent would stay and
    keep recording. Ask whether to detach it or leave it recording (None: keep watching)."""

    BINDINGS = [
        Binding("d", "answer('detach')", "Detach"),
        Binding("l", "answer('leave')", "Leave it recording"),
        Binding("escape,n", "answer(None)", "Keep watching"),
    ]

    def __init__(self, pid: int, recording: str | None) -> None:
        super().__init__()
        self.pid = pid
        self.recording = recording

    def compose(self) -> ComposeResult:
        where = plain(self.recording) if self.recording else Text("no file (a socket only)")
        question = Text.assemble(
            "Quit: ",
            ("d", "bold"),
            f"etach the agent from pid {self.pid} (it writes its last frame and removes its "
            "hooks; the job carries on), or ",
            ("l", "bold"),
            "eave the agent recording to ",
            where,
            f"? (memtui detach {self.pid} stops it later.) Esc: keep watching.",
        )
        with Vertical(id="detach-dialog", classes="dialog"):
            yield Static(question, id="detach-question")
            with Horizontal(id="confirm-buttons"):
                yield Button("Detach and quit", id="detach", variant="primary")
                yield Button("Leave it recording and quit", id="leave")
                yield Button("Keep watching", id="stay")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        choices = {"detach": QuitChoice.DETACH, "leave": QuitChoice.LEAVE}
        self.dismiss(choices.get(event.button.id or ""))

    def action_answer(self, value: str | None) -> None:
        self.dismiss(QuitChoice(value) if value is not None else None)


class AttachScreen(ModalScreen[dict[str, Any] | None]):
    """This user's live jobs: pid, command, age, recording. Enter attaches."""

    BINDINGS = [Binding("escape,q", "cancel", "Cancel")]

    def __init__(self, jobs: list[dict[str, Any]], now: float | None = None) -> None:
        super().__init__()
        self.jobs = jobs
        self.now = now if now is not None else time.time()

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-dialog", classes="dialog"):
            yield Static("[b]Live jobs[/b]: choose one and press Enter")
            yield DataTable(id="jobs", cursor_type="row")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("pid", "command", "age", "recording")
        for job in self.jobs:
            age = max(0.0, self.now - float(job.get("started_unix") or self.now))
            table.add_row(
                plain(job["pid"]),
                plain(
                    (" ".join(job.get("argv") or [])[:60])
                    + (f" [{len(job['ranks'])} ranks]" if "ranks" in job else "")
                ),
                format_age(age),
                plain(job.get("recording") or "(not recording)"),
                key=str(job["pid"]),
            )
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        for job in self.jobs:
            if str(job["pid"]) == event.row_key.value:
                self.dismiss(job)
                return

    def action_cancel(self) -> None:
        self.dismiss(None)
