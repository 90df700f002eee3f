"""The memtui app: one screen over a Session, fed by any Source, redrawn at a fixed tick.

The source runs in one thread worker and only appends message batches to an inbox; a 2 Hz timer
(`TICK_SECONDS`) drains the inbox into the Session, takes one immutable ViewState and hands it to
every widget.
However fast frames arrive, the UI does one ingest and one redraw per tick, and memory is bounded
by the Session's own limits.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Protocol

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, RichLog

from memtui.input.job_process import JobProcess
from memtui.model.job_state import QuitChoice
from memtui.model.session import AlertMiss, Session
from memtui.model.view_model import ViewModel
from memtui.model.view_state import ViewState
from memtui.terminal_text import job_output
from memtui.tui.allocations import AllocationsTable
from memtui.tui.ranks import RanksTable
from memtui.tui.screens import AlertScreen, ConfirmDetach, ConfirmQuit, HelpScreen
from memtui.tui.timeline import PileTimeline
from memtui.tui.widgets import (
    AlertDetail,
    AlertsTable,
    DtypeTable,
    GapPanel,
    JobHeader,
    NotesLine,
    PilesPanel,
    TopActivations,
)
from memtui_protocol import schema

TICK_SECONDS = 0.5
"""How often a live view drains new frames and redraws (keys redraw at once). Each redraw of a
160x48 screen costs about 35 ms of the viewer's CPU, which a job sharing a small machine feels:
2 Hz keeps the viewer under a tenth of a core."""
STEP_ACTIONS = {
    "move",
    "home",
    "end",
    "next_alert",
    "toggle_units",
    "next_rank",
    "show_alert",
    "toggle_notes",
}
NARROW_WIDTH = 140


class Source(Protocol):
    """What the app reads: a recording, a socket, or a recording being written."""

    live: bool
    label: str

    def run(self, sink: Any, stop: threading.Event) -> str | None:
        """Feed message batches to `sink` until the stream ends; why it ended."""
        ...


class MemtuiApp(App[int]):
    """Live or replay, the same screen. The return value is the job's exit code (run mode)."""

    CSS_PATH = "app.tcss"
    TITLE = "memtui"
    BINDINGS = [
        # Footer order: the footer cuts from the right on a narrow terminal, and help must stay.
        Binding("q", "quit_app", "Quit"),
        # Textual's own ctrl+c only says "press ctrl+q"; here it is q, dialogs and all.
        Binding("ctrl+c", "quit_app", "Quit", show=False, priority=True),
        Binding("question_mark", "help", "Help"),
        Binding("space", "toggle_pause", "Pause"),
        # Priority: the step keys must work whichever panel (a table, the scrolling body) has
        # focus; tables keep up/down/Enter for their own rows.
        Binding("left", "move(-1)", "Step -1", show=False, priority=True),
        Binding("right", "move(1)", "Step +1", show=False, priority=True),
        Binding("home", "home", "First", show=False, priority=True),
        Binding("end", "end", "Last", show=False, priority=True),
        Binding("n", "next_alert(1)", "Next alert", priority=True),
        # Off the footer (in the help): at 80 columns every shown key must fit.
        Binding("N", "next_alert(-1)", "Prev alert", show=False, priority=True),
        Binding("a", "show_alert", "Alert", priority=True),
        Binding("o", "toggle_notes", "Notes", priority=True),
        Binding("u", "toggle_units", "GiB/GB", priority=True),
        Binding("r", "next_rank", "Rank", priority=True),
        Binding("tab", "focus_next", "Focus", show=False),
    ]

    def __init__(
        self,
        source: Source,
        *,
        job: JobProcess | None = None,
        warning: str | None = None,
        ranks: dict[str, Source] | None = None,
        attached: bool = False,
        injected: bool = False,
    ) -> None:
        """`attached`: opened by `memtui attach`; `injected`: that attach put the agent into a
        job started without memtui (quitting then asks what to do with the agent)."""
        super().__init__()
        self.source = source
        self.job = job
        self.attached = attached
        self.injected = injected
        self.quit_choice: QuitChoice | None = None
        """What the user chose for an attached agent when quitting (None: nothing asked)."""
        # One Session per rank of a session folder (or a single one); `r` switches between them.
        self.ranks: dict[str, Source] = ranks or {"": source}
        self.model = ViewModel(
            {label: (rank.label, rank.live) for label, rank in self.ranks.items()},
            warning,
            frozenset(
                label for label, rank in self.ranks.items() if getattr(rank, "following", False)
            ),
        )
        self.inboxes: dict[str, deque[list[schema.Message]]] = {
            label: deque() for label in self.ranks
        }
        self._stop = threading.Event()
        self._rendered_version: object = -1
        self._rendered_width = -1
        self._job_code: int | None = None
        self._pausable: bool | None = None

    @property
    def sessions(self) -> dict[str, Session]:
        """Every rank's Session (owned by the model)."""
        return self.model.sessions

    @property
    def selected(self) -> str:
        """The label of the rank on screen."""
        return self.model.selected

    @property
    def session(self) -> Session:
        """The Session of the rank on screen."""
        return self.model.session

    # ----- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        with VerticalScroll(id="body"):
            yield NotesLine(id="notes")
            # Shown only with several ranks (a session folder or a torchrun job).
            with Vertical(id="ranks-box", classes="box"):
                yield RanksTable(id="ranks")
            with Horizontal(id="top-row"):
                with Vertical(id="piles-box", classes="box"):
                    yield PilesPanel(id="piles")
                with Vertical(id="gap-box", classes="box"):
                    yield GapPanel(id="gap")
            with Vertical(id="timeline-box", classes="box"):
                yield PileTimeline(id="timeline")
            with Horizontal(id="bottom-row"):
                with Vertical(id="alerts-box", classes="box"):
                    yield AlertsTable(id="alerts")
                    yield AlertDetail(id="alert-detail")
                # One column beside the alerts: their messages get the rest of the width.
                with Vertical(id="side-column"):
                    with Vertical(id="dtypes-box", classes="box"):
                        yield DtypeTable(id="dtypes")
                    with Vertical(id="activations-box", classes="box"):
                        yield TopActivations(id="activations")
            # Hidden until the job sends allocator events (`--alloc-events`).
            with Vertical(id="allocations-box", classes="box"):
                yield AllocationsTable(id="allocations")
            if self.job is not None:
                with Vertical(id="output-box", classes="box"):
                    yield RichLog(id="output", max_lines=2000, wrap=False, markup=False)
        # Ctrl+P still opens Textual's command palette; its footer key would be the one cut
        # at 80 columns (memtui's keys are all in the help).
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        titles = {
            "piles-box": "Piles at the step's peak",
            "gap-box": "Where the bytes are",
            "timeline-box": "Piles over steps",
            "dtypes-box": "Dtypes",
            "activations-box": "Top activations by module",
            "allocations-box": "Allocations in the step (--alloc-events)",
            "ranks-box": "Ranks side by side (each pile's high in the rank's latest step; r: next)",
            "output-box": "Job output",
        }
        for box_id, title in titles.items():
            for box in self.query(f"#{box_id}"):
                box.border_title = title
        self._apply_width_class(self.size.width)
        if len(self.ranks) > 1:
            box = self.query_one("#ranks-box")
            box.styles.display = "block"
            box.styles.height = min(len(self.ranks), 8) + 3  # header, rows, border
        for label in self.ranks:
            self._read_source(label)
        self.set_interval(TICK_SECONDS, self.refresh_view)
        self.call_after_refresh(self._redraw)

    def on_resize(self, event: Any) -> None:
        self._apply_width_class(event.size.width)
        # The timeline's window depends on its width: redraw after the new layout settles.
        self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        self._rendered_version = -1
        self.refresh_view()

    def on_unmount(self) -> None:
        self._stop.set()

    def _apply_width_class(self, width: int) -> None:
        self.set_class(width < NARROW_WIDTH, "narrow")

    # ----- the source ---------------------------------------------------------------------

    @work(thread=True, exclusive=False, group="sources")
    def _read_source(self, label: str) -> None:
        try:
            reason = self.ranks[label].run(self.inboxes[label].append, self._stop)
        except Exception as exc:  # one handler for every source failure
            reason = f"{type(exc).__name__}: {exc}"
        self.call_from_thread(self._source_ended, reason, label)

    def _source_ended(self, reason: str | None, label: str) -> None:
        if not self.is_running or self._stop.is_set():
            return
        self.refresh_view()
        self.model.source_ended(label, reason)
        self.refresh_view()

    # ----- the tick -------------------------------------------------------------------------

    def refresh_view(self) -> None:
        """Drain the inbox, then redraw every widget from one view state if anything changed."""
        if not self.is_running or self._stop.is_set():
            return
        for label, inbox in self.inboxes.items():
            while inbox:
                self.model.ingest(label, inbox.popleft())
        if self.job is not None:
            lines = self.job.take_lines()
            if lines:
                output = self.query_one("#output", RichLog)
                for line in lines:
                    output.write(job_output(line))  # its colours, none of its other escapes
            if self._job_code is None:
                self._job_code = self.job.poll()
                if self._job_code is not None:
                    self.model.job_exited(self._job_code, self.job.stopped)
        pausable = self.session.still_recording()
        if pausable != self._pausable:  # the footer offers Pause only while frames arrive
            self._pausable = pausable
            self.refresh_bindings()
        timeline = self.query_one(PileTimeline)
        width = timeline.size.width
        version = self.model.version
        if version == self._rendered_version and width == self._rendered_width:
            return
        self._rendered_version = version
        self._rendered_width = width
        self.show(self.model.view_state(timeline_width=max(width - 12, 20)))

    def show(self, view: ViewState) -> None:
        """Hand each widget its own slice of the view state.

        A widget's reactive compares the slice with the one it holds and skips the widget when
        they are equal, so only the panels whose data moved are redrawn.
        """
        self.query_one(JobHeader).view = view.header
        self.query_one(NotesLine).view = view.notes
        self.query_one(PilesPanel).view = view.piles
        self.query_one(GapPanel).view = view.gap
        self.query_one(PileTimeline).view = view.timeline
        self.query_one(AlertsTable).view = view.alerts
        self.query_one("#alerts-box").border_title = view.alerts.title()
        self._show_alert_detail()
        self.query_one(DtypeTable).view = view.dtypes
        self.query_one(TopActivations).view = view.activations
        if view.ranks.rows:
            self.query_one(RanksTable).view = view.ranks
        box = self.query_one("#allocations-box")
        if box.display != view.allocations.recorded:
            box.display = view.allocations.recorded
        if view.allocations.recorded:
            self.query_one(AllocationsTable).view = view.allocations

    # ----- actions ---------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Step keys are priority bindings; on a dialog they step aside so it gets its keys."""
        if action == "next_rank" and len(self.ranks) < 2:
            return False  # a single job: no rank key in the footer
        if action == "toggle_pause" and not self.session.still_recording():
            return False  # a replay or an ended job: nothing arrives, nothing to pause
        if action == "move" and isinstance(self.focused, AlertsTable):
            return False  # ←/→ belong to the table the user is reading, not the step cursor
        return not (action in STEP_ACTIONS and isinstance(self.screen, ModalScreen))

    def _changed(self) -> None:
        self.refresh_view()

    def action_move(self, delta: int) -> None:
        self.session.move(delta)
        self._changed()

    def action_home(self) -> None:
        self.session.home()
        self._changed()

    def action_end(self) -> None:
        self.session.end_key()
        self._changed()

    def action_next_alert(self, direction: int) -> None:
        miss = self.session.next_alert(direction)
        if miss is not None:
            self.notify(alert_miss_text(miss), timeout=6)
        self._changed()

    def action_toggle_notes(self) -> None:
        self.session.toggle_notes()
        self._changed()

    def action_toggle_units(self) -> None:
        self.model.toggle_units()
        self._changed()

    def action_next_rank(self) -> None:
        self.model.next_rank()
        self._changed()

    def action_toggle_pause(self) -> None:
        if self.session.still_recording():
            self.session.toggle_pause()
            self._changed()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    @on(DataTable.RowHighlighted, "#alerts")
    def _show_alert_detail(self) -> None:
        """The alert under the table's cursor, whole, under the table (none: no line)."""
        details, tables = self.query(AlertDetail), self.query(AlertsTable)
        if not details or not tables:
            return  # a highlight that lands while the app shuts down (its widgets are gone)
        detail = details.first()
        detail.view = tables.first().alert_at_cursor()
        detail.display = detail.view is not None

    @on(DataTable.RowSelected, "#alerts")
    def _alert_selected(self) -> None:
        """Enter on an alert: the same as `a`."""
        self.action_show_alert()

    def action_show_alert(self) -> None:
        """The alert under the alerts table's cursor (the newest until the user moves it):
        the step cursor goes to its step, and a dialog shows all of it."""
        alert = self.query_one(AlertsTable).alert_at_cursor()
        if alert is None:
            self.notify("no alerts", timeout=3)
            return
        self.session.jump_to_step(alert.step)
        self._changed()
        self.push_screen(AlertScreen(alert))

    async def action_quit(self) -> None:
        """Textual's own quit key (ctrl+q) goes through the same checks as `q`."""
        self.action_quit_app()

    def action_quit_app(self) -> None:
        if isinstance(self.screen, (ConfirmQuit, ConfirmDetach)):
            return  # the question is on screen already (a second Ctrl+C)
        session = self.session
        hello = session.hello
        if (
            self.attached
            and hello is not None
            and session.still_recording()
            and (self.injected or session.agent_attached)
        ):

            def chosen(choice: QuitChoice | None) -> None:
                if choice is not None:
                    self.quit_choice = choice
                    self._finish()

            self.push_screen(ConfirmDetach(hello.pid, hello.recording), chosen)
            return
        if self.job is not None and self.job.poll() is None:

            def decide(kill: bool | None) -> None:
                if kill:
                    self.job.terminate() if self.job is not None else None
                    self._finish()

            self.push_screen(ConfirmQuit(), decide)
            return
        self._finish()

    def _finish(self) -> None:
        self._stop.set()
        code = self.job.wait() if self.job is not None else 0
        self.exit(code)


def alert_miss_text(miss: AlertMiss) -> str:
    """Why `n`/`N` did not move: no alert that way, or only alerts grouped under an earlier
    one (which are not stops: the first alert of their group is)."""
    way = "after" if miss.forward else "before"
    if not miss.grouped or miss.grouped_steps is None:
        return f"no alert {way} step {miss.step}"
    first, last = miss.grouped_steps
    where = f"step {first}" if first == last else f"steps {first}-{last}"
    return (
        f"no alert of its own {way} step {miss.step}: the {miss.grouped} alerts on {where} "
        f"follow from step {miss.group}'s (one folded row in the alerts table)"
    )


def run_app(app: MemtuiApp) -> int:
    """Run the app in the terminal; its exit code (the job's in run mode).

    A crash inside the app (Textual prints its traceback) is exit code 1, never a silent 0.
    """
    result = app.run()
    if app.return_code:
        return app.return_code
    return int(result) if result is not None else 0
