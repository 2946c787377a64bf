"""The verifier's Python never imports a guarded name the agent placed: Python's own order, decided by who wrote it.

The verifier's view shows the agent's own folders live (the working directory, ``/var``, an output
folder...) and ``/tmp`` as the agent's under a layer of the verifier's, so no snapshot can hold back a
module the agent writes there — and ``python -m pytest`` puts its working directory first on the
import path, where a ``json.py`` (or an ``nt.py``, which CPython's ``ntpath`` imports if it exists)
would run inside the verifier. This module makes an import finder that every Python process of the
verifier's runs before anything is imported from a folder:

* **Where it is installed.** The view's copy of the image's standard library ``encodings`` package
  (imported by every CPython at start-up, before ``site``, ``.pth`` files and ``sitecustomize``; by
  virtual environments of that interpreter too, whoever makes them, and with ``-S``, ``-I`` or ``-E``)
  ends with :data:`ENCODINGS_SUFFIX`, which runs the guard's code — compiled once per image by the
  image's own interpreter at the probe (:data:`COMPILE_GUARD`), as is the whole module (an unchecked
  ``.pyc`` beside it: no start compiles it), else this source from the view's plumbing. The agent's
  sandbox never has it.
* **What it decides.** Imports keep Python's own order (the tests' own folders first, as pytest, a
  script's folder or ``-m`` put them). Only a *guarded* top-level name — the standard library's, the
  names the image's code imports, the test runner's, the start-up hooks ``sitecustomize`` and
  ``usercustomize`` — is looked at: if the first module of that name is one *the agent placed*, the
  search goes on past it (the image's own module, if any, is found instead) and never imports it.
  In the agent's layer of ``/tmp`` no module is imported, whatever its name: a folder the tests make
  at a fixed path there may already hold the agent's ``conftest.py``, or a module their script
  imports if present (a venv the agent made there, which the tests run, is the agent's work: used as
  it is). Every other module — the agent's own in its folders, which tests may import — is found as
  Python finds it. The guard stands in for the path finder's search itself (``PathFinder.find_spec``),
  so finders that call it — pytest's assertion rewriter, which loads ``conftest.py`` — get it too.
* **Who placed it.** Decided by where the file is, which the kernel reports and the agent cannot
  forge: a file in one of the agent's live folders (a mount of the agent's own tree: its device),
  or in the agent's layer of ``/tmp`` (the layer's device), is the agent's; a file of the image, of
  the snapshot of the agent's judged changes, or one the verifier wrote (the view's own layers: its
  ``/tmp`` layer, ``/tests``, what it installs) is not. So a hook the tests write into a temporary
  folder and put on ``PYTHONPATH`` runs, and the same file planted by the agent does not. The
  site folders of the virtual environment the verifier runs (``sys.prefix``'s) are the environment
  the tests chose — a venv they made in the working directory, or the agent's own — and are used as
  they are. The view tells the guard its devices in a file of its plumbing (:func:`provenance`).
* **Distribution metadata** (``pytest11`` plug-ins, entry points) of a distribution the agent placed
  the same way is not found, and ``site`` does not read a ``.pth`` file the agent placed (an audit
  hook refuses its ``io.open_code``): a venv the verifier makes at a path of ``/tmp`` the agent
  filled first runs none of the agent's start-up code.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "COMPILE_GUARD",
    "ENCODINGS_SUFFIX",
    "GUARD_FILE",
    "GUARD_SOURCE",
    "PROVENANCE_FILE",
    "CompiledGuard",
    "guard_files",
    "provenance",
    "stdlib_folder",
]

#: Where the view keeps the guard's source, its code as the image's Python compiled it (the magic number
#: in hexadecimal appended), the names it guards, and the devices that tell who placed a file (its plumbing).
GUARD_FILE = "/.harbor-local-sandbox/guard.py"
GUARD_CODE_FILE = "/.harbor-local-sandbox/guard-"
GUARDED_FILE = "/.harbor-local-sandbox/guarded"
PROVENANCE_FILE = "/.harbor-local-sandbox/provenance"

# Comments, not docstrings; no import but sys and posix (the line runs while ``encodings`` is being
# imported: ``open`` and ``os`` may not be there yet). Its data (GUARDED, PROVENANCE) come from the
# line that runs it, so the code is the same for every image: compiled once per image by the image's
# own interpreter (:data:`COMPILE_GUARD`).
GUARD_SOURCE = """# harbor-local-sandbox's import guard in the verifier's view of a sandbox (not the image's):
# a guarded module name (GUARDED) is never imported from a file the agent placed, and no module from
# a file the agent placed in /tmp; imports keep Python's own order. Who placed a file is told by the
# devices in PROVENANCE (written by the view).
import sys


