"""``HarborMix``: several task suites and harnesses, weighted, in one ``GRPOTrainer`` run.

.. code-block:: python

    from trl_harbor import HarborSpec

    mix = HarborSpec.mix(
        {
            "analysis": HarborSpec("suites/analysis", agent="bash", environment_type="local"),
            "terminal": HarborSpec("suites/terminal", agent="terminal_notes", environment_type="docker"),
        },
        weights=[3, 1],
    )
    trainer = GRPOTrainer(
        model=...,
        args=GRPOConfig(...),
        train_dataset=mix.train_dataset,            # `environment` and `suite` columns added
        environment_factory=mix.environment_factory,  # {environment name: factory}
        reward_funcs=mix.reward_funcs,              # verifier reward + per-suite metrics
    )

TRL routes each row to the factory named by its ``environment`` column and shows the model only
that environment's tools. One environment is made per distinct (suite, harness, backend,
options) combination. The rows are drawn from the specs by the weights: each spec gets an exact
quota of rows (largest remainder), its tasks are dealt out in seeded shuffled passes (every task
once before any task twice), and the quotas are spread evenly through the dataset, so every
prefix of it follows the weights too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trl_harbor.rollout.suite import TaskInfo
from trl_harbor.training.agents import AGENTS, EXAMPLE_AGENTS
from trl_harbor.training.env import HarborEnv
from trl_harbor.training.rewards import harbor_reward

if TYPE_CHECKING:
    from datasets import Dataset, Features

__all__ = ["HarborMix", "HarborMixError", "MixEntry", "harbor_mix_reward", "merge_features", "mix", "suite_name"]


class HarborMixError(ValueError):
    """A mix that cannot be built: bad weights, clashing names or clashing column types."""


class MixableSpec(Protocol):
    """What a mix reads of each spec: a :class:`~trl_harbor.training.spec.HarborSpec`.

    Structural, because the spec module builds mixes (``HarborSpec.mix``): mixing does not import it.
    """

    suite: Any
    env_cls: type[HarborEnv] | None
    options: Any
    loop_agent: str | None
    environment_type: str

    @property
    def environment_factory(self) -> Any: ...

    @property
    def train_dataset(self) -> Any: ...


#: What only a spec has, all of it (checked without computing any of it: no dataset is built).
_SPEC_ATTRIBUTES = ("suite", "env_cls", "options", "loop_agent", "environment_factory", "task_dirs")


def _is_spec(value: Any) -> bool:
    """Whether ``value`` is a spec (a ``HarborSpec``, or what has everything of one a mix reads)."""
    return not isinstance(value, type) and all(hasattr(value, name) for name in _SPEC_ATTRIBUTES)


def suite_name(spec: MixableSpec) -> str:
    """The default name of a spec's suite in a mix.

    A fetched dataset names itself as it was given (``"org/name"``, ``"terminal-bench@2.0"``), a
    suite rerun from a lock as the first run gave it; a local suite is named after its folder (the
    folder that holds ``tasks/``, when the tasks live in a ``tasks/`` subfolder).

    Args:
        spec: The spec.

    Returns:
        The suite's name.
    """
    source = spec.suite.source
    root = spec.suite.root
    resolved = getattr(spec, "resolved", None)  # how a HarborSpec's suite was found (trl_harbor.rollout.sources)
    if resolved is not None:
        first = resolved.lock_of  # None unless rerun from a lock
        kind, source = (first.kind, first.dataset) if first is not None else (resolved.source.kind, source)
        if kind != "local":
            return source
    elif not Path(source).expanduser().exists():
        return source  # a hub dataset id
    return root.parent.name if root.name == "tasks" and root.parent.name else root.name


@dataclass(frozen=True)
class MixEntry:
    """One spec of a mix, with what the mix made of it.

    Attributes:
        suite: The suite's name (the ``suite`` column).
        environment: The name of its environment (the ``environment`` column, the key of
            ``environment_factory``).
        spec: The spec.
        weight: Its share of the rows (the weights normalised to sum to 1).
        rows: How many rows of the mixed dataset it holds.
        harness: The harness's label (a built-in name, else the class name).
        environment_type: The sandbox backend.
        options: What its environments are given beyond the defaults (changed options, harness arguments).
    """

    suite: str
    environment: str
    spec: MixableSpec = field(repr=False)
    weight: float
    rows: int
    harness: str
    environment_type: str | None
    options: dict[str, Any] = field(default_factory=dict, repr=False)


def _harness_label(spec: MixableSpec) -> str:
    agent = getattr(spec.environment_factory, "agent", None)
    if isinstance(agent, str) and (agent in AGENTS or agent in EXAMPLE_AGENTS):
        return agent
    return spec.env_cls.__name__


def _spec_options(spec: MixableSpec) -> dict[str, Any]:
    """What a spec's environments get beyond the defaults: its changed options and harness arguments."""
    return {**spec.options.changed(), **spec.environment_factory.harness_kwargs}


