"""Drop-in parity with ``trl.experimental.harbor`` where the behaviour is meant to be identical.

Deliberate differences (not tested here): our ``task_dir`` is always absolute, ``reward_funcs``
is a list, malformed tasks fail in the constructor, and all ``[metadata]`` keys become columns
(a superset of the reference's four).
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest
from trl.experimental import harbor as ref  # noqa: E402

import trl_harbor as ours  # noqa: E402
from trl_harbor.agents import AGENTS  # noqa: E402

REF_COLUMNS = ["prompt", "task_dir", "task_index", "gold_answer", "reward_mode", "difficulty_level", "kaggle_dataset"]


def _params(fn) -> dict[str, object]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def test_same_public_names() -> None:
    for name in ("HarborSpec", "HarborEnv", "HarborBashEnv"):
        assert hasattr(ours, name), name
    assert sorted(AGENTS) == sorted(ref.AGENTS)


def test_constructor_parameters_and_defaults_are_kept() -> None:
    for ref_cls, our_cls in ((ref.HarborSpec, ours.HarborSpec), (ref.HarborEnv, ours.HarborEnv)):
        ref_params, our_params = _params(ref_cls.__init__), _params(our_cls.__init__)
        for name, default in ref_params.items():
            assert name in our_params, (our_cls, name)
            assert our_params[name] == default, (our_cls, name)


@pytest.mark.parametrize("selection", [{}, {"num_tasks": 5}, {"indices": [9, 0, 4]}])
def test_same_rows_and_columns(bundled_suite: Path, selection: dict) -> None:
    dataset = str(bundled_suite.resolve())
    ref_ds = ref.HarborSpec(dataset, **selection).train_dataset
    our_ds = ours.HarborSpec(dataset, **selection).train_dataset
    assert ref_ds.column_names == REF_COLUMNS
    assert set(REF_COLUMNS) <= set(our_ds.column_names)
    for column in REF_COLUMNS:
        assert our_ds[column] == ref_ds[column], column


def test_parent_folder_with_tasks_subtree(bundled_suite: Path) -> None:
    dataset = str(bundled_suite.parent.resolve())
    assert ours.HarborSpec(dataset).train_dataset["task_dir"] == ref.HarborSpec(dataset).train_dataset["task_dir"]


def test_without_metadata(bundled_suite: Path) -> None:
    dataset = str(bundled_suite.resolve())
    assert (
        ours.HarborSpec(dataset, include_metadata=False).train_dataset.column_names
        == ref.HarborSpec(dataset, include_metadata=False).train_dataset.column_names
    )


def test_same_errors(bundled_suite: Path) -> None:
    dataset = str(bundled_suite)
    for module in (ref, ours):
        with pytest.raises(ValueError):
            module.HarborSpec(dataset, num_tasks=1, indices=[0])
        with pytest.raises(ValueError, match="bash"):
            module.HarborSpec(dataset, agent="no-such-agent")
        with pytest.raises(TypeError):
            module.HarborSpec(dataset, agent="collections:OrderedDict")


def test_factory_and_reward_behave_alike(bundled_suite: Path) -> None:
    dataset = str(bundled_suite)
    ref_spec = ref.HarborSpec(dataset, environment_type="e2b")
    our_spec = ours.HarborSpec(dataset, environment_type="e2b")
    ref_env = pickle.loads(pickle.dumps(ref_spec.environment_factory))()
    our_env = pickle.loads(pickle.dumps(our_spec.environment_factory))()
    assert type(ref_env).__name__ == type(our_env).__name__ == "HarborBashEnv"
    assert ref_env._environment_type == our_env._environment_type == "e2b"
    assert ref_env.reward == our_env.reward == 0.0  # never reset: no backend touched

    ref_reward = ref_spec.reward_funcs
    our_reward = our_spec.reward_funcs
    assert ref_reward(environment_reward=[1, 0.25]) == our_reward(completions=[], environment_reward=[1, 0.25])
    assert ref_reward(environments=[ref_env]) == our_reward(completions=["x"], environments=[our_env]) == [0.0]


def test_bash_tool_schema_matches(bundled_suite: Path) -> None:
    from transformers.utils import get_json_schema

    ref_schema = get_json_schema(ref.HarborBashEnv.bash)["function"]["parameters"]
    our_schema = get_json_schema(ours.HarborBashEnv.bash)["function"]["parameters"]
    assert our_schema["required"] == ref_schema["required"] == ["command"]
    assert our_schema["properties"].keys() == ref_schema["properties"].keys()
    assert "/workdir/answer.txt" in ours.HarborBashEnv.PROMPT_SUFFIX


REFERENCE_STYLE_HARNESS = '''
from trl_harbor import HarborEnv  # the only line changed from `from trl.experimental.harbor import HarborEnv`


class NotebookEnv(HarborEnv):
    """A harness written against the reference integration's internals."""

    PROMPT_SUFFIX = "\\n\\nUse the tools."

    async def _setup(self):
        await self._env.exec("mkdir -p /home/user/notes && echo ready > /home/user/notes/state")
        self.setup_saw = (self._task.name, self._paths is not None)

    def read_state(self) -> str:
        """Read the notebook's state file.

        Returns:
            Its content.
        """
        result = self._run(self._env.exec("cat /home/user/notes/state; ls -d /workdir /home/user/input"))
        return (result.stdout or "") + (result.stderr or "")

    def answer(self, value: str) -> str:
        """Submit an answer.

        Args:
            value: The answer.

        Returns:
            The command's output.
        """
        return self._exec(f"echo -n {value} > /workdir/answer.txt", timeout=30)
'''


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="needs bubblewrap")
def test_a_harness_written_for_the_reference_runs_with_only_its_import_changed(
    tmp_path: Path, bundled_suite: Path
) -> None:
    from conftest import GOLD_ANSWER, GOLD_TASK

    harness = tmp_path / "notebook_env.py"
    harness.write_text(REFERENCE_STYLE_HARNESS)
    spec = ours.HarborSpec(
        str(bundled_suite), agent=f"{harness}:NotebookEnv", environment_type="local",
        indices=[sorted(p.name for p in bundled_suite.iterdir()).index(GOLD_TASK)],
    )  # fmt: skip
    env = spec.environment_factory()
    try:
        env.reset(task_dir=spec.train_dataset[0]["task_dir"])
        assert sorted(env.read_state().split()) == ["/home/user/input", "/workdir", "ready"]
        assert env.setup_saw == (GOLD_TASK, True)
        env.answer(GOLD_ANSWER)
        assert env.reward == 1.0
    finally:
        ours.close_all()
