"""What the model sees besides the task: its chat template, a system prompt, example turns.

Three options of ``trl-harbor train`` (and ``trl-harbor eval`` with a local model), which the
embedded default run sets for its 135M model and any run may set:

- ``--chat_template``: the tokenizer's chat template, by the name of one TRL bundles
  (``qwen2_5``: the file ``trl/chat_templates/qwen2_5.jinja``, used verbatim) or a Jinja file.
  TRL parses tool calls and keeps multi-turn prompts intact only for templates it recognises,
  and it recognises them by exact equality, so a name is read from TRL's own file.
- ``--system_prompt``: a system message in front of every prompt.
- ``--few_shot FILE``: example turns (JSON) between the system message and the task: user
  instructions and the assistant's tool calls, optionally the tools' outputs and final answers.

A few-shot file is a JSON list of messages::

    [{"role": "user", "content": "Write the word green into /workdir/colour.txt using the bash tool."},
     {"role": "assistant", "content": "",
      "tool_calls": [{"name": "bash", "arguments": {"command": "echo green > /workdir/colour.txt"}}]}]

``tool_calls`` entries are ``{"name", "arguments"}`` (or OpenAI's ``{"type": "function",
"function": {"name", "arguments"}}``, arguments as an object or a JSON string); a tool's output is
``{"role": "tool", "name": ..., "content": ...}``. The list starts with a user message and ends
with an assistant message; the system prompt is its own option.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor.training.tools import tool_functions

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = [
    "PromptError",
    "bundled_chat_templates",
    "check_few_shot_tools",
    "load_few_shot",
    "openai_messages",
    "prompt_prefix",
    "resolve_chat_template",
    "tool_names",
    "with_prompt_prefix",
]


class PromptError(ValueError):
    """A bad ``--chat_template``, ``--system_prompt`` or ``--few_shot`` (the message names the option)."""


def bundled_chat_templates() -> dict[str, Path]:
    """The chat templates TRL ships (``trl/chat_templates/*.jinja``), by name.

    Returns:
        ``{name: path}``, e.g. ``{"qwen2_5": .../qwen2_5.jinja, ...}``.
    """
    import trl

    folder = Path(trl.__file__).parent / "chat_templates"
    return {path.stem: path for path in sorted(folder.glob("*.jinja"))}


def resolve_chat_template(value: str, option: str = "--chat_template") -> str:
    """The text of a chat template given by a TRL template name or a file path.

    Args:
        value: A name from :func:`bundled_chat_templates` (e.g. ``qwen2_5``) or a path to a Jinja file.
        option: The option's name, for the error message.

    Returns:
        The template, verbatim (TRL recognises its templates by exact equality).

    Raises:
        PromptError: When ``value`` is neither.
    """
    bundled = bundled_chat_templates()
    if value in bundled:
        return bundled[value].read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    originals = sorted(name for name in bundled if not name.endswith("_training"))
    raise PromptError(
        f"{option} {value!r} is neither one of TRL's bundled chat templates nor a file. TRL parses tool calls "
        f"only with templates it knows: give one of {', '.join(originals)} (e.g. {option} qwen2_5), "
        "or a path to a .jinja file"
    )


def _fail(path: str | Path, index: int | None, why: str) -> PromptError:
    where = f"{path}" if index is None else f"{path}, message {index}"
    return PromptError(f"--few_shot {where}: {why}")


def _tool_call(raw: Any, path: str | Path, index: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _fail(path, index, f"a tool call must be an object, got {raw!r}")
    function = raw.get("function", raw) if raw.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _fail(path, index, 'a tool call needs a "name" (and "arguments"), e.g. {"name": "bash", "arguments": '
                    '{"command": "ls"}}')  # fmt: skip
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise _fail(path, index, f"the arguments of {function['name']!r} are not JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise _fail(path, index, f"the arguments of {function['name']!r} must be an object, got {arguments!r}")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def load_few_shot(path: str | Path) -> list[dict[str, Any]]:
    """Read and check a few-shot file (see the module's docstring for the format).

    Args:
        path: The JSON file.

    Returns:
        The messages, normalised to the form TRL's chat templates take: assistant tool calls as
        ``{"type": "function", "function": {"name", "arguments": {...}}}``, ``content`` always a string.

    Raises:
        PromptError: For a missing or malformed file, naming the message at fault.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise _fail(path, None, "no such file (a JSON list of example messages; see docs/cli.md)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, None, f"not JSON: {exc}") from exc
    if not isinstance(raw, list) or not raw:
        raise _fail(path, None, "expected a non-empty JSON list of messages")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        messages.append(_message(message, messages[-1] if messages else {}, path, index))
    if messages[0]["role"] != "user":
        raise _fail(path, 0, "the examples must start with a user message")
    if messages[-1]["role"] != "assistant":
        raise _fail(path, len(messages) - 1, "the examples must end with an assistant message (the task comes next)")
    return messages


def _message(message: Any, previous: dict[str, Any], path: str | Path, index: int) -> dict[str, Any]:
    """One example message, checked and normalised (``previous``: the normalised message before it)."""
    if not isinstance(message, dict):
        raise _fail(path, index, f"a message must be an object, got {message!r}")
    role, content = message.get("role"), message.get("content", "")
    if role == "system":
        raise _fail(path, index, "no system message here: give it with --system_prompt")
    if role not in ("user", "assistant", "tool"):
        raise _fail(path, index, f'role must be "user", "assistant" or "tool", got {role!r}')
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _fail(path, index, "content must be a string")
    if role == "user":
        return {"role": "user", "content": content}
    if role == "assistant":
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise _fail(path, index, "tool_calls must be a list")
        if not calls and not content:
            raise _fail(path, index, "an assistant message needs content or tool_calls")
        normalised = [_tool_call(call, path, index) for call in calls]
        return {"role": "assistant", "content": content, **({"tool_calls": normalised} if normalised else {})}
    if previous.get("role") not in ("assistant", "tool") or (
        previous.get("role") == "assistant" and not previous.get("tool_calls")
    ):
        raise _fail(path, index, "a tool message must follow an assistant message with tool_calls")
    name = message.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(path, index, 'a tool message needs the "name" of the tool it answers')
    return {"role": "tool", "name": name, "content": content}


def tool_names(harness: type) -> list[str]:
    """The tools TRL makes of a harness class (:func:`trl_harbor.training.tools.tool_functions`).

    Args:
        harness: A ``HarborEnv`` subclass.

    Returns:
        The tool names, sorted.
    """
    return list(tool_functions(harness))


def check_few_shot_tools(messages: Sequence[dict[str, Any]], tools: Iterable[str], agent: str) -> None:
    """Refuse example turns that call tools the harness does not have.

    Args:
        messages: Normalised few-shot messages (:func:`load_few_shot`).
        tools: The harness's tool names.
        agent: The harness's name, for the message.

    Raises:
        PromptError: Naming the unknown tool and the harness's tools.
    """
    known = set(tools)
    for index, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            if name not in known:
                raise PromptError(
                    f"--few_shot: message {index} calls the tool {name!r}, which the harness {agent!r} does not "
                    f"have (its tools: {', '.join(sorted(known)) or 'none'}); fix the examples or pick --agent"
                )


def prompt_prefix(system_prompt: str | None, few_shot: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages in front of every task: the system prompt, then the example turns.

    Args:
        system_prompt: The system message's text (``None`` or empty: none).
        few_shot: Normalised example messages (``None``: none).

    Returns:
        The messages (a new list).
    """
    prefix: list[dict[str, Any]] = []
    if system_prompt:
        prefix.append({"role": "system", "content": system_prompt})
    prefix.extend(dict(m) for m in few_shot or ())
    return prefix


def with_prompt_prefix(dataset: Dataset, prefix: Sequence[dict[str, Any]]) -> Dataset:
    """Put ``prefix`` in front of every row's ``prompt`` (a training dataset of ``HarborSpec``).

    The column becomes a list of JSON objects (``datasets.Json``), so messages of different
    shapes (with or without ``tool_calls``, a tool's ``name``) keep exactly their own keys.
    TRL appends the task's instruction to the last message, the row's own (empty) user message.

    Args:
        dataset: A dataset with a conversational ``prompt`` column.
        prefix: The messages to put first (:func:`prompt_prefix`).

    Returns:
        The new dataset (``dataset`` itself when ``prefix`` is empty).
    """
    if not prefix:
        return dataset
    from datasets import Json, List

    features = dataset.features.copy()
    features["prompt"] = List(Json())
    head = [dict(m) for m in prefix]

    def prepend(row: dict[str, Any]) -> dict[str, Any]:
        own = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
        return {"prompt": [*head, *own]}

    return dataset.map(prepend, features=features)


def openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as an OpenAI-compatible endpoint takes them (arguments as JSON strings, call ids).

    Args:
        messages: Normalised messages (:func:`prompt_prefix`).

    Returns:
        New messages: each tool call gets an ``id`` and a JSON-string ``arguments``; each tool
        message the ``tool_call_id`` of the call it answers.
    """
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for number, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for i, call in enumerate(message["tool_calls"]):
                function = call["function"]
                call_id = f"example_{number}_{i}"
                arguments = function["arguments"]
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": function["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})  # fmt: skip
                pending.append(call_id)
            message["tool_calls"] = calls
        elif message.get("role") == "tool":
            message["tool_call_id"] = pending.pop(0) if pending else ""
        out.append(message)
    return out
