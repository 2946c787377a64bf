"""Holes in the rule of the verifier's view (``harbor_local_sandbox/_view.py``), found by the red team (issue #17).

Each test is one thing the rule's design does not name, on a synthetic image and agent layer (as
in ``tests/test_verifier_rule.py``): the agent's entry must not reach the verifier's view — or,
for the honest ones, must. They fail until the rule covers them; the same attacks run end to end
in ``tests/adversarial/test_grading.py`` (and win there without the defences).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from harbor_local_sandbox._view import SearchPaths, snapshot

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted.* xattrs need root")

WORKDIR = "/app"
DIST = "/usr/lib/python3/dist-packages"
#: Debian bookworm's: PATH (with a venv of the working directory first, as uv projects' images have),
#: python3's sys.path with the user site, and the loader's system search path plus ld.so.conf's.
SEARCH = SearchPaths(
    path=("/app/.venv/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"),
    python=(
        "/usr/lib/python311.zip",
        "/usr/lib/python3.11",
        "/usr/lib/python3.11/lib-dynload",
        "/usr/local/lib/python3.11/dist-packages",
        DIST,
        "/root/.local/lib/python3.11/site-packages",
    ),
    loader=("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib", "/usr/local/lib"),
)


def _files(root: Path, entries: dict[str, str]) -> None:
    for relative, content in entries.items():
        path = root / relative.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _link(root: Path, relative: str, target: str) -> None:
    path = root / relative.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


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
            "/usr/bin/python3.11": "elf",
            "/usr/bin/pytest": "#!/usr/bin/python3",
            "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "the loader",
            "/usr/lib/x86_64-linux-gnu/libc.so.6": "libc",
            "/usr/lib/python3.11/os.py": "stdlib",
            "/usr/lib/python3.11/argparse.py": "stdlib",
            "/usr/lib/python3.11/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so": "ext",
            f"{DIST}/pytest/__init__.py": "pytest",
            f"{DIST}/_pytest/skipping.py": "pytest",
            "/usr/local/lib/python3.11/dist-packages/verpkg/__init__.py": 'VERSION = "1.0"',
            "/usr/local/lib/python3.11/dist-packages/verpkg-1.0.dist-info/METADATA": "Name: verpkg",
            "/etc/python3.11/sitecustomize.py": "try:\n    import apport_python_hook\nexcept ImportError:\n    pass\n",
            "/etc/apt/apt.conf.d/docker-clean": "",
            "/etc/dpkg/dpkg.cfg.d/excludes": "",
            "/etc/alternatives/README": "",
            "/app/.venv/pyvenv.cfg": "home = /usr/bin\ninclude-system-site-packages = true\n",
            "/app/.venv/lib/python3.11/site-packages/.keep": "",
        },
    )
    (lower / "usr/local/bin").mkdir(parents=True)
    (lower / "logs/verifier").mkdir(parents=True)
    _link(lower, "/usr/lib/python3.11/sitecustomize.py", "/etc/python3.11/sitecustomize.py")
    _link(lower, "/lib64", "usr/lib64")
    _link(lower, "/usr/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    _link(lower, "/bin", "usr/bin")
    _link(lower, "/lib", "usr/lib")
    _link(lower, "/app/.venv/bin/python3", "/usr/bin/python3.11")
    return lower, upper, target


def _snap(layers: tuple[Path, Path, Path]):
    lower, upper, target = layers
    return snapshot(upper, lower, target, SEARCH, WORKDIR)


def _seen(target: Path, path: str) -> bool:
    return os.path.lexists(target / path.lstrip("/"))


# ── hostile additions and changes the verifier must not see ─────────────────────────────


def test_a_lookup_directory_replaced_by_a_link(layers) -> None:
    """``rm -rf /usr/local/bin; ln -s /opt/bin /usr/local/bin``: the first PATH directory becomes the agent's."""
    lower, upper, target = layers
    _files(upper, {"/opt/bin/python3": "#!/bin/sh\necho 1 > /logs/verifier/reward.txt"})
    _link(upper, "/usr/local/bin", "/opt/bin")
    result = _snap(layers)
    assert not (target / "usr/local/bin").is_symlink(), result.concealed


