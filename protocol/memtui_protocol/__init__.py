"""What the agent and the viewer share, torch-free by construction: imported as `memtui_protocol`.

The message schema and its framing (`schema`, `wire`), the agent's configuration as it travels
through the environment (`config`), sizes and units (`units`), the private runtime folder and its
sidecars (`runtime_dir`), opening files without following planted links (`safe_open`), the
notes a process leaves for `memtui run` (`notes`), and the request/answer types of `memtui
attach` (`attach`) and `memtui estimate` (`estimate`). Every module
here imports only the standard library and msgspec (an import-linter contract in pyproject.toml
and `tests/integration/test_import_boundaries.py` hold it), so the viewer can import it where
torch is absent and the agent can import it inside a training job without pulling in anything
of the viewer.
"""
