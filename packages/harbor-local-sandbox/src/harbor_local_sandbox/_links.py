"""Where an agent's symbolic link can lead in the verifier's view: judged by resolution, not by its words.

The verifier follows the agent's links live, in a world where ``/tests``, ``/logs/verifier``, its own
``/proc`` and its temporary files exist (:data:`~.code_places.LINK_FORBIDDEN`, the *forbidden*
places). A link leads there if the verifier, resolving a path through it, can step into a forbidden
place — directly (``/tests/x``), or by first arriving at a folder *above* one (``/``, ``/logs``,
``/dev``: the *ancestors*) and then taking the forbidden place's name, which the rest of its own
target, or of the path being resolved, or of a second link, may supply.

The agent renames its links freely (that is not mediated) and moves the folders that hold them, and
a link's target may pass through other links, the agent's or the image's. So a link is judged for
every place it may be: :class:`LinkPolicy` walks its target one component at a time, knowing where
it stands only while that is certain (an absolute target starts at ``/``; a relative one at an
unknown folder that is not an ancestor: live folders never are, and the view freezes the entries
of the ancestors themselves), and otherwise assuming the worst:

* a ``..`` from an unknown folder may reach any ancestor (``/`` included);
* a name taken where the walk may stand at an ancestor may be a forbidden place (refused) or
  another ancestor;
* a name that is one of the image's own links that lead to a forbidden place or an ancestor
  (its *hazards*, found once per image by :func:`image_hazards`) may be that link;
* a link that may *end* at an ancestor is refused: a second link, or the verifier's path, could take
  the next step.

Every other link of the agent's is judged the same way, so following one never leaves the walk at
an ancestor or in a forbidden place: the judgement composes over chains. The sandbox's keel judges
every link the agent makes with the same walk (``_supervisor.c``: ``judge_link``, given the same
data on its command line); the view judges the links it freezes, and those of ``/`` and the other
ancestors with their place known.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from harbor_local_sandbox.code_places import LINK_FORBIDDEN

__all__ = ["INTO", "TO_ANCESTOR", "LinkPolicy", "image_hazards", "keel_items"]

#: Why a link is refused: it can lead into a forbidden place, or end at a folder above one.
INTO = "a link that can lead into the verifier's own places"
TO_ANCESTOR = "a link that can lead to a folder above the verifier's own places"
#: Longest target judged (the kernel's ``PATH_MAX``); a longer one is refused.
MAX_TARGET = 4096
#: Hazards of each kind of item the keel is given at most (its command line is bounded).
MAX_KEEL_HAZARDS = 10_000
#: Image links scanned for hazards at most, entries looked at, and how deep (an image is the task
#: author's: the bounds keep a pathological one from stalling a sandbox's start).
_MAX_IMAGE_LINKS = 200_000
_MAX_IMAGE_ENTRIES = 2_000_000
_MAX_DEPTH = 64

_SOMEWHERE = object()  # at an unknown folder that may be an ancestor (or ``/``)
_ELSEWHERE = object()  # at an unknown folder that is certainly not an ancestor nor forbidden


@dataclass(frozen=True)
class LinkPolicy:
    """The forbidden places, their ancestors and an image's hazards; :meth:`judge` walks a target.

    Attributes:
        forbidden: Absolute paths no link may lead into.
        hazards: The image's own links that can lead into a forbidden place (``"into"``) or to an
            ancestor (``"ancestor"``), by path.
        ancestors: The folders above a forbidden place (``/`` included).
        hazards_elsewhere: The hazards in folders that are not ancestors, by name.
    """

    forbidden: frozenset[str] = frozenset(LINK_FORBIDDEN)
    hazards: Mapping[str, str] = field(default_factory=dict)
    # Derived once from the two above (what the walk looks names up in).
    ancestors: frozenset[str] = field(init=False, repr=False, compare=False)
    _forbidden_names: frozenset[str] = field(init=False, repr=False, compare=False)
    _ancestor_names: frozenset[str] = field(init=False, repr=False, compare=False)
    _hazards_below_ancestor: dict[str, str] = field(init=False, repr=False, compare=False)
    hazards_elsewhere: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ancestors = {"/"}
        for place in self.forbidden:
            parent = posixpath.dirname(place)
            while parent not in ancestors:
                ancestors.add(parent)
                parent = posixpath.dirname(parent)
        object.__setattr__(self, "ancestors", frozenset(ancestors))
        object.__setattr__(self, "_forbidden_names", frozenset(posixpath.basename(p) for p in self.forbidden))
        object.__setattr__(self, "_ancestor_names", frozenset(posixpath.basename(a) for a in ancestors if a != "/"))
        below_ancestor: dict[str, str] = {}
        elsewhere: dict[str, str] = {}
        for path, kind in self.hazards.items():
            table = below_ancestor if posixpath.dirname(path) in ancestors else elsewhere
            name = posixpath.basename(path)
            table[name] = "into" if "into" in (kind, table.get(name)) else kind
        object.__setattr__(self, "_hazards_below_ancestor", below_ancestor)
        object.__setattr__(self, "hazards_elsewhere", elsewhere)

    def judge(self, target: str, base: str | None = None) -> str | None:
        """Why a link to ``target`` is refused (``None``: it is not).

        Args:
            target: The link's target, as the agent wrote it.
            base: The folder the link is in, when it is an ancestor and the link cannot move away
                (the view's frozen entries of ``/``, ``/logs``, ...); otherwise ``None``: any folder
                that is not an ancestor.
        """
        if not target or len(target) > MAX_TARGET or "\0" in target:
            return INTO
        at: object = "/" if target.startswith("/") else (base if base in self.ancestors else _ELSEWHERE)
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                at = posixpath.dirname(at) if isinstance(at, str) else _SOMEWHERE
                continue
            at = self._step(at, part)
            if at is None:
                return INTO
        return TO_ANCESTOR if at is not _ELSEWHERE else None

    def _step(self, at: object, name: str) -> object | None:
        """Where taking ``name`` from ``at`` may lead: a known ancestor, somewhere, elsewhere, or
        ``None`` (a forbidden place)."""
        if isinstance(at, str):
            path = posixpath.join(at, name)
            if path in self.forbidden:
                return None
            if path in self.ancestors:
                return path
            kind = self.hazards.get(path)
        elif at is _SOMEWHERE:
            if name in self._forbidden_names:
                return None
            if name in self._ancestor_names:
                return _SOMEWHERE
            kind = self._hazards_below_ancestor.get(name) or self.hazards_elsewhere.get(name)
        else:
            kind = self.hazards_elsewhere.get(name)
        if kind == "into":
            return None
        return _SOMEWHERE if kind == "ancestor" else _ELSEWHERE

    def with_hazards(self, hazards: Mapping[str, str]) -> LinkPolicy:
        """The same places with an image's hazards."""
        return LinkPolicy(self.forbidden, dict(hazards))


def keel_items(policy: LinkPolicy) -> list[str]:
    """The keel's command-line items for ``policy``: ``link-forbidden:PATH``, ``link-hazard:KIND:PATH`` for an
    image link in a folder above a forbidden place (the walk may know it stands there), and
    ``link-hazard-name:KIND:NAME`` for the others (the walk only ever matches them by name), at most
    :data:`MAX_KEEL_HAZARDS` of each.

    Raises:
        ValueError: For an image with more such links than that (its links cannot be judged).
    """
    items = [f"link-forbidden:{place}" for place in sorted(policy.forbidden)]
    below = {path: kind for path, kind in policy.hazards.items() if posixpath.dirname(path) in policy.ancestors}
    elsewhere = policy.hazards_elsewhere
    if len(below) > MAX_KEEL_HAZARDS or len(elsewhere) > MAX_KEEL_HAZARDS:
        raise ValueError(
            f"the image has {len(policy.hazards)} links that lead into the verifier's places or to a folder above "
            f"them (more than {MAX_KEEL_HAZARDS} names): the sandbox cannot judge the agent's links on it"
        )
    items += [f"link-hazard:{kind}:{path}" for path, kind in sorted(below.items())]
    items += [f"link-hazard-name:{kind}:{name}" for name, kind in sorted(elsewhere.items())]
    return items


def image_hazards(image_root: str | os.PathLike[str], policy: LinkPolicy | None = None) -> dict[str, str]:
    """The image's own links that can lead into a forbidden place or to an ancestor, by path.

    Judged as the agent's are (wherever they may be moved), until nothing changes: a link of the
    image's may lead through another.

    Args:
        image_root: The image's root folder on the host.
        policy: The forbidden places (the table's by default).
    """
    policy = policy or LinkPolicy()
    links = _image_links(os.fspath(image_root))
    hazards: dict[str, str] = {}
    while True:
        current = policy.with_hazards(hazards)
        found = {}
        for path, target in links:
            why = current.judge(target, posixpath.dirname(path))
            if why is not None:
                found[path] = "into" if why == INTO else "ancestor"
        if found == hazards:
            return hazards
        hazards = found


def _image_links(root: str) -> list[tuple[str, str]]:
    """Every symbolic link of the image's tree and its target (links are never followed)."""
    found: list[tuple[str, str]] = []
    pending = [("", 0)]
    seen = 0
    while pending and len(found) < _MAX_IMAGE_LINKS and seen < _MAX_IMAGE_ENTRIES:
        relative, depth = pending.pop()
        try:
            entries = list(os.scandir(root + relative if relative else root))
        except OSError:
            continue
        seen += len(entries)
        for entry in entries:
            path = f"{relative}/{entry.name}"
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                try:
                    found.append((path, os.readlink(entry.path)))
                except OSError:
                    continue
            elif stat.S_ISDIR(mode) and depth < _MAX_DEPTH:
                pending.append((path, depth + 1))
    return found
