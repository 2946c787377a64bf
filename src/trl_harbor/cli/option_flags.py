"""The command line's flags for :class:`~trl_harbor.HarborOptions`, generated from the dataclass.

Every command that runs rollouts (``check``, ``eval``, ``train``) takes one flag per option field,
made here from the field's type and the first sentence of its docstring entry, so that a field
added to :class:`~trl_harbor.HarborOptions` is a flag of every command at once:

- a number or a string: ``--command-timeout-sec 60``; where ``None`` is a value of its own
  (``max_concurrent_starts``, ``infra_stop_fraction``), ``none`` gives it;
- a choice (``Literal``): ``--on-infra-error zero``;
- a mapping: ``KEY=VALUE`` pairs (``--reward-weight tests=0.8``, ``--ek pids_max=64``);
- a tuple: repeated values (``--allowed-change '/etc/myapp/*'``).

``check`` and ``eval`` repeat a pair or a glob by repeating the flag; ``train`` (TRL's parser)
takes several after one flag. Three flags keep the names users know: ``--reward-weight``,
``--allowed-change`` and ``--ek`` (Harbor's own name for environment options).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from trl_harbor.options import HarborOptions

__all__ = ["OPTION_FLAGS", "OptionFlag", "add_option_flags", "option_arguments", "options_from_values"]

#: Flags whose names are not their fields' (the names users of earlier releases and of Harbor know).
_FLAG_NAMES = {"reward_weights": "reward-weight", "allowed_changes": "allowed-change", "backend_options": "ek"}


@dataclass(frozen=True)
class OptionFlag:
    """One :class:`~trl_harbor.HarborOptions` field as a command-line flag.

    Attributes:
        field: The option's field name.
        flag: The flag, without its dashes (``command-timeout-sec``).
        help: The flag's help (the field's docstring entry, first sentence).
        shape: ``"value"``, ``"pairs"`` (``KEY=VALUE``, repeatable) or ``"list"`` (repeatable).
        choices: The values a ``Literal`` field takes, else ``None``.
        parse: Turns one given string into the field's value (``"value"`` fields; ``None`` for
            choices, which are strings).
        default: The option's default (``"value"`` fields).
    """

    field: str
    flag: str
    help: str
    shape: Literal["value", "pairs", "list"]
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    default: Any = None

    @property
    def dest(self) -> str:
        """The attribute the flag's value lands in (``argparse``'s ``dest``, a ``train`` argument's name)."""
        return self.flag.replace("-", "_")

    @property
    def metavar(self) -> str | None:
        """How the flag's value is shown in ``--help``."""
        if self.shape == "pairs":
            return "KEY=VALUE"
        if self.shape == "list":
            return "GLOB"
        return None


def _field_help() -> dict[str, str]:
    """Each field's docstring entry (``Attributes:`` of :class:`HarborOptions`), its first sentence."""
    doc = inspect.cleandoc(HarborOptions.__doc__ or "")  # Python 3.13 dedents docstrings itself, 3.12 does not
    entries: dict[str, list[str]] = {}
    current = None
    for line in doc.split("Attributes:", 1)[-1].splitlines():
        match = re.match(r"^ {4}(\w+): (.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = [match.group(2)]
        elif current and line.startswith(" " * 8):
            entries[current].append(line.strip())
    helps = {}
    for name, lines in entries.items():
        text = " ".join(lines)
        first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.;])\s", text, maxsplit=1)[0].rstrip(".;")
        helps[name] = first.replace("``", "").replace("%", "%%")
    return helps


#: What ``none`` given to a flag whose option may be ``None`` parses to (``None`` itself means "not given").
NONE = "none"


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        return NONE if text.strip().lower() == NONE else parse(text)

    parse_or_none.__name__ = parse.__name__  # argparse names the type in its error
    return parse_or_none


def _flag(field: dataclasses.Field, hint: Any, help_text: str) -> OptionFlag:
    flag = _FLAG_NAMES.get(field.name, field.name.replace("_", "-"))
    args = typing.get_args(hint)
    optional = type(None) in args
    inner = [a for a in args if a is not type(None)] if isinstance(hint, types.UnionType) or optional else [hint]
    base = inner[0] if len(inner) == 1 else hint
    origin = typing.get_origin(base)
    if origin is Literal:
        choices = tuple(typing.get_args(base))
        return OptionFlag(field.name, flag, help_text, "value", choices=choices, default=field.default)
    if origin in (Mapping, dict) or base in (Mapping, dict):
        return OptionFlag(field.name, flag, help_text, "pairs")
    if origin is tuple:
        return OptionFlag(field.name, flag, help_text, "list")
    if base in (int, float, str):
        parse = _none_or(base) if optional and field.default is not None else base
        if optional and field.default is not None:
            help_text += " (none: no limit)" if base is int else " (none: never)"
        return OptionFlag(field.name, flag, help_text, "value", parse=parse, default=field.default)
    raise TypeError(f"HarborOptions.{field.name}: no flag for a field of type {hint!r}; extend option_flags._flag")


