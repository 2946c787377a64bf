"""The link policy (``_links.py``, and the keel's copy of its walk in ``_supervisor.c``), on generated input.

* The keel and the view judge alike: thousands of generated targets get the same verdict from
  ``LinkPolicy.judge`` and from the supervisor binary's ``judge-link`` mode (the code the keel runs).
* What is judged safe is safe under the kernel's own resolution: random trees of links the policy
  accepts — moved after they were made, chained through each other and through the image's links —
  are resolved with ``openat2(RESOLVE_IN_ROOT)`` (absolute targets from the tree's root, as in the
  verifier's view), and no path through them reaches a forbidden place, whatever names follow.
"""

from __future__ import annotations

import os
import posixpath
import random
import subprocess
from pathlib import Path

import pytest
from harbor_local_sandbox._binaries import static_binary
from harbor_local_sandbox._links import INTO, TO_ANCESTOR, LinkPolicy, image_hazards, keel_items
from harbor_local_sandbox._viewfs import open_beneath
from harbor_local_sandbox.code_places import LINK_FORBIDDEN

RESOLVE_IN_ROOT = 0x10
_VERDICTS = {None: "0", INTO: "1", TO_ANCESTOR: "2"}
#: Ordinary folders of the generated trees (not above a forbidden place).
_FOLDERS = ("/workdir", "/workdir/a", "/workdir/a/b", "/usr", "/usr/lib", "/etc", "/var", "/var/log", "/srv")
#: The image's own links in the generated trees: harmless ones, and hazards the policy must learn.
_IMAGE_LINKS = {
    "/lib": "usr/lib",
    "/etc/mtab": "../proc/self/mounts",
    "/srv/scratch": "/tmp",
    "/var/up": "..",
    "/usr/lib/current": "../lib",
}


def _words(rng: random.Random, policy: LinkPolicy, extra: tuple[str, ...] = ()) -> list[str]:
    vocabulary = (
        [".", "..", "", "x", "lib", "usr", "workdir", "a", "b", "mtab", "scratch", "up", "current", "data", *extra]
        + [posixpath.basename(p) for p in policy.forbidden]
        + [posixpath.basename(a) for a in policy.ancestors if a != "/"]
    )
    return [rng.choice(vocabulary) for _ in range(rng.randint(1, 6))]


def _target(rng: random.Random, policy: LinkPolicy, extra: tuple[str, ...] = ()) -> str:
    return ("/" if rng.random() < 0.4 else "") + "/".join(_words(rng, policy, extra))