def _install():
    if getattr(sys, "_harbor_local_sandbox_guard", None) is not None:
        return
    for PathFinder in sys.meta_path:
        if getattr(PathFinder, "__name__", "") == "PathFinder":
            break
    else:  # no path finder: nothing to guard
        return
    import posix

    fd = posix.open(PROVENANCE, posix.O_RDONLY)
    try:
        fields = posix.read(fd, 4096).split()
    finally:
        posix.close(fd)
    agent_dev, tmp_dev = int(fields[0]), int(fields[1])
    tmp_own = frozenset(int(field) for field in fields[2:])
    stat = posix.stat

    def parent(path):
        cut = path.rstrip("/").rfind("/")
        return path[:cut] or "/"

    def chosen(path):
        # In the site folders of the virtual environment the verifier runs (sys.prefix is a venv's once
        # site has read its pyvenv.cfg): the tests chose it, the agent's or one they made.
        prefix = sys.prefix
        if prefix == sys.base_prefix or not path.startswith(prefix.rstrip("/") + "/"):
            return False
        return "/site-packages/" in path or "/dist-packages/" in path

    def made_by_agent(prefix):
        # Whether the venv at prefix (in /tmp) is one the agent made: its pyvenv.cfg is the agent's (a
        # venv the verifier makes at a path the agent filled first has the verifier's).
        try:
            return stat(prefix.rstrip("/") + "/pyvenv.cfg").st_dev not in tmp_own
        except OSError:
            return False

    def agents(path, folder=False):
        # Whether the file (or folder) at path is one the agent placed: in one of its live folders
        # (but a venv the tests run), or in its layer of /tmp (but a venv the agent made there that the
        # tests run: what the verifier made there is in its own layer).
        try:
            if not folder:
                try:
                    stat(path)
                except OSError:  # inside an archive (a zip on the path): judge the archive
                    while path != "/":
                        path = parent(path)
                        try:
                            folder = stat(path).st_mode & 0o170000 == 0o040000
                            break
                        except OSError:
                            pass
            where = stat(path if folder else parent(path)).st_dev
            if where == agent_dev:
                return not chosen(path)
            if where != tmp_dev:
                return False
            if folder:
                return True
            return stat(path).st_dev not in tmp_own and not (chosen(path) and made_by_agent(sys.prefix))
        except OSError:
            return True

    def planted_in_tmp(path):
        # Whether a module file is one the agent placed in its layer of /tmp (a fixed path the verifier
        # makes there may already hold the agent's files: a conftest.py, a module it imports if present).
        where = path
        while where != "/":  # its folder (of an archive's member: the archive's)
            where = parent(where)
            try:
                mode = stat(where).st_mode
            except OSError:
                continue
            if mode & 0o170000 == 0o040000:
                if stat(where).st_dev != tmp_dev:
                    return False
                return agents(path)
        return False

    def absolute(entry):
        if entry.startswith("/"):
            return entry.rstrip("/") or "/"
        here = posix.getcwd()
        return here if entry in ("", ".") else (here.rstrip("/") + "/" + entry).rstrip("/")

    def past(entries, found):
        # The entries after the one that held ``found`` (a module file, a package's, a folder).
        places = (parent(found), parent(parent(found)), found.rstrip("/"))
        for index, entry in enumerate(entries):
            if absolute(entry) in places:
                return entries[index + 1 :]
        return []

    search = PathFinder.find_spec  # the path finder's own search

    def guarded_find_spec(name, path=None, target=None):
        # What the path finder finds, in its order, passed over when the agent placed it: for a guarded
        # top-level name, anywhere; for any other module, in /tmp. In place of the path finder's own
        # (finders that call it, such as pytest's assertion rewriter, which loads conftest.py, get it too).
        guarded = path is None and name in GUARDED
        entries = list(sys.path if path is None else path)
        passed = False
        while entries:
            spec = search(name, entries, target)
            if spec is None:
                break
            if spec.origin and spec.has_location:
                found, folder = spec.origin, False
            else:
                locations = list(spec.submodule_search_locations or ())
                if not locations or not guarded:
                    return spec  # a namespace package: its modules are judged one by one
                found, folder = locations[0], True
            if not (agents(found, folder) if guarded else planted_in_tmp(found)):
                return spec
            passed = True
            entries = past(entries, found)
        if guarded or passed:
            raise ModuleNotFoundError("No module named %r" % name, name=name)
        return None

    PathFinder.find_spec = staticmethod(guarded_find_spec)
    sys._harbor_local_sandbox_guard = guarded_find_spec

    def veto(event, args):
        # site reads a folder's .pth files with io.open_code, an audited "open" that it skips on OSError:
        # one the agent placed (a venv the verifier makes at a path the agent filled first) is not read.
        if event == "open" and args and isinstance(args[0], str) and args[0].endswith(".pth") and agents(args[0]):
            raise PermissionError("a start-up file the agent placed is not read: %s" % args[0])

    sys.addaudithook(veto)

    original = getattr(PathFinder, "find_distributions", None)
    if original is None:
        return

    def find_distributions(context=None, **kwargs):
        from importlib.metadata import DistributionFinder

        if context is None:
            context = DistributionFinder.Context(**kwargs)
        for distribution in original(context):
            found = getattr(distribution, "_path", None)
            if found is None:
                yield distribution
                continue
            found = str(found)
            for name in ("METADATA", "PKG-INFO"):  # a file of it tells its layer; its folder cannot
                try:
                    stat(found + "/" + name)
                except OSError:
                    continue
                found = found + "/" + name
                break
            if not agents(found, found.endswith(".dist-info") or found.endswith(".egg-info")):
                yield distribution

    PathFinder.find_distributions = staticmethod(find_distributions)


