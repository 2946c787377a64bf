"""What trl-harbor needs of TRL's internals, detected (``trl_harbor.training.trl_compat``), and what it does without it.

Two kinds of test: the installed TRL (1.16 here) is checked for real — its ``GRPOTrainer`` loop can
be hooked, its ``AsyncGRPOTrainer`` is found on the experimental path. Other TRL releases cannot be
installed here, so they are *simulated*: trainer classes whose ``_tool_call_loop`` has another
shape (the concurrent-tools mixin put on a tiny fake base, not a real trainer), and a TRL with a
stable ``AsyncGRPOTrainer`` (attributes set on ``trl`` and a fake ``async_rollout_worker`` module).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import types
import warnings
from typing import Any

import pytest
import trl
from trl import GRPOTrainer

import trl_harbor.training.trainer as trainer_module
from trl_harbor.training import trl_compat
from trl_harbor.training.trainer import ConcurrentToolsMixin, HarborGRPOTrainer, concurrent_tools_supported
from trl_harbor.training.trl_compat import async_grpo, rollout_sample_class, tool_loop_problem

EXPERIMENTAL = "trl.experimental.async_grpo"

# ── the tool loop ───────────────────────────────────────────────────────────────────────


def test_the_installed_trls_loop_can_be_hooked() -> None:
    """Real TRL: ``GRPOTrainer``'s loop, and ``HarborGRPOTrainer``'s (the loop after the mixin)."""
    assert tool_loop_problem(GRPOTrainer) is None
    assert concurrent_tools_supported()
    assert concurrent_tools_supported(GRPOTrainer)
    assert concurrent_tools_supported(HarborGRPOTrainer)
    with pytest.raises(TypeError, match="not a TRL version"):
        concurrent_tools_supported("99.0.0")  # type: ignore[arg-type]  # what it took before


def _calls(rollouts: int) -> list[list[dict[str, Any]]]:
    """A batch whose rollouts each call ``wait`` once in their last assistant message."""
    call = {"type": "function", "function": {"name": "wait", "arguments": {}}}
    return [
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        for _ in range(rollouts)
    ]


class _Base:
    """A simulated trainer: the tool dicts TRL's ``GRPOTrainer`` keeps, one rollout per entry."""

    def __init__(self, tools: dict[str, Any], rollouts: int = 2) -> None:
        self._sync_tool_dicts = [dict(tools) for _ in range(rollouts)]
        self._async_tool_dicts = [{} for _ in range(rollouts)]
        self.seen_dicts: list[Any] = []


class _HookableLoop(_Base):
    """A simulated TRL release whose loop has TRL 1.16's contract, in a few lines."""

    def _tool_call_loop(self, prompts: Any, completions: list[list[dict[str, Any]]]) -> str:
        self.seen_dicts.append(self._sync_tool_dicts)
        for index, messages in enumerate(completions):
            for call in list(messages[-1].get("tool_calls") or []):
                function = call["function"]
                assert function["name"] not in self._async_tool_dicts[index]  # sync tools only, here
                result = self._sync_tool_dicts[index][function["name"]](**function["arguments"])
                messages.append({"role": "tool", "content": str(result)})
        return "parent loop"


class _NoCompletions(_Base):
    """A simulated release whose loop takes no ``completions``."""

    def _tool_call_loop(self, prompts: Any, turns: Any) -> str:
        self.seen_dicts.append((self._sync_tool_dicts, self._async_tool_dicts))
        return "parent loop"


class _NoToolDicts(_Base):
    """A simulated release whose loop looks tools up elsewhere."""

    def _tool_call_loop(self, prompts: Any, completions: Any) -> str:
        self.seen_dicts.append(getattr(self, "tools", None))
        return "parent loop"


class _NoLoop(_Base):
    """A simulated release without a ``_tool_call_loop`` at all."""


_SOURCELESS: dict[str, Any] = {}
exec(  # a loop whose source cannot be read (as in a frozen or compiled build)
    "def _tool_call_loop(self, prompts, completions):\n    return 'parent loop'\n", _SOURCELESS
)
_NoSource = type("_NoSource", (_Base,), {"_tool_call_loop": _SOURCELESS["_tool_call_loop"]})


