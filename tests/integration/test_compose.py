"""docker/docker-compose.yml cannot rot: every deltastream command it runs exists and
accepts its flags, and every DELTASTREAM_* variable it sets is read by that command.

Docker cannot run here, so the check runs the real entry points with ``--help``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "docker-compose.yml"
OUR_IMAGE = "deltastream:latest"


def _scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _services() -> dict[str, dict]:
    with open(COMPOSE) as f:
        doc = yaml.safe_load(f)  # resolves the x-deltastream anchor and `<<` merges
    return {name: svc for name, svc in doc["services"].items()
            if svc.get("image") == OUR_IMAGE}


def _help(entry: str, sub: list[str]) -> str:
    exe = Path(sys.executable).parent / entry
    assert exe.exists(), f"console script {entry} is not installed next to {sys.executable}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASTREAM_")}
    out = subprocess.run([str(exe), *sub, "--help"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, f"{entry} {' '.join(sub)} --help failed: {out.stderr[-2000:]}"
    return out.stdout


def test_compose_file_has_the_expected_services():
    services = _services()
    assert {"topic-init", "trainer", "predictor"} <= set(services)
    with open(COMPOSE) as f:
        doc = yaml.safe_load(f)
    kafka = doc["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft mode
    assert int(kafka["environment"]["KAFKA_MESSAGE_MAX_BYTES"]) >= 1 << 20


@pytest.mark.parametrize("service", sorted(_services()))
def test_every_command_exists_and_accepts_its_flags(service):
    svc = _services()[service]
    cmd = svc["command"]
    assert isinstance(cmd, list) and cmd, f"{service}: command must be an exec-form list"
    entry = cmd[0]
    assert entry in _scripts(), f"{service}: {entry} is not a console script of the project"
    sub = [cmd[1]] if entry == "deltastream" and len(cmd) > 1 and not cmd[1].startswith("-") \
        else []
    text = _help(entry, sub)
    flags = [a.split("=")[0] for a in cmd[1:] if a.startswith("--")]
    for flag in flags:
        assert re.search(rf"(^|\s){re.escape(flag)}(\s|,|=|$)", text, re.M), \
            f"{service}: {entry} {' '.join(sub)} does not accept {flag}"
    for var in svc.get("environment", {}):
        if var.startswith("DELTASTREAM_"):
            assert var in text, f"{service}: {entry} {' '.join(sub)} ignores {var}"
