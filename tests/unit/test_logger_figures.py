"""The dict the integrations hand a job's logger (`output.logger_figures`): the recorded frame's own
figures, a figure the frame does not state left out (never 0), alerts counted by severity and
leaks by holder across every message that carries them."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from memtui_agent.integrations import metrics
from memtui_agent.integrations.lightning_figures import LightningFigures
from memtui_agent.integrations.step_figures import StepFigures
from memtui_agent.output.logger_figures import LoggerFigures
from memtui_protocol import schema


def step(number: int, **fields: object) -> schema.Step:
    piles = schema.Piles(100, 100, 200, 50)
    return msgspec.structs.replace(schema.Step(number, 0.0, 1.0, piles, piles, piles), **fields)


def test_nothing_before_the_first_step() -> None:
    figures_so_far = LoggerFigures()
    assert figures_so_far.figures() == {}
    assert figures_so_far.step is None


def test_piles_at_the_peak_and_the_peak_as_recorded() -> None:
    figures_so_far = LoggerFigures()
    peak = schema.Piles(1000, 10, 2000, 3000)
    figures_so_far.offer(step(3, peak=peak, activations_measured=False, activations_from=2))
    figures = figures_so_far.figures()
    assert figures["memtui/step"] == 3
    assert figures["memtui/weights_bytes"] == 1000
    assert figures["memtui/gradients_bytes"] == 10
    assert figures["memtui/optimizer_state_bytes"] == 2000
    assert figures["memtui/activations_bytes"] == 3000
    assert figures["memtui/peak_bytes"] == 6010
    assert figures["memtui/activations_known"] == 1  # carried from step 2
    assert figures["memtui/activations_measured"] == 0
    assert "memtui/other_bytes" not in figures  # a CPU frame: no allocator peak


def test_activations_not_known_are_left_out_never_zero() -> None:
    figures_so_far = LoggerFigures()
    unknown = schema.Piles(1000, 10, 2000, None)
    figures_so_far.offer(step(4, peak=unknown, max=unknown, activations_measured=False))
    figures = figures_so_far.figures()
    assert "memtui/activations_bytes" not in figures
    assert "memtui/peak_bytes" not in figures  # a peak without a pile is not the peak
    assert figures["memtui/activations_known"] == 0
    assert figures["memtui/weights_bytes"] == 1000


def test_other_on_a_gpu_is_the_allocator_peak_beyond_the_peak_and_buffers() -> None:
    figures_so_far = LoggerFigures()
    figures_so_far.offer(
        step(
            1,
            allocator=schema.Allocator(peak_allocated=1000),
            distributed=schema.Distributed(ddp_buckets=300, ddp_in_gradients=100),
        )
    )
    figures = figures_so_far.figures()
    assert figures["memtui/peak_bytes"] == 450 + 200  # the piles, and the buckets no pile holds
    assert figures["memtui/other_bytes"] == 1000 - 450 - 200


def test_alerts_by_severity_and_leaks_by_holder_so_far() -> None:
    figures_so_far = LoggerFigures()
    note = schema.Alert(kind="first_step_forecast", message="m")
    nan = schema.Alert(kind="nonfinite_loss", message="m")
    warning = schema.Alert(kind="divergence", message="m")
    leak = schema.Leak(holder="history", kind="tensors", bytes=100, tensors=1, per_step=10,
                       first_step=1)  # fmt: skip
    figures_so_far.offer(step(1, alerts=[note]))
    figures_so_far.offer(schema.AlertNow(time=0.0, step=2, alert=nan))
    figures_so_far.offer(step(2, late=[schema.StepLate(step=1, alerts=[warning])], leaks=[leak]))
    grown = schema.Leak(holder="history", kind="tensors", bytes=300, tensors=3, per_step=10,
                        first_step=1)  # fmt: skip
    other = schema.Leak(holder="cache", kind="tensors", bytes=7, tensors=1, per_step=1,
                        first_step=2)  # fmt: skip
    figures_so_far.offer(step(3, leaks=[grown, other]))
    figures = figures_so_far.figures()
    assert figures["memtui/step"] == 3
    assert (figures["memtui/alerts_error"], figures["memtui/alerts_warning"]) == (1, 1)
    assert figures["memtui/alerts_note"] == 1
    assert figures["memtui/leaks"] == 2
    assert figures["memtui/leak_bytes"] == 307  # each holder's latest figure


def test_a_step_is_taken_once_and_nothing_without_an_agent() -> None:
    assert metrics() == {}  # no agent runs in the test process
    figures = StepFigures("test", {})
    assert figures.take() == {}


def test_a_failing_callback_says_so_once_and_turns_off(capsys: pytest.CaptureFixture[str]) -> None:
    figures = StepFigures("lightning-callback", {})
    figures.failed(RuntimeError("logger gone"))
    figures.failed(RuntimeError("again"))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "memtui: lightning-callback failed and is off for the rest of this run "
        "(RuntimeError: logger gone); the job continues"
    ]
    assert figures.off and figures.take() == {}


class Logger:
    def __init__(self, fails: bool = False) -> None:
        self.logged: list[tuple[dict[str, int], int]] = []
        self.fails = fails

    def log_metrics(self, metrics: dict[str, int], step: int) -> None:
        if self.fails:
            raise OSError("disk full")
        self.logged.append((metrics, step))


def test_lightning_logs_at_the_trainers_cadence_and_contains_a_failing_logger(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mixin alone (no Lightning needed): every logger gets the figures at
    `log_every_n_steps`; a logger that raises turns the callback off, said once, and never
    reaches the job."""
    taken = iter(range(1, 100))
    monkeypatch.setattr(StepFigures, "take", lambda self: {"memtui/step": next(taken)})
    callback = LightningFigures()
    callback._set_up(None, {})
    logger = Logger()
    for step in (1, 2, 3, 4):
        trainer = SimpleNamespace(global_step=step, log_every_n_steps=2, loggers=[logger])
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
    assert logger.logged == [({"memtui/step": 1}, 2), ({"memtui/step": 2}, 4)]
    broken = SimpleNamespace(global_step=6, log_every_n_steps=2, loggers=[Logger(fails=True)])
    callback.on_train_batch_end(broken, None, None, None, 5)
    callback.on_train_batch_end(broken, None, None, None, 6)
    assert capsys.readouterr().err.count("lightning-callback failed") == 1
    assert callback._figures.off
