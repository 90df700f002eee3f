"""Divergence: the loss or the global gradient norm growing by orders of magnitude in a few
steps, said while the values are still finite, before the NaN it leads to.

A diverging run (a learning rate far too high, a loss scale gone wrong) multiplies its loss and
gradient norm by a large factor at every step until they overflow; the NaN alerts then come a
few steps too late to say why. This watch reads each step's mean loss and global gradient norm
(the health check's, `grad_norm`) in step order and raises one `divergence` alert per episode.

The rule, for each of the two signals (the loss, while it has never been negative, and the
gradient norm), over its
finite values at the last `RECENT` steps before t (at least one for the loss, two for the norm:
`LEAST`; steps of an open episode are not counted), is that the value at step t is all of:

- at least `GROWTH` times the lowest of them: grown by orders of magnitude within `RECENT`
  steps;
- at least `OVER_MEDIAN` times their median: one low step (a batch the model fits well) is not
  the baseline;
- above every value the signal had outside an episode so far: a loss near zero that rises 100x
  to a level the run had early on is a spike, not a divergence.

Why these numbers clear healthy runs (early falls, warm-ups, spikes, large sum-reduced losses)
is in docs/numbers.md#divergence. The episode began at the first step of the unbroken run of
steps above `BEGAN` times that lowest value that ends at t. It stays open (no second alert; the
non-finite alerts that follow name it) until every signal is back under `RECOVERED` times its
lowest value before the episode.

Pure Python, no torch: tests feed it sequences of losses and norms.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

GROWTH = 100.0
"""How many times its lowest recent value a signal must reach to have diverged."""
RECENT = 5
"""The steps a growth by `GROWTH` must happen within."""
OVER_MEDIAN = 10.0
"""How many times the recent median it must reach as well (robust to one low step)."""
BEGAN = 3.0
"""A step above this many times the baseline is part of the climb (the episode's start)."""
LEAST = {"loss": 1, "gradient norm": 2}
"""Earlier values a signal needs before it can diverge. The loss: one, so the users' lr=1e4 run
is said at step 2 (a loss 100x its first value, the run's highest so far, is no warm-up). The
norm: two, as its first value may be far below the next for reasons of the job's own (the first
step clipped before unscaling, a zero-initialised layer whose gradients start at step 2); with
two the median is no longer that one value."""
RECOVERED = 10.0
"""An episode ends when every signal is back under this many times its baseline."""
FIXES = (
    "lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), "
    "or check the loss scale (GradScaler)"
)
"""What the alert tells the user to try, in the order that most often fixes it."""


class Rise:
    """One signal's divergence at a step: its value, the baseline it grew from, and the first
    step of the climb."""

    __slots__ = ("baseline", "began", "name", "value")

    def __init__(self, name: str, value: float, baseline: float, began: int) -> None:
        self.name = name
        self.value = value
        self.baseline = baseline
        self.began = began

    def words(self, step: int) -> str:
        """`the loss rose 2.9e+14x in 1 step (1.41 before, 4.14e+14 at step 2)`."""
        steps = step - self.began + 1
        ratio = self.value / self.baseline
        times = f"{ratio:,.0f}" if ratio < 1e6 else f"{ratio:.2g}"
        return (
            f"the {self.name} rose {times}x in {steps} step{'s' if steps > 1 else ''} "
            f"({self.baseline:.3g} before, {self.value:.3g} at step {step})"
        )


class Signal:
    """One signal's recent history outside episodes, and the rule over it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.recent: deque[tuple[int, float]] = deque(maxlen=RECENT)
        self.highest = -math.inf
        self.baseline: float | None = None
        """The baseline of the open episode (None outside one)."""
        self.climb: list[tuple[int, float]] = []
        """Values since the last one kept in `recent`, while an episode is open."""

    def rise(self, step: int, value: float) -> Rise | None:
        """Whether `value` at `step` is a divergence of this signal (pure in its history)."""
        if len(self.recent) < LEAST[self.name] or value <= self.highest:
            return None
        seen = [v for _, v in self.recent]
        baseline = min(seen)
        if baseline <= 0 or value < GROWTH * baseline:
            return None
        if value < OVER_MEDIAN * statistics.median(seen):
            return None
        began = step
        for earlier, kept in reversed(self.recent):
            if kept <= BEGAN * baseline:
                break
            began = earlier
        return Rise(self.name, value, baseline, began)

    def keep(self, step: int, value: float) -> None:
        """Count a value outside an episode."""
        self.recent.append((step, value))
        self.highest = max(self.highest, value)

    def recovered(self, value: float | None) -> bool:
        """Whether a value read during an episode is back near the baseline this signal rose
        from (a signal that did not rise in the episode does not hold it open)."""
        if self.baseline is None:
            return True
        return value is not None and value < RECOVERED * self.baseline


class Episodes:
    """One optimizer's loss and gradient norm in step order, and its open episode if any."""

    def __init__(self) -> None:
        self.loss = Signal("loss")
        self.norm = Signal("gradient norm")
        self.began: int | None = None
        """The first step of the open episode's climb (None outside one)."""
        self.alerted: int | None = None
        """The step of the open episode's alert."""
        self.signed = False
        """The loss was negative once (a critic's, a log-likelihood): growth by a factor means
        nothing for a value that crosses zero, so only the gradient norm is read from then on."""

    def read(self, step: int, loss: float | None, norm: float | None) -> schema.Alert | None:
        """One step's mean loss and gradient norm (None or non-finite where not known); the
        divergence alert when this step starts an episode."""
        if loss is not None and loss < 0:
            self.signed = True
        values = (
            (self.loss, None if self.signed else _finite(loss)),
            (self.norm, _finite(norm)),
        )
        if self.began is not None:
            if all(signal.recovered(value) for signal, value in values):
                self.began = self.alerted = None
                for signal, _ in values:
                    signal.baseline = None
            else:
                return None
        rises = []
        for signal, value in values:
            rise = signal.rise(step, value) if value is not None else None
            if rise is not None:
                signal.baseline = rise.baseline
                rises.append(rise)
        if not rises:
            for signal, value in values:
                if value is not None:
                    signal.keep(step, value)
            return None
        self.began = min(rise.began for rise in rises)
        self.alerted = step
        return schema.Alert(
            kind=AlertKind.DIVERGENCE,
            message=f"training is diverging from step {self.began}: "
            + " and ".join(rise.words(step) for rise in rises)
            + f"; NaN usually follows. To fix: {FIXES}",
            began=self.began,
        )


MAX_OPTIMIZERS = 16
"""Optimizers watched apart; steps of any further one share one history (bounded memory)."""


class DivergenceWatch:
    """The episodes of each optimizer's steps: a GAN's discriminator and generator losses differ
    by orders of magnitude and alternate step by step, so each is compared with its own."""

    def __init__(self) -> None:
        self.optimizers: dict[str | None, Episodes] = {}

    def read(
        self, step: int, loss: float | None, norm: float | None, optimizer: str | None = None
    ) -> schema.Alert | None:
        """One step of `optimizer` (its name, None for a step a backward closed)."""
        if optimizer not in self.optimizers and len(self.optimizers) >= MAX_OPTIMIZERS:
            optimizer = None
        episodes = self.optimizers.setdefault(optimizer, Episodes())
        return episodes.read(step, loss, norm)

    def _open(self) -> Episodes | None:
        """The open episode that began first, if any."""
        open_ = [e for e in self.optimizers.values() if e.began is not None]
        return min(open_, key=lambda e: e.began or 0) if open_ else None

    @property
    def began(self) -> int | None:
        """The first step of the open episode that began first (None outside any)."""
        first = self._open()
        return first.began if first is not None else None

    def after(self) -> str | None:
        """What a non-finite alert adds while an episode is open: the divergence it follows."""
        first = self._open()
        if first is None:
            return None
        alerted = f", alerted at step {first.alerted}" if first.alerted != first.began else ""
        return f"after the divergence that began at step {first.began}{alerted}"


def _finite(value: float | None) -> float | None:
    """A signal's finite value, or None (not known, or already non-finite)."""
    if value is None or not math.isfinite(value):
        return None
    return value


def divergence_alerts(
    losses: Sequence[float | None],
    norms: Sequence[float | None] | None = None,
    optimizers: Sequence[str | None] | None = None,
) -> list[tuple[int, int]]:
    """(alert step, first step of the climb) for each episode over steps numbered from 1:
    the rule as a pure function of the sequences (tests, docs/numbers.md#divergence)."""
    watch = DivergenceWatch()
    norms = norms if norms is not None else [None] * len(losses)
    optimizers = optimizers if optimizers is not None else [None] * len(losses)
    found = []
    for step, (loss, norm, optimizer) in enumerate(
        zip(losses, norms, optimizers, strict=True), start=1
    ):
        alert = watch.read(step, loss, norm, optimizer)
        if alert is not None and alert.began is not None:
            found.append((step, alert.began))
    return found