def test_the_elf_interpreter_link_retargeted(layers) -> None:
    """Every dynamic program's ``PT_INTERP`` is ``/lib64/ld-linux-x86-64.so.2`` (a link, through ``/usr/lib64``)."""
    lower, upper, target = layers
    _files(upper, {"/opt/ld.so": "a static program"})
    _link(upper, "/usr/lib64/ld-linux-x86-64.so.2", "/opt/ld.so")
    result = _snap(layers)
    assert not _seen(target, "/usr/lib64/ld-linux-x86-64.so.2"), result.concealed


def test_the_elf_interpreters_folder_replaced(layers) -> None:
    """``/lib64`` (a link in the image) replaced by a folder holding the agent's ``ld-linux-x86-64.so.2``."""
    lower, upper, target = layers
    folder = upper / "lib64"
    folder.mkdir()
    os.setxattr(folder, "trusted.overlay.opaque", b"y")
    (folder / "ld-linux-x86-64.so.2").write_text("a static program")
    result = _snap(layers)
    assert not _seen(target, "/lib64/ld-linux-x86-64.so.2"), result.concealed


def test_an_import_path_entry_the_image_lacks(layers) -> None:
    """``/usr/lib/python311.zip`` is on ``sys.path`` before the stdlib; a zip made there is imported from."""
    lower, upper, target = layers
    _files(upper, {"/usr/lib/python311.zip": "PK... pytest.py"})
    result = _snap(layers)
    assert not _seen(target, "/usr/lib/python311.zip"), result.concealed


def test_an_upper_case_dist_info_registering_a_pytest_plugin(layers) -> None:
    """``importlib.metadata`` matches ``.dist-info`` case-insensitively (``child.lower()``)."""
    lower, upper, target = layers
    _files(
        upper,
        {
            f"{DIST}/Xx_plugin-1.0.DIST-INFO/entry_points.txt": "[pytest11]\nxx = xx_plugin\n",
            f"{DIST}/Xx_plugin-1.0.DIST-INFO/METADATA": "Name: xx-plugin",
        },
    )
    result = _snap(layers)
    assert not _seen(target, f"{DIST}/Xx_plugin-1.0.DIST-INFO"), result.concealed


def test_a_dist_info_that_is_a_link_to_a_folder(layers) -> None:
    """``importlib.metadata`` follows a link named ``*.dist-info``; the rule reads only real folders."""
    lower, upper, target = layers
    _files(upper, {"/opt/meta/entry_points.txt": "[pytest11]\nww = ww_plugin\n", "/opt/meta/METADATA": "Name: ww"})
    _link(upper, f"{DIST}/ww_plugin-1.0.dist-info", "/opt/meta")
    result = _snap(layers)
    assert not _seen(target, f"{DIST}/ww_plugin-1.0.dist-info"), result.concealed


def test_a_plugin_declaration_is_frozen_where_it_was_judged(layers) -> None:
    """The rule judges ``entry_points.txt`` by its content: a hard link lets a process the agent left
    running rewrite it after the judgement (its link count tells it when)."""
    lower, upper, target = layers
    _files(
        upper,
        {
            f"{DIST}/vv_plugin-1.0.dist-info/entry_points.txt": "[console_scripts]\nvv = vv_plugin:main\n",
            f"{DIST}/vv_plugin.py": "print('plug-in')",
        },
    )
    _snap(layers)
    judged = target / DIST.lstrip("/") / "vv_plugin-1.0.dist-info/entry_points.txt"
    if judged.exists():
        original = upper / DIST.lstrip("/") / "vv_plugin-1.0.dist-info/entry_points.txt"
        assert os.stat(judged).st_ino != os.stat(original).st_ino, "judged by content, then linked"


