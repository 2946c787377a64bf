"""``HarborOptions``: one options object, its defaults written once, reaching every entry point (issue #18).

The regression this guards: ``trl-harbor eval`` used to build its environments with four of the
options spelled out and silently dropped ``on_infra_error`` and ``max_concurrent_starts``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE

import trl_harbor
from trl_harbor import HarborBashEnv, HarborOptions, HarborSpec
from trl_harbor.cli import build_parser, options_from_args
from trl_harbor.options import OPTION_NAMES

EVERY_FLAG = [
    "--command-timeout-sec", "42", "--max-output-chars", "1234", "--max-concurrent-starts", "3",
    "--on-infra-error", "zero", "--infra-stop-fraction", "0.5", "--agent-processes", "kill",
    "--unreached-steps", "zero", "--reward-key", "exact", "--reward-weight", "exact=0.5",
    "--allowed-change", "/etc/motd", "--ek", "host_trust=false", "--ek", "pids_max=64",
]  # fmt: skip
EXPECTED = HarborOptions(
    command_timeout_sec=42, max_output_chars=1234, max_concurrent_starts=3, on_infra_error="zero",
    infra_stop_fraction=0.5, agent_processes="kill", unreached_steps="zero", reward_key="exact",
    reward_weights={"exact": 0.5}, allowed_changes=("/etc/motd",),
    backend_options={"host_trust": False, "pids_max": 64},
)  # fmt: skip
#: ``train`` takes the same flags, underscored or dashed, several values after one flag (TRL's parser).
TRAIN_FLAGS = [
    "--command_timeout_sec", "42", "--max-output-chars", "1234", "--max_concurrent_starts", "3",
    "--on_infra_error", "zero", "--infra_stop_fraction", "0.5", "--agent_processes", "kill",
    "--unreached_steps", "zero", "--reward_key", "exact", "--reward_weight", "exact=0.5",
    "--allowed_change", "/etc/motd", "--ek", "host_trust=false", "pids_max=64",
]  # fmt: skip


def _option_dests(parser) -> set[str]:
    """The dests of a parser's flags that are option flags (by the generated table)."""
    from trl_harbor.cli.option_flags import OPTION_FLAGS

    dests = {action.dest for action in parser._actions}
    return {option.field for option in OPTION_FLAGS if option.dest in dests}


def test_every_option_has_a_flag_and_the_flags_reach_the_options() -> None:
    """Every command that runs rollouts (check, eval, train) takes every option, generated from the dataclass."""
    from trl_harbor.cli.train import _parser, parse_train_args

    assert set(EXPECTED.changed()) == set(OPTION_NAMES), "EVERY_FLAG must set every HarborOptions field"
    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("check", "eval"):
        assert _option_dests(commands[command]) == set(OPTION_NAMES), command
        head = [command, str(BUNDLED_SUITE)] + (["--model", "m"] if command == "eval" else [])
        args = build_parser().parse_args(head + EVERY_FLAG)
        assert options_from_args(args) == EXPECTED, command
        # No flag given: every default is HarborOptions' own.
        assert options_from_args(build_parser().parse_args(head)) == HarborOptions(), command
    assert _option_dests(_parser(default_run=False)) == set(OPTION_NAMES), "train"
    harbor, _ = parse_train_args(["--model", "m", *TRAIN_FLAGS])
    assert harbor.options() == EXPECTED
    harbor, _ = parse_train_args(["--model", "m"])
    assert harbor.options() == HarborOptions()


def test_none_is_a_value_where_the_option_takes_it() -> None:
    """``none`` turns a limit off (``max_concurrent_starts``, ``infra_stop_fraction``), in every command."""
    from trl_harbor.cli.train import parse_train_args

    flags = ["--max-concurrent-starts", "none", "--infra-stop-fraction", "None"]
    expected = HarborOptions(max_concurrent_starts=None, infra_stop_fraction=None)
    assert options_from_args(build_parser().parse_args(["check", str(BUNDLED_SUITE), *flags])) == expected
    assert parse_train_args(["--model", "m", *flags])[0].options() == expected
    with pytest.raises(SystemExit):  # not a number, not none: argparse's own error
        build_parser().parse_args(["check", str(BUNDLED_SUITE), "--command-timeout-sec", "none"])
    with pytest.raises(ValueError, match="command_timeout_sec"):
        parse_train_args(["--model", "m", "--command_timeout_sec", "soon"])