def _options_key(options: Mapping[str, Any]) -> str:
    return json.dumps(dict(options), sort_keys=True, default=repr)


def _environment_name(suite: str, harness: str, environment_type: str | None, options: Mapping[str, Any]) -> str:
    name = f"{suite}:{harness}@{environment_type}"
    if options:  # a short, stable digest of the options tells combinations of one harness apart
        name += "+" + hashlib.sha1(_options_key(options).encode()).hexdigest()[:8]
    return name


def _label(names: list[str] | None, i: int) -> str:
    """How a message names the ``i``-th spec: by its key in a mapping, else by its position."""
    return f"specs[{names[i]!r}]" if names else f"specs[{i}]"


def _named_specs(
    specs: Sequence[MixableSpec] | Mapping[str, MixableSpec],
) -> tuple[list[str] | None, list[MixableSpec]]:
    """The specs as a list, and their names when given as a mapping; each checked to be a mixable spec."""
    names: list[str] | None = None
    if isinstance(specs, Mapping):
        names = [str(name) for name in specs]
        if any(not name for name in names):
            raise HarborMixError("A suite name in the specs mapping is empty; name every suite.")
        spec_list = list(specs.values())
    elif _is_spec(specs) or isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise TypeError(
            f"HarborSpec.mix takes a list of HarborSpec (or a mapping name -> HarborSpec), got {type(specs).__name__}."
        )
    else:
        spec_list = list(specs)
    if not spec_list:
        raise HarborMixError("HarborSpec.mix needs at least one spec; got none.")
    for i, spec in enumerate(spec_list):
        if not _is_spec(spec):
            hint = " (pass the specs of a mix, not the mix)" if isinstance(spec, HarborMix) else ""
            raise TypeError(f"{_label(names, i)} is a {type(spec).__name__}, not a HarborSpec{hint}.")
        if spec.loop_agent is not None:
            raise HarborMixError(
                f"{_label(names, i)} runs the loop-owning agent {spec.loop_agent!r}, which trains through a "
                "rollout_func and cannot be mixed with other specs yet. Fix: train it on its own spec."
            )
    return names, spec_list


def _environment_names(suites: list[str], specs: list[MixableSpec], names: list[str] | None) -> list[str]:
    """Each spec's environment name, refusing suites, combinations and names that two specs would share."""
    roots: dict[str, tuple[int, Path]] = {}
    combos: dict[tuple[Any, ...], int] = {}
    environments: dict[str, int] = {}
    for i, (suite, spec) in enumerate(zip(suites, specs, strict=True)):
        first, root = roots.setdefault(suite, (i, spec.suite.root))
        if root != spec.suite.root:
            raise HarborMixError(
                f"{_label(names, first)} and {_label(names, i)} are two different suites named {suite!r} ({root} "
                f"and {spec.suite.root}). Fix: name them apart, HarborSpec.mix({{'name_a': spec_a, "
                "'name_b': spec_b}, ...)."
            )
        options = _spec_options(spec)
        combo = (suite, spec.env_cls, spec.environment_type, _options_key(options))
        if combo in combos:
            raise HarborMixError(
                f"{_label(names, combos[combo])} and {_label(names, i)} are the same combination (suite {suite!r}, "
                f"harness {spec.env_cls.__name__}, backend {spec.environment_type!r}, same options): their rows "
                "could not be told apart. Fix: merge them into one spec (its weight is the sum), or "
                "name them apart with a mapping {name: spec} (e.g. easy and hard subsets of one suite)."
            )
        combos[combo] = i
        name = _environment_name(suite, _harness_label(spec), spec.environment_type, options)
        if name in environments:
            raise HarborMixError(
                f"{_label(names, environments[name])} and {_label(names, i)} both make the environment name "
                f"{name!r} from different harness classes of the same name. Fix: rename one harness class, or "
                "name the suites apart with a mapping {name: spec}."
            )
        environments[name] = i
    return list(environments)


