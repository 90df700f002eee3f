"""memtui's pytest plugin, imported as `memtui_pytest` (docs/check.md#in-pytest).

`pytest --memtui` runs every test under memtui's agent in the test's own process;
`@pytest.mark.memtui(max_peak="64MiB", no_leak=True)` does so for one test and fails it when its
recording breaks one of `memtui check`'s rules. Registered through the `pytest11` entry point:
importing the plugin imports neither torch, the agent nor the viewer, so a run that uses
neither the flag nor the marker pays nothing for it.
"""

from __future__ import annotations