try:
    _install()
except Exception:  # never the cause of a verifier's failure
    pass
"""

#: What the view's copy of ``encodings/__init__.py`` ends with: the same text for every image (its data
#: is in the view's plumbing), so that the image's interpreter compiles the whole module once, at the
#: probe, and each start loads that bytecode (:data:`COMPILE_GUARD`). Only ``sys``, ``posix``, ``marshal``
#: and builtins: ``open`` and ``os`` may not be there yet while ``encodings`` is imported.
ENCODINGS_SUFFIX = f"""

# harbor-local-sandbox's import guard (the verifier's view only: its _guard.py)
def _harbor_local_sandbox_guard():
    import marshal, posix, sys

    def read(path):
        fd = posix.open(path, posix.O_RDONLY)
        try:
            chunks = []
            while True:
                chunk = posix.read(fd, 1 << 16)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        finally:
            posix.close(fd)

    magic = getattr(sys.modules.get("_frozen_importlib_external"), "MAGIC_NUMBER", b"")
    try:
        code = marshal.loads(read({GUARD_CODE_FILE!r} + magic.hex()))
    except (OSError, ValueError, EOFError, TypeError):
        code = compile(read({GUARD_FILE!r}), {GUARD_FILE!r}, "exec")
    names = frozenset(read({GUARDED_FILE!r}).decode().split())
    exec(code, {{"__name__": "harbor_local_sandbox_guard", "GUARDED": names, "PROVENANCE": {PROVENANCE_FILE!r}}})


try:
    _harbor_local_sandbox_guard()
except Exception:
    pass
