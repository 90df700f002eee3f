"""When the DataLoader workers' private memory grows across steps: the rule, and nothing else.

A close hands the last sample of the workers (`worker_memory.WorkerSampler`) to `WorkerGrowth`.
Only a new sample taken while steps went on counts: a pause of the training (evaluation, a
checkpoint) adds no point. A healthy worker's USS rises while it starts (imports, its first
batches' buffers) and then moves by a few hundred KiB (measured: two workers of a numpy-backed
dataset, 24.1 -> 24.8 MiB over 4 s); a worker that copies a dataset's pages as it reads them grows
at every sample until it has touched all of them (two workers of a list of 40,000 dicts: +124 MiB
in one epoch). So the rule: the workers' summed growth rose by more than `NOISE` between at least
`GROWING` of the last `WINDOW` samples, and by `MIN_WINDOW` over them or by `MIN_TOTAL` since the
workers' first samples; or, once it reached `MIN_TOTAL`, at each of the last `SHORT` (a machine
so loaded that the sampler's thread wakes late: 6 samples in 190 steps on the fixture at load
average 10). A growth slower than `NOISE` a sample that stays under `MIN_TOTAL` is not told from
a worker's own noise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import pairwise

from memtui_protocol import schema

WINDOW = 5
"""Sample intervals the growth is judged over."""
GROWING = 4
"""Of those, how many must grow by more than `NOISE`."""
NOISE = 512 * 1024
"""Growth of the summed USS between two samples that counts as growing."""
MIN_WINDOW = 8 * 1024 * 1024
"""Growth over the window that makes it sustained..."""
MIN_TOTAL = 64 * 1024 * 1024
"""...or growth since the workers' first samples, for a slow but steady one."""
SHORT = 3
"""Sample intervals that suffice, all growing, once the growth reached `MIN_TOTAL`."""


@dataclass(frozen=True)
class Sustained:
    """Growth found sustained at a close."""

    growth: int
    """The workers' summed growth since their first samples, as last sampled."""
    since: int
    """The step the growth began at: the first close whose sample saw these workers."""
    per_step: int
    """`growth` over the steps since `since`."""


class WorkerGrowth:
    """Decides, close after close, whether the workers' memory keeps growing."""

    def __init__(self) -> None:
        self._points: deque[tuple[int, int]] = deque(maxlen=WINDOW + 1)
        """(step, growth) at the closes that brought a new sample."""
        self._samples = -1
        self._count: int | None = None
        self._since: int | None = None
        self.highest = 0
        """The highest summed growth seen (the leak's bytes: the most the workers took)."""

    def at_close(self, step: int, samples: int, reading: schema.Workers | None) -> Sustained | None:
        """One close: `samples` counts the sampler's samples so far, `reading` is the last."""
        if reading is None:
            self._points.clear()
            self._count = self._since = None
            return None
        if samples == self._samples:
            return None  # no new sample since the last close
        self._samples = samples
        dropped = bool(self._points) and reading.growth < self._points[-1][1] - NOISE
        if reading.count != self._count or dropped:
            # Another set of workers (a new epoch's, `persistent_workers=False`): afresh.
            self._points.clear()
            self._count = reading.count
            self._since = step
        if self._points and self._points[-1][0] == step:
            return None
        self._points.append((step, reading.growth))
        self.highest = max(self.highest, reading.growth)
        if not self.sustained():
            return None
        since = self._since if self._since is not None else step
        per_step = reading.growth // max(1, step - since)
        return Sustained(reading.growth, since, per_step)

    def sustained(self) -> bool:
        """Growth above the noise at nearly every sample of the window, and enough of it; or,
        with fewer samples (a loaded machine samples late), growth at each of the last `SHORT`
        and `MIN_TOTAL` in all."""
        points = list(self._points)
        deltas = [later[1] - earlier[1] for earlier, later in pairwise(points)]
        recent = deltas[-SHORT:]
        if len(recent) == SHORT and points[-1][1] >= MIN_TOTAL and min(recent) > NOISE:
            return True
        if len(deltas) < WINDOW:
            return False
        deltas = deltas[-WINDOW:]
        grew = sum(1 for delta in deltas if delta > NOISE)
        window = points[-1][1] - points[-WINDOW - 1][1]
        return grew >= GROWING and (window >= MIN_WINDOW or points[-1][1] >= MIN_TOTAL)
