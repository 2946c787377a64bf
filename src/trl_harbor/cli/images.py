"""``trl-harbor images``: a backend's task images (list, build ahead of training, prune, load).

The local sandbox's own command, ``harbor-local-sandbox images`` (its package's ``cli.ImagesCommand``:
the same subcommands, options and output), with what trl-harbor adds: ``-e`` names the backend whose
cache it is (any whose class keeps one, :class:`trl_harbor.rollout.contract.ImageCache`; default
``local``), reached through that class so that what is built here is what its sandboxes find; ``build``
takes any suite trl-harbor loads (:func:`trl_harbor.rollout.suite.load_suite`: a folder, a Hugging Face
dataset id); builds run on trl-harbor's shared event loop. Building a suite's images before training
keeps the first rollouts from waiting on pulls and builds::

    trl-harbor images build examples/tasks
    trl-harbor images list
    trl-harbor images prune            # images whose task changed or is gone
    trl-harbor images prune --all      # every image, and the pulled base images
    trl-harbor images load python-3.12-slim.tar python:3.12-slim   # a base image, offline
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "build_images", "image_store"]

#: Why ``images`` cannot run without the local sandbox's package (every image cache trl-harbor ships is its).
_NO_PACKAGE = (
    "`trl-harbor images` is the local sandbox's image command, whose package is not installed: "
    "pip install 'trl-harbor[local]'"
)


def image_store(environment_type: str = "local", cache_dir: Path | str | None = None, *, host_trust: bool = True):
    """The image cache of a backend's sandboxes for these options.

    Args:
        environment_type: The backend (``"local"``, or a plug-in's import path).
        cache_dir: The cache root (``None``: the backend's default).
        host_trust: Forward the host's proxy settings and CA certificates to builds.

    Returns:
        The backend's store (see :class:`~trl_harbor.rollout.contract.ImageCache`).

    Raises:
        ValueError: If the backend is unknown or keeps no image cache.
    """
    from trl_harbor.rollout.backends import resolve_backend

    options: dict[str, object] = {"host_trust": host_trust}
    if cache_dir:
        options["cache_dir"] = str(cache_dir)
    store = resolve_backend(environment_type, options).image_store()
    if store is None:
        raise ValueError(
            f"environment_type={environment_type!r} keeps no image cache trl-harbor can reach (it builds its "
            "images its own way): `trl-harbor images` serves backends such as 'local'"
        )
    return store


def _implementation() -> Any:
    """The local sandbox package's ``cli`` module (the implementation), or exit naming the install."""
    from trl_harbor.rollout.backends import local_sandbox_cli

    module = local_sandbox_cli()
    if module is None:
        raise SystemExit(_NO_PACKAGE)
    return module


def build_images(
    task_dirs: Sequence[Path],
    store: Any,
    *,
    force: bool = False,
    concurrency: int = 2,
    on_done: Callable[[str, str], None] | None = None,
) -> Any:
    """Build (or find cached) a backend's images of some tasks, ahead of their sandboxes.

    The local sandbox's ``build_images``, run on the process's shared event loop (:mod:`trl_harbor.runtime`)
    with the store the backend's sandboxes use (:func:`image_store`, :meth:`Backend.image_store`).

    Args:
        task_dirs: The task folders (each with ``environment/Dockerfile``).
        store: The backend's image store.
        force: Rebuild images that are cached.
        concurrency: Builds at once.
        on_done: Called with ``(task, status)`` as each task finishes (``status``: ``"cached"``,
            ``"built in 1.2s"`` or ``"FAILED: ..."``).

    Returns:
        The counts (the package's ``ImagesBuilt``: ``built``, ``cached``, ``failed``, ``seconds``, ``ready``,
        and ``+=``); a failed build is reported there, never raised.
    """
    from trl_harbor import runtime

    build = _implementation().build_images
    return runtime.run(build(task_dirs, store, force=force, concurrency=concurrency, on_done=on_done))


def _backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--environment-type", "-e", default="local", help="the backend whose image cache this is (default: local)"
    )


def _store(args: argparse.Namespace) -> Any:
    return image_store(args.environment_type, args.cache_dir or None, host_trust=not args.no_host_trust)


def _suite_tasks(args: argparse.Namespace) -> list[Path]:
    from trl_harbor.rollout.suite import load_suite

    return [task.path for task in load_suite(args.suite).tasks]


def _missing(args: argparse.Namespace) -> int:
    raise SystemExit(_NO_PACKAGE)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``images`` and its subcommands on the ``trl-harbor`` parser (without the local sandbox's
    package: a command that says what to install).

    Args:
        commands: The parser's subcommands.
    """
    from trl_harbor import runtime
    from trl_harbor.rollout.backends import local_sandbox_cli

    module = local_sandbox_cli()
    if module is None:
        images = commands.add_parser("images", help="task images of the local sandbox (needs trl-harbor[local])")
        images.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        images.set_defaults(func=_missing)
        return
    command = module.ImagesCommand(store=_store, task_dirs=_suite_tasks, run=runtime.run, options=_backend_option)
    command.add_parser(commands)
