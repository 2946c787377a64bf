"""The rule of the verifier's view (``harbor_local_sandbox/_view.py``), on a synthetic image and agent layer.

No sandbox here: an image root and an overlay upper layer are made by hand (whiteouts are 0:0
character devices, as overlayfs makes them; opaque folders carry ``trusted.overlay.opaque``), and
the snapshot the verifier's overlay would stack is inspected entry by entry. The rule's effect on
real sandboxes and real attacks is tested in ``tests/adversarial``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from harbor_local_sandbox._view import SearchPaths, snapshot, stem

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted.* xattrs need root")

SEARCH = SearchPaths(
    path=("/usr/local/bin", "/usr/bin", "/bin"),
    python=(
        "/usr/lib/python311.zip",
        "/usr/lib/python3.11",
        "/usr/lib/python3/dist-packages",
        "/root/.local/lib/python3.11/site-packages",
    ),  # fmt: skip
    loader=("/usr/lib/x86_64-linux-gnu", "/usr/local/lib"),
)


def _files(root: Path, entries: dict[str, str]) -> None:
    for relative, content in entries.items():
        path = root / relative.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _whiteout(root: Path, relative: str) -> None:
    path = root / relative.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, 0)


@pytest.fixture
def layers(tmp_path: Path) -> tuple[Path, Path, Path]:
    lower, upper, target = tmp_path / "image", tmp_path / "upper", tmp_path / "snapshot"
    for path in (lower, upper, target):
        path.mkdir()
    _files(
        lower,
        {
            "/usr/bin/python3": "elf",
            "/usr/bin/awk": "mawk",
            "/usr/lib/python3.11/json/__init__.py": "stdlib json",
            "/usr/lib/python3.11/os.py": "stdlib os",
            "/usr/lib/python3/dist-packages/requests/__init__.py": "requests 2.28",
            "/usr/lib/x86_64-linux-gnu/libssl.so.3": "libssl",
            "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0": "libpython",
            "/etc/ld.so.cache": "cache",
            "/etc/nsswitch.conf": "passwd: files",
            "/etc/hosts": "127.0.0.1 localhost",
            "/etc/nginx/nginx.conf": "worker_processes 1;",
            "/app/solution.py": "print('todo')",
            "/var/www/html/index.html": "old",
        },
    )
    return lower, upper, target


def _snap(layers: tuple[Path, Path, Path], allowed: tuple[str, ...] = (), workdir: str = "/app"):
    lower, upper, target = layers
    return snapshot(upper, lower, target, SEARCH, workdir, allowed)


def test_the_image_code_the_agent_changed_is_the_images(layers) -> None:
    lower, upper, target = layers
    _files(upper, {"/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0": "patched", "/usr/lib/python3.11/os.py": "evil"})
    _files(upper, {"/etc/ld.so.cache": "points at a planted library", "/etc/nsswitch.conf": "passwd: evil"})
    result = _snap(layers)
    for path in ("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0", "/usr/lib/python3.11/os.py",
                 "/etc/ld.so.cache", "/etc/nsswitch.conf"):  # fmt: skip
        assert not os.path.lexists(target / path.lstrip("/")), path  # the image's entry shows through
        assert any(c.startswith(path + " ") for c in result.concealed), (path, result.concealed)


def test_a_deletion_of_the_images_code_is_seen(layers) -> None:
    """Deleting only removes code (a task may ask to remove a binary): the verifier sees it gone."""
    lower, upper, target = layers
    _whiteout(upper, "/usr/bin/awk")
    result = _snap(layers)
    laid = os.lstat(target / "usr/bin/awk")
    assert stat.S_ISCHR(laid.st_mode) and laid.st_rdev == 0  # a whiteout in the snapshot: awk is gone
    assert not any(c.startswith("/usr/bin/awk") for c in result.concealed), result.concealed


def test_added_code_that_would_run_instead_of_the_images_is_hidden(layers) -> None:
    lower, upper, target = layers
    _files(
        upper,
        {
            "/usr/local/bin/python3": "a fake python3 earlier on PATH",
            "/usr/local/bin/json.py": "beside a script on PATH",
            "/usr/lib/python3/dist-packages/json.cpython-311-x86_64-linux-gnu.so": "shadows stdlib json",
            "/usr/lib/python3/dist-packages/requests/evil.cpython-311-x86_64-linux-gnu.so": "inside a shipped package",
            "/usr/lib/python3.11/__pycache__/os.cpython-311.pyc": "forged bytecode",
            "/usr/lib/python3/dist-packages/zz.pth": "import os",
            "/usr/bin/python3.11._pth": "hook",
            "/usr/pyvenv.cfg": "home = /evil",
            "/usr/lib/python3/dist-packages/sitecustomize.py": "hook",
            "/usr/lib/python3/dist-packages/plug-1.0.dist-info/entry_points.txt": "[pytest11]\nplug = plug\n",
            "/usr/lib/python3/dist-packages/pytest/__init__.py": "a fake test runner",
            "/usr/local/lib/libssl.so.3": "a planted library earlier on the loader's path",
            "/etc/ld.so.conf.d/evil.conf": "/evil",
            "/conftest.py": "an ancestor of the workdir and of /tests",
            "/pytest.ini": "[pytest]",
            "/pytest/__init__.py": "python -m pytest from /",
            "/root/.local/lib/python3.11/site-packages/evil.pth": "user site hook",
        },
    )
    result = _snap(layers)
    for relative in (
        "usr/local/bin/python3", "usr/local/bin/json.py",
        "usr/lib/python3/dist-packages/json.cpython-311-x86_64-linux-gnu.so",
        "usr/lib/python3/dist-packages/requests/evil.cpython-311-x86_64-linux-gnu.so",
        "usr/lib/python3.11/__pycache__/os.cpython-311.pyc", "usr/lib/python3/dist-packages/zz.pth", "usr/bin/python3.11._pth",
        "usr/pyvenv.cfg", "usr/lib/python3/dist-packages/sitecustomize.py",
        "usr/lib/python3/dist-packages/plug-1.0.dist-info", "usr/lib/python3/dist-packages/pytest",
        "usr/local/lib/libssl.so.3", "etc/ld.so.conf.d/evil.conf", "conftest.py", "pytest.ini", "pytest",
        "root/.local/lib/python3.11/site-packages/evil.pth",
    ):  # fmt: skip
        assert not os.path.lexists(target / relative), (relative, result.concealed)


def test_honest_changes_are_seen(layers) -> None:
    lower, upper, target = layers
    _files(
        upper,
        {
            "/usr/bin/jq": "apt-get install jq",
            "/usr/lib/x86_64-linux-gnu/libjq.so.1": "its library",
            "/usr/lib/python3/dist-packages/numpy/__init__.py": "pip install numpy",
            "/usr/lib/python3/dist-packages/numpy-2.1.0.dist-info/METADATA": "Name: numpy",
            "/usr/lib/python3/dist-packages/numpy/__pycache__/__init__.cpython-311.pyc": "its own bytecode",
            "/etc/nginx/nginx.conf": "worker_processes 4;",
            "/etc/hosts": "127.0.0.1 localhost db",
            "/app/solution.py": "print(42)",
            "/app/conftest.py": "the agent's work: the working directory is the agent's",
            "/workdir/answer.txt": "42",
            "/var/www/html/index.html": "new",
            "/root/.bashrc": "alias ll='ls -l'  # bash reads it for interactive shells only",
            "/etc/ssl/certs/local-ca.pem": "update-ca-certificates: a CA the task's service uses",
            "/usr/lib/x86_64-linux-gnu/perl5/5.36/JSON.pm": "apt-get install libjson-perl",
        },
    )
    result = _snap(layers)
    for relative, content in (
        ("usr/bin/jq", "apt-get install jq"), ("usr/lib/python3/dist-packages/numpy/__init__.py", "pip install numpy"),
        ("usr/lib/python3/dist-packages/numpy/__pycache__/__init__.cpython-311.pyc", "its own bytecode"),
        ("etc/nginx/nginx.conf", "worker_processes 4;"), ("etc/hosts", "127.0.0.1 localhost db"),
        ("app/solution.py", "print(42)"), ("app/conftest.py", "the agent's work: the working directory is the agent's"),
        ("workdir/answer.txt", "42"), ("var/www/html/index.html", "new"),
        ("root/.bashrc", "alias ll='ls -l'  # bash reads it for interactive shells only"),
        ("etc/ssl/certs/local-ca.pem", "update-ca-certificates: a CA the task's service uses"),
        ("usr/lib/x86_64-linux-gnu/libjq.so.1", "its library"),
        ("usr/lib/x86_64-linux-gnu/perl5/5.36/JSON.pm", "apt-get install libjson-perl"),
    ):  # fmt: skip
        assert (target / relative).read_text() == content, (relative, result.concealed)
    assert result.concealed == []


def test_allowed_changes_and_the_verifiers_own_folders(layers) -> None:
    lower, upper, target = layers
    _files(upper, {"/usr/lib/python3/dist-packages/requests/__init__.py": "patched, as the task asks",
                   "/tests/test_outputs.py": "planted", "/logs/verifier/reward.txt": "1", "/solution/solve.sh": "x"})  # fmt: skip
    result = _snap(layers, allowed=("/usr/lib/python3/dist-packages/requests/*",))
    assert (target / "usr/lib/python3/dist-packages/requests/__init__.py").read_text() == "patched, as the task asks"
    for relative in ("tests", "logs/verifier", "solution"):
        assert not os.path.lexists(target / relative), result.concealed


def test_outputs_are_the_agents_own_files_and_deletions_of_data_stand(layers) -> None:
    """The snapshot holds names: a file is the agent's own (a hard link), its data and metadata live."""
    lower, upper, target = layers
    (upper / "app").mkdir()
    with open(upper / "app" / "big.img", "wb") as handle:
        handle.truncate(10 << 30)  # 10 GiB apparent, nothing allocated
        handle.write(b"x")
    _whiteout(upper, "/var/www/html/index.html")
    result = _snap(layers)
    laid = target / "app" / "big.img"
    assert laid.stat().st_ino == (upper / "app" / "big.img").stat().st_ino  # the agent's inode: nothing copied
    with open(upper / "app" / "big.img", "ab") as handle:
        handle.write(b"later")
    assert laid.stat().st_size == (10 << 30) + 5  # what the agent writes after the snapshot is seen
    assert stat.S_ISCHR(os.lstat(target / "var/www/html/index.html").st_mode)  # the agent's deletion stands
    assert result.copied == 0


