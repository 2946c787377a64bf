"""``harbor-local-sandbox``: the local sandbox's command line, for its image cache (list, build, prune, load).

The images buildah builds from each task's Dockerfile are cached by content under
``~/.cache/harbor-local-sandbox`` (``$HARBOR_LOCAL_SANDBOX_CACHE_DIR``, ``--cache-dir``). The store is the
one :meth:`LocalEnvironment.image_store <harbor_local_sandbox.local.LocalEnvironment.image_store>` gives its
sandboxes, so what is built here is what they find. Building a suite's images before a run keeps its
first trials from waiting on pulls and builds::

    harbor-local-sandbox images build examples/tasks
    harbor-local-sandbox images list
    harbor-local-sandbox images prune            # images whose task changed or is gone
    harbor-local-sandbox images prune --all      # every image, and the pulled base images
    harbor-local-sandbox images load python-3.12-slim.tar python:3.12-slim   # a base image, offline

:class:`ImagesCommand` is the implementation; a trainer's own command line can register it with hooks of
its own (which backend's store, how a suite argument names its tasks, which event loop runs the builds).
Importing this module imports nothing of Harbor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ImagesBuilt", "ImagesCommand", "build_images", "cache_size", "find_task_dirs", "human_size", "main"]

#: What ``--cache-dir`` defaults to, as its help says.
CACHE_DIR_HELP = "cache root (default: $HARBOR_LOCAL_SANDBOX_CACHE_DIR or ~/.cache/harbor-local-sandbox)"


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


def human_size(size: int) -> str:
    """``size`` bytes as ``512 B``, ``1.5 KiB``, ..., ``3.2 GiB``, ``1.1 TiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


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


async def build_images(
    task_dirs: Sequence[Path],
    store: Any,
    *,
    force: bool = False,
    concurrency: int = 2,
    on_done: Callable[[str, str], None] | None = None,
) -> ImagesBuilt:
    """Build (or find cached) the images of some tasks, ahead of their sandboxes.

    Args:
        task_dirs: The task folders (each with ``environment/Dockerfile``).
        store: The image store the sandboxes use (:meth:`LocalEnvironment.image_store`).
        force: Rebuild images that are cached.
        concurrency: Builds at once.
        on_done: Called with ``(task, status)`` as each task finishes (``status``: ``"cached"``,
            ``"built in 1.2s"`` or ``"FAILED: ..."``).

    Returns:
        The counts; a failed build is reported there, never raised.
    """
    counts = ImagesBuilt()
    started = time.monotonic()
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
    counts.seconds = time.monotonic() - started
    return counts


def find_task_dirs(suite: str | Path) -> list[Path]:
    """The task folders of a suite, as Harbor's ``-p`` takes it: a task folder, a folder of task folders,
    or a folder holding ``tasks/``; a task is a folder with ``environment/Dockerfile`` (found at any depth,
    not inside another task), sorted by name.

    Raises:
        ValueError: If the folder does not exist, holds no task, or two tasks share a name.
    """
    root = Path(suite).expanduser()
    if not root.is_dir():
        raise ValueError(f"{suite}: no such folder (a task folder, or a folder of task folders)")
    if (root / "tasks").is_dir() and not (root / "environment" / "Dockerfile").is_file():
        root = root / "tasks"
    found: list[Path] = []
    for folder, dirs, _ in os.walk(root):
        if Path(folder, "environment", "Dockerfile").is_file():
            found.append(Path(folder))
            dirs[:] = []  # a task's own folders are not tasks
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    if not found:
        raise ValueError(f"{suite}: no task folders (folders with environment/Dockerfile)")
    names: dict[str, Path] = {}
    for path in found:
        if path.name in names:
            raise ValueError(f"two tasks are named {path.name!r}: {names[path.name]} and {path}")
        names[path.name] = path
    return sorted(found, key=lambda p: p.name)


def _local_store(args: argparse.Namespace) -> Any:
    from harbor_local_sandbox.local import LocalEnvironment

    return LocalEnvironment.image_store(args.cache_dir or None, host_trust=not args.no_host_trust)


def _suite_tasks(args: argparse.Namespace) -> list[Path]:
    try:
        return find_task_dirs(args.suite)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