def _mixable_dataset(suite: str, spec: MixableSpec) -> Dataset:
    """A spec's dataset, without the columns the mix sets itself (``environment``, ``suite``)."""
    dataset = spec.train_dataset
    if "environment" in dataset.column_names:  # suite.py renames such a metadata key
        raise HarborMixError(
            f"The dataset of suite {suite!r} already has a column 'environment', which a mix "
            "sets itself (TRL routes rows by it). Fix: rename that column."
        )
    # A [metadata] key named "suite" would collide with the mix's column: keep it as metadata_suite.
    return dataset.rename_column("suite", "metadata_suite") if "suite" in dataset.column_names else dataset


def _check_weights(
    weights: Iterable[Any] | Mapping[str, Any] | None, names: list[str] | None, count: int
) -> list[Fraction]:
    if weights is None:
        return [Fraction(1)] * count
    if isinstance(weights, Mapping):
        if names is None:
            raise HarborMixError(
                "weights is a mapping but the specs are a list; pass the weights as a list in the "
                "specs' order, or the specs as a mapping {name: spec} with the same keys."
            )
        if set(weights) != set(names):
            raise HarborMixError(
                f"weights name {sorted(map(str, weights))} but the specs are {sorted(names)}; "
                "give exactly one weight per spec name."
            )
        weights = [weights[name] for name in names]
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise HarborMixError(f"weights must be a list of numbers (one per spec), got {type(weights).__name__}.")
    weights = list(weights)
    if len(weights) != count:
        raise HarborMixError(f"{len(weights)} weight(s) for {count} spec(s); give exactly one weight per spec.")
    checked: list[Fraction] = []
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise HarborMixError(f"weights[{i}] is {weight!r}; weights must be numbers.")
        if not math.isfinite(weight) or weight <= 0:
            raise HarborMixError(
                f"weights[{i}] is {weight!r}; weights must be finite and > 0 (leave a spec out of "
                "the mix instead of giving it weight 0)."
            )
        checked.append(Fraction(float(weight)) if not isinstance(weight, (int, Fraction)) else Fraction(weight))
    return checked


def _quotas(weights: list[Fraction], sizes: list[int], num_rows: int | None, suites: list[str]) -> list[int]:
    total = sum(weights)
    if num_rows is None:  # the smallest size that holds every task of every spec at least once
        num_rows = max(math.ceil(size * total / weight) for size, weight in zip(sizes, weights, strict=True))
    exact = [num_rows * weight / total for weight in weights]
    quotas = [math.floor(share) for share in exact]
    # Largest remainder: the rows left over go to the largest fractional parts (ties: spec order).
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: num_rows - sum(quotas)]:
        quotas[i] += 1
    starved = [suites[i] for i, quota in enumerate(quotas) if quota == 0]
    if starved:
        smallest = max(math.ceil(total / weight) for weight in weights)
        raise HarborMixError(
            f"num_rows={num_rows} leaves no row for {', '.join(map(repr, starved))} at these weights; "
            f"use num_rows >= {smallest} (or num_rows=None: every task of every suite at least once)."
        )
    return quotas