def test_a_code_folder_replaced_whole_keeps_the_images_code(layers) -> None:
    lower, upper, target = layers
    folder = upper / "usr/lib/python3/dist-packages"
    folder.mkdir(parents=True)
    os.setxattr(folder, "trusted.overlay.opaque", b"y")  # rm -rf then mkdir
    (folder / "requests").mkdir()
    (folder / "requests" / "__init__.py").write_text("fake requests")
    _snap(layers)
    snap = target / "usr/lib/python3/dist-packages"
    assert snap.is_dir() and "trusted.overlay.opaque" not in os.listxattr(snap, follow_symlinks=False)
    assert not (snap / "requests" / "__init__.py").exists()  # the image's requests shows through


def test_stem() -> None:
    assert stem("json.cpython-311-x86_64-linux-gnu.so") == "json"
    assert stem("numpy-2.1.0.dist-info") == "numpy"
    assert stem("libssl.so.3") == "libssl"
    assert stem(".bashrc") == ".bashrc"


def test_an_own_folders_configuration_shortcut_judges_as_the_full_rule(tmp_path: Path) -> None:
    """An entry of a new folder is checked against the configuration globs it can begin like only:
    the verdict must be the full rule's for every glob of CODE_CONFIG (entries that match, entries
    beside them, and below folders that are configuration themselves)."""
    from harbor_local_sandbox._view import CODE_CONFIG, _Rule

    (tmp_path / "home" / "dev").mkdir(parents=True)
    rule = _Rule(tmp_path, SEARCH, "/workdir", ())
    folders = {"/", "/etc", "/etc/ssl", "/usr/lib/x86_64-linux-gnu/gconv", "/srv/app/newpkg", "/opt/tool"}
    names = {"x.py", "pip.conf", "openssl.cnf", "gconv-modules", "ld.so.conf", "python3.11", ".bashrc"}
    for glob in rule.config:
        head, _, tail = glob.replace("*", "zz").rpartition("/")
        folders |= {head or "/", glob.replace("*", "zz"), f"{glob.replace('*', 'zz')}/sub"}
        names.add(tail)
    assert any(item.startswith("~/") for item in CODE_CONFIG) and "/home/dev/.gitconfig" in {
        g.replace("*", "dev") for g in rule.config
    }
    checked = 0
    for folder in folders:
        for name in names:
            path = f"{folder.rstrip('/')}/{name}"
            expected = "code configuration" if rule.in_config(path) else None
            got = rule.own_entry(folder, name)
            if got in ("an interpreter hook", "the test runner's own package"):
                continue
            assert got == expected, (folder, name)
            checked += expected is not None
    assert checked > len(rule.config)  # most globs were matched through the shortcut
