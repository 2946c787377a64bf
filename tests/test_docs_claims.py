"""The checkable claims of README.md and docs/*.md, kept true against the code and the tests.

Every claim of these kinds is checked, in every document (no sandbox, no network):

- a repository path in code (``src/...``, ``tests/...``, ``examples/...``, ``benchmarks/...``,
  ``scripts/...``, ``docs/...``, ``packages/...``, ``harbor_local_sandbox/...``) exists (``*`` and
  ``<name>`` match anything); a ``tests/test_x.py::test_name`` names a test of that file, and a bare
  ``test_x.py`` a file of the test folders;
- a relative Markdown link reaches a file, and its ``#anchor`` a heading of it;
- ``trl-harbor <command> --flag`` (inline, in a code block, or in the option tables of a command's
  section and of the ``train`` / ``check`` / ``eval`` columns) is a flag of that command's parser;
  ``benchmarks/x.py --flag`` is a flag of that script;
- ``HarborOptions(field=...)``, ``HarborSpec(name=...)``, ``HarborSpec.mix(...)`` and ``HarborEnv(...)``
  name parameters those take; a written-out signature of them is the code's; the tables of
  ``HarborOptions`` fields and of the rollout flags give the code's defaults;
- a dotted name ``trl_harbor.x.y`` / ``harbor_local_sandbox.x:Y`` is defined where it says;
- docs/architecture.md's layer table is ``tests/test_architecture.py``'s, and the counted corpora
  (docs/security.md, the README) have the counts their modules hold.

The checkers return problems, one line each, so that ``test_the_checkers_find_wrong_claims`` can show
each of them failing on a made-up wrong claim.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import re
import sys
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SANDBOX_SRC = REPO / "packages" / "harbor-local-sandbox" / "src"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Paths written like the repository's that are not the repository's, with why.
NOT_REPO_PATHS = {
    "tests/test.sh": "a task's verifier script (Harbor's task layout), not a file of this repository",
    "tests/x": "security.md's example of a path inside a sandbox",
    "tests/data": "security.md's example of a link an agent makes in its sandbox",
}

#: Wrong claims found in documents that another change of issue #44 is editing, reported there; each must
#: still be found here (``test_the_known_wrong_claims_are_still_wrong``): remove its entry once it is fixed.
KNOWN_WRONG: dict[str, str] = {}

#: Documents about trl-harbor's own command line: a code span that is bare flags (`--model`) names its flags.
COMMAND_LINE_DOCS = {"README.md", "docs/cli.md"}

#: Flags a command takes that its argparse parser does not list, with why.
EXTRA_FLAGS = {
    "train": {"--config": "TRL's TrlParser reads --config itself, before argparse"},
}

_ROOTS = ("src", "tests", "examples", "benchmarks", "scripts", "docs", "packages", "harbor_local_sandbox")
_PATH = re.compile(r"(?<![\w./<>*-])((?:%s)/[\w.*<>/-]*)" % "|".join(_ROOTS))
_NODEID = re.compile(r"^((?:\S+/)?test_\w+\.py)::([\w:]+)")
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Doc:
    """One Markdown document: its name (for the messages), its folder (for links) and its text."""

    name: str
    text: str
    folder: Path = REPO

    @classmethod
    def read(cls, path: Path) -> Doc:
        return cls(str(path.relative_to(REPO)), path.read_text(), path.parent)

    @property
    def prose(self) -> str:
        """The text with its fenced blocks blanked out (lines kept)."""
        return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), self.text)

    @property
    def blocks(self) -> list[tuple[str, str]]:
        """The fenced blocks: ``(language, body)``, their ``# comments`` left out."""
        return [(m.group(1), re.sub(r"(?m)(^|\s+)#\s.*$", "", m.group(2))) for m in _FENCE.finditer(self.text)]

    @property
    def spans(self) -> list[str]:
        """The inline code spans of the prose, a line break read as a space."""
        return [m.group(1).replace("\n", " ") for m in _SPAN.finditer(self.prose)]

    def code_lines(self) -> Iterator[str]:
        """Inline spans, and each line of the fenced blocks (``\\``-continued lines joined)."""
        yield from self.spans
        for _, body in self.blocks:
            yield from body.replace("\\\n", " ").splitlines()

    def sections(self) -> Iterator[tuple[str, list[str]]]:
        """``(heading, lines)`` of the prose, the heading being the nearest one above."""
        heading, lines = "", []
        for line in self.prose.splitlines():
            if re.match(r"#{1,6} ", line):
                yield heading, lines
                heading, lines = line.lstrip("#").strip(), []
            else:
                lines.append(line)
        yield heading, lines

    def tables(self) -> Iterator[tuple[str, list[str], list[list[str]]]]:
        """``(heading, header cells, rows of cells)`` of every table."""
        for heading, lines in self.sections():
            table: list[list[str]] = []
            for line in [*lines, ""]:
                if line.startswith("|"):
                    table.append(_cells(line))
                    continue
                if len(table) >= 2:
                    yield heading, table[0], [row for row in table[2:] if len(row) == len(table[0])]
                table = []