def test_option_flags_help_is_the_dataclass_docstring() -> None:
    from trl_harbor.cli.option_flags import OPTION_FLAGS

    for option in OPTION_FLAGS:
        assert option.help and option.help != option.field, option
    timeout = next(o for o in OPTION_FLAGS if o.field == "command_timeout_sec")
    assert timeout.help.startswith("Seconds one command may run") and timeout.default == 180


def test_eval_hands_every_option_to_its_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression: eval's environments get the whole options object, not four fields of it."""
    from trl_harbor.cli.evaluate import EvalConfig, evaluate

    seen: list[HarborOptions] = []

    class Stop(Exception):
        pass

    class Spying(HarborSpec):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self.environment_factory().options)
            raise Stop

    monkeypatch.setattr(trl_harbor, "HarborSpec", Spying)
    args = build_parser().parse_args(["eval", str(BUNDLED_SUITE), "--model", "m", *EVERY_FLAG])
    with pytest.raises(Stop):
        evaluate(EvalConfig(dataset=str(BUNDLED_SUITE), base_url=None, model="m", options=options_from_args(args)))
    assert seen == [EXPECTED]


def test_options_validate_early_and_merge_by_name() -> None:
    with pytest.raises(ValueError, match="on_infra_error"):
        HarborOptions(on_infra_error="ignore")
    with pytest.raises(ValueError, match="max_concurrent_starts"):
        HarborOptions(max_concurrent_starts=0)
    with pytest.raises(ValueError, match="command_timeout_sec"):
        HarborBashEnv(command_timeout_sec=0)
    with pytest.raises(TypeError, match="command_timeout_secs.*the options are"):
        HarborBashEnv(command_timeout_secs=5)  # a typo is refused, with the names
    base = HarborOptions(reward_key="exact")
    merged = HarborOptions.merged(base, command_timeout_sec=9)
    assert (merged.reward_key, merged.command_timeout_sec) == ("exact", 9) and base.command_timeout_sec == 180
    # A spec's env_kwargs that name options still override its options (deprecated: a FutureWarning shows the
    # options= to write, pointing at the caller's line); the rest go to the harness.
    with pytest.warns(
        FutureWarning, match=r"Fix: pass options=HarborOptions\.merged\(options, max_output_chars=77\)"
    ) as caught:
        spec = HarborSpec(BUNDLED_SUITE, options=base, env_kwargs={"max_output_chars": 77})
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    env = spec.environment_factory()
    assert env.options == dataclasses.replace(base, max_output_chars=77)


def test_options_is_the_one_way_in_and_loose_fields_warn_with_the_fix(recwarn: pytest.WarningsRecorder) -> None:
    """``options=`` is the way in; a field given loose still works, deprecated, and says what to write."""
    options = HarborOptions(command_timeout_sec=9)
    quiet = [HarborBashEnv(options=options), HarborSpec(BUNDLED_SUITE, options=options).environment_factory()]
    assert [env.options for env in quiet] == [options, options]
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]  # options= never warns
    with pytest.warns(
        FutureWarning, match=r"HarborBashEnv\(\.\.\.\).*Fix: pass options=HarborOptions\(command_timeout_sec=9\)"
    ) as caught:
        loose = HarborBashEnv(command_timeout_sec=9)
    assert loose.options == options
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]  # the caller's line, not ours
    # A harness's own constructor arguments in env_kwargs are no options: they never warn.
    recwarn.clear()
    spec = HarborSpec(BUNDLED_SUITE, agent=_Greeting, options=options, env_kwargs={"greeting": "hi"})
    assert spec.environment_factory().greeting == "hi"
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


class _Greeting(HarborBashEnv):
    """A harness with a constructor argument of its own."""

    def __init__(self, greeting: str = "", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.greeting = greeting
