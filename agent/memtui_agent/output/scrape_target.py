"""A rank's Prometheus `file_sd` target: `SESSION/prometheus/HOST-rankN.json`.

Prometheus' `file_sd_configs` watches a folder and reads every file matching its pattern, so a
rank that serves metrics announces itself with one small JSON file: its address and the labels
every series carries (`job, host, rank, local_rank, world_size`), which also land on
Prometheus' own `up` series for the target, so a rank whose endpoint died is still named.

Session folders are often shared (NFS, a 1777 scratch folder), and beside a single recording
`prometheus/` sits in whatever folder the recording is in. So the folder is trusted by the rule
session folders follow: opened once without following a link, it must be ours and writable by
nobody else (one another user made first could hold a target of theirs that points our
Prometheus elsewhere, or be swapped under us); else nothing is written, said once. The file is
written relative to that opened folder: a temporary name created with O_CREAT|O_EXCL|O_NOFOLLOW,
then renamed over the final name, which replaces a directory entry and never writes through a
link; Prometheus never reads a half-written file.

A system Prometheus runs as its own user (Debian's `prometheus`), so what it reads is readable by
others, explicitly whatever the job's umask: the folder 0755, each target 0644 (an address and
labels, nothing else). The session folder of a job with `--metrics-port` is 0711: others may pass
through it to `prometheus/`, never list it; every recording stays 0600.

Removed when the rank ends cleanly, and only if the name still holds the file this process
wrote (a rerun into the same folder may have replaced it). A killed rank leaves its file: then
Prometheus reports `up == 0` for it and `memtui cluster` lists the rank as stopped reporting.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from memtui_protocol.safe_open import (
    RefusedPath,
    Replace,
    create_in,
    open_or_make_folder,
    refusal,
)

TARGET_MODE = 0o644
TARGETS_FOLDER_MODE = 0o755


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


def open_targets_folder(folder: Path) -> int:
    """A descriptor of `folder` (made 0755 if missing), which must be ours and writable by
    nobody else: the rule of session folders.

    Raises:
        RefusedPath: a link, not a folder, another user's folder, or one others may write.
        OSError: it cannot be made or opened.
    """
    return open_or_make_folder(folder, TARGETS_FOLDER_MODE, private="the Prometheus target folder")


def write_target(path: Path, address: str, labels: dict[str, str]) -> ScrapeTarget:
    """Write the `file_sd` document for one target at `path`.

    Raises:
        OSError: the folder cannot be made or written, or is refused (`RefusedPath`).
    """
    document = json.dumps([{"targets": [address], "labels": labels}], indent=1) + "\n"
    folder = open_targets_folder(path.parent)
    try:
        reason = refusal(path)  # the folder is ours alone: nobody else can plant it meanwhile
        if reason is not None:
            raise RefusedPath(errno.EEXIST, reason)
        temporary = f".{path.name}.{os.getpid()}.tmp"
        # A leftover of a killed process whose pid this one has: ours alone to replace (the
        # folder is ours, nobody else writes in it).
        descriptor = create_in(
            folder, temporary, path.parent / temporary, TARGET_MODE, Replace.OWN_FILE
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(document)
                os.fchmod(handle.fileno(), TARGET_MODE)  # whatever the umask took away
                info = os.fstat(handle.fileno())
            os.rename(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=folder)
            except OSError:
                pass
            raise
    finally:
        os.close(folder)
    return ScrapeTarget(path, (info.st_dev, info.st_ino))
