"""What `memtui attach`/`detach` and the bootstrap inside the job say to each other.

The viewer writes one `AttachRequest` (JSON) into a private temporary folder; the bootstrap,
run by a pending call in the job, reads it, and the job answers in a reply file, replaced
atomically, whose `state` is an `Answer`. This module imports only the standard library and
`safe_open` (standard library only too): the bootstrap loads it by path inside a job that may
not be able to import memtui at all.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from memtui_protocol.safe_open import write_new


class Answer(str, Enum):
    """How far a request got, as the reply file says (the viewer waits for one of these)."""

    ARMED = "armed"
    """The hooks wait for the job's next step boundary."""
    STARTED = "started"
    """The agent runs on the training thread and records."""
    RUNNING = "running"
    """An agent was already running: nothing was done."""
    REFUSED = "refused"
    """Nothing was done (or what was done is undone); `message` says why."""
    DETACHING = "detaching"
    DETACHED = "detached"


class Action(str, Enum):
    """What a request asks of the job."""

    ATTACH = "attach"
    DETACH = "detach"


@dataclass(frozen=True)
class AttachRequest:
    """One request, written by the viewer and read by the bootstrap inside the job."""

    action: Action
    pid: int
    python: tuple[int, int]
    """The viewer's Python major.minor: memtui's own packages load only into the same one."""
    agent_dir: str
    """memtui's `memtui_agent` folder, for a job that cannot import its own."""
    protocol_dir: str
    """memtui's `memtui_protocol` folder, likewise."""
    dependency_paths: tuple[str, ...]
    """Where memtui's environment keeps the agent's dependencies (msgspec, psutil)."""
    reply: str
    deadline: float
    """Unix time after which the bootstrap does nothing (the viewer gave up)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The agent's options for an attach: `record`, `budget`, `nan_check`."""

    def to_json(self) -> str:
        """The request file's text."""
        raw = asdict(self)
        raw["action"] = self.action.value
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str) -> AttachRequest:
        """Parse a request file (written by memtui itself, in a folder only its user can use).

        Raises:
            ValueError: not a request of this version.
        """
        try:
            raw = json.loads(text)
            return cls(
                action=Action(raw["action"]),
                pid=int(raw["pid"]),
                python=(int(raw["python"][0]), int(raw["python"][1])),
                agent_dir=str(raw["agent_dir"]),
                protocol_dir=str(raw["protocol_dir"]),
                dependency_paths=tuple(str(entry) for entry in raw["dependency_paths"]),
                reply=str(raw["reply"]),
                deadline=float(raw["deadline"]),
                options=dict(raw.get("options") or {}),
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"not an attach request: {exc}") from None


def write_reply(path: str, state: Answer, message: str = "", **extra: Any) -> None:
    """Tell `memtui attach` how far we got: one small JSON file, replaced atomically.

    Never raises: the viewer then times out and says so; the job is not to be disturbed.
    """
    try:
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        document = json.dumps(dict(extra, state=state.value, message=message))
        write_new(temporary, document.encode("utf-8"))  # 0600, never through a link
        os.replace(temporary, path)
    except Exception:
        pass


def read_reply(path: str) -> dict[str, Any] | None:
    """The reply file as a dict with `state` an `Answer`; None if the job wrote none (yet)."""
    try:
        with open(path, encoding="utf-8") as handle:
            answer = json.load(handle)
        answer["state"] = Answer(answer["state"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return answer if isinstance(answer, dict) else None
