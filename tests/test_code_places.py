"""One table of code places (``harbor_local_sandbox/code_places.py``), read by the view, the keel and the seal.

Each consumer is shown to take its places from the table, not from a list of its own: changing the
table changes what each one does.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import harbor_local_sandbox.code_places as table
from harbor_local_sandbox import _links, _view
from harbor_local_sandbox._binaries import static_binary

from trl_harbor.rollout import code_places as seal_table
from trl_harbor.rollout import integrity

ROOT = Path(__file__).resolve().parents[1]


def test_the_seal_reads_the_same_file_without_needing_the_sandbox_package() -> None:
    """trl-harbor's copy is a link to the package's table (one file), importing nothing of the package."""
    assert os.path.samefile(seal_table.__file__, table.__file__)
    source = Path(table.__file__).read_text()
    assert "import harbor_local_sandbox" not in source and "from harbor_local_sandbox" not in source
    assert seal_table.STARTUP_FILES == table.STARTUP_FILES


def test_the_view_takes_its_configuration_places_from_the_table(tmp_path: Path, monkeypatch) -> None:
    """An entry added to the table is a code place of the view's rule: the agent's addition there is not seen."""
    lower = tmp_path / "image"
    (lower / "etc").mkdir(parents=True)
    search = _view.SearchPaths(path=("/usr/bin",))
    rule = _view._Rule(lower, search, "/workdir", ())
    assert rule.concealed_change("/etc/tablecheck.conf", shipped=False, folder=False, link=False) is None
    monkeypatch.setattr(_view, "CODE_CONFIG", (*table.CODE_CONFIG, "/etc/tablecheck.conf"))
    rule = _view._Rule(lower, search, "/workdir", ())
    assert (
        rule.concealed_change("/etc/tablecheck.conf", shipped=False, folder=False, link=False) == "code configuration"
    )
    assert _view.HOOKS is table.HOOKS and _view.RUNNER_PACKAGES is table.RUNNER_PACKAGES


def test_the_keel_takes_its_forbidden_places_from_the_table() -> None:
    """The keel has no list of its own: it refuses what the items made from the table name, and only that."""
    source = (ROOT / "packages/harbor-local-sandbox/src/harbor_local_sandbox/_supervisor.c").read_text()
    for place in set(table.LINK_FORBIDDEN) - {"/proc", "/dev/shm"}:  # those two it mounts, as the kernel's
        assert f'"{place.strip("/")}"' not in source and f'"{place}"' not in source, place
    targets = "/srv/secret/x\n/tests/x\n/usr/bin/x\n"

    def keel(policy: _links.LinkPolicy) -> list[str]:
        done = subprocess.run(
            [static_binary("supervisor"), "judge-link", *_links.keel_items(policy)],
            input=targets,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return done.stdout.split()

    assert keel(_links.LinkPolicy()) == ["0", "1", "0"]
    assert keel(_links.LinkPolicy(forbidden=frozenset({*table.LINK_FORBIDDEN, "/srv/secret"}))) == ["1", "1", "0"]
    assert _links.LinkPolicy().forbidden == frozenset(table.LINK_FORBIDDEN)


def test_the_seal_watches_the_tables_start_up_files() -> None:
    """Every start-up place of the table is watched by the seal of a backend without a view (the loader's
    cache aside, see ``integrity.STARTUP_FILES``), read from the table when the seal is imported."""
    watched = {watch.pattern for watch in integrity.watches([], [])}
    for item in table.STARTUP_FILES:
        if item == "/etc/ld.so.*":
            continue
        assert item in integrity.STARTUP_FILES
        assert item.replace("~/", "/root/") in watched, item
    assert integrity.code_places is seal_table
