"""Generation that runs the prompts' shared beginning once, then samples every row from its cache.

The prompts of a GRPO step, and of an evaluation turn, begin with the same hundreds of tokens (the
system prompt, the tool schemas, example turns; in training, the whole prompt is the same for the
``num_generations`` samples of a task). ``generate`` would run them once per row: on a CPU that is
most of a small model's sampling time. Here they run once; their key-value cache is copied per row;
each row is the prefix, left padding, then the rest of its prompt. The attention mask skips the
padding and positions follow the mask, so each row sees exactly its own prompt.

Used by :class:`~trl_harbor.cli.evaluate.LocalPolicy` and by :class:`~trl_harbor.HarborGRPOTrainer`'s
generation with ``transformers`` (not vLLM); the trainer's loss runs the prefix once too
(:class:`~trl_harbor.training.trainer.SharedPrefixMixin`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MIN_SHARED_TOKENS", "SharedPrefix", "cache_keyword", "generate_after_prefix", "shared_prefix"]

#: Fewer shared tokens than this are run with each prompt (a cache copy per row is not worth it).
MIN_SHARED_TOKENS = 32


@dataclass(frozen=True)
class SharedPrefix:
    """Token ids every prompt begins with, and the model's cache of them (a batch of one).

    Attributes:
        ids: The shared token ids.
        cache: The model's key-value cache after them.
        keyword: The name ``generate`` takes the cache by.
    """

    ids: list[int]
    cache: Any
    keyword: str


def cache_keyword(model: Any) -> str:
    """The name a model's ``forward`` and ``generate`` take its key-value cache by: ``cache`` since
    transformers 5.24, ``past_key_values`` before.

    Args:
        model: A causal LM.

    Returns:
        The keyword.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def shared_prefix(
    model: Any, prompts: Sequence[Sequence[int]], min_tokens: int = MIN_SHARED_TOKENS
) -> SharedPrefix | None:
    """Run the prompts' common beginning through the model once.

    At least one token of each prompt is left out of it: generation starts from that token's logits.

    Args:
        model: A causal LM.
        prompts: Token ids of each prompt.
        min_tokens: Share no fewer tokens than this (``None`` is returned instead).

    Returns:
        The shared prefix and its cache, or ``None`` when fewer than ``min_tokens`` are shared or the
        model's cache cannot be copied per row.
    """
    import torch

    if not prompts:
        return None
    first, shortest = prompts[0], min(len(p) for p in prompts)
    shared = 0
    while shared < shortest - 1 and all(p[shared] == first[shared] for p in prompts):
        shared += 1
    if shared < min_tokens:
        return None
    keyword = cache_keyword(model)
    device = next(model.parameters()).device
    with torch.no_grad():
        output = model(input_ids=torch.tensor([list(first[:shared])], device=device), use_cache=True)
    cache = getattr(output, keyword, None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    return SharedPrefix(list(first[:shared]), cache, keyword)


def generate_after_prefix(
    model: Any, prompts: Sequence[Sequence[int]], prefix: SharedPrefix | None, pad_token_id: int, **generate_kwargs: Any
) -> list[list[int]]:
    """One ``generate`` call over the prompts; each row's new tokens (up to the length limit, padding included).

    Args:
        model: A causal LM.
        prompts: Token ids of each prompt; with ``prefix``, each begins with ``prefix.ids``.
        prefix: Their shared beginning (from :func:`shared_prefix`), or ``None``: rows left-padded.
        pad_token_id: The padding token.
        **generate_kwargs: Sampling settings for ``model.generate`` (``generation_config``,
            ``max_new_tokens``, ``do_sample``, ...).

    Returns:
        Each row's generated tokens, as ``generate`` returned them (cut them at the end token).
    """
    import torch

    head: list[int] = [] if prefix is None else prefix.ids
    rows = [list(p[len(head) :]) for p in prompts]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    if prefix is not None:
        cache = copy.deepcopy(prefix.cache)
        cache.batch_repeat_interleave(len(rows))
        generate_kwargs[prefix.keyword] = cache
    with torch.no_grad():
        output = model.generate(
            input_ids=torch.tensor([head + [pad_token_id] * (width - len(r)) + r for r in rows], device=device),
            attention_mask=torch.tensor(
                [[1] * len(head) + [0] * (width - len(r)) + [1] * len(r) for r in rows], device=device
            ),
            pad_token_id=pad_token_id,
            use_cache=True,
            **generate_kwargs,
        )
    return output[:, len(head) + width :].tolist()
