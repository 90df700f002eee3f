"""Getting the agent into a job and out again: the public API (`start`, `stop`, `monitor`,
`watch`), the `Agent` that wires the hooks to the output, `memtui run`'s runner and bootstrap
`sitecustomize`, autostart under `-- COMMAND`, and the stop signal from memtui."""