def test_sourceless_bytecode_in_the_verifiers_working_directory(layers) -> None:
    """``python -m pytest`` from ``/`` imports ``/pytest.pyc`` (no source needed)."""
    lower, upper, target = layers
    _files(upper, {"/pytest.pyc": "bytecode", "/_pytest/__init__.pyc": "bytecode"})
    result = _snap(layers)
    assert not _seen(target, "/pytest.pyc"), result.concealed
    assert not _seen(target, "/_pytest/__init__.pyc"), result.concealed  # a package: __init__ of any suffix


def test_a_module_the_images_start_up_code_imports_if_present(layers) -> None:
    """Debian's ``sitecustomize`` does ``try: import apport_python_hook``: a new name, run by every python3."""
    lower, upper, target = layers
    _files(upper, {"/usr/local/lib/python3.11/dist-packages/apport_python_hook.py": "import os; os._exit(0)"})
    result = _snap(layers)
    assert not _seen(target, "/usr/local/lib/python3.11/dist-packages/apport_python_hook.py"), result.concealed


def test_a_lookup_directory_under_the_working_directory(layers) -> None:
    """The working directory is the agent's: also the venv there that is first on ``PATH``."""
    lower, upper, target = layers
    _files(
        upper,
        {
            "/app/.venv/bin/python3": "#!/bin/sh\necho 1 > /logs/verifier/reward.txt",
            "/app/.venv/lib/python3.11/site-packages/zz.pth": "import os; os._exit(0)",
            "/app/solution.py": "the agent's work",
        },
    )
    result = _snap(layers)
    assert _seen(target, "/app/solution.py")
    assert not (target / "app/.venv/bin/python3").is_file(), result.concealed


def test_package_managers_configuration(layers) -> None:
    """A verifier that installs its tools (apt, dpkg, pip) runs what their configuration says."""
    lower, upper, target = layers
    hooks = {
        "/etc/apt/apt.conf.d/00hook": 'DPkg::Pre-Invoke { "/opt/hook.sh"; };',
        "/etc/apt/sources.list.d/evil.list": "deb [trusted=yes] file:/opt/repo ./",
        "/etc/dpkg/dpkg.cfg.d/00hook": "pre-invoke=/opt/hook.sh",
        "/etc/xdg/pip/pip.conf": "[global]\nfind-links = /opt/evil",
        "/usr/pip.conf": "[global]\nfind-links = /opt/evil",
    }
    _files(upper, hooks)
    result = _snap(layers)
    seen = [path for path in hooks if _seen(target, path)]
    assert not seen, (seen, result.concealed)


def test_node_and_uv_configuration_around_the_tests(layers) -> None:
    """``require()`` walks up from ``/tests`` into ``/node_modules``; uv reads ``uv.toml`` and ``.python-version``
    from the working directory up."""
    lower, upper, target = layers
    _files(
        upper,
        {
            "/node_modules/chai/index.js": "process.exit(0)",
            "/uv.toml": "[pip]\nfind-links = ['/opt/evil']",
            "/.python-version": "3.8",
        },
    )
    result = _snap(layers)
    seen = [path for path in ("/node_modules", "/uv.toml", "/.python-version") if _seen(target, path)]
    assert not seen, (seen, result.concealed)


def test_the_verifiers_log_folder_through_a_link(layers) -> None:
    """``/logs`` replaced by a link into the agent's files: ``/logs/verifier`` would resolve into them."""
    lower, upper, target = layers
    _files(upper, {"/app/fake/verifier/reward.txt": "1"})
    _link(upper, "/logs", "/app/fake")
    result = _snap(layers)
    assert not (target / "logs").is_symlink(), result.concealed


# ── honest changes the verifier must see ────────────────────────────────────────────────


def test_honest_an_editable_install(layers) -> None:
    """``pip install -e /app/proj`` is a ``.pth`` naming a folder (no code in it)."""
    lower, upper, target = layers
    pth = "/usr/local/lib/python3.11/dist-packages/__editable__.answerpkg-1.0.pth"
    _files(upper, {pth: "/app/proj\n", "/usr/local/lib/python3.11/dist-packages/answerpkg-1.0.dist-info/METADATA": "x"})
    result = _snap(layers)
    assert _seen(target, pth), result.concealed


