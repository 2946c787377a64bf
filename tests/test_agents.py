"""Resolving ``agent=`` in all its forms, and its two errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from trl_harbor.training.agents import AGENTS, resolve_agent
from trl_harbor.training.env import HarborBashEnv, HarborBashStepsEnv, HarborEnv

HARNESS_SOURCE = textwrap.dedent(
    '''
    from trl_harbor import HarborEnv


    class EchoEnv(HarborEnv):
        """A harness with one tool."""

        def echo(self, text: str) -> str:
            """Echo text in the sandbox.

            Args:
                text: What to echo.

            Returns:
                The output.
            """
            return self._exec("echo " + text)


    class NotAnEnv:
        pass
    '''
)


class LocalEnv(HarborBashEnv):
    """A harness defined in the test module."""


def test_builtin_name() -> None:
    assert resolve_agent("bash") is HarborBashEnv
    assert resolve_agent("bash_steps") is HarborBashStepsEnv
    assert {"bash": HarborBashEnv} == AGENTS  # the reference's built-ins, exactly


def test_class() -> None:
    assert resolve_agent(LocalEnv) is LocalEnv
    assert resolve_agent(HarborEnv) is HarborEnv


def test_module_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "my_harnesses"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(HARNESS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = resolve_agent("my_harnesses.echo:EchoEnv")
    assert cls.__name__ == "EchoEnv" and issubclass(cls, HarborEnv)
    assert resolve_agent("trl_harbor.training.env:HarborBashEnv") is HarborBashEnv
    sys.modules.pop("my_harnesses.echo", None)
    sys.modules.pop("my_harnesses", None)


def test_file_path(tmp_path: Path) -> None:
    path = tmp_path / "harness dir" / "env.py"
    path.parent.mkdir()
    path.write_text(HARNESS_SOURCE)
    cls = resolve_agent(f"{path}:EchoEnv")
    assert cls.__name__ == "EchoEnv" and issubclass(cls, HarborEnv)
    # loading the same file again yields the same class (one module per file)
    assert resolve_agent(f"{path}:EchoEnv") is cls


def test_relative_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "env.py").write_text(HARNESS_SOURCE)
    monkeypatch.chdir(tmp_path)
    assert resolve_agent("harness/env.py:EchoEnv").__name__ == "EchoEnv"


def test_windows_drive_letter_keeps_the_path() -> None:
    # The drive's colon must not be taken as the class separator: the whole path is the file.
    with pytest.raises(ValueError) as info:
        resolve_agent("C:\\work\\harness\\env.py:EchoEnv")
    assert "C:\\work\\harness\\env.py" in str(info.value) and "does not exist" in str(info.value)


def test_unknown_name_lists_builtins() -> None:
    with pytest.raises(ValueError) as info:
        resolve_agent("terminus")
    assert "'bash'" in str(info.value)


def test_missing_module_or_attribute() -> None:
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_agent("no_such_package_xyz.env:Env")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_agent("trl_harbor.training.env:NoSuchEnv")


def test_not_a_harbor_env_subclass(tmp_path: Path) -> None:
    path = tmp_path / "env.py"
    path.write_text(HARNESS_SOURCE)
    with pytest.raises(TypeError, match="HarborEnv subclass"):
        resolve_agent(f"{path}:NotAnEnv")
    with pytest.raises(TypeError, match="HarborEnv subclass"):
        resolve_agent("collections:OrderedDict")
    with pytest.raises(TypeError, match="HarborEnv subclass"):
        resolve_agent(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HarborEnv subclass"):
        resolve_agent("trl_harbor.training.env:close_all")