def _generate() -> tuple[OptionFlag, ...]:
    hints = typing.get_type_hints(HarborOptions)
    helps = _field_help()
    return tuple(_flag(f, hints[f.name], helps.get(f.name, f.name)) for f in dataclasses.fields(HarborOptions))


#: One flag per :class:`~trl_harbor.HarborOptions` field, in field order.
OPTION_FLAGS: tuple[OptionFlag, ...] = _generate()


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every :class:`~trl_harbor.HarborOptions` field to an ``argparse`` parser.

    Flags are dashed (``--command-timeout-sec``); pairs and globs are repeated
    (``--ek a=1 --ek b=2``). A flag not given leaves the option's own default.

    Args:
        parser: The command's parser (``check``, ``eval``).
    """
    group = parser.add_argument_group("rollout options (trl_harbor.HarborOptions; defaults there)")
    for option in OPTION_FLAGS:
        kwargs: dict[str, Any] = {"dest": option.dest, "help": option.help}
        if option.shape == "value":
            kwargs.update(choices=option.choices, type=option.parse, default=None)
            kwargs["help"] += f" (default: {option.default})"
        else:
            kwargs.update(action="append", default=[], metavar=option.metavar)
            kwargs["help"] += " (repeatable)"
        group.add_argument(f"--{option.flag}", **kwargs)


def option_arguments() -> type:
    """A dataclass of the option flags for TRL's parser (``trl.TrlParser``), as ``train`` takes them.

    Its fields are named after the flags (``command_timeout_sec``, ``reward_weight``, ``ek``, ...);
    a value field defaults to the option's default (a value is checked when the instance is
    made, a choice when :meth:`options` is called), a pairs or list field is a list of strings (several after one flag:
    ``--ek a=1 b=2``). :meth:`options` of an instance gives the :class:`~trl_harbor.HarborOptions`.

    Returns:
        The dataclass, made once per call (subclass it to add arguments of your own).
    """
    fields: list[tuple[str, Any, dataclasses.Field]] = []
    for option in OPTION_FLAGS:
        metadata = {"help": option.help}
        if option.shape != "value":
            fields.append((option.dest, list[str], dataclasses.field(default_factory=list, metadata=metadata)))
            continue
        if option.choices is not None:
            # Checked by HarborOptions, as a value from a --config file is: one error, naming the option.
            metadata["help"] += f" (one of: {', '.join(option.choices)})"
        # The option's own default, so that --help shows it (TRL's parser prints every default).
        fields.append((option.dest, str | None, dataclasses.field(default=option.default, metadata=metadata)))

    def __post_init__(self: Any) -> None:
        # Values from a --config file arrive typed (YAML), from the command line as strings: one form.
        for option in OPTION_FLAGS:
            value = getattr(self, option.dest)
            if option.parse is not None and isinstance(value, str) and value != NONE:
                try:
                    setattr(self, option.dest, option.parse(value))
                except ValueError as exc:
                    raise ValueError(f"--{option.dest} {value!r}: {exc}") from exc
            elif option.shape != "value" and isinstance(value, (str, int, float)):
                setattr(self, option.dest, [str(value)])

    def options(self: Any) -> HarborOptions:
        """The :class:`~trl_harbor.HarborOptions` the flags give (defaults for those not given).

        Raises:
            ValueError: For a malformed pair or an invalid option.
        """
        return options_from_values({option.dest: getattr(self, option.dest) for option in OPTION_FLAGS})

    return dataclasses.make_dataclass(
        "HarborOptionArguments",
        fields,
        namespace={"__post_init__": __post_init__, "options": options, "__module__": __name__},
    )


def options_from_values(values: Mapping[str, Any]) -> HarborOptions:
    """The :class:`~trl_harbor.HarborOptions` that flag values give.

    Args:
        values: ``{dest: value}`` for the flags of :data:`OPTION_FLAGS` (``None`` or an empty list:
            not given, the option's default).

    Returns:
        The options.

    Raises:
        ValueError: For a malformed ``KEY=VALUE`` pair or an invalid option.
    """
    from trl_harbor.rollout.backends import parse_backend_options

    given: dict[str, Any] = {}
    for option in OPTION_FLAGS:
        value = values.get(option.dest)
        if value is None or (option.shape != "value" and not value):
            continue
        if option.shape == "list":
            given[option.field] = tuple(value)
        elif option.shape == "pairs":
            given[option.field] = (
                parse_backend_options(list(value)) if option.field == "backend_options" else _numbers(option, value)
            )
        else:
            given[option.field] = None if value == NONE and option.parse is not None else value
    return HarborOptions(**given)


def _numbers(option: OptionFlag, pairs: list[str]) -> dict[str, float]:
    numbers = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            numbers[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"--{option.flag} expects key=number, got {pair!r}")
    return numbers