def test_an_upgrade_of_a_package_the_image_ships_is_graded_as_shipped_unless_allowed(layers) -> None:
    """``pip install --upgrade verpkg`` replaces image code the verifier may run (a checker's numpy, say):
    the verifier grades the image's version, unless the task allows the change (``allowed_changes``)."""
    lower, upper, target = layers
    site = "/usr/local/lib/python3.11/dist-packages"
    _whiteout(upper, f"{site}/verpkg-1.0.dist-info")
    _files(upper, {f"{site}/verpkg/__init__.py": 'VERSION = "2.0"', f"{site}/verpkg-2.0.dist-info/METADATA": "x"})
    result = _snap(layers)  # not in the snapshot: the image's file, beneath it, is the verifier's
    assert not _seen(target, f"{site}/verpkg/__init__.py") and not _seen(target, f"{site}/verpkg-2.0.dist-info")
    assert f"{site}/verpkg/__init__.py (the image's code)" in result.concealed
    other = target.parent / "allowed"
    other.mkdir()
    result = snapshot(upper, lower, other, SEARCH, WORKDIR, allowed=(f"{site}/verpkg*",))
    assert (other / site.lstrip("/") / "verpkg/__init__.py").read_text() == 'VERSION = "2.0"', result.concealed
    assert _seen(other, f"{site}/verpkg-2.0.dist-info") and _seen(other, f"{site}/verpkg-1.0.dist-info")


def test_honest_a_setuptools_editable_install_of_a_flat_project(layers) -> None:
    """Setuptools installs a flat project editable as a ``.pth`` importing a generated finder: the finder is
    read, not run, and the verifier's ``.pth`` names the folder holding the package it maps."""
    lower, upper, target = layers
    site = "/usr/local/lib/python3.11/dist-packages"
    finder = "__editable___answerpkg_1_0_finder"
    _files(
        upper,
        {
            f"{site}/__editable__.answerpkg-1.0.pth": f"import {finder}; {finder}.install()",
            f"{site}/{finder}.py": "import sys\nMAPPING = {'answerpkg': '/app/proj/answerpkg'}\nNAMESPACES = {}\n",
            "/app/proj/answerpkg/__init__.py": "",
        },
    )
    result = _snap(layers)
    assert (target / site.lstrip("/") / "__editable__.answerpkg-1.0.pth").read_text() == "/app/proj\n", result.concealed


@pytest.mark.parametrize(
    "mapping",
    ["{'pytest': '/app/proj/pytest'}", "{'sitecustomize': '/app/proj/sitecustomize.py'}", "__import__('os')", "{1: 2}"],
)
def test_an_editable_finder_that_maps_start_up_code_or_is_no_literal(layers, mapping: str) -> None:
    lower, upper, target = layers
    site = "/usr/local/lib/python3.11/dist-packages"
    finder = "__editable___x_1_0_finder"
    _files(
        upper,
        {f"{site}/x.pth": f"import {finder}; {finder}.install()", f"{site}/{finder}.py": f"MAPPING = {mapping}\n"},
    )
    result = _snap(layers)
    assert not _seen(target, f"{site}/x.pth"), result.concealed


@pytest.mark.parametrize("hook", ["sitecustomize.py", "usercustomize.py", "pytest.py", "evil.pth"])
def test_a_plain_pth_naming_a_folder_with_start_up_code(layers, hook: str) -> None:
    """The folder a ``.pth`` appends joins the import path before ``site`` imports ``sitecustomize`` and
    ``usercustomize``: a folder holding them is start-up code, not an editable install."""
    lower, upper, target = layers
    site = "/usr/local/lib/python3.11/dist-packages"
    _files(upper, {f"{site}/x.pth": "/opt/proj\n", f"/opt/proj/{hook}": "import os; os._exit(0)"})
    result = _snap(layers)
    assert not (_seen(target, f"{site}/x.pth") and _seen(target, f"/opt/proj/{hook}")), result.concealed


