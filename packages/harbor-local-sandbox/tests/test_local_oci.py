"""Task images built by buildah from a real registry on loopback (``oci.ImageStore``).

The base image is Debian bookworm, bootstrapped from Debian packages and served by
Debian's ``docker-registry`` on 127.0.0.1 (see ``registry_testing.py``): no test reaches a
registry off this machine.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor_local_sandbox.oci import BaseImageUnavailableError, ImageBuildError, ImageStore, base_images
from registry_testing import loopback_registry  # noqa: F401 - the session fixture

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, loopback_registry) -> Iterator[ImageStore]:  # noqa: F811
    store = ImageStore(tmp_path_factory.mktemp("image-cache"))
    yield store
    store.release_mounts()


def _context(root: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_base_images_skips_stages_scratch_and_variables():
    text = "ARG V=1\nFROM a/b:1 AS build\nFROM build\nFROM scratch\nFROM --platform=x c:2\nFROM ${V}\nFROM a/b:1\n"
    assert base_images(text) == ["a/b:1", "c:2"]


def test_multi_stage_build_exports_root_and_config(store, loopback_registry, tmp_path):  # noqa: F811
    base = loopback_registry.base
    context = _context(
        tmp_path / "env",
        f"""FROM {base} AS build
ARG GREETING=hello
RUN echo "$GREETING from stage one" > /built.txt
FROM {base}
ENV PATH="/opt/tool/bin:${{PATH}}" APP_MODE=test
RUN mkdir -p /opt/tool/bin && useradd -m agent
COPY --from=build /built.txt /etc/myapp/built.txt
COPY app.conf /etc/myapp/app.conf
COPY tool.sh /usr/local/bin/tool
COPY . /app/
WORKDIR /app
USER agent
ENTRYPOINT ["/usr/local/bin/tool"]
CMD ["serve"]
""",
        {
            "app.conf": "mode=1\n",
            "tool.sh": "#!/bin/sh\necho tool\n",
            "secret.txt": "x",
            ".dockerignore": "secret.txt\n",
        },
    )
    (context / "tool.sh").chmod(0o755)
    image = asyncio.run(store.get(context, "multi"))
    root = image.rootfs
    host = store.buildah.host  # read where the image is mounted: this process as root, the holder without root
    assert host.call(Path.read_text, root / "etc/myapp/built.txt") == "hello from stage one\n"
    assert host.call(Path.read_text, root / "etc/myapp/app.conf") == "mode=1\n"
    assert host.call(os.stat, root / "usr/local/bin/tool").st_mode & 0o111
    assert host.call(os.path.isdir, root / "home/agent")
    assert "agent:" in host.call(Path.read_text, root / "etc/passwd")
    assert not host.call(os.path.exists, root / "app/secret.txt"), ".dockerignore must keep secret.txt out"
    config = image.config
    assert config.env["PATH"].startswith("/opt/tool/bin:/usr/local/sbin:")
    assert config.env["APP_MODE"] == "test"
    assert (config.workdir, config.user) == ("/app", "agent")
    assert (config.entrypoint, config.cmd) == (["/usr/local/bin/tool"], ["serve"])
    assert json.loads((image.path / "image.json").read_text())["bases"] == [base]

    # Unchanged: the cached root is reused, in this process and by a fresh store.
    again = asyncio.run(ImageStore(store.cache_dir).get(context, "multi"))
    assert again.path == image.path and again.record.built_at == image.record.built_at
    # Changed context: a new key.
    (context / "app.conf").write_text("mode=2\n")
    changed = asyncio.run(store.get(context, "multi"))
    assert changed.path != image.path
    assert host.call(Path.read_text, changed.rootfs / "etc/myapp/app.conf") == "mode=2\n"


def test_concurrent_requests_share_one_build(store, loopback_registry, tmp_path):  # noqa: F811
    context = _context(tmp_path / "env", f"FROM {loopback_registry.base}\nRUN date +%s%N > /stamp\n")

    async def many():
        return await asyncio.gather(*(store.get(context, "shared") for _ in range(8)))

    images = asyncio.run(many())
    assert len({image.path for image in images}) == 1
    assert len({image.record.built_at for image in images}) == 1


def test_a_store_serves_one_event_loop_after_another_even_one_closed_mid_build(store, loopback_registry, tmp_path):  # noqa: F811
    """The store is process-wide; callers come with their own loops (``asyncio.run`` per call).

    A loop closed while one of its builds waited on the store must not leave it unusable for the next loop.
    """
    context = _context(tmp_path / "env", f"FROM {loopback_registry.base}\nRUN sleep 2 && date +%s%N > /stamp\n")

    async def abandoned() -> None:
        builds = [asyncio.ensure_future(store.get(context, "abandoned")) for _ in range(2)]
        await asyncio.sleep(0.5)  # one build holds the store's lock for this content, one waits on it
        for build in builds:
            build.cancel()

    async def two() -> list:
        return await asyncio.wait_for(asyncio.gather(*(store.get(context, "next loop") for _ in range(2))), 300)

    asyncio.run(abandoned())
    images = asyncio.run(two())
    assert (images[0].rootfs / "stamp").is_file()
    assert [image.path for image in asyncio.run(two())] == [images[0].path] * 2


def test_failing_run_names_the_dockerfile_and_output(store, loopback_registry, tmp_path):  # noqa: F811
    context = _context(tmp_path / "env", f"FROM {loopback_registry.base}\nRUN echo boom-marker >&2 && false\n")
    with pytest.raises(ImageBuildError) as error:
        asyncio.run(store.get(context, "broken"))
    assert "Dockerfile" in str(error.value) and "boom-marker" in str(error.value)
    assert store.cached(context) is None


def test_unpullable_base_names_image_registries_and_fixes(store, loopback_registry, tmp_path):  # noqa: F811
    missing = f"{loopback_registry.address}/nothing/here:1"
    context = _context(tmp_path / "env", f"FROM {missing}\nRUN true\n")
    with pytest.raises(BaseImageUnavailableError) as error:
        asyncio.run(store.get(context, "offline"))
    message = str(error.value)
    assert missing in message
    assert loopback_registry.address in message.split("registries tried:")[1]
    assert "registries.conf" in message and "archive" in message


@pytest.mark.slow
def test_unreachable_debian_base_is_bootstrapped_from_debian_packages(loopback_registry, tmp_path):  # noqa: F811
    """No registry serves debian:bookworm-slim here; a Debian mirror does: mmdebstrap makes the base."""
    context = _context(tmp_path / "env", "FROM debian:bookworm-slim\nRUN echo built-on-debian > /marker\n")
    store = ImageStore(tmp_path / "cache", debian_bootstrap=False)
    with pytest.raises(BaseImageUnavailableError, match="debian:bookworm-slim"):
        asyncio.run(store.get(context, "debian"))
    bootstrapping = ImageStore(tmp_path / "cache")
    try:
        image = asyncio.run(bootstrapping.get(context, "debian"))
        assert (image.rootfs / "marker").read_text() == "built-on-debian\n"
        assert (image.rootfs / "etc/debian_version").read_text().startswith("12")
        assert image.config.env["PATH"].startswith("/usr/local/sbin")
    finally:
        bootstrapping.release_mounts()


def test_debian_suite_names():
    from harbor_local_sandbox.oci import debian_suite

    assert [debian_suite(r) for r in ("debian:bookworm", "debian:12-slim", "docker.io/library/debian:trixie")] == [
        "bookworm", "bookworm", "trixie",
    ]  # fmt: skip
    assert debian_suite("debian") == "stable"
    assert debian_suite("python:3.12-slim") is None and debian_suite("debian@sha256:00") is None


def test_tasks_share_identical_build_steps(store, loopback_registry, tmp_path):  # noqa: F811
    """Like docker build's cache: a step with the same parent and instruction is built once."""
    prefix = f"FROM {loopback_registry.base}\nRUN date +%s%N > /stamp\n"
    first = _context(tmp_path / "one", prefix + "COPY a.txt /a.txt\n", {"a.txt": "a"})
    second = _context(tmp_path / "two", prefix + "COPY b.txt /b.txt\n", {"b.txt": "b"})
    one = asyncio.run(store.get(first, "one"))
    two = asyncio.run(store.get(second, "two"))
    assert one.path != two.path
    assert (one.rootfs / "stamp").read_text() == (two.rootfs / "stamp").read_text()
    assert (two.rootfs / "b.txt").exists() and not (two.rootfs / "a.txt").exists()