def test_the_keel_and_the_view_judge_alike() -> None:
    """The keel's walk (C) and the view's (Python) give every generated target the same verdict."""
    policy = LinkPolicy(
        hazards={
            "/etc/mtab": "into", "/srv/scratch": "into", "/var/up": "ancestor",  # passed to the keel by name
            "/data": "into", "/logs/up": "ancestor", "/dev/scratch": "into",  # by path (above forbidden places)
        }
    )  # fmt: skip
    rng = random.Random(43)
    targets = sorted({_target(rng, policy) for _ in range(6000)} | {"/", ".", "..", "/tests", "a/../../tests"})
    targets = [t for t in targets if "\n" not in t and t]
    result = subprocess.run(
        [static_binary("supervisor"), "judge-link", *keel_items(policy)],
        input="".join(f"{t}\n" for t in targets),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    keel = result.stdout.split()
    assert len(keel) == len(targets)
    disagree = [
        (t, k, _VERDICTS[policy.judge(t)])
        for t, k in zip(targets, keel, strict=True)
        if k != _VERDICTS[policy.judge(t)]
    ]
    assert not disagree, disagree[:20]
    # the generator reaches every verdict (a test that only ever saw "0" would prove nothing)
    assert {"0", "1", "2"} <= set(keel)


def test_the_image_links_that_lead_there_are_found(tmp_path: Path) -> None:
    """``image_hazards`` finds the image's links into a forbidden place or to a folder above one, through chains."""
    root = _tree(tmp_path)
    hazards = image_hazards(root)
    assert hazards == {"/etc/mtab": "into", "/srv/scratch": "into", "/var/up": "ancestor"}, hazards


def _tree(tmp_path: Path) -> Path:
    """A root with every forbidden place (a marker file in each), ordinary folders and the image's links."""
    root = tmp_path / "root"
    for place in LINK_FORBIDDEN:
        (root / place.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / place.lstrip("/") / "secret").write_text("secret\n")
    for folder in _FOLDERS:
        (root / folder.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / "proc/self").mkdir()
    (root / "proc/self/mounts").write_text("mounts\n")
    for path, target in _IMAGE_LINKS.items():
        os.symlink(target, root / path.lstrip("/"))
    return root


def _forbidden_inodes(root: Path) -> set[tuple[int, int]]:
    """The (device, inode) of every forbidden place and of everything below it."""
    found = set()
    for place in LINK_FORBIDDEN:
        for dirpath, dirnames, filenames in os.walk(root / place.lstrip("/")):
            for name in [".", *dirnames, *filenames]:
                info = os.lstat(os.path.join(dirpath, name))
                found.add((info.st_dev, info.st_ino))
    return found


@pytest.mark.parametrize("seed", range(6))
def test_no_judged_link_leads_into_a_forbidden_place(tmp_path: Path, seed: int) -> None:
    """Links the policy accepts, made anywhere and then moved, chained freely: no path through them reaches a
    forbidden place under the kernel's resolution (absolute targets from the tree's root, as in the view)."""
    rng = random.Random(seed)
    root = _tree(tmp_path)
    policy = LinkPolicy(hazards=image_hazards(root))
    made: list[str] = []
    refused = accepted = 0
    for index in range(400):
        name = f"l{index}"
        target = _target(rng, policy, tuple(posixpath.basename(m) for m in made[-20:]))
        folder = rng.choice(_FOLDERS)
        if policy.judge(target) is not None:  # what the keel refuses is never made
            refused += 1
            continue
        accepted += 1
        os.symlink(target, root / folder.lstrip("/") / name)
        made.append(f"{folder}/{name}")
        if made and rng.random() < 0.3:  # a rename is not mediated: any link may move to any ordinary folder
            moved = rng.choice(made)
            new = f"{rng.choice(_FOLDERS)}/m{index}"
            os.rename(root / moved.lstrip("/"), root / new.lstrip("/"))
            made[made.index(moved)] = new
    assert refused and accepted > 100, (refused, accepted)
    forbidden = _forbidden_inodes(root)
    above = {(info.st_dev, info.st_ino) for info in (os.stat(root / a.lstrip("/")) for a in policy.ancestors)}
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    reached = []
    try:
        for link in made:  # no link leads to a folder above a forbidden place, where one more name would enter it
            try:
                fd = open_beneath(root_fd, link, os.O_PATH, resolve=RESOLVE_IN_ROOT)
            except OSError:
                continue
            info = os.fstat(fd)
            os.close(fd)
            if (info.st_dev, info.st_ino) in forbidden | above:
                reached.append(link)
        for _ in range(20000):
            link = rng.choice(made)
            # the verifier's own names after the link (anything but a climb of its own), often a forbidden
            # place's or an ancestor's name first
            rest = [w for w in _words(rng, policy, tuple(posixpath.basename(m) for m in made)) if w != ".."]
            if rng.random() < 0.5:
                rest.insert(0, posixpath.basename(rng.choice(sorted({*policy.forbidden, *policy.ancestors}))))
            path = "/".join([link, *rest])
            try:
                fd = open_beneath(root_fd, path, os.O_PATH, resolve=RESOLVE_IN_ROOT)
            except OSError:
                continue
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if (info.st_dev, info.st_ino) in forbidden:
                reached.append(path)
    finally:
        os.close(root_fd)
    assert not reached, reached[:10]


def test_the_keels_items_are_bounded() -> None:
    """The keel is told the image's links in folders above the forbidden places by path and the others by
    name (that is all its walk matches), each at most ``MAX_KEEL_HAZARDS``; an image with more cannot be
    judged, and says so."""
    from harbor_local_sandbox._links import MAX_KEEL_HAZARDS

    items = keel_items(LinkPolicy(hazards={"/data": "into", "/a/b/mtab": "into", "/c/mtab": "ancestor"}))
    assert "link-hazard:into:/data" in items and "link-hazard-name:into:mtab" in items
    assert not any("/a/b" in item for item in items)
    many = {f"/srv/x{index}/l{index}": "into" for index in range(MAX_KEEL_HAZARDS + 1)}
    with pytest.raises(ValueError, match="cannot judge"):
        keel_items(LinkPolicy(hazards=many))
