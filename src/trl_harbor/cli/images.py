"""``trl-harbor images``: a backend's task images (list, build ahead of training, prune, load).

For a backend whose class keeps an image cache (:class:`trl_harbor.rollout.contract.ImageCache`;
``-e local``, the default: the local sandbox, whose images buildah builds from each task's Dockerfile,
cached by content under ``~/.cache/trl-harbor``). The store is the backend's own, reached through
its class, so what is built here is what its sandboxes find. Building a suite's images before
training keeps the first rollouts from waiting on pulls and builds::

    trl-harbor images build examples/tasks
    trl-harbor images list
    trl-harbor images prune            # images whose task changed or is gone
    trl-harbor images prune --all      # every image, and the pulled base images
    trl-harbor images load python-3.12-slim.tar python:3.12-slim   # a base image, offline
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ImagesBuilt", "add_parser", "build_images", "cache_size", "image_store"]


def cache_size(path: Path) -> int:
    """Bytes used on disk under ``path``, counting each hard-linked file once, not entering mounts.

    Args:
        path: A folder (missing: 0).

    Returns:
        The size in bytes.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    try:
        device = os.lstat(path).st_dev
    except OSError:
        return 0
    for folder, dirs, files in os.walk(path):
        # Mounted image roots (overlays of layers counted already) are not entered.
        dirs[:] = [d for d in dirs if _same_device(os.path.join(folder, d), device)]
        for name in dirs + files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
    return total


def _same_device(path: str, device: int) -> bool:
    try:
        return os.lstat(path).st_dev == device
    except OSError:
        return False


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


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


def _store(args: argparse.Namespace):
    try:
        return image_store(args.environment_type, args.cache_dir or None, host_trust=not args.no_host_trust)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    images = store.images()
    if not images:
        print(f"no task images in {store.images_dir}")
    else:
        print(f"{'key':<24}  {'built':<16}  {'build':>7}  {'base':<40}  task")
        for image in images:
            record = image.record
            built = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.built_at))
            bases = ", ".join(record.bases) or "scratch"
            took = f"{record.build_seconds:.0f}s"
            print(f"{record.key:<24}  {built:<16}  {took:>7}  {bases:<40}  {record.source}")
    # Images share layers (with their bases and each other): the cache is measured as a whole.
    size = cache_size(store.storage_dir) + cache_size(store.images_dir)
    print(f"\n{len(images)} image(s); cache {store.cache_dir}: {_human(size)} (layers shared, counted once)")
    return 0


@dataclass
class ImagesBuilt:
    """What :func:`build_images` did.

    Attributes:
        built: Images built now.
        cached: Images that were in the cache already.
        failed: ``{task: error}`` for each task whose image could not be built.
        seconds: Wall time.
    """

    built: int = 0
    cached: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ready(self) -> int:
        """Images ready to use (built now or cached)."""
        return self.built + self.cached

    def __iadd__(self, other: ImagesBuilt) -> ImagesBuilt:
        """Count another store's builds in (a run whose backends keep several caches)."""
        self.built += other.built
        self.cached += other.cached
        self.failed.update(other.failed)
        self.seconds += other.seconds
        return self


def build_images(
    task_dirs: Sequence[Path],
    store: Any,
    *,
    force: bool = False,
    concurrency: int = 2,
    on_done: Callable[[str, str], None] | None = None,
) -> ImagesBuilt:
    """Build (or find cached) a backend's images of some tasks, ahead of their sandboxes.

    Runs on the process's shared event loop (:mod:`trl_harbor.runtime`), with the image store the
    backend's sandboxes use (:func:`image_store`, :meth:`Backend.image_store`), so what is built
    here is what they find.

    Args:
        task_dirs: The task folders (each with ``environment/Dockerfile``).
        store: The backend's image store.
        force: Rebuild images that are cached.
        concurrency: Builds at once.
        on_done: Called with ``(task, status)`` as each task finishes (``status``: ``"cached"``,
            ``"built in 1.2s"`` or ``"FAILED: ..."``).

    Returns:
        The counts; a failed build is reported there, never raised.
    """
    from trl_harbor import runtime

    counts = ImagesBuilt()
    started = time.monotonic()

    async def build_all() -> None:
        semaphore = asyncio.Semaphore(max(1, concurrency))

        async def one(task_dir: Path) -> None:
            environment = task_dir / "environment"
            async with semaphore:
                cached = not force and await asyncio.to_thread(store.cached, environment) is not None
                begun = time.monotonic()
                try:
                    await store.get(environment, task_dir.name, force=force)
                except Exception as error:  # reported per task, then counted
                    counts.failed[task_dir.name] = str(error)
                    status = f"FAILED: {error}"
                else:
                    if cached:
                        counts.cached += 1
                        status = "cached"
                    else:
                        counts.built += 1
                        status = f"built in {time.monotonic() - begun:.1f}s"
            if on_done is not None:
                on_done(task_dir.name, status)

        await asyncio.gather(*(one(Path(task_dir)) for task_dir in task_dirs))

    runtime.run(build_all())
    counts.seconds = time.monotonic() - started
    return counts


