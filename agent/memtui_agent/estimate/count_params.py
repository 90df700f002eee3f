"""Count a model's parameters without allocating them, on the meta device.

`python -m memtui_agent.estimate.count_params M:F` prints them as one JSON line.

`memtui estimate --model module:callable` runs this in a child process because the viewer never
imports torch (docs/design.md#the-shape), and because a user's module may do anything on import.
The callable runs under `torch.device("meta")`, so a 70B model is built in a second with no
memory: meta tensors have shapes and dtypes but no storage.

Prints one JSON line: `params`, `trainable`, `param_bytes` (the parameters' bytes in the dtype
the model is built in) and `buffer_bytes`. On any failure it prints one line on stderr and exits
2; `memtui` shows that line as its own error.

Known limitations: `model.parameters()` counts each Parameter object once, so weights tied by
sharing one Parameter (the usual way) count once; two distinct Parameters that are views of one
storage would count twice, because meta tensors have no storage pointer to compare. Buffers are
counted as weights (`buffer_bytes`), as the agent's ledger counts them. A callable that loads a
checkpoint from disk cannot do so on the meta device and fails with its own error.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from typing import Any

from memtui_protocol.estimate import EXIT_FAILED


class CountError(Exception):
    """A failure the user can act on, already phrased as one sentence."""


def one_line(exc: BaseException) -> str:
    """An exception as `Type: first line of its message` (a child's one-line reason)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def resolve(spec: str, flag: str = "--model") -> Any:
    """The callable `module:attr.path` (or `file.py:attr.path`) names, importing its module.

    Raises:
        CountError: the spec is malformed, its module fails to import, or it names nothing
            callable; one sentence naming `flag`.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise CountError(f"{flag} expects module:callable, e.g. mypkg.models:build, not {spec!r}")
    try:
        target: Any = (
            _import_file(module_name)
            if module_name.endswith(".py")
            else importlib.import_module(module_name)
        )
    except Exception as exc:
        raise CountError(f"cannot import {module_name!r}: {one_line(exc)}") from None
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise CountError(f"{module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, attr)
    if not callable(target):
        raise CountError(f"{spec!r} is not callable")
    return target


def _import_file(path: str) -> Any:
    """A module from a file path (`losses.py:nll`), as `python path` would load it."""
    import importlib.util

    found = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    if found is None or found.loader is None or not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path}")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def count(spec: str) -> dict[str, int]:
    """Build the model on the meta device and count its unique parameters.

    Raises:
        CountError: the module, the callable or the model could not be had.
    """
    try:
        import torch
    except ImportError:
        raise CountError("--model needs torch in this Python; give --params instead") from None
    factory = resolve(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        raise CountError(f"{spec} raised {one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise CountError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    params = trainable = param_bytes = 0
    for parameter in model.parameters():  # yields a shared (tied) Parameter only once
        params += parameter.numel()
        param_bytes += parameter.numel() * parameter.element_size()
        if parameter.requires_grad:
            trainable += parameter.numel()
    # Buffers (batch norm's statistics, a causal mask) are weights too, as `memtui run` and
    # `--batch` count them: the same figure whatever the flags.
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return {
        "params": params,
        "trainable": trainable,
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    """Count, print one JSON line; user output goes to stderr so stdout stays parseable."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m memtui_agent.estimate.count_params module:callable", file=sys.stderr
        )
        return EXIT_FAILED
    # `python -m` already puts the working directory first; a direct call to main() may not.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = count(args[0])
    except CountError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    except SystemExit as exc:
        print(f"{args[0]} called sys.exit({exc.code!r})", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
