"""The hooks the agent installs in the job and what they report to: module, saved-tensor,
gradient, optimizer and library-call hooks. They do constant-time work and hand events to the
step window and the activation gate (`memtui_agent.steps`)."""
