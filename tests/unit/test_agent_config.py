"""One `AgentConfig` from the flags to the hooks (issue 16, point 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtui.commands.cli import agent_config, build_parser
from memtui.commands.run_command import build_job
from memtui_agent.startup.parts import AgentParts
from memtui_protocol.config import VARIABLES, AgentConfig
from memtui_protocol.schema import ActivationMode, NanCheck


def test_config_survives_the_environment() -> None:
    config = AgentConfig(
        record="/tmp/x.memtui",
        socket=False,
        argv=("python", "train.py", "--lr", "3e-4"),
        budget=24 * 10**9,
        nan_check=NanCheck.FULL,
        reset_peaks=True,
        snapshot_on_oom=True,
        alloc_events=True,
        activations=ActivationMode.EVERY,
        session="abc",
        metrics_port=9400,
        metrics_job="train",
        error_file="/tmp/error",
    )
    env = config.to_env()
    assert set(env) <= set(VARIABLES)
    assert AgentConfig.from_env(env) == config
    assert AgentConfig.from_env({}) == AgentConfig()


def test_a_malformed_environment_falls_back_to_defaults() -> None:
    env = {
        "MEMTUI_BUDGET": "lots",
        "MEMTUI_ARGV": "[not json",
        "MEMTUI_NAN_CHECK": "sometimes",
        "MEMTUI_ACTIVATIONS": "bogus",
    }
    assert AgentConfig.from_env(env) == AgentConfig()


def test_run_flags_reach_the_job_as_one_config(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    args = build_parser().parse_args(
        ["run", "--activations", "off", "--nan-check", "full", "--budget", "1GB", str(script)]
    )
    job = build_job(args.target, None, str(tmp_path / "r.memtui"), False, agent_config(args))
    config = AgentConfig.from_env(job.env)
    assert config.activations is ActivationMode.OFF
    assert config.nan_check is NanCheck.FULL
    assert config.budget == 10**9
    assert config.record == str((tmp_path / "r.memtui").resolve())
    assert config.session == job.session and job.session  # one token, set once


@pytest.mark.parametrize("command", ["run", "demo"])
def test_activations_flag_defaults_to_auto(command: str) -> None:
    args = build_parser().parse_args([command, *(["x.py"] if command == "run" else [])])
    assert agent_config(args).activations is ActivationMode.AUTO


def test_start_hands_the_config_to_the_tracker() -> None:
    import memtui_agent

    agent = memtui_agent.start(record=None, socket=False, activations="every")
    try:
        assert agent is not None and isinstance(agent.parts, AgentParts)
        assert agent.parts.gate.mode is ActivationMode.EVERY
        assert agent.parts.config is agent.config
    finally:
        memtui_agent.stop()
