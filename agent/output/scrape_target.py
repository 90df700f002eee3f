"""A rank's Prometheus `file_sd` target: `SESSION/prometheus/HOST-rankN.json`.

Prometheus' `file_sd_configs` watches a folder and reads every file matching its pattern, so a
rank that serves metrics announces itself with one small JSON file: its address and the labels
every series carries (`job, host, rank, local_rank, world_size`), which also land on
Prometheus' own `up` series for the target, so a rank whose endpoint died is still named.

Session folders are often shared (NFS, a 1777 scratch folder), so the file is written the way
recordings are: a temporary name created with O_CREAT|O_EXCL|O_NOFOLLOW (never through a link
someone planted), then renamed over the final name, which replaces a directory entry and never
writes through a link; Prometheus never reads a half-written file. The folder must be a real
directory, not a link. Mode 0644: the file holds only an address and labels, and a system
Prometheus runs as its own user.

Removed when the rank ends cleanly, and only if the name still holds the file this process
wrote (a rerun into the same folder may have replaced it). A killed rank leaves its file: then
Prometheus reports `up == 0` for it and `memtui cluster` lists the rank as stopped reporting.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from memtui_protocol.safe_open import RefusedPath, create_private, refusal

TARGET_MODE = 0o644


class ScrapeTarget:
    """A target file this process wrote, identified by device and inode."""

    def __init__(self, path: Path, identity: tuple[int, int]) -> None:
        self.path = path
        self._identity = identity

    def remove(self) -> None:
        """Unlink the file if the name still holds ours (never raises)."""
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                os.unlink(self.path)
        except OSError:
            pass


def _real_folder(folder: Path) -> None:
    """Make `folder` if missing; refuse a link or a non-directory there."""
    try:
        os.mkdir(folder, 0o755)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise RefusedPath(0, f"{folder}: is not a directory (a link?); refusing to write there")


def write_target(path: Path, address: str, labels: dict[str, str]) -> ScrapeTarget:
    """Write the `file_sd` document for one target at `path`.

    Raises:
        OSError: the folder cannot be made or written, or the name is refused (`RefusedPath`).
    """
    _real_folder(path.parent)
    reason = refusal(path)
    if reason is not None:
        raise RefusedPath(0, reason)
    document = json.dumps([{"targets": [address], "labels": labels}], indent=1) + "\n"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = create_private(temporary, mode=TARGET_MODE)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(document)
            os.fchmod(handle.fileno(), TARGET_MODE)  # whatever the umask took away
            info = os.fstat(handle.fileno())
        os.rename(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return ScrapeTarget(path, (info.st_dev, info.st_ino))
