"""Run mypy over memtui's three packages by their import names.

The folders are not named as the packages import (`agent/` is `memtui_agent`, `protocol/` is
`memtui_protocol`: setuptools' package-dir), and mypy follows neither an editable install's
import hook nor package-dir. So this links each package under its import name in a temporary
folder and checks them there, with the settings in pyproject.toml. Paths in mypy's messages are
then given back relative to the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"memtui_protocol": "protocol", "memtui_agent": "agent", "memtui": "memtui"}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="memtui-mypy-") as folder:
        for name, source in PACKAGES.items():
            os.symlink(ROOT / source, Path(folder) / name)
        command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        for name in PACKAGES:
            command += ["-p", name]
        result = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, "MYPYPATH": folder},
            capture_output=True,
            text=True,
        )
        output = result.stdout + result.stderr
        for name, source in PACKAGES.items():
            output = output.replace(f"{folder}/{name}/", f"{source}/")
        sys.stdout.write(output)
        return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
