"""What a start no longer does every time (issue #45): facts about an image kept with it, the host's CA
names kept, the image's mount reused, launchers parked as a pool. Behaviour only, never timings."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harbor_local_sandbox import _box, oci
from harbor_local_sandbox._cache import CACHE, FACTS_FILE, ImageFacts
from harbor_local_sandbox._roots import ImageRoot
from sandbox_testing import (  # noqa: F401 - task_base_image: the session fixture
    BASE_DOCKERFILE,
    make_task,
    open_env,
    run,
    task_base_image,
    wait_until,
)

pytestmark = [pytest.mark.local, pytest.mark.usefixtures("task_base_image")]
PROBE_MARK = "echo '#python'"


def _probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The search-path probes run in sandboxes from now on (their commands)."""
    ran: list[str] = []
    original = ImageRoot.run

    async def run_recorded(self, command, **kwargs):
        if command.startswith(PROBE_MARK):
            ran.append(command)
        return await original(self, command, **kwargs)

    monkeypatch.setattr(ImageRoot, "run", run_recorded)
    return ran


async def _started(task: Path, tmp_path: Path):
    env = open_env(task, tmp_path / "trials")
    await env.start(force_build=False)
    return env


def _facts(env) -> dict:
    return json.loads((env._sandbox.image.path / FACTS_FILE).read_text())["facts"]


def test_an_images_facts_are_kept_with_it_and_a_rebuilt_image_has_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search-path probe and the link hazards, found by an image's first sandbox, are kept beside
    ``image.json``; a new process (its memory cleared) reads them and runs no probe. Another image, or
    the image rebuilt (a new folder), is probed again, with what it has now."""
    task = make_task(tmp_path / "tasks", "facts")
    extra = make_task(  # an image of this test's own (rebuilt below: no other test's)
        tmp_path / "tasks",
        "facts-extra",
        dockerfile=BASE_DOCKERFILE
        + "RUN mkdir -p /opt/extra && echo /opt/extra > /usr/lib/python3/dist-packages/extra.pth"
        + f" && echo {time.time_ns()} > /opt/extra/made\nWORKDIR /workdir\n",
    )

    async def scenario():
        first = await _started(task, tmp_path)
        try:
            facts = _facts(first)
            search = first._sandbox.search
            assert "link hazards" in facts and any(name.startswith("search ") for name in facts)
        finally:
            await first.stop(delete=True)
        CACHE.clear()  # as a new process finds it
        probes = _probes(monkeypatch)
        again = await _started(task, tmp_path)
        try:
            assert probes == [], "the kept facts were not used"
            assert again._sandbox.search == search
            assert (await again.exec("python3 -c 'print(6*7)'")).stdout.strip() == "42"
        finally:
            await again.stop(delete=True)

        async def extra_probed(times: int) -> None:
            other = await _started(extra, tmp_path)
            try:
                assert len(probes) == times
                assert "/opt/extra" in other._sandbox.search.python and "/opt/extra" not in search.python
            finally:
                await other.stop(delete=True)
            CACHE.clear()

        await extra_probed(1)  # built, and probed
        await extra_probed(1)  # its facts kept
        store = CACHE.builder(oci.ImageStore, None, host_trust=True)
        await store.get(extra / "environment", "facts-extra", force=True)  # `images build --force`
        CACHE.clear()
        await extra_probed(2)  # rebuilt: probed again

    run(scenario())


def test_facts_made_by_other_code_or_another_build_are_not_trusted(tmp_path: Path) -> None:
    facts = ImageFacts(tmp_path, "stamp-1")
    assert facts.get("link hazards") is None
    facts.put("link hazards", {"/x": "into"})
    assert ImageFacts(tmp_path, "stamp-1").get("link hazards") == {"/x": "into"}
    assert ImageFacts(tmp_path, "stamp-2").get("link hazards") is None  # another build, or other code
    ImageFacts(tmp_path, "stamp-1").put("search /bin", {"search": {}, "guard": None})
    kept = ImageFacts(tmp_path, "stamp-1")
    assert kept.get("link hazards") == {"/x": "into"} and kept.get("search /bin") is not None  # merged
    (tmp_path / FACTS_FILE).write_text("{not json")
    assert ImageFacts(tmp_path, "stamp-1").get("link hazards") is None
    assert [p.name for p in tmp_path.iterdir()] == [FACTS_FILE]  # no partial file left
    assert CACHE.image_facts(tmp_path, "build-a").stamp != CACHE.image_facts(tmp_path, "build-b").stamp


def test_local_ca_names_are_kept_and_found_again_when_a_certificate_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cas = tmp_path / "cas"
    cas.mkdir()
    (cas / "one.crt").write_text("one")
    (cas / "two.crt").write_text("two")
    hashed: list[str] = []

    def fake_hash(path: str) -> str:
        hashed.append(Path(path).name)
        return f"{abs(hash(Path(path).read_text())) % 0xFFFFFFFF:08x}.0"

    monkeypatch.setattr(oci, "_EXTRA_CA_DIR", cas)
    monkeypatch.setattr(oci, "_subject_hash", fake_hash)
    monkeypatch.setattr(oci, "_CA_NAMES", {})
    known = tmp_path / "trust" / "ca-names.json"
    first = oci._extra_cas(known)
    assert sorted(hashed) == ["one.crt", "two.crt"] and len(first) == 2
    oci._CA_NAMES.clear()  # a new process: read from the file
    assert oci._extra_cas(known) == first and len(hashed) == 2
    (cas / "two.crt").write_text("two, replaced")
    os.utime(cas / "two.crt", ns=(1, 1))
    oci._CA_NAMES.clear()
    changed = oci._extra_cas(known)
    assert hashed[2:] == ["two.crt"] and changed[0] == first[0] and changed[1] != first[1]


def test_a_mounted_image_root_is_reused_and_a_stale_record_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later process finds the image's root still mounted where the record says: no ``buildah mount``.
    A record that points at what is not a mount, or outside the store, is not followed."""
    task = make_task(tmp_path / "tasks", "mounted")
    mounts: list[tuple[str, ...]] = []
    original = oci.Buildah.run

    async def recorded(self, *args, **kwargs):
        if args[:1] == ("mount",):
            mounts.append(args)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(oci.Buildah, "run", recorded)

    async def rootfs(clear: bool) -> tuple[Path, Path]:
        if clear:
            CACHE.clear()
        store = CACHE.builder(oci.ImageStore, None, host_trust=True)
        image = await store.get(task / "environment", "mounted")
        return image.rootfs, image.path

    async def scenario():
        root, folder = await rootfs(clear=False)
        before = len(mounts)
        assert await rootfs(clear=True) == (root, folder)
        assert len(mounts) == before, "buildah mount ran for a root still mounted"
        record = folder / "mountpoint.json"
        kept = json.loads(record.read_text())
        for path in (tmp_path, root / "usr"):  # outside the store; inside it, not a mount
            record.write_text(json.dumps({**kept, "path": str(path)}))
            assert (await rootfs(clear=True))[0] == root
        assert len(mounts) == before + 2
        assert json.loads(record.read_text()) == kept  # recorded again by the mount

    run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups (and so parked launchers) need root")
