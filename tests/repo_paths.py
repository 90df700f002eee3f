"""Where the tests find the repository and their fixtures, wherever in tests/ a test file lives.

Importable by name because pytest puts `tests/` on `sys.path` (`pythonpath` in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parent.parent
"""The repository's root (the checkout CI clones)."""
FIXTURES: Final = REPO / "tests" / "fixtures"
"""Recordings, jobs and models the tests share."""