def _cells(line: str) -> list[str]:
    """A table row's cells (a ``|`` inside a code span stays in its cell)."""
    cells, cell, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*cells, cell.strip()]


# ── repository paths, test files and test names ──────────────────────────────────────────


def _repo_path(written: str) -> Path | None:
    """Where a path of the docs is in the checkout, or ``None``; globs (``*``, ``<name>``) allowed."""
    written = written.rstrip(".,;:)")
    if written.startswith("harbor_local_sandbox/"):
        written = str(SANDBOX_SRC.relative_to(REPO) / written)
    pattern = re.sub(r"<[^>]*>", "*", written).rstrip("/") or "."
    if "*" in pattern:
        return next(iter(sorted(REPO.glob(pattern))), None)
    path = REPO / pattern
    return path if path.exists() else None


def _test_names(path: Path) -> set[str]:
    """``test_x`` and ``Class::test_x`` of a test file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def _test_files() -> set[str]:
    return {p.name for folder in (REPO / "tests", *REPO.glob("packages/*/tests")) for p in folder.rglob("test_*.py")}


def check_paths(doc: Doc) -> list[str]:
    """Repository paths exist; ``file::test`` names a test of the file; a bare ``test_x.py`` is a test file."""
    problems = []
    texts = [*doc.spans, *(body for lang, body in doc.blocks if lang in {"bash", "sh", "python", "yaml", "toml"})]
    for text in texts:
        for match in _PATH.finditer(text):
            written = match.group(1)
            if written.rstrip(".,;:)") in NOT_REPO_PATHS:
                continue
            path = _repo_path(written)
            if path is None:
                problems.append(f"{doc.name}: `{written}` does not exist")
                continue
            rest = text[match.end() :]
            nodeid = _NODEID.match(written.rstrip(".,;:)") + rest)
            if nodeid and path.is_file():
                test = nodeid.group(2).split("[")[0]
                if test not in _test_names(path):
                    problems.append(f"{doc.name}: `{written}::{test}`: no such test in {written}")
    files = _test_files()
    for span in doc.spans:
        for name in re.findall(r"(?<![\w/.-])(test_\w+\.py)\b", span):
            if name not in files:
                problems.append(f"{doc.name}: `{name}`: no such test file")
    return problems


# ── links and their anchors ──────────────────────────────────────────────────────────────


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(doc: Doc) -> set[str]:
    seen: collections.Counter[str] = collections.Counter()
    anchors = set()
    for heading, _ in doc.sections():
        if not heading:
            continue
        slug = _slug(heading)
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def check_links(doc: Doc) -> list[str]:
    """Relative links reach a file, and their anchors a heading of it."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.folder / file).resolve() if file else None
        if path is not None and not path.exists():
            problems.append(f"{doc.name}: link to {target}: {file} does not exist")
            continue
        if anchor and (path is None or path.suffix == ".md"):
            linked = doc if path is None else Doc.read(path)
            if anchor not in _anchors(linked):
                problems.append(f"{doc.name}: link to {target}: no heading of {linked.name} has that anchor")
    return problems


