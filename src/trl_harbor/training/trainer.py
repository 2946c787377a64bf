"""A ``GRPOTrainer`` whose batch runs each turn's tool calls at the same time.

TRL's ``GRPOTrainer`` executes the tool calls of one turn rollout after rollout: it walks the
batch, runs the rollout's sync tools one by one, awaits its async tools, and only then moves on
to the next rollout. With sandboxes that answer in tens of milliseconds (a cloud API) or seconds
(a test suite, a build), a batch of 64 rollouts waits 64 commands per turn.

:class:`ConcurrentToolsMixin` (and :class:`HarborGRPOTrainer`, the mixin on ``GRPOTrainer``)
leaves TRL's tool loop in charge of everything it decides — which calls run, their order, the
tool messages, the token accounting, the roll-back of results that would overflow
``max_completion_length``, the failure counts — and changes only *when* the calls run. When
the loop asks for the first tool result of a turn, every call of that turn is started at once:
one thread per rollout (the rollout's sync calls in order, then its async calls together on
TRL's event loop, as TRL orders them). The loop then walks the batch as before and collects
finished results instead of running each command itself. A tool that raises raises again at
the moment the loop collects it, so TRL turns it into the same ``{"error": ...}`` message.

The calls of a turn are read from the same messages TRL reads (the rollout's last assistant
message); a call is started only when the loop is certain to ask for it. This depends on how a
TRL release walks its loop, so the mixin checks the loop it hooks rather than TRL's version
(:func:`trl_harbor.training.trl_compat.tool_loop_problem`): the loop must take the batch's
``completions`` and look tools up through ``_sync_tool_dicts`` and ``_async_tool_dicts``. When
it does not, the mixin warns once and runs TRL's own loop (same results, one rollout after
another). When it does, on a release other than those tested (:data:`TESTED_TRL_VERSIONS`), the
calls run concurrently after one log line saying so; should that loop ever ask for a call that
was not started ahead, the call runs then and there, as TRL would have run it, with a warning.

Tools run in worker threads: the tools of *different* rollouts run concurrently, the tools of
one rollout never do (except async ones, which TRL gathers too). trl-harbor's environments are
safe for that; standalone ``tools=[...]`` functions passed to the trainer must be thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trl
from trl import GRPOTrainer

from trl_harbor import progress
from trl_harbor.training import trl_compat

__all__ = [
    "TESTED_TRL_VERSIONS",
    "ConcurrentToolsMixin",
    "HarborGRPOTrainer",
    "SharedPrefixMixin",
    "concurrent_tools_supported",
]

logger = logging.getLogger(__name__)

#: The TRL releases the mixin is tested against (for the docs and a log line: what decides
#: whether the mixin runs tool calls concurrently is :func:`concurrent_tools_supported`).
TESTED_TRL_VERSIONS: tuple[str, ...] = ("1.16.0",)

_warned_classes: weakref.WeakSet[type] = weakref.WeakSet()
_logged_untested = False


def concurrent_tools_supported(trainer_cls: type | None = None) -> bool:
    """Whether :class:`ConcurrentToolsMixin` runs tool calls concurrently on this trainer class.

    It checks the ``_tool_call_loop`` the mixin would hook (see
    :func:`trl_harbor.training.trl_compat.tool_loop_problem`), not TRL's version.

    Args:
        trainer_cls: A trainer class: one with the mixin in its bases (the loop after the mixin
            is checked), or one to put the mixin on (its own loop is checked). ``None`` (default):
            the installed TRL's ``GRPOTrainer``.

    Returns:
        ``True`` when the mixin can hook the loop; otherwise it runs TRL's own, sequential loop.

    Raises:
        TypeError: When given a TRL version string (what this function took before it checked the loop).
    """
    if isinstance(trainer_cls, str):
        raise TypeError(
            f"concurrent_tools_supported takes a trainer class, not a TRL version ({trainer_cls!r}): whether the "
            "tool calls run concurrently is decided by the trainer's tool loop, not by TRL's version"
        )
    return _loop_problem(GRPOTrainer if trainer_cls is None else trainer_cls) is None


def _loop_problem(trainer_cls: type) -> str | None:
    """Why the mixin cannot hook ``trainer_cls``'s loop: the one ``super()`` reaches from the mixin."""
    mro = trainer_cls.__mro__
    if ConcurrentToolsMixin in mro:
        after = mro[mro.index(ConcurrentToolsMixin) + 1 :]
        trainer_cls = next((cls for cls in after if "_tool_call_loop" in vars(cls)), after[0])
    return trl_compat.tool_loop_problem(trainer_cls)