class ImagesCommand:
    """``images list|build|prune|load``: the image cache's subcommands.

    Args:
        store: The image store for the parsed arguments (default: the local sandbox's, for ``--cache-dir``
            and ``--no-host-trust``). A ``ValueError`` it raises is the command's error message.
        task_dirs: The task folders ``images build`` builds, for the parsed arguments (default:
            :func:`find_task_dirs` of ``SUITE``).
        run: Runs a coroutine to its end (default: :func:`asyncio.run`; a trainer passes its own loop's).
        options: Adds options of the caller's to every subcommand (e.g. which backend's cache).
    """

    def __init__(
        self,
        *,
        store: Callable[[argparse.Namespace], Any] | None = None,
        task_dirs: Callable[[argparse.Namespace], Sequence[Path]] | None = None,
        run: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
        options: Callable[[argparse.ArgumentParser], None] | None = None,
    ):
        self._store_of = store or _local_store
        self._task_dirs_of = task_dirs or _suite_tasks
        self._run = run or asyncio.run
        self._options = options

    def store(self, args: argparse.Namespace) -> Any:
        """The store the arguments name (its error, a ``ValueError``, exits with the message)."""
        try:
            return self._store_of(args)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None

    def add_parser(self, commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Register ``images`` and its subcommands on a command line's subcommands.

        Args:
            commands: The parser's subcommands.

        Returns:
            The ``images`` parser.
        """
        images = commands.add_parser("images", help="task images of the local sandbox: list, build, prune, load")
        sub = images.add_subparsers(dest="images_command", required=True)
        common = argparse.ArgumentParser(add_help=False)
        if self._options is not None:
            self._options(common)
        common.add_argument("--cache-dir", help=CACHE_DIR_HELP)
        common.add_argument(
            "--no-host-trust", action="store_true", help="do not forward the host's proxies and CA certificates"
        )
        listing = sub.add_parser("list", parents=[common], help="built images and the cache's size")
        listing.set_defaults(func=self.list)
        build = sub.add_parser("build", parents=[common], help="build a suite's images ahead of a run")
        build.add_argument("suite", help="a folder of task folders, or one holding tasks/")
        build.add_argument("--task", "-t", action="append", help="build only this task (repeatable)")
        build.add_argument("--concurrency", "-n", type=int, default=2, help="builds at once")
        build.add_argument("--force", action="store_true", help="rebuild even if cached")
        build.set_defaults(func=self.build)
        prune = sub.add_parser("prune", parents=[common], help="remove images whose task changed or is gone")
        prune.add_argument("--all", action="store_true", help="remove every image and the pulled base images")
        prune.set_defaults(func=self.prune)
        load = sub.add_parser("load", parents=[common], help="load a base image from an OCI or Docker archive")
        load.add_argument("archive", help="the archive (skopeo copy ... oci-archive:FILE, or docker save)")
        load.add_argument("name", help="the name Dockerfiles use after FROM, e.g. python:3.12-slim")
        load.set_defaults(func=self.load)
        return images

    def list(self, args: argparse.Namespace) -> int:
        """``images list``: each built image (key, when built, build time, bases, task), and the cache's size."""
        store = self.store(args)
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
        print(f"\n{len(images)} image(s); cache {store.cache_dir}: {human_size(size)} (layers shared, counted once)")
        return 0

    def build(self, args: argparse.Namespace) -> int:
        """``images build SUITE``: the suite's images (``--task``: some of them), one line per task as it ends."""
        tasks = [Path(path) for path in self._task_dirs_of(args)]
        if args.task:
            wanted = set(args.task)
            tasks = [path for path in tasks if path.name in wanted]
            missing = wanted - {path.name for path in tasks}
            if missing:
                raise SystemExit(f"no task named {', '.join(sorted(missing))} in {args.suite}")
        done = 0

        def report(task: str, status: str) -> None:
            nonlocal done
            done += 1
            print(f"[{done}/{len(tasks)}] {task}: {status}", flush=True)

        store = self.store(args)
        counts = self._run(build_images(tasks, store, force=args.force, concurrency=args.concurrency, on_done=report))
        print(f"\n{counts.ready} of {len(tasks)} image(s) ready in {store.images_dir}")
        return 1 if counts.failed else 0

    def prune(self, args: argparse.Namespace) -> int:
        """``images prune``: images whose task changed or is gone; ``--all``: every image and the base images."""
        store = self.store(args)
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
            self._run(store.prune_bases())
            store.release_mounts()
            freed += max(0, before - cache_size(store.storage_dir))
        print(f"removed {removed} image(s), freed {human_size(freed)}")
        return 0

    def load(self, args: argparse.Namespace) -> int:
        """``images load ARCHIVE NAME``: a base image from an OCI or Docker archive, under the name ``FROM`` uses."""
        archive = Path(args.archive)
        if not archive.is_file():
            raise SystemExit(f"{archive}: no such file (an OCI or Docker archive of the image)")
        self._run(self.store(args).load_archive(archive.resolve(), args.name))
        print(f"loaded {archive} as {args.name}")
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``harbor-local-sandbox`` parser: ``images list|build|prune|load``."""
    parser = argparse.ArgumentParser(
        prog="harbor-local-sandbox", description="The local sandbox's image cache (a Harbor environment's)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ImagesCommand().add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``harbor-local-sandbox`` with ``argv`` (default: the process's arguments).

    Returns:
        The exit status (0: done; 1: a build failed).
    """
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