# ── command-line flags ───────────────────────────────────────────────────────────────────


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@cache
def cli_flags() -> dict[str, set[str]]:
    """Each command's flags (``images build`` as ``"images build"``), ``train``'s from TRL's parser."""
    from trl_harbor.cli import build_parser
    from trl_harbor.cli.train import _parser

    flags = {}
    for name, sub in _subparsers(build_parser()).items():
        flags[name] = _option_strings(sub)
        for subname, subsub in _subparsers(sub).items():
            flags[f"{name} {subname}"] = flags[name] | _option_strings(subsub)
    flags["train"] = _option_strings(_parser(default_run=False))
    for name, extra in EXTRA_FLAGS.items():
        flags[name] = flags[name] | set(extra)
    return flags


def _flags_in(text: str) -> list[str]:
    """The flags of a command line's words (up to a comment or the next command)."""
    found = []
    for word in text.split():
        if word.startswith("#") or word in {"|", "||", "&&", ";", "&"}:
            break
        word = word.strip("[](),'\"`")
        if re.match(r"--?[A-Za-z]", word):
            found.append(word.split("=")[0])
    return found


def _command_of(words: list[str], known: dict[str, set[str]]) -> tuple[str | None, int]:
    """The command the words after ``trl-harbor`` run (``-v`` skipped), and how many words name it."""
    index = 0
    while index < len(words) and words[index] in {"-v", "--verbose"}:
        index += 1
    if index >= len(words) or words[index] not in known:
        return None, 0
    command = words[index]
    if index + 1 < len(words) and f"{command} {words[index + 1]}" in known:
        return f"{command} {words[index + 1]}", index + 2
    return command, index + 1


def check_flags(doc: Doc, flags: dict[str, set[str]]) -> list[str]:
    """``trl-harbor`` flags on command lines and in option tables; ``benchmarks/x.py`` flags."""
    problems = []
    for line in doc.code_lines():
        for match in re.finditer(r"(?:^|[\s/])(?:trl-harbor|-m trl_harbor\.cli)\s+(.*)", line):
            words = match.group(1).split()
            command, used = _command_of(words, flags)
            if command is None:
                continue
            for flag in _flags_in(" ".join(words[used:])):
                if flag not in flags[command]:
                    problems.append(f"{doc.name}: `trl-harbor {command} {flag}`: no such flag")
        for match in re.finditer(r"(benchmarks/\w+\.py)((?:\s+[^\s]+)*)", line):
            source = (REPO / match.group(1)).read_text() if (REPO / match.group(1)).is_file() else ""
            for flag in _flags_in(match.group(2)):
                if f'"{flag}"' not in source:
                    problems.append(f"{doc.name}: `{match.group(1)} {flag}`: the script has no such flag")
    commands = {name for name in flags if " " not in name}
    if doc.name in COMMAND_LINE_DOCS:
        every = set().union(*flags.values())
        for span in doc.spans:
            if re.match(r"--?[A-Za-z]", span):
                problems += [
                    f"{doc.name}: `{flag}`: no trl-harbor command takes it"
                    for flag in _flags_in(span)
                    if flag not in every
                ]
    for heading, header, rows in doc.tables():
        for column, title in enumerate(header):
            names = [t.strip().strip("`") for t in title.lower().split("/")]
            if all(name in commands for name in names):
                subs = names
            elif column == 0 and title.lower() in {"option", "flag"}:
                named = re.search(r"trl-harbor (\w+)", heading)
                subs = [named.group(1)] if named and named.group(1) in commands else sorted(commands)
            else:
                continue
            for row in rows:
                for span in _SPAN.finditer(row[column]):
                    narrowed = re.match(r"\s*\((\w+)\)", row[column][span.end() :])
                    where = [narrowed.group(1)] if narrowed and narrowed.group(1) in commands else subs
                    for flag in _flags_in(span.group(1)):
                        if not any(flag in flags[sub] for sub in where):
                            problems.append(
                                f"{doc.name}: `{flag}` in the table under '{heading}': not a flag of {where}"
                            )
    return problems