def test_a_batchs_starts_find_a_pool_of_parked_launchers_and_releasing_it_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a batch of N starts, N launchers are parked (between batches) in cgroups of their own; the
    next batch's boxes are those processes; ``release_idle()`` leaves no launcher and no cgroup."""
    monkeypatch.setattr(_box, "MAX_PARKED", 64)  # HARBOR_LOCAL_SANDBOX_MAX_PARKED=64 (the default parks one)
    from harbor_local_sandbox._cgroups import ROOT
    from harbor_local_sandbox.local import LocalEnvironment

    task = make_task(tmp_path / "tasks", "pool")
    n = 3

    async def batch() -> list[int]:
        envs = [open_env(task, tmp_path / "trials") for _ in range(n)]
        await asyncio.gather(*(env.start(force_build=False) for env in envs))
        try:
            for env in envs:
                assert (await env.exec("echo up")).stdout.strip() == "up"
            return [env._sandbox.running_box()._proc.pid for env in envs]
        finally:
            await asyncio.gather(*(env.stop(delete=True) for env in envs))

    async def pool_of(size: int) -> list[int]:
        for _ in range(500):
            if len(_box._POOL) >= size and not _box._PARKING:
                break
            await asyncio.sleep(0.01)
        return [parked.proc.pid for parked in _box._POOL]

    def parked_cgroups() -> list[Path]:
        return list(ROOT.glob(f"*/harbor-local-sandbox/{os.getpid()}-parked-*"))

    async def scenario():
        LocalEnvironment.release_idle()
        await batch()
        parked = await pool_of(n)
        assert len(parked) >= n, parked
        assert _box._PARKED is _box._POOL[0]
        for pid in parked:
            assert "harbor-local-sandbox" in Path(f"/proc/{pid}/cgroup").read_text()
        started = await batch()
        assert set(started) <= set(parked), (started, parked)  # each box's bubblewrap a parked launcher
        left = await pool_of(n)
        assert len(left) >= n
        LocalEnvironment.release_idle()
        assert _box._POOL == [] and _box._PARKED is None
        for _ in range(500):  # killed (zombies until this loop reaps them)
            if not any(_alive(pid) for pid in left):
                break
            await asyncio.sleep(0.01)
        assert not any(_alive(pid) for pid in left), left
        assert wait_until(lambda: parked_cgroups() == []), parked_cgroups()

    run(scenario())


