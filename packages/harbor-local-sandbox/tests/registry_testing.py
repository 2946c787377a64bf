"""A real OCI registry on loopback, seeded with a Debian base image built from Debian packages.

The image tests never reach a registry off this machine: a session fixture starts Debian's
``docker-registry`` on ``127.0.0.1:<free port>`` with its storage in a temporary folder,
and pushes to it a ``debian:bookworm`` base image that ``mmdebstrap`` bootstraps from the
Debian mirror (``minbase`` plus ``python3``, ``python3-venv`` and ``ca-certificates``).
The image archive is cached under ``~/.cache/harbor-local-sandbox/test-images``
(``HARBOR_LOCAL_SANDBOX_TEST_CACHE`` overrides), so only the first run pays the bootstrap (~30 s).

Builds find the registry the way every containers tool does: a ``registries.conf`` that marks
it insecure (plain HTTP), named by ``CONTAINERS_REGISTRIES_CONF`` for the whole session.

Use it from a test module with ``from registry_testing import loopback_registry  # noqa: F401`` (each module
that imports the session fixture gets one registry, started at its first use).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Bump to rebuild the cached base image (e.g. when the package list changes).
BASE_VERSION = "1"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
TOOLS = {
    "docker-registry": "docker-registry",
    "buildah": "buildah",
    "skopeo": "skopeo",
    "mmdebstrap": "mmdebstrap",
}


@dataclass(frozen=True)
class LoopbackRegistry:
    """The running test registry.

    Attributes:
        address: ``127.0.0.1:<port>``.
        base: Reference of the seeded Debian image (``<address>/debian:bookworm``).
        registries_conf: The ``registries.conf`` that marks the registry insecure.
    """

    address: str
    base: str
    registries_conf: Path


def _cache_dir() -> Path:
    configured = os.environ.get("HARBOR_LOCAL_SANDBOX_TEST_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "harbor-local-sandbox" / "test-images"
    base.mkdir(parents=True, exist_ok=True)
    return base


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def base_image_archive() -> Path:
    """The Debian base image as an OCI archive, bootstrapped on first use and cached.

    Returns:
        Path of the ``oci-archive`` file.
    """
    cache = _cache_dir()
    archive = cache / f"debian-bookworm-{BASE_VERSION}.oci.tar"
    if archive.exists():
        return archive
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if archive.exists():
            return archive
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            rootfs = Path(scratch) / "rootfs.tar"
            _run(
                "mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                "bookworm", str(rootfs),
            )  # fmt: skip
            # vfs: a one-layer image needs no overlay mounts that could outlive the folder.
            storage = ["--root", f"{scratch}/storage", "--runroot", f"{scratch}/run", "--storage-driver", "vfs"]
            container = _run("buildah", *storage, "from", "scratch").stdout.strip()
            _run("buildah", *storage, "add", container, str(rootfs), "/")
            _run(
                "buildah", *storage, "config",
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd", "bash", container,
            )  # fmt: skip
            partial = Path(scratch) / "image.oci.tar"
            _run("buildah", *storage, "commit", "--quiet", container, f"oci-archive:{partial}:debian:bookworm")
            with contextlib.suppress(RuntimeError):
                _run("buildah", *storage, "rm", container)
            partial.replace(archive)
    return archive


@contextlib.contextmanager
def serve_loopback_registry(workdir: Path) -> Iterator[LoopbackRegistry]:
    """Run a seeded registry on loopback while the context lasts, and point builds at it.

    Args:
        workdir: An empty folder for its configuration and storage.

    Yields:
        The running registry (``CONTAINERS_REGISTRIES_CONF`` names its ``registries.conf``).
    """
    missing = [package for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"the image tests need {', '.join(missing)}: `apt-get install {' '.join(missing)}`")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    (workdir / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n"
    )
    log = open(workdir / "registry.log", "w")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        ["docker-registry", "serve", str(workdir / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except OSError as error:
                if server.poll() is not None or time.monotonic() > deadline:
                    log_text = (workdir / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {log_text}") from error
                time.sleep(0.1)
        conf = workdir / "registries.conf"
        conf.write_text(
            f'unqualified-search-registries = []\n\n[[registry]]\nlocation = "{address}"\ninsecure = true\n'
        )
        base = f"{address}/debian:bookworm"
        _run(
            "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
            f"oci-archive:{base_image_archive()}", f"docker://{base}",
        )  # fmt: skip
        previous = os.environ.get("CONTAINERS_REGISTRIES_CONF")
        os.environ["CONTAINERS_REGISTRIES_CONF"] = str(conf)
        try:
            yield LoopbackRegistry(address=address, base=base, registries_conf=conf)
        finally:
            if previous is None:
                os.environ.pop("CONTAINERS_REGISTRIES_CONF", None)
            else:
                os.environ["CONTAINERS_REGISTRIES_CONF"] = previous
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        if server.poll() is None:
            server.kill()
        log.close()


@pytest.fixture(scope="session")
def loopback_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackRegistry]:
    """Start a registry on loopback, seed it with the Debian base image, point builds at it.

    At the end of the session, what buildah left mounted under the session's temporary folders
    (image caches made by tests) is detached, so those folders can be deleted.
    """
    from harbor_local_sandbox._mounts import unmount_under

    try:
        with serve_loopback_registry(tmp_path_factory.mktemp("registry")) as registry:
            yield registry
    finally:
        unmount_under(tmp_path_factory.getbasetemp())