del _harbor_local_sandbox_guard
"""

#: Python 3 code (run by the image's interpreter in its first sandbox, before anything of an agent's
#: runs there) printing ``#guard MAGIC CODE`` — its bytecode's magic number and the guard's code
#: object, marshalled, both in hexadecimal — and ``#encodings PYC BYTECODE``: where that interpreter
#: keeps the bytecode of its ``encodings/__init__.py`` and, in hexadecimal, an unchecked hash-based
#: ``.pyc`` of that module with :data:`ENCODINGS_SUFFIX` (so the view's copy is not compiled at every
#: start). Nothing when it cannot: the source is compiled then.
COMPILE_GUARD = (
    "import marshal, sys\n"
    "magic = getattr(sys.modules.get('_frozen_importlib_external'), 'MAGIC_NUMBER', None)\n"
    "if magic:\n"
    f"    code = compile(bytes.fromhex('{GUARD_SOURCE.encode().hex()}'), '<harbor-local-sandbox guard>', 'exec')\n"
    "    print('#guard', magic.hex(), marshal.dumps(code).hex())\n"
    "    import encodings, importlib.util\n"
    "    from importlib._bootstrap_external import _code_to_hash_pyc\n"
    "    path = encodings.__file__ or ''\n"
    "    if path.endswith('__init__.py'):\n"
    f"        source = open(path, 'rb').read() + bytes.fromhex('{ENCODINGS_SUFFIX.encode().hex()}')\n"
    "        module = compile(source, path, 'exec', dont_inherit=True)\n"
    "        pyc = _code_to_hash_pyc(module, importlib.util.source_hash(source), False)\n"
    "        print('#encodings', importlib.util.cache_from_source(path), bytes(pyc).hex())\n"
)


@dataclass(frozen=True)
class CompiledGuard:
    """What the image's interpreter compiled at the probe (:data:`COMPILE_GUARD`).

    Attributes:
        magic: Its bytecode's magic number, in hexadecimal.
        code: The guard's code object, marshalled, in hexadecimal.
        pyc_path: Where it reads the bytecode of its ``encodings/__init__.py`` (``None``: not given).
        pyc: That bytecode for the view's copy of the module, in hexadecimal.
    """

    magic: str
    code: str
    pyc_path: str | None = None
    pyc: str = ""


def stdlib_folder(python_path: Iterable[str], has_encodings: Callable[[str], bool]) -> str | None:
    """The image's standard-library folder on its import path: the first that holds ``encodings/__init__.py``.

    Args:
        python_path: The image's Python import path (probed), in order.
        has_encodings: Whether a sandbox path holds ``encodings/__init__.py`` in the image.
    """
    for folder in python_path:
        if folder.startswith("/") and has_encodings(posixpath.join(folder, "encodings", "__init__.py")):
            return folder
    return None


def guard_files(
    stdlib: str | None,
    encodings: bytes,
    guarded: Iterable[str],
    compiled: CompiledGuard | None = None,
) -> dict[str, str | bytes]:
    """The view's files that install the guard (empty when the image has no standard library folder).

    Args:
        stdlib: The image's standard-library folder (:func:`stdlib_folder`).
        encodings: The image's ``encodings/__init__.py`` there (the view's copy ends with
            :data:`ENCODINGS_SUFFIX`, which runs the guard).
        guarded: The names never imported from a file the agent placed.
        compiled: What the image's interpreter compiled at the probe (:data:`COMPILE_GUARD`): the guard's
            code (an interpreter whose magic number differs compiles :data:`GUARD_SOURCE` instead) and
            the bytecode of the view's copy of ``encodings`` (without it, each start compiles it).

    Returns:
        The files by sandbox path (text, or bytes for bytecode).
    """
    if stdlib is None:
        return {}
    module = posixpath.join(stdlib, "encodings", "__init__.py")
    files: dict[str, str | bytes] = {
        module: encodings + ENCODINGS_SUFFIX.encode(),
        GUARD_FILE: GUARD_SOURCE,
        GUARDED_FILE: " ".join(sorted(set(guarded))) + "\n",
    }
    if compiled is not None:
        files[GUARD_CODE_FILE + compiled.magic] = bytes.fromhex(compiled.code)
        if compiled.pyc and compiled.pyc_path and compiled.pyc_path.startswith(posixpath.dirname(module) + "/"):
            files[compiled.pyc_path] = bytes.fromhex(compiled.pyc)
    return files


def provenance(agent_dev: int, tmp_dev: int, tmp_own: Iterable[int]) -> str:
    """The text of :data:`PROVENANCE_FILE`: the device of the agent's live folders, of the view's ``/tmp``
    (its folders), and those of the ``/tmp`` layers whose files the agent did not place."""
    return " ".join(str(number) for number in (agent_dev, tmp_dev, *sorted(set(tmp_own)))) + "\n"