@pytest.mark.parametrize("kind", ["zip", "link", "linked parent"])
def test_a_plain_pth_naming_a_file_or_a_link(layers, kind: str) -> None:
    """A ``.pth`` line may name a zip archive (imported from like a folder), or a link to a folder elsewhere,
    whose contents the rule would not look at."""
    lower, upper, target = layers
    site = "/usr/local/lib/python3.11/dist-packages"
    _files(upper, {"/opt/hooks.zip": "PK", "/srv/hooks/usercustomize.py": "import os"})
    line = {"zip": "/opt/hooks.zip", "link": "/opt/proj", "linked parent": "/opt/up/proj"}[kind]
    _link(upper, "/opt/proj", "/srv/hooks")
    _link(upper, "/opt/up", "/srv/parent")
    _files(upper, {f"{site}/x.pth": line + "\n", "/srv/parent/proj/usercustomize.py": "import os"})
    result = _snap(layers)
    assert not _seen(target, f"{site}/x.pth"), result.concealed


@pytest.mark.parametrize("path", ["/app/pytest.py", "/tmp/pytest.py", "/opt/x/_pytest/__init__.py", "/app/pluggy.pyc"])
def test_the_test_runners_own_package_anywhere(layers, path: str) -> None:
    """``python -m pytest`` imports ``pytest`` from its working directory first, wherever test.sh runs it."""
    lower, upper, target = layers
    _files(upper, {path: "import os; os._exit(0)"})
    result = _snap(layers)
    top = path if path.endswith((".py", ".pyc")) else path.rsplit("/", 1)[0]
    assert not _seen(target, top), result.concealed


@pytest.mark.parametrize("path", ["/app/argparse.py", "/app/nt.py", "/app/_json.cpython-311-x86_64-linux-gnu.so"])
def test_a_module_of_the_images_python_in_a_folder_the_verifier_runs_in(layers, path: str) -> None:
    """``cd /app && python -m pytest``: ``/app/argparse.py`` would be pytest's ``argparse``."""
    lower, upper, target = layers
    _files(upper, {path: "import os; os._exit(0)"})
    result = _snap(layers)
    assert not _seen(target, path), result.concealed


def test_the_agents_own_modules_in_the_working_directory_are_seen(layers) -> None:
    lower, upper, target = layers
    _files(upper, {"/app/solution.py": "", "/app/parsers/__init__.py": "", "/app/py/x.txt": ""})
    result = _snap(layers)
    assert all(_seen(target, p) for p in ("/app/solution.py", "/app/parsers", "/app/py")), result.concealed


def test_perl_and_other_interpreters_module_paths(layers) -> None:
    """Perl's ``@INC`` (``/etc/perl`` first) is judged as Python's import path: a shipped name is shipped."""
    lower, upper, target = layers
    _files(lower, {"/usr/share/perl/5.36/strict.pm": "package strict;", "/usr/share/perl/5.36/File/Temp.pm": ""})
    (lower / "etc/perl").mkdir(parents=True)
    (lower / "usr/local/share/perl/5.36.0").mkdir(parents=True)
    planted = {"/etc/perl/strict.pm": "", "/usr/local/share/perl/5.36.0/File/Temp.pm": "", "/etc/perl/New.pm": ""}
    _files(upper, planted)
    search = SearchPaths(
        path=SEARCH.path, python=SEARCH.python, loader=SEARCH.loader,
        modules=("/etc/perl", "/usr/local/share/perl/5.36.0", "/usr/share/perl/5.36"),
    )  # fmt: skip
    result = snapshot(upper, lower, target, search, WORKDIR)
    assert not _seen(target, "/etc/perl/strict.pm") and not _seen(target, "/usr/local/share/perl/5.36.0/File")
    assert _seen(target, "/etc/perl/New.pm"), result.concealed