def _interleave(quotas: list[int], rng: random.Random) -> list[int]:
    """Spread each spec's quota evenly over the rows: the k-th row of spec i sits at (k + phase_i) / quota_i."""
    slots: list[tuple[float, float, int]] = []
    for i, quota in enumerate(quotas):
        phase = rng.random()
        slots += [((k + phase) / quota, rng.random(), i) for k in range(quota)]
    slots.sort()
    return [i for _, _, i in slots]


def _deal(size: int, count: int, rng: random.Random) -> list[int]:
    """``count`` row positions of a spec: shuffled passes over its ``size`` rows, one after another."""
    dealt: list[int] = []
    while len(dealt) < count:
        order = list(range(size))
        rng.shuffle(order)
        dealt += order
    return dealt[:count]


def _dtype(feature: Any) -> str | None:
    """A plain column's type (``"int64"``, ``"null"``, ...); ``None`` for a nested one."""
    from datasets import Value

    return feature.dtype if isinstance(feature, Value) else None


def _numeric(feature: Any) -> bool:
    return (_dtype(feature) or "").startswith(("int", "uint", "float"))


def merge_features(named: Sequence[tuple[str, Features]]) -> tuple[Features, set[str]]:
    """Merge the columns of several suites' datasets into one schema.

    A column missing from a suite holds ``None`` there; integer and float columns merge to
    float; any other difference of type is an error.

    Args:
        named: ``(suite name, dataset features)`` pairs, in mix order.

    Returns:
        The merged features, and the names of the columns widened to float.

    Raises:
        HarborMixError: When one column has different types in two suites (the message names the
            column, both suites and both types).
    """
    from datasets import Features, Value

    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    widened: set[str] = set()
    for suite, features in named:
        for column, feature in features.items():
            if column not in merged or _dtype(merged[column]) == "null":
                merged[column], owner[column] = feature, suite
                continue
            current = merged[column]
            if _dtype(feature) == "null" or feature == current:
                continue
            if _numeric(feature) and _numeric(current):
                merged[column] = Value("float64")
                widened.add(column)
                continue
            raise HarborMixError(
                f"Column {column!r} is {_dtype(current) or repr(current)} in suite {owner[column]!r} but "
                f"{_dtype(feature) or repr(feature)} in suite {suite!r}; a mixed dataset needs one type per column. "
                f"Fix: rename the [metadata] key {column!r} in one suite's task.toml files, or build "
                "one of the specs with include_metadata=False."
            )
    return Features(merged), widened


