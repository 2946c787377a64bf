#!/usr/bin/env python3
"""Generator of the starter suite in ../starter_tasks/ (the embedded default run's tasks).

Run ``python3 examples/starter_tasks_src/generate.py``; it rewrites ``examples/starter_tasks/``
from scratch:

- ``train/<task_id>/`` and ``heldout/<task_id>/``: one-command file tasks in Harbor's format
  (instruction.md, task.toml, environment/Dockerfile (+ files it copies), tests/test.sh,
  solution/solve.sh);
- ``few_shot.json``: the example turns the default run puts in front of every prompt
  (``trl-harbor train --few_shot``).

Six kinds of task, each asking for one shell command: write a word, write a number, create an
empty file, create a directory, copy a file, delete a file. Words, numbers and file names vary
from task to task. The held-out tasks are of the same kinds, with words, numbers and file
names that appear in no training task and in no example turn (asserted below), so a model that
only memorised its training tasks does not pass them.

The verifiers are plain bash (no python3 in the image): ``FROM debian:bookworm-slim``, which
the local backend builds offline (it bootstraps the base with mmdebstrap when no registry is
reachable), with no ``RUN`` step. Standard library only; deterministic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "starter_tasks"

#: (kind, parameters) per task. Words and file names are plain lower-case ASCII (no quoting needed).
TRAIN: list[tuple[str, dict]] = [
    ("word", {"word": "blue", "path": "/workdir/answer.txt"}),
    ("word", {"word": "apple", "path": "/workdir/output.txt"}),
    ("word", {"word": "river", "path": "/workdir/result.txt"}),
    ("word", {"word": "tiger", "path": "/workdir/animal.txt"}),
    ("number", {"number": "7", "path": "/workdir/answer.txt"}),
    ("number", {"number": "315", "path": "/workdir/number.txt"}),
    ("number", {"number": "88", "path": "/workdir/value.txt"}),
    ("touch", {"path": "/workdir/done.flag"}),
    ("touch", {"path": "/workdir/ready.txt"}),
    ("touch", {"path": "/workdir/empty.log"}),
    ("mkdir", {"path": "/workdir/logs"}),
    ("mkdir", {"path": "/workdir/backup"}),
    ("mkdir", {"path": "/workdir/build"}),
    ("copy", {"src": "/workdir/input.txt", "dst": "/workdir/backup.txt", "content": "line one\nline two\n"}),
    ("copy", {"src": "/workdir/config.ini", "dst": "/workdir/config.bak", "content": "[core]\nmode = fast\n"}),
    ("copy", {"src": "/workdir/list.csv", "dst": "/workdir/copy.csv", "content": "id,name\n1,ada\n2,bob\n"}),
    ("delete", {"path": "/workdir/old.log", "keep": "/workdir/new.log"}),
    ("delete", {"path": "/workdir/trash.txt", "keep": "/workdir/keep.txt"}),
    ("delete", {"path": "/workdir/temp.dat", "keep": "/workdir/main.dat"}),
]
HELDOUT: list[tuple[str, dict]] = [
    ("word", {"word": "silver", "path": "/workdir/metal.txt"}),
    ("word", {"word": "lemon", "path": "/workdir/fruit.txt"}),
    ("number", {"number": "64", "path": "/workdir/size.txt"}),
    ("touch", {"path": "/workdir/marker.txt"}),
    ("mkdir", {"path": "/workdir/reports"}),
    ("copy", {"src": "/workdir/draft.md", "dst": "/workdir/final.md", "content": "# Draft\nsome text\n"}),
    ("delete", {"path": "/workdir/cache.tmp", "keep": "/workdir/data.tmp"}),
]
#: The example turns put in front of every prompt: one per kind, the harness's call format shown
#: on words, numbers and file names that no task uses (with four, no number or delete example,
#: the base model passed 3 of 28 held-out samples; with these six, 17 of 56).
FEW_SHOT: list[tuple[str, str]] = [
    ("Write the word green into /workdir/colour.txt using the bash tool.", "echo green > /workdir/colour.txt"),
    ("Write the number 42 into /workdir/total.txt using the bash tool.", "echo 42 > /workdir/total.txt"),
    ("Create an empty file named /workdir/notes.md using the bash tool.", "touch /workdir/notes.md"),
    ("Create a directory named /workdir/photos using the bash tool.", "mkdir /workdir/photos"),
    ("Copy the file /workdir/a.txt to /workdir/b.txt using the bash tool.", "cp /workdir/a.txt /workdir/b.txt"),
    ("Delete the file /workdir/junk.bin using the bash tool.", "rm /workdir/junk.bin"),
]

GRADER_HEAD = """#!/bin/bash
# Verifier (Harbor runs /tests/test.sh after the agent; its exit code is ignored): writes 1 to
# /logs/verifier/reward.txt when the sandbox is in the state the instruction asks for, else 0.
mkdir -p /logs/verifier
trim() { local s="$1"; s="${s#"${s%%[![:space:]]*}"}"; s="${s%"${s##*[![:space:]]}"}"; printf '%s' "$s"; }
reward=0
"""
GRADER_TAIL = 'echo "$reward" > /logs/verifier/reward.txt\nexit 0\n'


def task_id(kind: str, p: dict) -> str:
    name = Path(p.get("dst", p.get("path"))).name.replace(".", "_")
    return {
        "word": f"write_{p.get('word')}_{name}",
        "number": f"write_{p.get('number')}_{name}",
        "touch": f"touch_{name}",
        "mkdir": f"mkdir_{name}",
        "copy": f"copy_{Path(p.get('src', '')).name.replace('.', '_')}_to_{name}",
        "delete": f"delete_{name}",
    }[kind]


def render(kind: str, p: dict) -> dict:
    """Instruction, check, reference command and files of one task."""
    path = p.get("path")
    if kind in ("word", "number"):
        value = p[kind]
        return {
            "instruction": f"Write the {kind} {value} into {path} using the bash tool.",
            "check": f'[ -f {path} ] && [ "$(trim "$(cat {path})")" = "{value}" ] && reward=1',
            "solve": f"echo {value} > {path}",
            "files": {},
        }
    if kind == "touch":
        return {
            "instruction": f"Create an empty file named {path} using the bash tool.",
            "check": f'[ -f {path} ] && [ -z "$(trim "$(cat {path})")" ] && reward=1',
            "solve": f"touch {path}",
            "files": {},
        }
    if kind == "mkdir":
        return {
            "instruction": f"Create a directory named {path} using the bash tool.",
            "check": f"[ -d {path} ] && reward=1",
            "solve": f"mkdir {path}",
            "files": {},
        }
    if kind == "copy":
        src, dst = p["src"], p["dst"]
        return {
            "instruction": f"Copy the file {src} to {dst} using the bash tool.",
            # The copy must hold the original content, and the original must still be there.
            "check": f'[ -f {dst} ] && [ -f {src} ] && [ "$(cat {dst})" = "$(cat /tests/expected)" ] && reward=1',
            "solve": f"cp {src} {dst}",
            "files": {src: p["content"]},
            "expected": p["content"],
        }
    if kind == "delete":
        keep = p["keep"]
        return {
            "instruction": f"Delete the file {path} using the bash tool.",
            # Only that file: deleting everything does not pass.
            "check": f"[ ! -e {path} ] && [ -f {keep} ] && reward=1",
            "solve": f"rm {path}",
            "files": {path: "scratch\n", keep: "keep me\n"},
        }
    raise ValueError(kind)


def task_toml(tid: str, kind: str, split: str, solve: str) -> str:
    return "\n".join(
        [
            'version = "1.0"',
            "",
            "[metadata]",
            f"task_id = {json.dumps(tid)}",
            f"kind = {json.dumps(kind)}",
            f"split = {json.dumps(split)}",
            f"reference_command = {json.dumps(solve)}",
            "difficulty_level = 0",
            'category = "shell-basics"',
            'author_name = "trl-harbor"',
            "",
            "[verifier]",
            "timeout_sec = 30.0",
            "",
            "[agent]",
            "timeout_sec = 120.0",
            "",
            "[environment]",
            "build_timeout_sec = 600.0",
            "cpus = 1",
            "memory_mb = 512",
            "storage_mb = 256",
            'network_mode = "no-network"',
            "",
        ]
    )


def dockerfile(files: dict[str, str]) -> str:
    lines = ["FROM debian:bookworm-slim", "", "WORKDIR /workdir"]
    for path in files:
        lines.append(f"COPY files/{Path(path).name} {path}")
    return "\n".join(lines) + "\n"


def write_task(root: Path, kind: str, p: dict, split: str) -> str:
    tid = task_id(kind, p)
    spec = render(kind, p)
    tdir = root / tid
    (tdir / "environment").mkdir(parents=True)
    (tdir / "tests").mkdir()
    (tdir / "solution").mkdir()
    if spec["files"]:
        (tdir / "environment" / "files").mkdir()
        for path, text in spec["files"].items():
            (tdir / "environment" / "files" / Path(path).name).write_text(text)
    if "expected" in spec:
        (tdir / "tests" / "expected").write_text(spec["expected"])
    (tdir / "environment" / "Dockerfile").write_text(dockerfile(spec["files"]))
    (tdir / "instruction.md").write_text(spec["instruction"] + "\n")
    (tdir / "task.toml").write_text(task_toml(tid, kind, split, spec["solve"]))
    test = tdir / "tests" / "test.sh"
    test.write_text(GRADER_HEAD + spec["check"] + "\n" + GRADER_TAIL)
    solve = tdir / "solution" / "solve.sh"
    solve.write_text(f"#!/bin/bash\n# Reference solution (oracle).\n{spec['solve']}\n")
    test.chmod(0o755)
    solve.chmod(0o755)
    return tid


def few_shot_messages() -> list[dict]:
    messages: list[dict] = []
    for instruction, command in FEW_SHOT:
        messages.append({"role": "user", "content": instruction})
        messages.append(
            {"role": "assistant", "content": "", "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}
        )
    return messages


def _words(kind: str, p: dict) -> set[str]:
    """What a memorising model could copy from a task: its word or number and its file names."""
    found = {p[kind]} if kind in ("word", "number") else set()
    return found | {Path(p[k]).name for k in ("path", "src", "dst", "keep") if k in p}


def main() -> None:
    train_words = set().union(*(_words(k, p) for k, p in TRAIN))
    shot_text = json.dumps(FEW_SHOT)
    for kind, p in HELDOUT:
        # Held out means unseen: its word, number and files appear in no training task and no example.
        clash = _words(kind, p) & train_words
        clash |= {w for w in _words(kind, p) if w in shot_text}
        assert not clash, (kind, p, clash)
    assert {k for k, _ in TRAIN} == {k for k, _ in HELDOUT}, "every kind is trained on and held out"
    for _, p in TRAIN:
        assert not any(str(v) in shot_text for k, v in p.items() if k in ("word", "number")), p
    if OUT.exists():
        shutil.rmtree(OUT)
    ids = [write_task(OUT / "train", k, p, "train") for k, p in TRAIN]
    ids += [write_task(OUT / "heldout", k, p, "heldout") for k, p in HELDOUT]
    assert len(set(ids)) == len(ids), "task ids are unique"
    (OUT / "few_shot.json").write_text(json.dumps(few_shot_messages(), indent=1) + "\n")
    print(f"{len(TRAIN)} training tasks, {len(HELDOUT)} held-out tasks, {len(FEW_SHOT)} example turns -> {OUT}")


if __name__ == "__main__":
    main()