def test_a_repositorys_configuration_and_hooks_are_the_agents(layers) -> None:
    """A task may ask to configure a repository (a remote, a hook): the verifier sees it. Tests that run
    git in the agent's repository run what it configured, as under Harbor (docs/security.md)."""
    lower, upper, target = layers
    _files(lower, {"/app/.git/config": "[core]\n\tbare = false\n", "/app/.git/HEAD": "ref: refs/heads/main\n"})
    _files(
        upper,
        {
            "/app/.git/config": "[core]\n\tfsmonitor = /app/evil.sh\n",
            "/app/.git/hooks/pre-commit": "#!/bin/sh",
            "/app/sub/.git/config": "[core]\n\tfsmonitor = /app/evil.sh\n",
            "/app/.git/refs/heads/main": "abc",
        },
    )
    result = _snap(layers)
    assert all(_seen(target, p) for p in ("/app/.git/config", "/app/.git/hooks", "/app/sub/.git/config"))
    assert _seen(target, "/app/.git/refs/heads/main"), result.concealed  # the agent's commits are its work


@pytest.mark.parametrize(
    "path",
    [
        "/root/.local/bin/uvx",  # test.sh: curl uv's installer | sh; source ~/.local/bin/env; uvx pytest
        "/root/.m2/repository/junit/junit/4.13.2/junit-4.13.2.jar",  # mvn test resolves JUnit here
        "/root/.npm/_cacache/index-v5/00/x",
        "/root/.cargo/registry/cache/x/serde-1.0.0.crate",
        "/etc/java-17-openjdk/security/java.security",
    ],
)
def test_where_verifiers_get_their_tools_at_verify_time(layers, path: str) -> None:
    lower, upper, target = layers
    _files(upper, {path: "planted"})
    result = _snap(layers)
    assert not _seen(target, path), result.concealed


def test_the_name_service_cache_socket(layers) -> None:
    """glibc asks nscd for users and hosts whenever its socket exists: the agent's is not the verifier's."""
    import socket

    lower, upper, target = layers
    (upper / "run/nscd").mkdir(parents=True)
    (upper / "app").mkdir()
    with socket.socket(socket.AF_UNIX) as nscd, socket.socket(socket.AF_UNIX) as service:
        nscd.bind(str(upper / "run/nscd/socket"))
        service.bind(str(upper / "app/service.sock"))
        result = _snap(layers)
    assert not _seen(target, "/run/nscd/socket"), result.concealed
    # the agent's own socket, as a hard link: connecting to it reaches the agent's service
    assert os.lstat(target / "app/service.sock").st_ino == os.lstat(upper / "app/service.sock").st_ino


def test_a_library_added_where_the_loader_looks_asks_for_a_new_loader_cache(layers) -> None:
    lower, upper, target = layers
    assert not _snap(layers).libraries_added
    _files(upper, {"/usr/local/lib/libanswer.so.1": "elf"})
    other = target.parent / "again"
    other.mkdir()
    assert snapshot(upper, lower, other, SEARCH, WORKDIR).libraries_added


def test_a_folder_swapped_for_a_link_during_the_walk_is_not_followed(layers, monkeypatch) -> None:
    """The agent's processes still run while the snapshot is taken: a folder it lists may be a link to the
    host's ``/`` by the time it is entered."""
    import harbor_local_sandbox._view as view

    lower, upper, target = layers
    _files(upper, {"/opt/data/out.txt": "x"})
    real_open = os.open

    def swap_then_open(name, *args, **kwargs):  # listed as a folder, a link by the time it is entered
        if name == "data" and not (upper / "opt/old").exists():
            os.rename(upper / "opt/data", upper / "opt/old")
            (upper / "opt/data").symlink_to("/etc")
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(view.os, "open", swap_then_open)
    result = _snap(layers)
    assert not _seen(target, "/opt/data"), result.concealed


def _swap_before(monkeypatch, call: str, name: str, swap) -> None:
    """Run ``swap`` once, just before the walk's ``os.<call>`` reaches the entry ``name`` (the agent's race)."""
    import harbor_local_sandbox._view as view

    real = getattr(os, call)
    done = []

    def racing(first, *args, **kwargs):
        if first == name and not done:
            done.append(True)
            swap()
        return real(first, *args, **kwargs)

    monkeypatch.setattr(view.os, call, racing)


