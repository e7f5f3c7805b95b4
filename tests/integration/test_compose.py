"""docker/ cannot rot: every deltastream command docker-compose.yml runs exists and accepts
its flags, every DELTASTREAM_* variable it sets is read by that command (and is the tool's
own or a shared one), Kafka keeps its data on the volume, and the Dockerfile builds on a
base with Python 3.11+ and installs every package.

Docker cannot run here, so the check parses the files and runs the real entry points with
``--help``.
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
DOCKERFILE = REPO / "docker" / "Dockerfile"
OUR_IMAGE = "deltastream:latest"
SHARED_VARS = {"DELTASTREAM_BOOTSTRAP_SERVERS", "DELTASTREAM_KAFKA_CONFIG",
               "DELTASTREAM_LOG_LEVEL"}


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
    if "--help-env" not in out.stdout:
        return out.stdout
    # a brief --help (deltastream-sync): the variables are behind --help-env
    env_out = subprocess.run([str(exe), *sub, "--help-env"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert env_out.returncode == 0, env_out.stderr[-2000:]
    return out.stdout + env_out.stdout


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


def _tool_prefix(cmd: list[str]) -> str:
    if cmd[0] == "deltastream":
        return f"DELTASTREAM_{cmd[1].upper()}_"
    return "DELTASTREAM_" + cmd[0][len("deltastream-"):].upper() + "_"


@pytest.mark.parametrize("service", sorted(_services()))
def test_variables_are_the_tools_own_or_shared(service):
    """A flat DELTASTREAM_MODEL would be read by every tool; each service sets its tool's
    variables (DELTASTREAM_SYNC_MODEL) and only the truly shared ones without a tool name."""
    svc = _services()[service]
    prefix = _tool_prefix(svc["command"])
    for var in svc.get("environment", {}):
        assert (var in SHARED_VARS or var.startswith(prefix)
                or var.startswith("DELTASTREAM_KAFKA_")), f"{service}: {var}"


def test_kafka_keeps_its_log_on_the_volume():
    with open(COMPOSE) as f:
        kafka = yaml.safe_load(f)["services"]["kafka"]
    mounts = {v.split(":", 1)[1] for v in kafka["volumes"] if ":" in v}
    log_dirs = kafka["environment"].get("KAFKA_LOG_DIRS")
    assert log_dirs, "KAFKA_LOG_DIRS is not set: Kafka would write to /tmp, not the volume"
    assert set(str(log_dirs).split(",")) <= mounts, (log_dirs, mounts)


def _dockerfile() -> tuple[str, dict[str, str]]:
    text = DOCKERFILE.read_text()
    args = {k: v for k, _, v in re.findall(r'^ARG (\w+)=("?)([^"\n]*)\2$', text, re.M)}
    return text, args


def test_dockerfile_base_has_python_311_and_pip():
    text, args = _dockerfile()
    # the default and every base the comments suggest (a CUDA runtime base such as
    # nvidia/cuda has neither Python 3.11 nor pip: CUDA comes with the torch wheel)
    bases = [args["BASE_IMAGE"]] + re.findall(r"BASE_IMAGE=(\S+)", text)
    for base in bases:
        m = re.fullmatch(r"python:3\.(\d+)(-[\w.-]+)?", base)
        assert m and int(m.group(1)) >= 11, f"base image {base!r} is not a Python >= 3.11 image"
    assert "TORCH_INDEX_URL" in args and args["TORCH_INDEX_URL"].startswith("https://")
    assert re.search(r'pip install --index-url "\$TORCH_INDEX_URL" "\$TORCH_SPEC"', text)
    # the build stops early, with a message, on a base without Python 3.11+ and pip
    assert "sys.version_info >= (3, 11)" in text and "pip --version" in text


def test_dockerfile_copies_every_package():
    text, _ = _dockerfile()
    with open(REPO / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) ", text, re.M))
    for pattern in include:
        package = pattern.rstrip("*")
        assert package in copied, f"Dockerfile does not COPY the {package}/ package"
