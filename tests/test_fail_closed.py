"""Judging and copying what the agent left is total: its content scores the rollout, never skips it (issue #43, classes 7, 8).

A policy controls every byte the rollout leaves. Content our code cannot handle — a parser's
recursion or memory error, a NUL byte in a ``.pth`` line, an artifact tree thousands of folders deep
or with paths past the host's limits, hundreds of thousands of names — must never be counted as an
infrastructure failure (a skip a policy could choose over a 0), and what reaches the trainer must
stay bounded whatever the rollout wrote. Here:

* grading's classification, on both sides: a view the backend refused for the rollout's content
  (its error marked ``tampered``, :class:`~trl_harbor.rollout.contract.RefusedView`) scores 0 with
  cause ``tampered``; an unmarked failure — a programming error, the backend's own — stays
  ``infrastructure``;
* the local sandbox's downloads (``_hostfs.download_dir``, the artifacts of a separate verifier):
  past their bounds, or failing on the sandbox's entries, the error is marked ``unsafe`` (the
  rollout's: 0, ``verifier``); a failure of the host's own is not;
* a verification's report of the agent's changes is bounded;
* on real local sandboxes, rollouts leaving such content score 0 (or 1 with the right answer and
  content the view refused), never ``None``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import pickle
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import requires_local
from harbor_local_sandbox import _hostfs
from harbor_local_sandbox.errors import SandboxError, UnjudgeableViewError

from sandbox_helpers import make_task
from trl_harbor import HarborOptions, HarborSpec
from trl_harbor.rollout import grading
from trl_harbor.rollout.contract import RefusedDownload, RefusedView
from trl_harbor.rollout.outcome import REPORTED_LINE_CAP, REPORTED_LINES, Cause, Verification

# ── grading's classification of a view that did not open ───────────────────────────────


class _Sandbox:
    """A sandbox that offers an isolated view (the protocols of ``trl_harbor.rollout.contract``) whose
    opening raises ``error``; it still runs, and its agent exhausted nothing."""

    isolated_verification = True

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def verifier_view(self, allowed_changes=(), network_policy=None):
        error = self.error

        class _Opening:
            async def __aenter__(self):
                raise error

            async def __aexit__(self, *exc):
                return None

        return _Opening()

    async def kill_processes(self, keep=()) -> int:
        return 0

    async def alive(self) -> bool:
        return True

    async def resource_exhaustion(self) -> str | None:
        return None


def _grade(error: BaseException) -> Verification:
    context = SimpleNamespace(
        task=SimpleNamespace(name="task"),
        placement=SimpleNamespace(separate=False, plan=SimpleNamespace(verifier_phase=None)),
        policy=SimpleNamespace(allowed_changes=()),
    )
    verification = asyncio.run(grading.grade(_Sandbox(error), context, None))  # type: ignore[arg-type]
    return grading.settle(verification, SimpleNamespace(on_infra_error="skip"))  # type: ignore[arg-type]


class _Marked(RuntimeError):
    tampered = True


class _MarkedFalse(RuntimeError):
    tampered = False


def _wrapped() -> RuntimeError:
    try:
        try:
            raise UnjudgeableViewError("what the agent left could not be judged nor left out")
        except UnjudgeableViewError as refused:
            raise RuntimeError("the view's worker failed") from refused
    except RuntimeError as error:
        return error


@pytest.mark.parametrize(
    "error",
    [UnjudgeableViewError("what the agent left could not be judged nor left out"), _Marked("marked"), _wrapped()],
    ids=["the local sandbox's", "any backend's mark", "raised from a marked error"],
)
def test_a_view_refused_for_the_rollouts_content_scores_zero_tampered(error: BaseException) -> None:
    assert isinstance(UnjudgeableViewError("x"), RefusedView)
    verification = _grade(error)
    assert verification.reward == 0.0 and verification.cause is Cause.TAMPERED and not verification.infra
    assert "refused for what the rollout left" in verification.reason


@pytest.mark.parametrize(
    "error",
    [TypeError("a bug of grading's"), AttributeError("a bug"), SandboxError("a mount of the view failed"),
     OSError(errno.EIO, "the host's disk"), _MarkedFalse("marked false"), RuntimeError("unmarked")],
    ids=["TypeError", "AttributeError", "the backend's own", "the host's", "tampered=False", "unmarked"],
)  # fmt: skip
def test_an_unmarked_failure_of_the_view_stays_infrastructure(error: BaseException) -> None:
    """A programming error of our own, or the backend's own failure, on our own data: never the rollout's."""
    verification = _grade(error)
    assert verification.cause is Cause.INFRASTRUCTURE and verification.infra and verification.reward is None


def test_a_view_that_could_not_be_made_for_a_full_storage_scores_zero() -> None:
    """``ENOSPC`` from the walk (the snapshot is on the agent's own storage): the rollout filled it."""
    verification = _grade(OSError(errno.ENOSPC, "No space left on device"))
    assert verification.reward == 0.0 and verification.cause is Cause.VERIFIER


# ── the copy of a separate verifier's artifacts ────────────────────────────────────────


def _chain(root: Path, relative: str, depth: int, name: bytes = b"d") -> None:
    """``depth`` nested folders named ``name`` below ``root/relative`` (through descriptors: any length)."""
    fd = os.open(root / relative.lstrip("/"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open(b"leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def _remove_deep(top: Path) -> None:
    """Remove a tree deeper than ``rmtree`` can (one descriptor a level, paths past ``PATH_MAX``): each
    level's folder moved up in place of its parent, one at a time; pytest's own clean-up of its temporary
    folders fails on such a tree, and every later ``tmp_path`` with it."""
    hold = top.with_name(f".{top.name}.next")
    while os.path.lexists(top):
        folders = []
        for entry in os.scandir(top):
            if entry.is_dir(follow_symlinks=False):
                folders.append(Path(entry.path))
            else:
                os.unlink(entry.path)
        for sibling in folders[1:]:
            _remove_deep(sibling)
        if not folders:
            os.rmdir(top)
            return
        folders[0].rename(hold)
        os.rmdir(top)
        hold.rename(top)


@pytest.fixture
def deep_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, whatever deep trees a test makes in it removed after it."""
    yield tmp_path
    for child in list(tmp_path.iterdir()):
        if child.is_dir() and not child.is_symlink():
            _remove_deep(child)


def _refused(root: Path, target: Path) -> BaseException:
    with pytest.raises(Exception) as raised:
        _hostfs.download_dir(root, "/art", target)
    return raised.value


def test_an_artifact_tree_thousands_of_folders_deep_is_the_rollouts(deep_tmp_path: Path) -> None:
    """3,000 folders deep: the copy raised ``RecursionError`` (or ``ENAMETOOLONG``), unmarked: a skip."""
    tmp_path = deep_tmp_path
    (tmp_path / "sandbox" / "art").mkdir(parents=True)
    _chain(tmp_path / "sandbox", "/art", 3000)
    error = _refused(tmp_path / "sandbox", tmp_path / "host")
    assert isinstance(error, RefusedDownload) and error.unsafe and grading._unsafe(error), repr(error)
    assert "deep" in str(error)


def test_an_artifact_path_longer_than_the_host_allows_is_the_rollouts(deep_tmp_path: Path) -> None:
    tmp_path = deep_tmp_path
    (tmp_path / "sandbox" / "art").mkdir(parents=True)
    _chain(tmp_path / "sandbox", "/art", 18, name=b"n" * 255)  # 4,608 bytes below the artifact
    error = _refused(tmp_path / "sandbox", tmp_path / "host")
    assert grading._unsafe(error), repr(error)


def test_an_artifact_tree_of_too_many_entries_is_the_rollouts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_hostfs, "DOWNLOAD_MAX_ENTRIES", 500)
    folder = tmp_path / "sandbox" / "art"
    folder.mkdir(parents=True)
    for index in range(501):
        (folder / f"f{index}").touch()
    error = _refused(tmp_path / "sandbox", tmp_path / "host")
    assert grading._unsafe(error), repr(error)


def test_an_honest_artifact_tree_is_copied(tmp_path: Path) -> None:
    folder = tmp_path / "sandbox" / "art"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "answer.txt").write_text("42\n")
    (folder / "\udcff-not-utf8").write_bytes(b"x")
    (folder / "link").symlink_to("/etc/passwd")  # skipped, never followed
    os.mkfifo(folder / "fifo")  # skipped, never waited on
    (folder / "deep").mkdir()
    _chain(folder.parent, "/art/deep", 40)
    _hostfs.download_dir(tmp_path / "sandbox", "/art", tmp_path / "host")
    assert (tmp_path / "host" / "a" / "b" / "answer.txt").read_text() == "42\n"
    assert (tmp_path / "host" / "\udcff-not-utf8").read_bytes() == b"x"
    assert not (tmp_path / "host" / "link").exists() and not (tmp_path / "host" / "fifo").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a file system of the test's own needs root")
def test_the_hosts_own_failure_in_a_copy_is_not_the_rollouts(tmp_path: Path) -> None:
    """The host's disk full while it copies a bounded artifact: not marked (infrastructure)."""
    folder = tmp_path / "sandbox" / "art"
    folder.mkdir(parents=True)
    (folder / "data").write_bytes(os.urandom(3 << 20))
    host = tmp_path / "host"
    host.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "copy-test", str(host)], check=False).returncode:
        pytest.skip("no tmpfs of the test's own (mount failed)")
    try:
        error = _refused(tmp_path / "sandbox", host / "out")
    finally:
        subprocess.run(["umount", "-l", str(host)], check=False)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and not grading._unsafe(error), repr(error)


# ── what reaches the trainer ───────────────────────────────────────────────────────────


def test_a_verifications_report_is_bounded_whatever_the_rollout_wrote() -> None:
    lines = tuple(f"/usr/lib/python3/dist-packages/pkg/m{index}.py (an interpreter hook)" for index in range(250_000))
    verification = Verification(0.0, concealed=(*lines[:10], "x" * 100_000, *lines[10:]), tampered=lines)
    for kept in (verification.concealed, verification.tampered):
        assert len(kept) == REPORTED_LINES and all(len(line) <= REPORTED_LINE_CAP for line in kept)
    assert verification.concealed[-1] == f"... and {250_001 - REPORTED_LINES + 1} more lines"
    assert verification.concealed[:10] == lines[:10]
    assert len(pickle.dumps(verification)) < 64 << 10
    copied = dataclasses.replace(verification, reward=None)  # as settle() copies it: bounding twice keeps it
    assert copied.concealed == verification.concealed and copied.tampered == verification.tampered
    assert Verification(0.0, concealed=("/a (why)",)).concealed == ("/a (why)",)  # a short report is kept as it is


# ── on real local sandboxes ────────────────────────────────────────────────────────────

SITE = '"$(python3 -c "import site; print(site.getsitepackages()[0])")"'
#: A ``.pth`` line with a NUL byte (``os.lstat`` raised ``ValueError`` on it in the view's walk).
NUL_PTH = f"printf '/opt/x\\000y\\n' > {SITE}/zz_nul.pth"
#: A setuptools editable install whose finder is an expression too deep for Python's parser (``MemoryError``).
DEEP_FINDER = "python3 -c " + shlex.quote(
    "import site; s = site.getsitepackages()[0]; f = '__editable___deep_1_0_finder'; "
    "open(f'{s}/{f}.py', 'w').write('MAPPING = ' + '-' * 100000 + '1\\n'); "
    "open(f'{s}/__editable__.deep-1.0.pth', 'w').write(f'import {f}; {f}.install()\\n')"
)
#: An artifact tree 3,000 folders deep (the copy raised ``RecursionError``).
DEEP_TREE = "python3 -c " + shlex.quote(
    "import os\nos.chdir('/workdir')\nfor _ in range(3000):\n os.mkdir('d'); os.chdir('d')"
)


def _suite(root: Path) -> dict[str, str]:
    view = make_task(root, "view", gold="42", memory_mb=512)
    separate = make_task(root, "separate", gold="42", memory_mb=512)
    toml = separate / "task.toml"
    text = toml.read_text()
    text = text.replace('version = "1.0"\n', 'version = "1.0"\nartifacts = ["/workdir"]\n', 1)
    toml.write_text(text.replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n', 1))
    return {"view": str(view), "separate": str(separate)}


@requires_local
def test_content_our_code_choked_on_scores_zero_not_skipped(tmp_path: Path, close_sandboxes: None) -> None:
    """One batch, as ``GRPOTrainer`` verifies it: the content that used to be an infrastructure failure (a
    skip) scores 0 with a wrong answer — and 1 with the right one where only the content is refused —
    beside honest rollouts that score 1; nothing is skipped."""
    tasks = _suite(tmp_path / "tasks")
    rollouts = {  # name: (task, commands, reward deserved)
        "NUL .pth, wrong answer": ("view", [NUL_PTH, "echo 0 > /workdir/answer.txt"], 0.0),
        "NUL .pth, right answer": ("view", [NUL_PTH, "echo 42 > /workdir/answer.txt"], 1.0),
        "finder too deep to parse, wrong answer": ("view", ["echo 7 > /workdir/answer.txt", DEEP_FINDER], 0.0),
        "artifact tree 3,000 deep": ("separate", [DEEP_TREE, "echo 42 > /workdir/answer.txt"], 0.0),
        "honest": ("view", ["echo 42 > /workdir/answer.txt"], 1.0),
        "honest, separate verifier": ("separate", ["echo 42 > /workdir/answer.txt"], 1.0),
    }
    spec = HarborSpec(
        tmp_path / "tasks", agent="bash", environment_type="local", options=HarborOptions(command_timeout_sec=120)
    )
    envs = {name: spec.environment_factory() for name in rollouts}
    for name, (task, commands, _) in rollouts.items():
        envs[name].reset(task_dir=tasks[task])
        for command in commands:
            envs[name].bash(command)
    extra: dict[str, list] = {}
    rewards = spec.reward_funcs(
        completions=[None] * len(envs), environments=list(envs.values()), log_extra=extra.__setitem__
    )
    got = dict(zip(rollouts, rewards, strict=True))
    reasons = dict(zip(rollouts, extra["harbor_error"], strict=True))
    assert got == {name: deserved for name, (_, _, deserved) in rollouts.items()}, (got, reasons)
    verifications = {name: env.verification for name, env in envs.items()}
    assert not any(v.infra for v in verifications.values()), reasons
    for name in ("NUL .pth, wrong answer", "NUL .pth, right answer"):
        assert any("zz_nul.pth" in line for line in verifications[name].concealed), verifications[name].concealed
    assert any(
        "__editable__.deep-1.0.pth" in line
        for line in verifications["finder too deep to parse, wrong answer"].concealed
    )
    deep = verifications["artifact tree 3,000 deep"]
    assert deep.cause is Cause.VERIFIER and "deep" in deep.reason, deep