def _held_back(result, target: Path, where: str) -> None:
    assert not _seen(target, where), result.concealed
    assert any(c.startswith(where + " ") and "changed while it was judged" in c for c in result.concealed), (
        result.concealed
    )


@pytest.mark.parametrize(
    "where",
    [
        "/usr/local/lib/python3.11/dist-packages/swapme.link",  # an image folder's new entry (judged by the rule)
        # a new folder's (judged by its name; not a package name: walked, not mounted live)
        "/usr/local/lib/python3.11/dist-packages/newpkg.libs/swapme.link",
    ],
)
def test_an_entry_swapped_for_a_folder_before_it_is_linked_is_held_back(layers, monkeypatch, where: str) -> None:
    """Listed as a link, a folder by the time it is hard-linked (the race of view case 2a): the kernel
    refuses the hard link (``EPERM``); the entry is held back as changed, and the snapshot is made —
    it is not an error of grading's (which would skip the rollout instead of scoring it)."""
    lower, upper, target = layers
    _files(upper, {"/usr/local/lib/python3.11/dist-packages/newpkg.libs/__init__.py": "", "/app/answer.txt": "42"})
    _link(upper, where, "/etc")
    entry = upper / where.lstrip("/")

    def to_folder() -> None:
        entry.rename(entry.with_name(entry.name + ".old"))
        entry.mkdir()

    _swap_before(monkeypatch, "link", "swapme.link", to_folder)
    _held_back(_snap(layers), target, where)


@pytest.mark.parametrize(
    "where",
    [
        "/usr/local/lib/python3.11/dist-packages/swapped.py",  # an image folder's new entry
        "/usr/local/lib/python3.11/dist-packages/newpkg.libs/swapped.py",  # a new folder's (walked)
    ],
)
def test_a_file_swapped_for_a_link_before_it_is_linked_is_held_back(layers, monkeypatch, where: str) -> None:
    """Judged as a file (by its name), a link by the time it is hard-linked: its target was never judged,
    so what is laid is checked after linking (the inode can no longer change what it is) and held back."""
    lower, upper, target = layers
    _files(upper, {where: "x = 1", "/usr/local/lib/python3.11/dist-packages/newpkg.libs/__init__.py": ""})
    entry = upper / where.lstrip("/")

    def to_link() -> None:
        entry.unlink()
        entry.symlink_to("/usr/lib/python3.11/os.py")

    _swap_before(monkeypatch, "link", "swapped.py", to_link)
    _held_back(_snap(layers), target, where)
    assert _seen(target, "/usr/local/lib/python3.11/dist-packages/newpkg.libs/__init__.py")  # the rest is laid


def test_a_link_swapped_for_a_file_before_its_target_is_read_is_held_back(layers, monkeypatch) -> None:
    """In a new folder of the agent's, listed as a link, a file by the time its target is read (``EINVAL``): held
    back as changed, not an error of grading's."""
    lower, upper, target = layers
    where = "/usr/local/lib/python3.11/dist-packages/newpkg.libs/flip.py"
    _files(upper, {"/usr/local/lib/python3.11/dist-packages/newpkg.libs/__init__.py": ""})
    _link(upper, where, "__init__.py")
    entry = upper / where.lstrip("/")

    def to_file() -> None:
        entry.unlink()
        entry.write_text("x = 1")

    _swap_before(monkeypatch, "readlink", "flip.py", to_file)
    _held_back(_snap(layers), target, where)


