"""Bootstrap for `memtui run -- COMMAND`: arm the agent in every Python process of the command.

Python imports this module at start-up because `memtui run` put its folder first on PYTHONPATH.
It chains to the user's own `sitecustomize` (if any), then arms the agent to start when the job
imports torch. It never raises: a broken install must not stop the user's command.
"""

import os
import sys


def _chain_user_sitecustomize() -> None:
    """Import the next `sitecustomize` on sys.path, as if ours were not there."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get("sitecustomize")
    removed = [entry for entry in sys.path if os.path.abspath(entry or ".") == here]
    positions = [sys.path.index(entry) for entry in removed]
    for entry in removed:
        sys.path.remove(entry)
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the user's, found past our folder)
    except ImportError:
        pass
    except Exception as exc:
        print(f"memtui: your sitecustomize raised {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.modules["sitecustomize"] = ours
        for position, entry in sorted(zip(positions, removed, strict=True)):
            sys.path.insert(position, entry)


def _arm() -> None:
    try:
        from memtui_agent import autostart
    except Exception as exc:
        print(f"memtui: agent unavailable in this interpreter ({exc})", file=sys.stderr)
        return
    try:
        autostart.arm_from_environment(install_exit_handlers=True)
    except Exception as exc:
        print(f"memtui: agent not armed ({type(exc).__name__}: {exc})", file=sys.stderr)


_chain_user_sitecustomize()
_arm()
