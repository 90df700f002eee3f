"""memtui's in-process agent, imported as `memtui_agent`.

Importing this package is cheap and never imports torch: the training job may import it long
before (or without ever) importing torch, and `memtui` itself imports `memtui_protocol.schema` and
`memtui_protocol.wire` in processes where torch is absent. torch is imported inside `start()`.
"""

from __future__ import annotations

from memtui_agent.startup.api import monitor, start, stop, watch

__version__ = "0.1.0"

__all__ = ["__version__", "monitor", "start", "stop", "watch"]