async def _until(what, seconds: float = 30.0) -> bool:
    """Whether ``what()`` holds within ``seconds``, the loop running meanwhile (the pool fills on it)."""
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return bool(what())


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups (and so parked launchers) need root")
def test_no_launcher_is_parked_while_a_verifier_grades(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is filled between batches, not while a verifier's view is open (grading keeps the CPUs):
    with a view open nothing is parked however long it stays; once it is closed the pool fills — also
    when the start's own filling was released while it was under way (CI: a filling asked for while a
    released one was ending was dropped, and nothing was parked after the view)."""
    monkeypatch.setattr(_box, "MAX_PARKED", 64)
    from harbor_local_sandbox.local import LocalEnvironment

    task = make_task(tmp_path / "tasks", "grading")

    async def scenario():
        LocalEnvironment.release_idle()
        env = await _started(task, tmp_path)
        try:
            assert _box._PARKING, "a start parks a launcher for the next box once it is up"
            LocalEnvironment.release_idle()  # while that filling is under way: it parks nothing
            async with env.verifier_view() as view:
                _box._park_next()  # as a start would
                await asyncio.sleep(0.5)  # ten times the pool's quiet spell
                assert _box._POOL == [], "a launcher was parked while the verifier graded"
                assert (await view.exec("echo grading")).stdout.strip() == "grading"
            assert await _until(lambda: _box._POOL), "no launcher parked once the view closed"
        finally:
            await env.stop(delete=True)
            LocalEnvironment.release_idle()
            assert await _until(lambda: not _box._PARKING)

    run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups (and so parked launchers) need root")
def test_a_release_stops_a_filling_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``release_idle()`` (a shutdown's) while the pool is being filled: the filling stops, nothing is parked
    after it (a launcher made after a shutdown's release was left with its cgroups, seen in CI)."""
    monkeypatch.setattr(_box, "MAX_PARKED", 64)
    monkeypatch.setattr(_box, "_WANTED", 8)
    from harbor_local_sandbox._cgroups import ROOT
    from harbor_local_sandbox.local import LocalEnvironment

    async def scenario():
        LocalEnvironment.release_idle()
        _box._park_next()
        assert await _until(lambda: _box._POOL, 5.0), "the filling did not begin"
        LocalEnvironment.release_idle()
        await asyncio.sleep(0.5)  # ten times the pool's quiet spell
        assert _box._POOL == [] and not _box._PARKING, _box._POOL
        # A filling asked for right after a release (a start's), while the released one is still ending:
        # it follows that one (it was dropped, and nothing was parked until the next start).
        _box._park_next()
        LocalEnvironment.release_idle()  # before that filling's task first ran: it parks nothing
        assert _box._PARKING
        _box._park_next()
        assert await _until(lambda: _box._POOL, 10.0), "a filling asked for while a released one was ending was dropped"
        LocalEnvironment.release_idle()
        await _until(lambda: not _box._PARKING, 10.0)
        LocalEnvironment.release_idle()
        assert wait_until(lambda: not list(ROOT.glob(f"*/harbor-local-sandbox/{os.getpid()}-parked-*")))

    run(scenario())


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_process_that_ends_while_launchers_are_being_parked_leaves_nothing(tmp_path: Path) -> None:
    """A loop that ends (``asyncio.run`` returning) right after a batch, while the pool is being filled,
    ends at once, and the process leaves no launcher, cgroup or sandbox folder behind."""
    task = make_task(tmp_path / "tasks", "exit")
    state = tmp_path / "state"
    state.mkdir()
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from sandbox_testing import open_env

        async def main():
            envs = [open_env(Path({str(task)!r}), Path({str(tmp_path / "trials")!r})) for _ in range(3)]
            await asyncio.gather(*(env.start(force_build=False) for env in envs))
            await asyncio.gather(*(env.stop(delete=True) for env in envs))
            await asyncio.sleep(0.002)  # the pool's filling has begun

        asyncio.run(main())
        print(os.getpid())
        """
    )
    environ = {**os.environ, "HARBOR_LOCAL_SANDBOX_STATE_DIR": str(state), "HARBOR_TELEMETRY": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    pid = done.stdout.split()[-1]
    if os.geteuid() == 0:
        from harbor_local_sandbox._cgroups import ROOT

        assert wait_until(lambda: list(ROOT.glob(f"*/harbor-local-sandbox/{pid}-*")) == [])
    assert [p.name for p in state.iterdir() if p.name != "workers"] == []


def test_stops_of_one_box_from_several_callers_end_on_a_loop_with_one_executor_thread(tmp_path: Path) -> None:
    """A box stopped by several callers at once (an episode's own stop beside a shutdown's), with other
    boxes stopping too, on a loop whose executor has a single thread: every stop ends once its box is
    down. A stop that finds the teardown under way must not hold a thread that teardown needs (it would
    wait for it the whole ``TEARDOWN_WAIT``: a shutdown's stops would then run past their deadline)."""
    from concurrent.futures import ThreadPoolExecutor

    task = make_task(tmp_path / "tasks", "stops")

    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        envs = [open_env(task, tmp_path / "trials") for _ in range(2)]
        await asyncio.gather(*(env.start(force_build=False) for env in envs))
        boxes = [env._sandbox.running_box() for env in envs]
        pids = [box._proc.pid for box in boxes]
        stops = [box.kill() for box in boxes for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(*stops), timeout=_box.TEARDOWN_WAIT / 2)
        assert all(box.closed for box in boxes)
        assert not any(_alive(pid) for pid in pids)
        await asyncio.gather(*(env.stop(delete=True) for env in envs))

    run(scenario())