class HarborMix:
    """Several ``HarborSpec`` s in one training run: rows drawn by weight, routed by TRL.

    Built by :meth:`HarborSpec.mix <trl_harbor.training.spec.HarborSpec.mix>`. Everything that can be
    wrong with the combination (names, weights, column types) fails here, when the mix is built.

    Args:
        specs: The specs, as a list or as a mapping ``{suite name: spec}``. In a list each
            spec's suite is named by :func:`suite_name` (the folder or hub id).
        weights: One positive weight per spec (a list in the specs' order, or a mapping with
            the specs' names); they need not sum to 1. ``None``: equal weights.
        seed: Seed of the row order: the same seed gives the same dataset.
        num_rows: Rows of the mixed dataset. ``None`` (default): the smallest number holding
            every task of every spec at least once at these weights. A spec's rows beyond its
            task count repeat its tasks (each task once per pass); fewer rows than tasks use a
            seeded subset. Trainers cycle through the dataset in epochs, so any size trains for
            any ``max_steps``.

    Raises:
        TypeError: When a spec is not a ``HarborSpec`` or the seed is not an integer.
        HarborMixError: When there is no spec; the weights are missing, negative, zero, not
            finite or not one per spec; ``num_rows`` leaves a spec without rows; two
            different suites share a name; two specs are the same (suite, harness, backend,
            options) combination; or a dataset column has clashing types in two suites.
    """

    def __init__(
        self,
        specs: Sequence[MixableSpec] | Mapping[str, MixableSpec],
        weights: Sequence[float] | Mapping[str, float] | None = None,
        seed: int = 0,
        *,
        num_rows: int | None = None,
    ) -> None:
        names, spec_list = _named_specs(specs)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an integer, got {seed!r}.")
        if num_rows is not None and (isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1):
            raise HarborMixError(f"num_rows must be a positive integer (or None), got {num_rows!r}.")
        suites = names if names is not None else [suite_name(spec) for spec in spec_list]
        fractions = _check_weights(weights, names, len(spec_list))
        environments = _environment_names(suites, spec_list, names)
        self._datasets = [_mixable_dataset(suite, spec) for suite, spec in zip(suites, spec_list, strict=True)]
        self._features, _ = merge_features([(s, ds.features) for s, ds in zip(suites, self._datasets, strict=True)])
        quotas = _quotas(fractions, [len(ds) for ds in self._datasets], num_rows, suites)
        total = sum(fractions)
        self._seed = seed
        self.entries: list[MixEntry] = [
            MixEntry(
                suite=suite,
                environment=name,
                spec=spec,
                weight=float(weight / total),
                rows=quota,
                harness=_harness_label(spec),
                environment_type=spec.environment_type,
                options=_spec_options(spec),
            )
            for suite, name, spec, weight, quota in zip(suites, environments, spec_list, fractions, quotas, strict=True)
        ]

    @property
    def specs(self) -> list[MixableSpec]:
        """The specs, in mix order."""
        return [entry.spec for entry in self.entries]

    @property
    def tasks(self) -> list[TaskInfo]:
        """Every distinct selected task of the specs, in mix order (a task shared by two specs once)."""
        seen: dict[Path, TaskInfo] = {}
        for entry in self.entries:
            for task in entry.spec.tasks:
                seen.setdefault(task.path, task)
        return list(seen.values())

    @property
    def task_dirs(self) -> list[Path]:
        """Absolute paths of :attr:`tasks`."""
        return [task.path for task in self.tasks]

    @property
    def suites(self) -> list[str]:
        """The distinct suite names (the ``suite`` column's values), in mix order."""
        return list(dict.fromkeys(entry.suite for entry in self.entries))

    @property
    def weights(self) -> list[float]:
        """The weights normalised to sum to 1, in mix order."""
        return [entry.weight for entry in self.entries]

    @property
    def num_rows(self) -> int:
        """The number of rows of :attr:`train_dataset`."""
        return sum(entry.rows for entry in self.entries)

    @cached_property
    def train_dataset(self) -> Dataset:
        """The mixed ``datasets.Dataset``: every spec's columns plus ``environment`` and ``suite``.

        Each spec contributes its quota of rows (its weight times :attr:`num_rows`), its tasks
        dealt in seeded shuffled passes; the specs' rows are spread evenly through the dataset.
        A column that a suite lacks is ``None`` in its rows.
        """
        import pyarrow as pa
        from datasets import Dataset, DatasetInfo, Features, Value

        features = Features({**self._features, "environment": Value("string"), "suite": Value("string")})
        schema = features.arrow_schema
        rng = random.Random(f"trl-harbor-mix:{self._seed}")
        order = _interleave([entry.rows for entry in self.entries], rng)
        # Each spec's rows, dealt and cast to the mixed schema (Arrow, no per-row Python) ...
        pieces = []
        for i, (entry, ds) in enumerate(zip(self.entries, self._datasets, strict=True)):
            dealt = _deal(len(ds), entry.rows, random.Random(f"trl-harbor-mix:{self._seed}:{i}"))
            table = ds.with_format("arrow")[:].take(pa.array(dealt, pa.int64()))
            fixed = {"environment": entry.environment, "suite": entry.suite}
            arrays = [
                pa.array([fixed[f.name]] * entry.rows, f.type)
                if f.name in fixed
                else table.column(f.name).cast(f.type)
                if f.name in table.column_names
                else pa.nulls(entry.rows, f.type)
                for f in schema
            ]
            pieces.append(pa.Table.from_arrays(arrays, schema=schema))
        # ... then interleaved: the k-th row of spec i in the order is row offset_i + k of the stack.
        rows = [itertools.count(start) for start in itertools.accumulate((e.rows for e in self.entries), initial=0)]
        positions = [next(rows[i]) for i in order]
        table = pa.concat_tables(pieces).take(pa.array(positions, pa.int64()))
        return Dataset(table.combine_chunks(), info=DatasetInfo(features=features))

    @cached_property
    def environment_factory(self) -> dict[str, Callable[[], HarborEnv]]:
        """``{environment name: factory}``, the dict by which TRL routes rows (``environment`` column).

        A name reads ``"<suite>:<harness>@<backend>"``, with ``"+<digest>"`` of the options when
        the spec changes options or harness arguments; it depends only on that combination, not on the other specs.
        """
        return {entry.environment: entry.spec.environment_factory for entry in self.entries}

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]]:
        """:func:`harbor_mix_reward`: the verifier's scalar for every row, plus per-suite metrics."""
        return harbor_mix_reward

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        parts = ", ".join(f"{e.environment!r}: {e.weight:.3g} ({e.rows} rows)" for e in self.entries)
        return f"HarborMix({{{parts}}}, seed={self._seed})"


