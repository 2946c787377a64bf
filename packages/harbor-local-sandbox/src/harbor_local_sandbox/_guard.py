"""The verifier's Python imports what the image ships from where the image ships it.

The verifier's view shows the agent's working directory (and ``/tmp``) live, so no snapshot can hold
back a module the agent writes there after grading begins — and ``python -m pytest`` puts its
working directory first on the import path, where a ``json.py`` (or a ``nt.py``, which CPython's
``ntpath`` imports if it exists) would run inside the verifier. This module writes a start-up hook
into the view's copy of the image's site folder (a ``.pth`` line running our code — compiled once
per image by the image's own interpreter, else our file by its path; the agent's sandbox never has
it): in every Python process of the verifier's that runs the image's interpreter, an import finder
placed before the path finder looks each top-level module up in the image's own import folders first
(the frozen part of the view, the agent's judged additions included), and refuses a *guarded* name —
the standard library's, the names the image's code imports, the test runner's — that is not there,
wherever else it might be. Distribution metadata (``pytest11`` plug-ins, entry points) is read from
those folders only. Other names — the agent's own modules, which tests may import — are found as
before.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

__all__ = ["GUARD_MODULE", "GUARD_SOURCE", "COMPILE_GUARD", "guard_files", "site_folder"]

#: The hook's module name (also its file's stem); a ``.pth`` of that stem imports it.
GUARD_MODULE = "_trl_harbor_verifier_guard"

# Comments, not docstrings, and no import. Its data (TRUSTED, GUARDED) come from the ``.pth`` line
# that runs it, so the code is the same for every image: compiled once per image by the image's own
# interpreter (:data:`COMPILE_GUARD`), the line runs that code object — compiling this source at
# every Python start of the verifier's cost it 1.3 ms (measured in a view: 9.5 ms a start without
# the guard, 10.8 ms compiling it, 9.2-9.8 ms running its compiled code).
GUARD_SOURCE = """# trl-harbor's import guard in the verifier's view of a sandbox (not a file of the task's image):
# modules the image ships, imports, or the test runner needs are imported from the image's own
# folders only; distribution metadata is read from those folders only. TRUSTED (the image's import
# folders) and GUARDED (the names taken from them only) are given by the .pth line that runs it.
import sys


def _install():
    # The path finder already loaded (importing importlib.machinery costs a start ~0.7 ms).
    for position, PathFinder in enumerate(sys.meta_path):
        if getattr(PathFinder, "__name__", "") == "PathFinder":
            break
    else:  # no path finder: nothing to guard
        return

    class VerifierImportGuard(object):
        # Top-level imports: the image's folders first; a guarded name nowhere else.

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if path is not None or "." in name:
                return None
            spec = PathFinder.find_spec(name, TRUSTED)
            if spec is not None or name not in GUARDED:
                return spec
            raise ModuleNotFoundError("No module named %r" % name, name=name)

        @classmethod
        def invalidate_caches(cls):
            pass

    sys.meta_path.insert(position, VerifierImportGuard)

    original = getattr(PathFinder, "find_distributions", None)
    if original is None:
        return

    def find_distributions(context=None, **kwargs):
        from importlib.metadata import DistributionFinder

        if context is None:
            context = DistributionFinder.Context(**kwargs)
        trusted = [entry for entry in context.path if entry in TRUSTED]
        return original(DistributionFinder.Context(name=context.name, path=trusted))

    PathFinder.find_distributions = staticmethod(find_distributions)


try:
    _install()
except Exception:  # never the cause of a verifier's failure
    pass
"""

#: Python 3 code (run by the image's interpreter in its first sandbox, before anything of an agent's
#: runs there) printing ``#guard MAGIC CODE``: its bytecode's magic number and the guard's code
#: object, marshalled, both in hexadecimal (nothing when it cannot: the source is compiled then).
COMPILE_GUARD = (
    "import marshal, sys\n"
    "magic = getattr(sys.modules.get('_frozen_importlib_external'), 'MAGIC_NUMBER', None)\n"
    "if magic:\n"
    f"    code = compile(bytes.fromhex('{GUARD_SOURCE.encode().hex()}'), '<{GUARD_MODULE}>', 'exec')\n"
    "    print('#guard', magic.hex(), marshal.dumps(code).hex())\n"
)


def site_folder(python_path: Iterable[str]) -> str | None:
    """The image's first site folder (where ``site`` reads ``.pth`` files) on its import path, if any."""
    for folder in python_path:
        name = posixpath.basename(folder.rstrip("/"))
        if name in ("site-packages", "dist-packages"):
            return folder
    return None


def guard_files(
    python_path: Iterable[str], guarded: Iterable[str], compiled: tuple[str, str] | None = None
) -> dict[str, str]:
    """The files of the hook, by sandbox path (empty when the image has no Python site folder).

    Args:
        python_path: The image's Python import path (probed), in order.
        guarded: The names to take only from there.
        compiled: The guard's code as the image's interpreter compiled it (:data:`COMPILE_GUARD`):
            its magic number and marshalled code, in hexadecimal. An interpreter whose magic number
            differs (another Python of the image's) compiles the source instead, as all do without it.
    """
    trusted = [folder for folder in python_path if folder.startswith("/")]
    site = site_folder(trusted)
    if site is None:
        return {}
    module = posixpath.join(site, f"{GUARD_MODULE}.py")
    # The names as one string constant, not a set literal of hundreds: the line is compiled at
    # every interpreter start.
    names = " ".join(sorted(set(guarded)))
    data = f"{{'__name__': {GUARD_MODULE!r}, 'TRUSTED': {trusted!r}, 'GUARDED': frozenset({names!r}.split())}}"
    # Run by its path, not imported by name: a folder on PYTHONPATH (the agent's, perhaps) comes
    # before the site folder while ``.pth`` files are read.
    source = f"compile(open({module!r}).read(), {module!r}, 'exec')"
    if compiled is None:
        loader = f"import sys; exec({source}, {data})\n"
    else:
        magic, code = compiled
        loader = (
            "import sys, marshal; exec(marshal.loads(bytes.fromhex(%r)) if getattr(sys.modules.get("
            "'_frozen_importlib_external'), 'MAGIC_NUMBER', None) == bytes.fromhex(%r) else %s, %s)\n"
            % (code, magic, source, data)
        )
    return {module: GUARD_SOURCE, posixpath.join(site, f"00-{GUARD_MODULE}.pth"): loader}