def _check_loop_once(trainer_cls: type) -> bool:
    """Whether the mixin hooks ``trainer_cls``'s loop; warns (once per class) when it cannot."""
    global _logged_untested
    problem = _loop_problem(trainer_cls)
    if problem is not None:
        if trainer_cls not in _warned_classes:
            _warned_classes.add(trainer_cls)
            warnings.warn(
                f"trl-harbor: {trainer_cls.__qualname__} cannot run a turn's tool calls at the same time with "
                f"TRL {trl.__version__}: {problem}. It runs TRL's own tool loop instead (one rollout's tool "
                f"calls after another: same results, slower). Tested with TRL {', '.join(TESTED_TRL_VERSIONS)}.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    if trl.__version__ not in TESTED_TRL_VERSIONS and not _logged_untested:
        _logged_untested = True
        logger.info(
            "trl-harbor: concurrent tool calls are tested with TRL %s; TRL %s is installed and its tool loop "
            "looks hookable, so they run concurrently.",
            ", ".join(TESTED_TRL_VERSIONS),
            trl.__version__,
        )
    return True


@dataclass(eq=False)
class _Call:
    """One tool call started ahead of TRL's loop, and its outcome."""

    name: str
    kwargs: dict[str, Any]
    function: Callable[..., Any]
    is_async: bool
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    #: For an async tool: its coroutine, or the error calling the tool raised (bad arguments),
    #: which TRL's loop meets when it calls the tool, not when it awaits it.
    coroutine: Coroutine[Any, Any, Any] | None = None
    call_error: BaseException | None = None

    def matches(self, name: str, kwargs: Mapping[str, Any]) -> bool:
        # Identity first: the loop passes the very objects this call was read from (and
        # NaN != NaN would otherwise run a call twice).
        return (
            name == self.name
            and kwargs.keys() == self.kwargs.keys()
            and all(kwargs[k] is v or kwargs[k] == v for k, v in self.kwargs.items())
        )


async def _collect(future: concurrent.futures.Future[Any]) -> Any:
    """Await a started async call's outcome on TRL's event loop (where the loop gathers it)."""
    return await asyncio.wrap_future(future)


def _run_rollout(calls: Sequence[_Call], async_loop: asyncio.AbstractEventLoop | None) -> None:
    """Run one rollout's calls the way TRL's loop does: sync ones in order, then async ones together."""
    for call in calls:
        if call.is_async:
            continue
        try:
            call.future.set_result(call.function(**call.kwargs))
        except BaseException as exc:  # handed to the loop, which reports it like TRL does
            call.future.set_exception(exc)
    pending = [call for call in calls if call.is_async and call.coroutine is not None]
    if not pending:
        return

    async def gather() -> list[Any]:
        return await asyncio.gather(*(call.coroutine for call in pending), return_exceptions=True)

    try:
        if async_loop is None:
            raise RuntimeError("the trainer has no event loop for async tools")
        outcomes = asyncio.run_coroutine_threadsafe(gather(), async_loop).result()
    except BaseException as exc:
        outcomes = [exc] * len(pending)
    for call, outcome in zip(pending, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            call.future.set_exception(outcome)
        else:
            call.future.set_result(outcome)


class _TurnDispatcher:
    """Starts a turn's tool calls together and hands their results to TRL's loop, in its order.

    It stands in for the loop's per-rollout tool dicts. The loop keeps its own bookkeeping; the
    dispatcher reads only the messages the loop appends to ``completions`` (in place), which
    tell which rollouts call tools this turn:

    - a rollout's latest message is an assistant message with ``tool_calls`` that nothing has
      answered yet (no tool message after it), and
    - that message is newer than the one whose calls were last started (a result the loop
      rolled back for length leaves the old message last: that rollout is done).

    The calls started are exactly those the loop will make through the dicts: function calls of
    a tool the rollout has, with keyword arguments. Anything else (an unknown tool, a call type
    TRL rejects) the loop answers itself, as before.
    """

    def __init__(
        self,
        completions: list[list[dict[str, Any]]],
        sync_dicts: Sequence[Mapping[str, Callable[..., Any]]],
        async_dicts: Sequence[Mapping[str, Callable[..., Any]]],
        async_loop: asyncio.AbstractEventLoop | None,
        max_threads: int | None,
    ) -> None:
        self._completions = completions
        self._sync = sync_dicts
        self._async = async_dicts
        self._async_loop = async_loop
        self._max_threads = max_threads
        self._queues: dict[int, collections.deque[_Call]] = {}
        self._started: list[_Call] = []
        self._answered_up_to = [0] * len(completions)  # index of the first message not yet started
        self._warned_mismatch = False
        self.sync_dicts = [
            {name: self._proxy(i, name, fn, is_async=False) for name, fn in tools.items()}
            for i, tools in enumerate(sync_dicts)
        ]
        self.async_dicts = [
            {name: self._proxy(i, name, fn, is_async=True) for name, fn in tools.items()}
            for i, tools in enumerate(async_dicts)
        ]

    # ── what the loop calls ─────────────────────────────────────────────────────────────

    def _proxy(self, rollout: int, name: str, function: Callable[..., Any], *, is_async: bool) -> Callable[..., Any]:
        def proxy(**kwargs: Any) -> Any:
            call = self._take(rollout, name, kwargs)
            if call is None:  # not started ahead: exactly what TRL's loop would have done
                return function(**kwargs)
            if not is_async:
                return call.future.result()
            if call.call_error is not None:
                raise call.call_error
            return _collect(call.future)

        proxy.__name__ = name
        return proxy

    def _take(self, rollout: int, name: str, kwargs: Mapping[str, Any]) -> _Call | None:
        if not any(self._queues.values()):  # the first call the loop asks for this turn
            self._start_turn()
        queue = self._queues.get(rollout)
        if queue and queue[0].matches(name, kwargs):
            return queue.popleft()
        self._mismatch(rollout, name)
        return None

    def _mismatch(self, rollout: int, name: str) -> None:
        if not self._warned_mismatch:
            self._warned_mismatch = True
            logger.warning(
                "trl-harbor: TRL's tool loop asked rollout %d for a %r call that was not started ahead; "
                "running it now. (This TRL release walks its loop differently from the tested ones.)",
                rollout,
                name,
            )

    # ── starting a turn ─────────────────────────────────────────────────────────────────

    def _start_turn(self) -> None:
        batch: list[list[_Call]] = []
        for index, messages in enumerate(self._completions):
            try:
                calls = self._pending_calls(index, messages)
            except Exception as exc:  # never break the loop: TRL runs this rollout's calls itself
                logger.warning("trl-harbor: could not read rollout %d's tool calls ahead: %r", index, exc)
                continue
            if calls:
                self._queues[index] = collections.deque(calls)
                self._started.extend(calls)
                batch.append(calls)
        if not batch:
            return
        work = collections.deque(batch)
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not work:
                        return
                    calls = work.popleft()
                _run_rollout(calls, self._async_loop)

        threads = len(batch) if self._max_threads is None else min(self._max_threads, len(batch))
        for _ in range(threads):
            # Daemon threads: an interrupted run must not wait at exit for commands still in flight.
            threading.Thread(target=worker, name="trl-harbor-tools", daemon=True).start()

    def _pending_calls(self, index: int, messages: list[dict[str, Any]]) -> list[_Call]:
        if not messages or len(messages) - 1 < self._answered_up_to[index]:
            return []
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant" or not last.get("tool_calls"):
            return []
        self._answered_up_to[index] = len(messages)
        calls = []
        for tool_call in last["tool_calls"]:
            if not isinstance(tool_call, dict) or tool_call.get("type") != "function":
                continue
            function = tool_call.get("function")
            if not isinstance(function, dict) or "name" not in function or "arguments" not in function:
                continue
            name = function["name"]
            if not isinstance(name, str):
                continue
            try:
                kwargs = dict(**function["arguments"])  # what `f(**arguments)` accepts, the loop's call
            except TypeError:
                continue
            if name in self._sync[index]:
                calls.append(_Call(name, kwargs, self._sync[index][name], is_async=False))
            elif name in self._async[index]:
                call = _Call(name, kwargs, self._async[index][name], is_async=True)
                try:
                    call.coroutine = call.function(**kwargs)
                except Exception as exc:
                    call.call_error = exc
                    call.future.set_exception(exc)
                calls.append(call)
        return calls

    # ── after the loop ──────────────────────────────────────────────────────────────────

    def finish(self, *, wait: bool) -> None:
        """Wait for every started call (so no command outlives the tool phase); report leftovers.

        Args:
            wait: Whether to wait for calls still running (not when the loop was interrupted).
        """
        leftovers = [call for queue in self._queues.values() for call in queue]
        if wait:
            concurrent.futures.wait([call.future for call in self._started])
        if leftovers:
            logger.warning(
                "trl-harbor: %d tool call(s) ran ahead that TRL's tool loop never collected (%s).",
                len(leftovers),
                ", ".join(sorted({call.name for call in leftovers})),
            )


class ConcurrentToolsMixin:
    """Mixin for ``GRPOTrainer``: every rollout's tool calls of a turn run at the same time (see the module).

    Put it before ``GRPOTrainer`` (or a subclass) in the bases.

    Args:
        *args: Passed on to the trainer.
        tool_concurrency: How many rollouts run their tool calls at once (one thread each);
            ``None`` (default): every rollout of the turn.
        **kwargs: Passed on to the trainer.

    Raises:
        ValueError: When ``tool_concurrency`` is below 1.
    """

    def __init__(self, *args: Any, tool_concurrency: int | None = None, **kwargs: Any) -> None:
        if tool_concurrency is not None and tool_concurrency < 1:
            raise ValueError(f"tool_concurrency must be at least 1 (or None for no limit); got {tool_concurrency!r}")
        self._tool_concurrency = tool_concurrency
        self._concurrent_tools = _check_loop_once(type(self))
        super().__init__(*args, **kwargs)

    def _tool_call_loop(self, *args: Any, **kwargs: Any) -> Any:
        parent = super()._tool_call_loop  # type: ignore[misc]
        if not getattr(self, "_concurrent_tools", False):  # warned once, in __init__
            return parent(*args, **kwargs)
        completions = inspect.signature(parent).bind(*args, **kwargs).arguments["completions"]
        sync_dicts, async_dicts = self._sync_tool_dicts, self._async_tool_dicts
        dispatcher = _TurnDispatcher(
            completions,
            sync_dicts,
            async_dicts,
            getattr(self, "async_loop", None),
            self._tool_concurrency,
        )
        self._sync_tool_dicts, self._async_tool_dicts = dispatcher.sync_dicts, dispatcher.async_dicts
        interrupted = False
        try:
            return parent(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            interrupted = True  # leave at once: calls still running are abandoned
            raise
        finally:
            self._sync_tool_dicts, self._async_tool_dicts = sync_dicts, async_dicts
            dispatcher.finish(wait=not interrupted)


def _plain_generation(trainer: Any) -> bool:
    """Whether the trainer generates text with ``model.generate`` on one process or under DDP.

    Each attribute is TRL's; one that is missing (another release) counts against, so that an
    unknown setup keeps TRL's own path.
    """
    unknown = object()
    switches = ("use_vllm", "use_transformers_continuous_batching", "_is_vlm", "is_deepspeed_enabled",
                "is_fsdp_enabled")  # fmt: skip
    return all(getattr(trainer, name, unknown) is False for name in switches)


@dataclass
class _Split:
    """A scoring batch as its shared prefix and each row's rest (left-padded), with their masks and positions."""

    prefix: Any  # (P,) token ids
    rest: Any  # (B, R) token ids: each row's tokens after the prefix, left-padded
    mask: Any  # (B, P + R) attention mask over the prefix and the rest
    positions: Any  # (B, R) each rest token's position, its prompt starting at 0 (rotary: only distances count)


def _shared_split(input_ids: Any, attention_mask: Any, logits_to_keep: int) -> _Split | None:
    """Split left-padded prompts and their completions at the longest beginning every row shares.

    At least one prompt token of each row stays in its rest: the first completion token is
    scored from it. ``None`` when fewer than :data:`~trl_harbor.training.shared_prefix.MIN_SHARED_TOKENS`
    are shared.
    """
    import torch

    from trl_harbor.training.shared_prefix import MIN_SHARED_TOKENS

    rows, width = input_ids.shape
    starts = attention_mask.int().argmax(dim=1)  # each row's left padding
    limit = int(width - logits_to_keep - starts.max()) - 1
    if rows < 2 or limit < MIN_SHARED_TOKENS:
        return None
    columns = starts[:, None] + torch.arange(limit, device=input_ids.device)[None, :]
    aligned = input_ids.gather(1, columns)
    differs = ((aligned != aligned[:1]) | (attention_mask.gather(1, columns) == 0)).any(dim=0)
    shared = int(differs.int().argmax()) if bool(differs.any()) else limit
    if shared < MIN_SHARED_TOKENS:
        return None
    rest_width = int(width - starts.min()) - shared
    rest = input_ids.new_zeros((rows, rest_width))
    mask = attention_mask.new_zeros((rows, shared + rest_width))
    mask[:, :shared] = 1
    positions = input_ids.new_zeros((rows, rest_width))
    for row in range(rows):
        begin = int(starts[row]) + shared
        length = width - begin
        rest[row, rest_width - length :] = input_ids[row, begin:]
        mask[row, shared + rest_width - length :] = attention_mask[row, begin:]
        positions[row, rest_width - length :] = torch.arange(shared, shared + length, device=input_ids.device)
    return _Split(input_ids[0, int(starts[0]) : int(starts[0]) + shared], rest, mask, positions)


def _score_after_prefix(
    trainer: Any, model: Any, split: _Split, logits_to_keep: int, batch_size: int | None, compute_entropy: bool
) -> tuple[Any, Any, None] | None:
    """TRL's per-token log-probabilities (and entropies) of the completions, the prefix run once
    (``None``: the model kept no cache of it)."""
    import torch
    from transformers import DynamicCache

    from trl_harbor.training.shared_prefix import cache_keyword

    keyword = cache_keyword(model)
    prefix = DynamicCache(config=model.config)  # filled in place (a decoder may return no cache)
    with trainer.accelerator.autocast():
        model.get_decoder()(input_ids=split.prefix[None], use_cache=True, **{keyword: prefix})
    layers = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in prefix.layers]
    if not layers or any(keys is None or values is None for keys, values in layers):
        return None
    rows = split.rest.size(0)
    batch_size = batch_size or rows
    logps, entropies = [], []
    for start in range(0, rows, batch_size):
        end = min(start + batch_size, rows)
        cache = DynamicCache(config=model.config)
        for index, (keys, values) in enumerate(layers):  # expanded, not copied: gradients sum over the rows
            cache.update(keys.expand(end - start, -1, -1, -1), values.expand(end - start, -1, -1, -1), index)
        rest, mask = split.rest[start:end], split.mask[start:end]
        labels = rest.masked_fill(mask[:, -rest.size(1) :] == 0, -100)
        labels[:, :-logits_to_keep] = -100  # only the completion tokens are scored
        with trainer.accelerator.autocast():
            outputs = model(input_ids=rest, attention_mask=mask, position_ids=split.positions[start:end],
                            labels=labels, fused_lm_head=True, **{keyword: cache})  # fmt: skip
        logps.append(outputs.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(outputs.entropy[:, -logits_to_keep:])
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


class SharedPrefixMixin:
    """Runs the prompts' shared beginning once per batch: when generating with ``transformers``,
    and in the forward pass that scores the completions for the loss.

    The ``num_generations`` samples of a task share their whole prompt, and every task's prompt
    begins with the same system prompt, tool schemas and example turns. TRL runs that prefix once
    per row, in ``generate`` and again in the loss's forward pass (and backward through it); on a
    CPU it was most of a step. Here it runs once (:mod:`trl_harbor.training.shared_prefix`):

    - **generation** copies its key-value cache to each row and samples with the trainer's own
      generation settings (``self.generation_config``), each row seeing exactly its prompt:
      greedy completions are TRL's, token for token;
    - **scoring** runs the prefix once as a batch of one, with gradients, and each row's rest of
      the prompt and its completion attend to that cache (expanded per row: its gradients sum over
      the rows), each token at the same distance from the others as in TRL's padded layout;
      log-probabilities, entropies and gradients are TRL's up to float rounding. Taken for models
      with rotary position embeddings (Llama, Qwen, Mistral, SmolLM, ...), where only those
      distances count.

    Both are taken for plain text on one process (generation also under DDP); vLLM, continuous
    batching, vision-language inputs, DeepSpeed, FSDP and a mixture-of-experts auxiliary loss keep
    TRL's own path, as do batches whose rows share fewer than
    :data:`~trl_harbor.training.shared_prefix.MIN_SHARED_TOKENS` tokens.
    """

    def _generate_single_turn(
        self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any, num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], Any]:  # fmt: skip
        parent = super()._generate_single_turn  # type: ignore[misc]
        plain = _plain_generation(self) and not (images or multimodal_fields or has_tool_images)
        if not plain or not prompt_ids:
            return parent(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        import torch
        from trl.models import unwrap_model_for_generation

        from trl_harbor.training.shared_prefix import generate_after_prefix, shared_prefix

        with (
            unwrap_model_for_generation(
                self.model_wrapped,  # type: ignore[attr-defined]
                self.accelerator,  # type: ignore[attr-defined]
                generation_kwargs=self.generation_kwargs,  # type: ignore[attr-defined]
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,  # type: ignore[attr-defined]
            ) as model,
            torch.no_grad(),
        ):
            prefix = shared_prefix(model, prompt_ids)
            rows = None if prefix is None else generate_after_prefix(
                model, prompt_ids, prefix, self._tokenizer.pad_token_id,  # type: ignore[attr-defined]
                generation_config=self.generation_config,  # type: ignore[attr-defined]
            )  # fmt: skip
        if rows is None:  # too little shared: TRL's own path
            return parent(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        ends = set(self.eos_token_ids)  # type: ignore[attr-defined]
        completions = [next((row[: i + 1] for i, t in enumerate(row) if t in ends), row) for row in rows]
        return completions, None

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, batch_size: int | None = None,
        compute_entropy: bool = False, compute_aux_loss: bool = False, **inputs: Any,
    ) -> Any:  # fmt: skip
        parent = super()._get_per_token_logps_and_entropies  # type: ignore[misc]
        plain = (
            _plain_generation(self)
            and getattr(getattr(self, "accelerator", None), "num_processes", 2) == 1
            and not compute_aux_loss
            and all(value is None for value in inputs.values())  # no images, no token types
            and hasattr(model, "get_decoder")
            # Rotary positions: only distances count, so the prefix's positions need not follow each
            # row's padding as in TRL's layout (absolute position embeddings would see the difference).
            and hasattr(model.get_decoder(), "rotary_emb")
            # Activation checkpointing drops a cache passed in while training: the rest would not see the prefix.
            and not any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
        )
        split = _shared_split(input_ids, attention_mask, logits_to_keep) if plain else None
        scored = None if split is None else _score_after_prefix(self, model, split, logits_to_keep, batch_size,
                                                                compute_entropy)  # fmt: skip
        if scored is None:
            return parent(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                          compute_aux_loss, **inputs)  # fmt: skip
        return scored


class HarborGRPOTrainer(SharedPrefixMixin, ConcurrentToolsMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with each turn's tool calls run at the same time across the batch,
    the prompts' shared beginning run once (in generation with ``transformers`` and in the loss's
    forward pass), on a CPU the LM head run on the completion's positions only, and its
    generation and model update reported as progress phases (:mod:`trl_harbor.progress`).

    A drop-in for ``GRPOTrainer``: same arguments, same results (tool messages, their order,
    token ids, roll-back at ``max_completion_length``, failure counts; log-probabilities and
    gradients up to float rounding), plus ``tool_concurrency``. See :class:`ConcurrentToolsMixin`,
    :class:`SharedPrefixMixin` and :func:`trl_harbor.training.trl_compat.completion_only_lm_head`.

    Example:
        ```python
        from trl import GRPOConfig
        from trl_harbor import HarborGRPOTrainer, HarborSpec

        spec = HarborSpec("path/to/tasks", agent="bash", environment_type="local")
        trainer = HarborGRPOTrainer(
            model="Qwen/Qwen3-0.6B",
            args=GRPOConfig(num_generations=8, max_tool_calling_iterations=25),
            train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory,
            reward_funcs=spec.reward_funcs,
        )
        ```
    """

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with progress.phase("generation"):
            return super()._generate_single_turn(*args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        progress.report("model update", 0, 1)  # ends with training_step: the backward pass is in it
        return super().compute_loss(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().training_step(*args, **kwargs)
        finally:
            progress.report("model update", 1, 1)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        # TRL's fused LM head scores the prompt's positions too when not on Triton (most of the
        # head's cost on a CPU); the completion's are all it returns (trl_compat explains).
        with trl_compat.completion_only_lm_head():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