def test_registry_mirror_from_registries_conf(loopback_registry, tmp_path, monkeypatch):  # noqa: F811
    """A mirror is plain registries.conf: FROM a registry this machine cannot reach, served by its mirror."""
    conf = tmp_path / "registries.conf"
    conf.write_text(
        loopback_registry.registries_conf.read_text()
        + f'\n[[registry]]\nlocation = "registry.invalid"\n[[registry.mirror]]\nlocation = "{loopback_registry.address}"\ninsecure = true\n'
    )
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(conf))
    context = _context(tmp_path / "env", "FROM registry.invalid/debian:bookworm\nRUN echo mirrored > /marker\n")
    store = ImageStore(tmp_path / "cache")
    try:
        image = asyncio.run(store.get(context, "mirrored"))
        assert (image.rootfs / "marker").read_text() == "mirrored\n"
    finally:
        store.release_mounts()


def test_with_build_args_declares_the_trust_variables_in_every_stage() -> None:
    """Each stage gets the declarations right after its FROM (continued lines too); heredoc bodies are not FROMs."""
    from harbor_local_sandbox.oci import with_build_args

    text = "# escape=`\nFROM python:3.12 AS b\nRUN <<EOF\nFROM nothing\nEOF\nfrom `\n  debian\nCOPY --from=b /x /y\n"
    assert with_build_args(text, ("A", "B")).splitlines() == [
        "# escape=`", "FROM python:3.12 AS b", "ARG A", "ARG B", "RUN <<EOF", "FROM nothing", "EOF",
        "from `", "  debian", "ARG A", "ARG B", "COPY --from=b /x /y",
    ]  # fmt: skip


def test_prebuilt_contexts_made_by_threads_at_once_are_whole(tmp_path: Path) -> None:
    """A prebuilt image's build context is made from threads (each sandbox starting): made at once for
    one image by several, each gets it, written whole, and no writer's temporary file is left (two writers
    of one temporary name lost the file between them: a compose task's start failed in CI)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store = ImageStore(tmp_path / "cache")
    writers = 8

    def make(ref: str, barrier: threading.Barrier) -> Path:
        barrier.wait()
        return store.prebuilt_context(ref)

    with ThreadPoolExecutor(writers) as pool:
        for i in range(30):
            ref = f"registry.test/image-{i}:1"
            barrier = threading.Barrier(writers)
            folders = set(pool.map(make, [ref] * writers, [barrier] * writers))
            (folder,) = folders
            assert (folder / "Dockerfile").read_text() == f"FROM {ref}\n"
            assert sorted(p.name for p in folder.iterdir()) == ["Dockerfile"]
