"""Flower's commands are found beside the interpreter, not only on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

from flwr_prox_strategies._executables import (
    SCRIPTS_DIR,
    flower_env,
    flower_executable,
)


def test_a_python_whose_scripts_are_not_on_path_finds_flower_beside_it() -> None:
    """As a virtualenv's python run by its full path, not activated."""
    code = (
        "from flwr_prox_strategies._executables import flower_env, flower_executable\n"
        "print(flower_executable('flwr'))\n"
        "import subprocess\n"
        "out = subprocess.run(['flwr', '--version'], env=flower_env(),"
        " capture_output=True, text=True, check=True)\n"
        "print(out.stdout.strip())\n"
    )
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    assert str(SCRIPTS_DIR) not in env["PATH"].split(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    found, version = out.stdout.splitlines()
    assert Path(found) == SCRIPTS_DIR / "flwr"
    assert installed_version("flwr") in version


def test_the_command_beside_the_interpreter_comes_first() -> None:
    assert flower_executable("flwr") == str(SCRIPTS_DIR / "flwr")


def test_a_command_only_on_path_is_found_there(tmp_path, monkeypatch) -> None:
    tool = tmp_path / "flower-only-on-path"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert flower_executable("flower-only-on-path") == str(tool)


def test_a_missing_command_says_how_to_install_it() -> None:
    with pytest.raises(FileNotFoundError) as err:
        flower_executable("flower-no-such-command")
    message = str(err.value)
    assert sys.executable in message
    assert "pip install 'flwr-prox-strategies[experiment]'" in message


def test_flower_env_puts_the_interpreters_scripts_first_once() -> None:
    env = flower_env({"PATH": "/usr/bin", "OTHER": "1"})
    assert env["PATH"].split(os.pathsep) == [str(SCRIPTS_DIR), "/usr/bin"]
    assert env["OTHER"] == "1"
    assert flower_env(env)["PATH"] == env["PATH"]
