"""`python -m memtui`: the same entry point as the `memtui` console script."""

from memtui.commands.cli import main

raise SystemExit(main())
