"""TRL's rule for which methods of an environment are tools, in one place.

``GRPOTrainer`` lists the class's functions (``inspect.getmembers(type(env), inspect.isfunction)``)
and makes a tool of each public one but ``reset`` and ``get_reward``; properties are not functions,
so they are never tools. ``trl-harbor eval`` and the trajectory log follow the same rule.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["NOT_TOOLS", "tool_functions", "tool_schemas"]

#: Public methods TRL calls itself rather than offering them to the model.
NOT_TOOLS: tuple[str, ...] = ("reset", "get_reward")


def tool_functions(cls: type) -> dict[str, Callable[..., Any]]:
    """The tool methods of an environment class, by name, as TRL finds them.

    Args:
        cls: The environment class.

    Returns:
        ``{name: function}`` (unbound), sorted by name as ``inspect.getmembers`` sorts them.
    """
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def tool_schemas(env: Any) -> tuple[dict[str, Callable[..., Any]], list[dict]]:
    """An environment's bound tools and the JSON schemas TRL builds from their signatures and docstrings.

    Args:
        env: The environment instance.

    Returns:
        ``({name: bound method}, [schema, ...])`` in the same order.
    """
    from transformers.utils import get_json_schema

    tools = {name: getattr(env, name) for name in tool_functions(type(env))}
    return tools, [get_json_schema(fn) for fn in tools.values()]