def harbor_mix_reward(
    environments: Sequence[Any] | None = None,
    environment_reward: Sequence[float | None] | None = None,
    *,
    suite: Sequence[str] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """The outcome reward of a mix: :func:`~trl_harbor.training.spec.harbor_reward`, plus metrics per suite.

    Every rollout is scored by its own task's verifier, whatever its suite or harness, exactly
    as :func:`~trl_harbor.training.rewards.harbor_reward` does (which logs the batch-wide ``harbor/*``
    metrics). For each suite present in the batch it also logs
    ``harbor/suite/<suite>/reward`` (the mean reward of its scored rollouts; absent when
    all of them were skipped), ``harbor/suite/<suite>/infra_failures`` (rollouts lost to an
    infrastructure failure) and ``harbor/suite/<suite>/rollouts``.

    Args:
        environments: The rollouts' environments (passed by ``GRPOTrainer``).
        environment_reward: Per-rollout rewards computed elsewhere; used as given.
        suite: The rows' ``suite`` column (TRL passes dataset columns as keyword arguments).
        log_metric: TRL's metric logger.
        log_extra: TRL's completions-table logger.
        **kwargs: Other columns TRL passes.

    Returns:
        One reward per rollout (``None``: left out of the batch).

    Raises:
        ValueError: When neither ``environments`` nor ``environment_reward`` is given, or the
            ``suite`` column does not have one entry per rollout.
    """
    rewards = harbor_reward(
        environments=environments,
        environment_reward=environment_reward,
        log_metric=log_metric,
        log_extra=log_extra,
        **kwargs,
    )
    if log_metric is None or suite is None:
        return rewards
    if len(suite) != len(rewards):
        raise ValueError(f"harbor_mix_reward got {len(suite)} suite values for {len(rewards)} rollouts.")
    for name in dict.fromkeys(suite):
        picked = [i for i, s in enumerate(suite) if s == name]
        scored = [rewards[i] for i in picked if rewards[i] is not None]
        if scored:
            log_metric(f"harbor/suite/{name}/reward", sum(scored) / len(scored))
        log_metric(f"harbor/suite/{name}/infra_failures", float(sum(_infra(environments, rewards, i) for i in picked)))
        log_metric(f"harbor/suite/{name}/rollouts", float(len(picked)))
    return rewards


def _infra(environments: Sequence[Any] | None, rewards: list[float | None], i: int) -> bool:
    if environments is None:  # rewards computed elsewhere: a skipped rollout is an infrastructure loss
        return rewards[i] is None
    env = environments[i]
    if isinstance(env, HarborEnv):
        outcome = env.verification
        return bool(outcome is not None and outcome.infra)
    return False


#: ``mix(specs, weights=None, seed=0, *, num_rows=None)``: a :class:`HarborMix` (also ``HarborSpec.mix``).
mix = HarborMix