def _cmd_build(args: argparse.Namespace) -> int:
    from trl_harbor.rollout.suite import load_suite

    tasks = load_suite(args.suite).tasks
    if args.task:
        wanted = set(args.task)
        tasks = [t for t in tasks if t.path.name in wanted]
        missing = wanted - {t.path.name for t in tasks}
        if missing:
            raise SystemExit(f"no task named {', '.join(sorted(missing))} in {args.suite}")
    done = 0

    def report(task: str, status: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{len(tasks)}] {task}: {status}", flush=True)

    store = _store(args)
    counts = build_images(
        [t.path for t in tasks],
        store,
        force=args.force,
        concurrency=args.concurrency,
        on_done=report,
    )
    print(f"\n{counts.ready} of {len(tasks)} image(s) ready in {store.images_dir}")
    return 1 if counts.failed else 0


def _cmd_prune(args: argparse.Namespace) -> int:
    store = _store(args)
    if store.used_elsewhere():
        raise SystemExit(
            f"{store.cache_dir}: another process (a training run, a test session) is starting sandboxes "
            "from these images; prune them once it has stopped"
        )
    removed, freed = 0, 0
    for image in store.images():
        source = Path(image.record.source)
        stale = args.all
        if not stale:
            environment_gone = not (source / "Dockerfile").is_file()
            stale = environment_gone or store.content_key(source) != image.record.key
        if stale:
            freed += cache_size(image.path)
            store.remove(image)
            removed += 1
    if args.all:
        before = cache_size(store.storage_dir)
        asyncio.run(store.prune_bases())
        store.release_mounts()
        freed += max(0, before - cache_size(store.storage_dir))
    print(f"removed {removed} image(s), freed {_human(freed)}")
    return 0


def _cmd_load(args: argparse.Namespace) -> int:
    archive = Path(args.archive)
    if not archive.is_file():
        raise SystemExit(f"{archive}: no such file (an OCI or Docker archive of the image)")
    asyncio.run(_store(args).load_archive(archive.resolve(), args.name))
    print(f"loaded {archive} as {args.name}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``images`` and its subcommands on the ``trl-harbor`` parser.

    Args:
        commands: The parser's subcommands.
    """
    images = commands.add_parser("images", help="task images of the local sandbox: list, build, prune")
    sub = images.add_subparsers(dest="images_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--environment-type", "-e", default="local", help="the backend whose image cache this is (default: local)"
    )
    common.add_argument("--cache-dir", help="cache root (default: $TRL_HARBOR_CACHE_DIR or ~/.cache/trl-harbor)")
    common.add_argument(
        "--no-host-trust", action="store_true", help="do not forward the host's proxies and CA certificates"
    )
    listing = sub.add_parser("list", parents=[common], help="built images and the cache's size")
    listing.set_defaults(func=_cmd_list)
    build = sub.add_parser("build", parents=[common], help="build a suite's images ahead of training")
    build.add_argument("suite", help="a folder of task folders, or one holding tasks/")
    build.add_argument("--task", "-t", action="append", help="build only this task (repeatable)")
    build.add_argument("--concurrency", "-n", type=int, default=2, help="builds at once")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.set_defaults(func=_cmd_build)
    prune = sub.add_parser("prune", parents=[common], help="remove images whose task changed or is gone")
    prune.add_argument("--all", action="store_true", help="remove every image and the pulled base images")
    prune.set_defaults(func=_cmd_prune)
    load = sub.add_parser("load", parents=[common], help="load a base image from an OCI or Docker archive")
    load.add_argument("archive", help="the archive (skopeo copy ... oci-archive:FILE, or docker save)")
    load.add_argument("name", help="the name Dockerfiles use after FROM, e.g. python:3.12-slim")
    load.set_defaults(func=_cmd_load)
