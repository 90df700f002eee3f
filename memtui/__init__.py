"""memtui: a live memory monitor for PyTorch training (the viewer side).

This package never imports torch: `memtui replay`, `report` and `attach` work where torch is not
installed. The TUI (Textual) is imported lazily by the commands that open it.
"""

__version__ = "0.1.0"
