"""Fingerprints of an image-rooted sandbox's files, read from the host: nothing runs in the sandbox.

A trainer's seal (used where the verifier is not isolated:
``verifier_isolation=False``) compares them before and after the agent's turn. The image never
changes, and everything the sandbox changed is in its overlay's upper folder (``redirect_dir`` and
``metacopy`` off: new and changed entries, whiteouts, opaque folders). So the image is listed once
per process and each fingerprint walks only what the sandbox wrote, not thousands of unchanged
entries (``/usr/lib/python3.*``). Links are never followed.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
from collections.abc import Sequence
from pathlib import Path

from harbor_local_sandbox._cache import CACHE
from harbor_local_sandbox._mounts import is_kernel_path
from harbor_local_sandbox._userns import overlay_xattr


def fingerprints(image_root: Path, box_dir: Path, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
    """Fingerprint the sandbox paths matching ``patterns`` (``(path, depth)``; see
    ``LocalEnvironment.file_fingerprints``) of the sandbox whose tree is ``box_dir`` over ``image_root``."""
    found: dict[str, str] = {}
    for pattern, depth in patterns:
        for path in _glob(box_dir / "rootfs", posixpath.normpath(pattern)):
            _walk(image_root, box_dir / "upper", path, depth, found)
    return found


def _glob(rootfs: Path, pattern: str) -> list[str]:
    """The sandbox paths matching ``pattern`` (wildcards per component, listed in the merged tree)."""
    current = ["/"]
    for part in pattern.strip("/").split("/"):
        if not any(ch in part for ch in "*?["):
            current = [posixpath.join(base, part) for base in current]
            continue
        expanded = []
        for base in current:
            host = rootfs / base.lstrip("/")
            if is_kernel_path(base) or host.is_symlink() or not host.is_dir():
                continue
            with os.scandir(host) as entries:
                expanded += [posixpath.join(base, e.name) for e in entries if fnmatch.fnmatchcase(e.name, part)]
        current = sorted(expanded)
    return current


def _walk(lower: Path, upper: Path, path: str, depth: int | None, found: dict[str, str]) -> None:
    """Fingerprint ``path`` and ``depth`` levels below it: the image's entries under the sandbox's own changes."""
    if is_kernel_path(path):
        return
    parts = [part for part in path.strip("/").split("/") if part]
    image_visible = True
    for depth_of_ancestor in range(1, len(parts)):  # what the sandbox did to the path's ancestors
        kind = layer_entry(upper / "/".join(parts[:depth_of_ancestor]))
        if kind is None:
            break  # nothing of the sandbox's own at or below it
        if kind in ("whiteout", "other"):
            return  # deleted, or no longer a folder: the path is gone
        if kind == "opaque":
            image_visible = False  # a folder the sandbox replaced whole hides the image's below it
    entries: dict[str, str] = {}
    if image_visible:
        entries.update(CACHE.listing(("image", str(lower), path, depth), lambda: list_image(lower, path, depth)))
    _lay_upper(upper, path, depth, entries)
    found.update(entries)


def list_image(lower: Path, path: str, depth: int | None) -> dict[str, str]:
    """Fingerprints of ``path`` in an image root (nothing when it is under a link of the image)."""
    listed: dict[str, str] = {}
    parts = [part for part in path.strip("/").split("/") if part]
    if all(layer_entry(lower / "/".join(parts[:i])) == "dir" for i in range(1, len(parts))):
        _walk_tree(lower, path, depth, listed)
    return listed


def signature(info: os.stat_result) -> str:
    """What changes when an entry's content, inode, mode or type does (folders: type and mode only)."""
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        return f"d|{mode:o}"
    kind = "f" if stat.S_ISREG(info.st_mode) else "l" if stat.S_ISLNK(info.st_mode) else "o"
    return f"{kind}|{mode:o}|{info.st_size}|{info.st_ino}|{info.st_ctime_ns}"


def _walk_tree(root: Path, path: str, depth: int | None, found: dict[str, str]) -> None:
    """Fingerprint ``path`` (a sandbox path) of the tree at ``root``, ``depth`` levels down, never following links."""
    try:
        info = os.lstat(root / path.lstrip("/"))
    except OSError:
        return
    found[path] = signature(info)
    if not stat.S_ISDIR(info.st_mode) or depth == 0:
        return
    try:
        names = os.listdir(root / path.lstrip("/"))
    except OSError:
        return
    for name in names:
        _walk_tree(root, posixpath.join(path, name), None if depth is None else depth - 1, found)


def layer_entry(host: Path) -> str | None:
    """What an overlay layer holds at ``host``: ``None`` (nothing), ``"dir"``, ``"opaque"`` (a folder
    hiding the layers below), ``"whiteout"`` (a deletion) or ``"other"`` (a file or a link)."""
    try:
        info = os.lstat(host)
    except OSError:
        return None
    if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
        return "whiteout"
    if not stat.S_ISDIR(info.st_mode):
        return "other"
    try:
        opaque = os.getxattr(host, overlay_xattr("opaque"), follow_symlinks=False) == b"y"
    except OSError:
        opaque = False
    return "opaque" if opaque else "dir"


def _lay_upper(upper: Path, path: str, depth: int | None, entries: dict[str, str]) -> None:
    """Apply what the sandbox's own layer holds at ``path`` to the image's ``entries``."""
    host = upper / path.lstrip("/")
    kind = layer_entry(host)
    if kind is None:
        return
    if kind != "dir":  # deleted, replaced by a file or a link, or a folder replaced whole
        entries.pop(path, None)
        prefix = path.rstrip("/") + "/"
        for key in [key for key in entries if key.startswith(prefix)]:
            del entries[key]
        if kind == "whiteout":
            return
    entries[path] = signature(os.lstat(host))
    if kind == "other" or depth == 0:
        return
    try:
        names = os.listdir(host)
    except OSError:
        return
    for name in names:
        _lay_upper(upper, posixpath.join(path, name), None if depth is None else depth - 1, entries)
