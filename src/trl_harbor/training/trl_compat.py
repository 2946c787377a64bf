"""What trl-harbor needs of TRL's internals, found by looking, never by TRL's version string.

trl-harbor relies on a few things TRL does not promise across releases: the shape of
``GRPOTrainer._tool_call_loop`` (which :class:`~trl_harbor.training.trainer.ConcurrentToolsMixin`
hooks), and where ``AsyncGRPOTrainer``, ``AsyncGRPOConfig`` and ``RolloutSample`` live (TRL 1.18
made the async trainer stable, importable from ``trl``; before that, and with a deprecation
warning until TRL 2.0, it is in ``trl.experimental.async_grpo``), and the test that picks the
fused LM head's compact path (:func:`completion_only_lm_head`). Each helper here checks the
installed TRL for what it needs and says what is missing, so a new TRL release keeps working
where it still can and fails with a clear message where it cannot.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["async_grpo", "completion_only_lm_head", "rollout_sample_class", "tool_loop_problem"]

#: The attributes of a trainer that the concurrent tool loop swaps for the duration of a loop.
_TOOL_DICTS = ("_sync_tool_dicts", "_async_tool_dicts")
_EXPERIMENTAL_ASYNC_GRPO = "trl.experimental.async_grpo"

_tool_loop_problems: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()


def _trl_version() -> str:
    try:
        import trl
    except ImportError:
        return "(not installed)"
    return str(getattr(trl, "__version__", "(unknown version)"))


def tool_loop_problem(trainer_cls: type) -> str | None:
    """Why the concurrent tool loop cannot hook this trainer class's ``_tool_call_loop``.

    The hook needs a ``_tool_call_loop`` method that takes the batch's ``completions`` (which
    the loop extends in place with each turn's messages) and that looks tools up through the
    trainer's ``_sync_tool_dicts`` and ``_async_tool_dicts`` (the attributes the hook swaps for
    its own). The result is cached per class.

    Args:
        trainer_cls: The trainer class whose ``_tool_call_loop`` would be hooked (for TRL's
            own loop: ``trl.GRPOTrainer`` or a subclass).

    Returns:
        ``None`` when the loop can be hooked; otherwise a short reason, for a warning.
    """
    try:
        return _tool_loop_problems[trainer_cls]
    except KeyError:
        pass
    problem = _find_tool_loop_problem(trainer_cls)
    _tool_loop_problems[trainer_cls] = problem
    return problem


def _find_tool_loop_problem(trainer_cls: type) -> str | None:
    name = f"{trainer_cls.__qualname__}._tool_call_loop"
    loop = getattr(trainer_cls, "_tool_call_loop", None)
    if loop is None or not callable(loop):
        return f"{trainer_cls.__qualname__} has no `_tool_call_loop` method"
    try:
        parameters = inspect.signature(loop).parameters
    except (TypeError, ValueError) as exc:
        return f"cannot tell what `{name}` takes ({exc})"
    if "completions" not in parameters:
        return f"`{name}` takes no `completions` argument (it takes {', '.join(parameters) or 'nothing'})"
    try:
        source = inspect.getsource(loop)
    except (OSError, TypeError) as exc:
        return f"cannot read the source of `{name}` to tell how it looks tools up ({exc})"
    missing = [attribute for attribute in _TOOL_DICTS if attribute not in source]
    if missing:
        return f"`{name}` does not look tools up through {' and '.join(f'`{m}`' for m in missing)}"
    return None


_lm_head_lock = threading.Lock()


@contextlib.contextmanager
def completion_only_lm_head() -> Iterator[bool]:
    """While it holds, TRL's fused LM head scores only the positions it returns, on a CPU too.

    ``GRPOTrainer`` computes log-probabilities through a fused LM head that, on devices with
    Triton, projects only the positions whose label counts (the completion); elsewhere it projects
    every position (the prompt too) and masks afterwards, to keep tile shapes fixed for compilers
    such as Neuron's. On a CPU that fixed shape buys nothing and the prompt's positions were most
    of the head's cost: with a 600-token prompt and 64-token completions, ten times the work in the
    forward pass and again in the backward. This switches TRL's choice (the module-level
    ``_use_triton`` test of ``trl.trainer.utils``) to its compact path for CPU tensors only; the
    kernels themselves still run TRL's PyTorch fallback. Where that test is not found (another TRL
    release), nothing changes.

    Returns:
        A context manager; what it yields says whether the compact path is in force.
    """
    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError:
        yield False
        return
    original = getattr(utils, "_use_triton", None)
    if not callable(original) or not _lm_head_lock.acquire(blocking=False):  # absent, or already switched
        yield False
        return
    try:
        utils._use_triton = lambda device: device.type == "cpu" or original(device)
        yield True
    finally:
        utils._use_triton = original
        _lm_head_lock.release()


def async_grpo() -> tuple[type, type]:
    """TRL's ``AsyncGRPOTrainer`` and ``AsyncGRPOConfig``, wherever the installed TRL has them.

    They are taken from ``trl`` where they are stable (TRL 1.18 and later), without importing
    the deprecated experimental path; otherwise from ``trl.experimental.async_grpo`` (TRL 1.16
    and 1.17, which warns that the module is experimental).

    Returns:
        ``(AsyncGRPOTrainer, AsyncGRPOConfig)``.

    Raises:
        ImportError: When neither place has both (or TRL is not installed).
    """
    import trl

    errors = []
    try:
        found = getattr(trl, "AsyncGRPOTrainer", None), getattr(trl, "AsyncGRPOConfig", None)
    except ImportError as exc:  # a lazily imported name whose module fails to import
        found, errors = (None, None), [f"trl: {exc}"]
    if all(isinstance(cls, type) for cls in found):
        return found  # type: ignore[return-value]
    try:
        module: Any = importlib.import_module(_EXPERIMENTAL_ASYNC_GRPO)
    except ImportError as exc:
        errors.append(f"{_EXPERIMENTAL_ASYNC_GRPO}: {exc}")
    else:
        found = getattr(module, "AsyncGRPOTrainer", None), getattr(module, "AsyncGRPOConfig", None)
        if all(isinstance(cls, type) for cls in found):
            return found  # type: ignore[return-value]
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise ImportError(
        f"TRL {_trl_version()} has no AsyncGRPOTrainer and AsyncGRPOConfig: looked in `trl` (TRL 1.18 and "
        f"later) and in `{_EXPERIMENTAL_ASYNC_GRPO}` (TRL 1.16 and 1.17){detail}. Install a TRL release "
        "that has them: pip install -U 'trl>=1.16'."
    )


def rollout_sample_class() -> type:
    """TRL's ``RolloutSample``, the row an ``AsyncGRPOTrainer`` rollout worker hands the trainer.

    It is looked up in the ``async_rollout_worker`` module next to the ``AsyncGRPOTrainer``
    that :func:`async_grpo` finds, then in
    ``trl.experimental.async_grpo.async_rollout_worker``.

    Returns:
        The ``RolloutSample`` class.

    Raises:
        ImportError: When neither module has it.
    """
    places = []
    try:
        trainer_cls, _ = async_grpo()
    except ImportError:
        pass
    else:
        package = trainer_cls.__module__.rpartition(".")[0]
        if package:
            places.append(f"{package}.async_rollout_worker")
    experimental = f"{_EXPERIMENTAL_ASYNC_GRPO}.async_rollout_worker"
    if experimental not in places:
        places.append(experimental)
    errors = []
    for place in places:
        try:
            module = importlib.import_module(place)
        except ImportError as exc:
            errors.append(f"{place}: {exc}")
            continue
        sample_cls = getattr(module, "RolloutSample", None)
        if isinstance(sample_cls, type):
            return sample_cls
        errors.append(f"{place}: no RolloutSample")
    raise ImportError(
        f"TRL {_trl_version()} has no RolloutSample: looked in {' and '.join(f'`{p}`' for p in places)} "
        f"({'; '.join(errors)}). Install a TRL release with AsyncGRPOTrainer: pip install -U 'trl>=1.16'."
    )