@pytest.mark.parametrize(
    ("base", "reason"),
    [
        (_NoCompletions, "takes no `completions` argument"),
        (_NoToolDicts, "does not look tools up through `_sync_tool_dicts` and `_async_tool_dicts`"),
        (_NoLoop, "has no `_tool_call_loop` method"),
        (_NoSource, "cannot read the source"),
    ],
)
def test_a_loop_of_another_shape_is_refused_with_a_reason(base: type, reason: str) -> None:
    """Simulated releases: each way a loop can differ is named."""
    problem = tool_loop_problem(base)
    assert problem is not None and reason in problem, problem
    assert not concurrent_tools_supported(base)


def test_the_verdict_is_cached_per_class(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = type("Fresh", (_HookableLoop,), {})
    assert tool_loop_problem(cls) is None

    def unreadable(obj: Any) -> str:
        raise OSError("no source")

    monkeypatch.setattr(inspect, "getsource", unreadable)
    assert tool_loop_problem(cls) is None  # not looked at again
    assert "cannot read the source" in (tool_loop_problem(type("Other", (_HookableLoop,), {})) or "")


@pytest.mark.parametrize("base", [_NoCompletions, _NoToolDicts, _NoLoop])
def test_the_mixin_on_a_refused_loop_warns_once_and_runs_the_parents(base: type) -> None:
    """Simulated releases: the mixin leaves the loop (and the tool dicts) to the parent."""

    class Trainer(ConcurrentToolsMixin, base):  # type: ignore[misc, valid-type]
        pass

    def wait() -> str:
        return "done"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainers = [Trainer({"wait": wait}) for _ in range(2)]
    ours = [w for w in caught if "trl-harbor" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is RuntimeWarning, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert f"TRL {trl.__version__}" in message and "TRL's own tool loop" in message
    assert tool_loop_problem(base) in message  # type: ignore[operator]
    assert ours[0].filename == __file__  # points at the trainer's construction

    trainer = trainers[0]
    if base is _NoLoop:
        with pytest.raises(AttributeError):
            trainer._tool_call_loop(["go"], _calls(2))
        return
    assert trainer._tool_call_loop(["go"], _calls(2)) == "parent loop"
    if base is _NoCompletions:
        assert trainer.seen_dicts == [(trainer._sync_tool_dicts, trainer._async_tool_dicts)]
        assert trainer._sync_tool_dicts[0]["wait"] is wait  # never swapped for the dispatcher's


def test_a_hookable_loop_on_an_untested_release_runs_concurrently_after_one_info_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A simulated untested release whose loop has the tested contract: both rollouts' calls run at once."""
    monkeypatch.setattr(trainer_module, "TESTED_TRL_VERSIONS", ())
    monkeypatch.setattr(trainer_module, "_logged_untested", False)

    class Trainer(ConcurrentToolsMixin, _HookableLoop):
        pass

    barrier = threading.Barrier(2, timeout=10)  # broken unless both rollouts' calls are in flight together

    def wait() -> str:
        barrier.wait()
        return "met"

    with caplog.at_level(logging.INFO, logger=trainer_module.__name__), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        trainers = [Trainer({"wait": wait}) for _ in range(2)]
    untested = [r for r in caplog.records if "tested with TRL" in r.getMessage()]
    assert len(untested) == 1 and untested[0].levelno == logging.INFO
    assert trl.__version__ in untested[0].getMessage()

    trainer = trainers[0]
    completions = _calls(2)
    assert trainer._tool_call_loop(["go", "go"], completions=completions) == "parent loop"
    assert [messages[-1] for messages in completions] == [{"role": "tool", "content": "met"}] * 2
    assert trainer.seen_dicts[0] is not trainer._sync_tool_dicts  # the dispatcher's, during the loop
    assert trainer._sync_tool_dicts[0]["wait"] is wait  # and TRL's own again after it


def test_a_tested_release_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Real TRL: the installed release is a tested one."""
    assert trl.__version__ in trainer_module.TESTED_TRL_VERSIONS

    class Trainer(ConcurrentToolsMixin, _HookableLoop):
        pass

    with caplog.at_level(logging.INFO, logger=trainer_module.__name__):
        Trainer({})
    assert not [r for r in caplog.records if "tested with TRL" in r.getMessage()]


# ── AsyncGRPOTrainer ────────────────────────────────────────────────────────────────────


class _StableTrainer:
    """A simulated newer TRL's stable ``AsyncGRPOTrainer``."""


class _StableConfig:
    """A simulated newer TRL's stable ``AsyncGRPOConfig``."""


class _StableSample:
    """A simulated newer TRL's ``RolloutSample``."""


_STABLE_PACKAGE = "simulated_trl_118.async_grpo"


@pytest.fixture
def stable_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated TRL 1.18+: the async trainer in ``trl``; the experimental path unimportable."""
    monkeypatch.setattr(_StableTrainer, "__module__", f"{_STABLE_PACKAGE}.async_grpo_trainer")
    monkeypatch.setattr(trl, "AsyncGRPOTrainer", _StableTrainer, raising=False)
    monkeypatch.setattr(trl, "AsyncGRPOConfig", _StableConfig, raising=False)
    # ``None`` in sys.modules makes an import fail: proof the experimental path is not touched.
    monkeypatch.setitem(sys.modules, EXPERIMENTAL, None)
    monkeypatch.setitem(sys.modules, f"{EXPERIMENTAL}.async_rollout_worker", None)


def _no_experimental_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trl, "AsyncGRPOTrainer", None, raising=False)
    monkeypatch.setattr(trl, "AsyncGRPOConfig", None, raising=False)
    monkeypatch.setitem(sys.modules, EXPERIMENTAL, None)
    monkeypatch.setitem(sys.modules, f"{EXPERIMENTAL}.async_rollout_worker", None)


@pytest.mark.usefixtures("stable_trl")
def test_a_stable_async_trainer_is_taken_from_trl_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated TRL 1.18+: found in ``trl``, ``RolloutSample`` beside it, no experimental import or warning."""
    worker = types.ModuleType(f"{_STABLE_PACKAGE}.async_rollout_worker")
    worker.RolloutSample = _StableSample  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, worker.__name__, worker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert async_grpo() == (_StableTrainer, _StableConfig)
        assert rollout_sample_class() is _StableSample


@pytest.mark.usefixtures("stable_trl")
def test_rollout_sample_not_beside_the_stable_trainer_names_where_it_looked() -> None:
    """Simulated TRL 1.18+ with no ``async_rollout_worker`` beside the trainer (and no experimental path)."""
    with pytest.raises(ImportError) as raised:
        rollout_sample_class()
    message = str(raised.value)
    assert f"`{_STABLE_PACKAGE}.async_rollout_worker`" in message
    assert f"`{EXPERIMENTAL}.async_rollout_worker`" in message


def test_the_experimental_path_without_a_stable_trainer() -> None:
    """Real TRL 1.16: only ``trl.experimental.async_grpo`` has the async trainer."""
    if isinstance(getattr(trl, "AsyncGRPOTrainer", None), type):
        pytest.skip(f"TRL {trl.__version__} has a stable AsyncGRPOTrainer (the simulated tests cover it)")
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    assert async_grpo() == (AsyncGRPOTrainer, AsyncGRPOConfig)
    assert rollout_sample_class() is RolloutSample


def test_no_async_trainer_anywhere_names_both_places_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated TRL with neither place (``trl`` lacks the names, the experimental module fails to import)."""
    _no_experimental_trl(monkeypatch)
    with pytest.raises(ImportError) as raised:
        async_grpo()
    message = str(raised.value)
    assert "`trl`" in message and f"`{EXPERIMENTAL}`" in message and "pip install" in message
    assert trl.__version__ in message
    with pytest.raises(ImportError, match=r"RolloutSample: looked in `trl\.experimental\.async_grpo\."):
        rollout_sample_class()


def test_the_module_documents_every_public_name() -> None:
    for name in trl_compat.__all__:
        doc = inspect.getdoc(getattr(trl_compat, name)) or ""
        assert "Returns:" in doc, name


def test_the_installed_transformers_and_trl_parse_a_tool_call(tmp_path) -> None:
    """The pair installed reads back as a call a Qwen3 tool call that the tokenizer holds as one added token,
    as the test policy emits it (transformers 5.25's response-template parser, with TRL 1.16, returns it as
    text: no tool is ever called; the ``test`` extra caps transformers below it)."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import add_response_schema, parse_response

    from trl_harbor import HarborBashEnv
    from trl_harbor.testing import build_tokenizer, tool_call_text

    call = tool_call_text("bash", {"command": "ls /workdir/data"})
    # The test policy (tests/demo_policy.py) emits a whole call as one added token; saved, then loaded,
    # as a checkpoint is trained and evaluated.
    build_tokenizer(extra_tokens=[call]).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)
    tools = [get_json_schema(HarborBashEnv.bash)]
    conversation = [{"role": "user", "content": "list the data folder"}]
    prompt = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    reply = call + "<|im_end|>"
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tokenizer, ids, prefix=prompt, tools=tools)
    calls = parsed.get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["bash"], parsed
