"""The package as Harbor users get it: installed with Harbor alone (no TRL, no trl-harbor), run by `harbor run`."""

from __future__ import annotations

import importlib.metadata
import json
import re
import time
import tomllib
from pathlib import Path

import pytest
from harbor_alone import plugin_venv  # noqa: F401 - the session fixture

PACKAGE_DIR = Path(__file__).resolve().parents[1]
BUNDLED_SUITE = PACKAGE_DIR.parents[1] / "examples" / "tasks"
#: The bundled suite's tasks: its folders that hold a task.toml.
BUNDLED_TASKS = sorted(path.parent for path in BUNDLED_SUITE.glob("*/task.toml"))
#: Distributions the package must not bring in (trl-harbor's and a trainer's, not Harbor's).
FORBIDDEN = {"trl", "trl-harbor", "torch", "transformers"}


def _normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_plugin_imports_in_the_venv_and_trl_does_not(plugin_venv) -> None:  # noqa: F811
    """The venv proves the package needs neither trl-harbor nor TRL: both are missing there, the plug-in is not."""
    plugin = plugin_venv.imports["harbor_local_sandbox.local"]
    assert "file" in plugin, plugin
    assert Path(plugin["file"]).resolve().is_relative_to(plugin_venv.path.resolve()), plugin
    assert plugin_venv.imports["trl_harbor"] == {"error": "ModuleNotFoundError", "missing": "trl_harbor"}
    assert plugin_venv.imports["trl"] == {"error": "ModuleNotFoundError", "missing": "trl"}


def test_the_ray_backend_imports_without_ray_and_names_the_extra(plugin_venv) -> None:  # noqa: F811
    """Ray is an extra: without it the Ray backend's module imports, and using it says what to install."""
    code = (
        "import harbor_local_sandbox.ray_cluster as m\n"
        "try:\n    m.connect()\nexcept m.RayClusterUnavailableError as exc:\n    print(exc)\n"
    )
    result = plugin_venv.run(plugin_venv.python, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "pip install 'harbor-local-sandbox[ray]'" in result.stdout, result.stdout


def test_pip_sees_the_package_and_nothing_of_trl(plugin_venv) -> None:  # noqa: F811
    """pip's metadata is what a user sees: the package's own name and version, no trainer stack pulled in."""
    project = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]
    shown = plugin_venv.run(plugin_venv.python, "-m", "pip", "show", "harbor-local-sandbox")
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(": ", 1) for line in shown.stdout.splitlines() if ": " in line)
    assert (fields["Name"], fields["Version"]) == ("harbor-local-sandbox", project["version"])

    listed = plugin_venv.run(plugin_venv.python, "-m", "pip", "list", "--format=json")
    assert listed.returncode == 0, listed.stderr
    installed = {_normalized(entry["name"]): entry for entry in json.loads(listed.stdout)}
    assert not FORBIDDEN & installed.keys(), sorted(FORBIDDEN & installed.keys())
    assert installed["harbor"]["version"] == importlib.metadata.version("harbor")
    assert "editable_project_location" not in installed["harbor-local-sandbox"]  # a real install, not the source


@pytest.mark.local
def test_harbor_run_with_the_plugin_alone_passes_the_bundled_suite(plugin_venv, tmp_path: Path) -> None:  # noqa: F811
    """Harbor's own CLI, oracle and verifier, with only this package as the environment, on all bundled tasks."""
    assert len(BUNDLED_TASKS) == 15, BUNDLED_TASKS
    jobs = tmp_path / "jobs"
    started = time.monotonic()
    completed = plugin_venv.run(
        plugin_venv.bin / "harbor", "run", "-p", BUNDLED_SUITE, "-a", "oracle",
        "-e", "harbor_local_sandbox.local:LocalEnvironment", "-n", "4", "-o", jobs, "-y",
        timeout=900, cwd=tmp_path,
        # litellm (Harbor imports it) fetches its model price list from GitHub on import unless told not to.
        env=plugin_venv.env(HARBOR_TELEMETRY="0", LITELLM_LOCAL_MODEL_COST_MAP="True"),
    )  # fmt: skip
    print(f"harbor run took {time.monotonic() - started:.1f} s")
    errors = "".join(f"\n{path}:\n{path.read_text()[-2000:]}" for path in sorted(jobs.glob("**/exception.txt")))
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:] + errors
    (result_file,) = jobs.glob("*/result.json")
    stats = json.loads(result_file.read_text())["stats"]
    assert stats["n_errored_trials"] == 0, errors
    assert stats["n_completed_trials"] == len(BUNDLED_TASKS)
    (evaluation,) = stats["evals"].values()
    assert evaluation["metrics"][0]["reward"] == 1.0, evaluation