def test_a_live_folder_without_a_mount_point_in_the_view_stays_out(tmp_path: Path) -> None:
    """A folder of the agent's removed before the snapshot and made again before it is mounted live has no
    mount point in the view: it stays out (as when the snapshot was made), not an error of grading's."""
    from harbor_local_sandbox._roots import _bind_live

    agent, view_root = tmp_path / "agent", tmp_path / "view"
    (agent / "newdir").mkdir(parents=True)
    view_root.mkdir()
    agent_fd = os.open(agent, os.O_RDONLY | os.O_DIRECTORY)
    root_fd = os.open(view_root, os.O_PATH | os.O_DIRECTORY)
    try:
        _bind_live(agent_fd, root_fd, "/newdir")  # no mount point: nothing mounted, nothing raised
    finally:
        os.close(agent_fd)
        os.close(root_fd)
    assert not (view_root / "newdir").exists()


def test_an_agents_hosts_file_that_is_a_fifo_does_not_hang_the_view(tmp_path: Path) -> None:
    """``mkfifo /etc/hosts``: reading the agent's host names for the view must not wait for a writer."""
    import threading

    from harbor_local_sandbox._roots import _agents_local_hosts

    (tmp_path / "etc").mkdir()
    os.mkfifo(tmp_path / "etc" / "hosts")
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(_agents_local_hosts(tmp_path, "box")), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO /etc/hosts blocked"
    assert found == [""]
    (tmp_path / "etc" / "hosts").unlink()
    (tmp_path / "etc" / "hosts").write_text("10.0.0.5 db\n127.0.0.1 localhost\n")
    assert _agents_local_hosts(tmp_path, "box") == "10.0.0.5 db\n"


def test_a_test_runner_command_the_agent_adds_to_path_is_not_seen(layers) -> None:
    """A verifier that installs its runner at verify time (``pip install pytest``: /usr/local/bin/pytest) would
    run the agent's, earlier on PATH (issue #43, class 5): the runner's own commands are never the agent's,
    as its modules are not. Another new command is an install, seen."""
    lower, upper, target = layers
    (lower / "usr/bin/pytest").unlink()  # an image without pytest
    _files(upper, {"/usr/local/sbin/pytest": "#!/bin/sh\nexit 0\n", "/usr/local/sbin/mytool": "#!/bin/sh\n"})
    result = _snap(layers)
    assert not _seen(target, "/usr/local/sbin/pytest")
    assert any(c.startswith("/usr/local/sbin/pytest (the test runner's own command") for c in result.concealed)
    assert _seen(target, "/usr/local/sbin/mytool")


def test_a_new_package_of_the_agents_is_mounted_live_where_nothing_below_it_is_judged(layers) -> None:
    """A new top-level package in Python's import folder is left for the view to mount live (its folder
    laid empty, its path in ``live_packages``): nothing the rule judges can be below it. Not so a package
    whose name the image ships or imports (concealed), a folder that is not a package name (walked), nor
    any package once the agent added a ``.pth`` file (which may name a folder of one: all are walked)."""
    lower, upper, target = layers
    local = "/usr/local/lib/python3.11/dist-packages"
    _files(
        upper,
        {
            f"{local}/agentpkg/__init__.py": "VALUE = 1",
            f"{local}/agentpkg/sub/mod.py": "N = 1",
            f"{local}/argparse/__init__.py": "planted",  # a standard-library name
            f"{local}/agentpkg.libs/libx.so": "elf",
            "/usr/local/share/agentdata/__init__.py": "",  # not an import folder of Python's
        },
    )
    result = _snap(layers)
    assert result.live_packages == [f"{local}/agentpkg"]
    assert (target / local.lstrip("/") / "agentpkg").is_dir()
    assert not any((target / local.lstrip("/") / "agentpkg").iterdir())  # a mount point: nothing laid
    assert not _seen(target, f"{local}/argparse/__init__.py")
    assert _seen(target, f"{local}/agentpkg.libs/libx.so")

    _files(upper, {f"{local}/agentpkg_paths.pth": f"{local}/agentpkg/sub\n"})
    for entry in sorted(target.iterdir()):
        _remove(entry)
    walked = _snap(layers)
    assert walked.live_packages == []
    assert _seen(target, f"{local}/agentpkg/sub/mod.py") and _seen(target, f"{local}/agentpkg_paths.pth")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
