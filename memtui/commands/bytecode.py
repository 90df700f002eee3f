"""Write the bytecode cache of memtui's own packages before a job starts under the agent.

A job under `memtui run` imports about forty agent modules. Without their bytecode cache each
start compiles them all again, and the job pays for it: 0.11 s of a 1.6 s `import torch` script
here (`memtui run --headless` with and without the cache). pip writes the cache when it
installs a package normally; an editable install (`pip install -e .`, as the README has it)
does not, and `PYTHONDONTWRITEBYTECODE`, which some machines and images set, stops Python from
writing it at import. So the launcher writes it for memtui's three packages, when it is missing or
older than the source: once per change, about 0.1 s; checking an up-to-date cache costs about
1.5 ms. Best effort: a read-only install just compiles at each start, as before. Nothing else is
written, and the job's own modules are never touched.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

PACKAGES = ("memtui_protocol", "memtui_agent", "memtui")


def package_folders(names: Iterable[str] = PACKAGES) -> list[Path]:
    """The source folders of the installed packages `names` (those that can be found)."""
    folders: list[Path] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            folders.extend(Path(location) for location in spec.submodule_search_locations)
    return folders


def write_bytecode(folders: Iterable[Path] | None = None) -> bool:
    """Compile each `.py` under `folders` (default: memtui's packages) whose cache is stale.

    True when every cache is now current; False when one could not be written (read-only
    folder, full disk), which only means that those modules compile at import as before.
    """
    import compileall

    written = True
    for folder in package_folders() if folders is None else folders:
        try:
            # py_compile writes regardless of sys.dont_write_bytecode; quiet=2 prints nothing.
            written = bool(compileall.compile_dir(str(folder), quiet=2)) and written
        except (OSError, ValueError):
            written = False
    return written