# ── HarborOptions, HarborSpec, HarborEnv: parameters, signatures, defaults ───────────────

_CALLABLES = {
    # written as: (source file, class, method)
    "HarborSpec": ("src/trl_harbor/training/spec.py", "HarborSpec", "__init__"),
    "HarborSpec.mix": ("src/trl_harbor/training/spec.py", "HarborSpec", "mix"),
    "HarborEnv": ("src/trl_harbor/training/env.py", "HarborEnv", "__init__"),
    "HarborOptions": ("src/trl_harbor/options.py", "HarborOptions", None),
}


@cache
def _code_signature(name: str) -> ast.arguments:
    file, cls, method = _CALLABLES[name]
    tree = ast.parse((REPO / file).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    if method is None:  # a dataclass: its fields, keyword arguments with their defaults
        fields = [n for n in klass.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        return ast.arguments(
            posonlyargs=[],
            args=[],
            kwonlyargs=[ast.arg(f.target.id) for f in fields],
            kw_defaults=[f.value for f in fields],
            defaults=[],
        )
    function = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    arguments = function.args
    if arguments.args and arguments.args[0].arg in {"self", "cls"}:
        arguments.args = arguments.args[1:]
    return arguments


def _parameters(arguments: ast.arguments) -> set[str]:
    return {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}


def _shape(arguments: ast.arguments) -> list[tuple[str, str, str | None]]:
    """``(kind, name, default)`` of each parameter, defaults as code (``"bash"`` and ``'bash'`` alike)."""
    shape = []
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    for arg, default in zip(positional, defaults, strict=True):
        shape.append(("positional", arg.arg, None if default is None else ast.unparse(default)))
    if arguments.vararg:
        shape.append(("*", arguments.vararg.arg, None))
    for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
        shape.append(("keyword", arg.arg, None if default is None else ast.unparse(default)))
    if arguments.kwarg:
        shape.append(("**", arguments.kwarg.arg, None))
    return shape


def _calls(text: str, name: str) -> Iterator[str]:
    """The argument text of each ``name(...)`` in a text."""
    for match in re.finditer(r"(?<![\w.])%s\(" % re.escape(name), text):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[index], 0)
            if depth == 0:
                yield text[start:index]
                break


def _keywords(arguments: str) -> list[str]:
    """The keyword names given at the top level of a call's argument text."""
    names, depth = [], 0
    for match in re.finditer(r"[(\[{]|[)\]}]|(?<![=!<>])\b(\w+)\s*=(?!=)", arguments):
        token = match.group(0)
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth -= 1
        elif depth == 0:
            names.append(match.group(1))
    return names


def check_parameters(doc: Doc) -> list[str]:
    """Calls name parameters the code takes; written-out signatures are the code's."""
    problems = []
    texts = [*doc.spans, *(body for _, body in doc.blocks)]
    options = _parameters(_code_signature("HarborOptions"))
    for name in _CALLABLES:
        accepted = _parameters(_code_signature(name)) | (options if name == "HarborEnv" else set())
        for text in texts:
            for arguments in _calls(text, name):
                for keyword in _keywords(arguments):
                    if keyword not in accepted:
                        problems.append(f"{doc.name}: `{name}({keyword}=...)`: {name} takes no such parameter")
        for span in doc.spans:
            written = re.fullmatch(r"%s\((.*)\)" % re.escape(name), span.strip())
            if not written or not re.search(r"(^|,)\s*\*", written.group(1)):
                continue  # a call, not a signature (a signature has its bare `*` or `**kwargs`)
            try:
                claimed = ast.parse(f"def f({written.group(1)}): pass").body[0].args
            except SyntaxError:
                problems.append(f"{doc.name}: `{span}` is neither a call nor a signature")
                continue
            if _shape(claimed) != _shape(_code_signature(name)):
                problems.append(f"{doc.name}: `{span}` is not the code's signature of {name}")
    return problems


def _same_default(written: str, actual: object) -> bool:
    text = written.replace("`", "").strip().strip("\"'")
    if actual is None:
        return text.lower() == "none"
    if isinstance(actual, bool | str):
        return text == str(actual)
    if isinstance(actual, int | float):
        try:
            return float(text) == actual
        except ValueError:
            return False
    return text == repr(actual)


def check_option_tables(doc: Doc) -> list[str]:
    """The tables of ``HarborOptions`` fields and of the rollout flags: names and defaults."""
    from trl_harbor.cli.option_flags import OPTION_FLAGS
    from trl_harbor.options import HarborOptions

    problems = []
    defaults = HarborOptions()
    by_flag = {f"--{option.flag}": option for option in OPTION_FLAGS}
    for heading, header, rows in doc.tables():
        titles = [title.lower() for title in header]
        if titles[:2] == ["field", "default"] and "HarborOptions" in heading:
            for row in rows:
                for field in re.findall(r"`(\w+)`", row[0]):
                    if not hasattr(defaults, field):
                        problems.append(f"{doc.name}: `{field}` under '{heading}': no HarborOptions field")
                    elif not _same_default(row[1], getattr(defaults, field)):
                        problems.append(f"{doc.name}: `{field}` defaults to {getattr(defaults, field)!r}, not {row[1]}")
        if titles[:2] == ["flag", "default"]:
            for row in rows:
                for flag in re.findall(r"`(--[\w-]+)", row[0]):
                    option = by_flag.get(flag)
                    if option is not None and option.shape == "value" and not _same_default(row[1], option.default):
                        problems.append(f"{doc.name}: `{flag}` defaults to {option.default!r}, not {row[1]}")
    return problems


# ── dotted names ─────────────────────────────────────────────────────────────────────────

_DOTTED = re.compile(r"(?<![\w./-])((?:trl_harbor|harbor_local_sandbox)(?:\.\w+)*)(?::(\w+))?")


def _module_file(dotted: str) -> Path | None:
    parts = dotted.split(".")
    root = REPO / "src" if parts[0] == "trl_harbor" else SANDBOX_SRC
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _defined(file: Path) -> set[str]:
    """The names a module defines or imports at its top level (``if``/``try`` blocks too), and its ``__all__``."""
    names: set[str] = set()
    statements = list(ast.parse(file.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "sys.modules[__name__]":
            names |= _defined(_module_file(ast.unparse(node.value)))  # an alias: the module it stands for
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names |= {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            statements += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                statements += handler.body
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        file = _module_file(".".join(parts[:end]))
        if file is not None:
            rest = parts[end:]
            return not rest or rest[0] in _defined(file)
    return False


def check_dotted_names(doc: Doc) -> list[str]:
    """``trl_harbor.x.Y``, ``harbor_local_sandbox.x:Y`` and ``from trl_harbor.x import Y`` are defined there."""
    problems = []
    for text in [*doc.spans, *(body for _, body in doc.blocks)]:
        names = [m.group(1) + (f".{m.group(2)}" if m.group(2) else "") for m in _DOTTED.finditer(text)]
        for module, imported in re.findall(
            r"from\s+((?:trl_harbor|harbor_local_sandbox)[\w.]*)\s+import\s+([\w, ]+)", text
        ):
            names += [f"{module}.{name.strip()}" for name in imported.split(",") if name.strip()]
        for name in names:
            if not _resolves(name.rstrip(".")):
                problems.append(f"{doc.name}: `{name}` is not defined there")
    return problems


# ── the checks, on every document ────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def flags() -> dict[str, set[str]]:
    return cli_flags()


def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def _new(problems: list[str]) -> list[str]:
    return [problem for problem in problems if not any(problem.startswith(known) for known in KNOWN_WRONG)]


@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_paths_test_names_and_links_exist(path: Path) -> None:
    doc = Doc.read(path)
    assert _new(check_paths(doc) + check_links(doc)) == []


@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_command_line_flags_exist(path: Path, flags: dict[str, set[str]]) -> None:
    assert _new(check_flags(Doc.read(path), flags)) == []


@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_parameters_signatures_defaults_and_dotted_names_are_the_codes(path: Path) -> None:
    doc = Doc.read(path)
    assert _new(check_parameters(doc) + check_option_tables(doc) + check_dotted_names(doc)) == []


def test_the_known_wrong_claims_are_still_wrong(flags: dict[str, set[str]]) -> None:
    """An entry of ``KNOWN_WRONG`` whose claim was fixed must go, so that the claim is checked again."""
    found = []
    for path in DOCS:
        doc = Doc.read(path)
        found += check_paths(doc) + check_links(doc) + check_flags(doc, flags)
        found += check_parameters(doc) + check_option_tables(doc) + check_dotted_names(doc)
    fixed = [known for known in KNOWN_WRONG if not any(problem.startswith(known) for problem in found)]
    assert fixed == [], "fixed now: remove these entries of KNOWN_WRONG"


def test_the_layer_table_is_the_architecture_tests() -> None:
    """docs/architecture.md's layers are ``LAYERS`` of tests/test_architecture.py, which enforces them."""
    tree = ast.parse((REPO / "tests" / "test_architecture.py").read_text())
    layers = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "LAYERS"
    )
    doc = Doc.read(REPO / "docs" / "architecture.md")
    written: dict[int, set[str]] = collections.defaultdict(set)
    for _, header, rows in doc.tables():
        if [h.lower() for h in header[:2]] == ["layer", "module"]:
            for row in rows:
                written[int(row[0])] |= set(re.findall(r"`([\w.]+)`", row[1]))
    packages = {"training", "loop"}  # package folders: no row of their own
    assert {n: sorted(m) for n, m in written.items()} == {n: sorted(layer - packages) for n, layer in enumerate(layers)}


# ── counts ───────────────────────────────────────────────────────────────────────────────


def _section(doc: Doc, heading: str) -> tuple[str, list[list[str]]]:
    """A section's prose (its text up to the next heading) and its table rows."""
    text = next("\n".join(lines) for h, lines in doc.sections() if h.startswith(heading))
    rows = next((rows for h, _, rows in doc.tables() if h.startswith(heading)), [])
    return text, rows


def _corpus(name: str) -> ModuleType:
    """A corpus module of tests/adversarial/ (its ``CASES``)."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "adversarial")]
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[:2]


def test_the_corpora_hold_the_counts_the_docs_give() -> None:
    """docs/security.md's tables and totals, and the README's sum of them, against the corpora's cases."""
    security = Doc.read(REPO / "docs" / "security.md")
    problems = []
    attacks = honest = 0
    for heading, module in (("Attacks on grading", "grading_corpus"), ("The verifier's view", "view_corpus")):
        corpus = _corpus(module)
        cases = corpus.CASES
        text, rows = _section(security, heading)
        by_class = collections.Counter(case.klass for case in cases)
        runs = len(cases) + sum(1 for case in cases if case.undefended is not corpus.NOT_RUN)
        said = {row[0].split()[0].lower(): int(row[1].split()[0]) for row in rows}
        expected = {("honest" if k == "H" else k): n for k, n in by_class.items()}
        if {k: said.get(k) for k in expected} != expected:
            problems.append(f"{heading}: the table says {said}, {module} holds {expected}")
        numbers = re.search(r"(\d+) rollouts.*?(\d+)\s+cases, (\d+) runs", text, re.S)
        if numbers is None or tuple(map(int, numbers.groups())) != (len(cases), len(cases), runs):
            problems.append(f"{heading}: {len(cases)} rollouts, {len(cases)} cases, {runs} runs in {module}")
        attacks += len(cases) - by_class["H"]
        honest += by_class["H"]
    cases = _corpus("adv_corpus").CASES
    text, rows = _section(security, "The adversarial corpus")
    for row in rows:
        category = [c for c in cases if row[0].strip("*").startswith(c.category)]
        said = re.match(r"\**(\d+) \((\d+)\)", row[1])
        expected = (len(category), sum(len(c.harnesses) for c in category)) if category else None
        if row[0].startswith("**total"):
            expected = (len(cases), sum(len(c.harnesses) for c in cases))
        if said is None or tuple(map(int, said.groups())) != expected:
            problems.append(f"The adversarial corpus: '{row[0]}' says {row[1]}, adv_corpus holds {expected}")
    if not text.lstrip().startswith(f"{len(cases)} hostile rollouts"):
        problems.append(f"The adversarial corpus: adv_corpus holds {len(cases)} cases")
    readme = " ".join(Doc.read(REPO / "README.md").text.split())
    if f"{attacks} attacks on grading score 0 and {honest} honest rollouts 1" not in readme:
        problems.append(f"README.md: the grading and view corpora hold {attacks} attacks and {honest} honest rollouts")
    assert problems == []


def test_the_bundled_suites_and_the_broken_suites_have_the_sizes_the_docs_give() -> None:
    def folders(path: str) -> int:
        return sum(1 for p in (REPO / path).iterdir() if (p / "task.toml").is_file())

    tree = ast.parse((REPO / "tests" / "bad_suites" / "test_bad_suites.py").read_text())
    bad = sum(
        len(n.value.keys)
        for n in tree.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and n.target.id in {"SPEC_ERRORS", "ROLLOUTS"}
    )
    readme = " ".join(Doc.read(REPO / "README.md").text.split())
    cli = " ".join(Doc.read(REPO / "docs" / "cli.md").text.split())
    security = " ".join(Doc.read(REPO / "docs" / "security.md").text.split())
    claims: list[tuple[str, str, str, int]] = [
        ("README.md", readme, r"\| (\d+) offline data-analysis tasks", folders("examples/tasks")),
        ("README.md", readme, r"suite: (\d+) training", folders("examples/starter_tasks/train")),
        ("README.md", readme, r"training and (\d+) held-out", folders("examples/starter_tasks/heldout")),
        ("README.md", readme, r"\((\d+) tasks never trained on", folders("examples/starter_tasks/heldout")),
        ("docs/cli.md", cli, r"`examples/starter_tasks/train`: (\d+) tasks", folders("examples/starter_tasks/train")),
        (
            "docs/cli.md",
            cli,
            r"`examples/starter_tasks/heldout`: (\d+) tasks",
            folders("examples/starter_tasks/heldout"),
        ),
        ("docs/security.md", security, r"(\d+) cases \(`test_bad_suites.py`\)", bad),
    ]
    problems = []
    for name, text, pattern, actual in claims:
        said = re.search(pattern, text)
        if said is None or int(said.group(1)) != actual:
            problems.append(f"{name}: /{pattern}/ should give {actual}, found {said and said.group(1)}")
    assert problems == []


# ── the checkers find wrong claims ───────────────────────────────────────────────────────

WRONG = """# Made up

## Section

Run `tests/test_no_such_module.py`, `tests/test_options.py::test_no_such_test` and `test_nowhere.py`;
see [cli](docs/cli.md#no-such-heading) and [nothing](docs/nothing.md).

```bash
trl-harbor check examples/tasks --no-such-flag
.venv/bin/python benchmarks/batch.py --no-such-option
```

| option | default | meaning |
|---|---|---|
| `--made-up` | 1 | x |

`HarborSpec(dataset, agent="bash", *, options=None)` and `HarborOptions(made_up_field=1)`.

## `HarborOptions`

| field | default | meaning |
|---|---|---|
| `command_timeout_sec` | 181 | seconds |

| flag | default | meaning |
|---|---|---|
| `--max-output-chars` | 7999 | characters |

`trl_harbor.training.env.NoSuchName` and `harbor_local_sandbox.local:NoSuchClass`.
"""

RIGHT = """# Made up

## Section

Run `tests/test_options.py`, `tests/test_docs_claims.py::test_the_checkers_find_wrong_claims`,
`tests/test_docker_*.py`, `examples/scripts/harbor/harnesses/<name>/` and `test_options.py`; see
[cli](docs/cli.md#rollout-options-every-command-that-runs-rollouts) and [here](#section).

```bash
trl-harbor check examples/tasks -e local --task orders_count --ek pids_max=64
trl-harbor train --config train.yaml --num_generations 8 --no_trajectories   # a comment --not-a-flag
trl-harbor images prune --all
.venv/bin/python benchmarks/batch.py --parts tools
```

| option | default | meaning |
|---|---|---|
| `--command-timeout-sec` | 180 | x |

`HarborEnv(environment_type="docker", *, options=None, **overrides)`, `HarborEnv(command_timeout_sec=60)`,
`HarborSpec(..., options=HarborOptions(infra_stop_fraction=0.5), preflight=False)`.

## `HarborOptions`

| field | default | meaning |
|---|---|---|
| `on_infra_error` | `"skip"` | x |
| `reward_key`, `reward_weights` | `None` | x |

`trl_harbor.training.env.close_all`, `harbor_local_sandbox.local:LocalEnvironment`, `trl_harbor.HarborOptions`.
"""


def test_the_checkers_find_wrong_claims(flags: dict[str, set[str]]) -> None:
    """Each checker fails on a made-up wrong claim of its kind, and passes the right ones beside them."""
    checkers: list[Callable[[Doc], list[str]]] = [
        check_paths,
        check_links,
        lambda doc: check_flags(doc, flags),
        check_parameters,
        check_option_tables,
        check_dotted_names,
    ]
    right = Doc("docs/cli.md", RIGHT + "\nTrain with `--model Qwen/Qwen3-0.6B`, `--config`, `--num-tasks 2`.\n")
    assert [problem for checker in checkers for problem in checker(right)] == []
    wrong = Doc("docs/cli.md", WRONG + "\nTrain with `--no-such-train-flag 3`.\n")
    found = "\n".join(problem for checker in checkers for problem in checker(wrong))
    for claim in (
        "`tests/test_no_such_module.py` does not exist",
        "`tests/test_options.py::test_no_such_test`: no such test",
        "`test_nowhere.py`: no such test file",
        "link to docs/cli.md#no-such-heading: no heading",
        "link to docs/nothing.md: docs/nothing.md does not exist",
        "`trl-harbor check --no-such-flag`: no such flag",
        "`--no-such-train-flag`: no trl-harbor command takes it",
        "`benchmarks/batch.py --no-such-option`: the script has no such flag",
        "`--made-up` in the table",
        "is not the code's signature of HarborSpec",
        "`HarborOptions(made_up_field=...)`",
        "`command_timeout_sec` defaults to 180, not 181",
        "`--max-output-chars` defaults to 8000, not 7999",
        "`trl_harbor.training.env.NoSuchName` is not defined",
        "`harbor_local_sandbox.local.NoSuchClass` is not defined",
    ):
        assert claim in found, f"{claim!r} not among:\n{found}"
