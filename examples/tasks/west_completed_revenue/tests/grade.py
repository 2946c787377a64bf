#!/usr/bin/env python3
"""Shared grader for the bundled trl-harbor data tasks (Python standard library only).

Reads the agent's answer from /workdir/answer.txt and compares it with $EXPECTED_ANSWER:

1. exact: normalised string match (strip, collapse whitespace, case-fold, drop surrounding
   quotes/backticks and a trailing period);
2. numeric: both sides parsed as numbers (thousands commas, a % or $ sign and surrounding
   quotes are tolerated; any other text makes the answer non-numeric) and compared with
   ``math.isclose(got, expected, rel_tol=RTOL, abs_tol=ATOL + 1e-9)`` (the slack makes the
   tolerance inclusive despite float representation error).

The reward is 1.0 when either check passes, else 0.0. A missing, empty or unreadable
answer scores 0.0. The reward is always written, to /logs/verifier/reward.txt, or with
``--json`` to /logs/verifier/reward.json as a flat object of finite numbers:
{"reward", "exact", "numeric_close", "answered"}.

Environment: EXPECTED_ANSWER (required), REWARD_MODE (exact_short|numeric; informational:
both checks always run), ATOL, RTOL (floats; default 1e-6), and for local testing only
ANSWER_PATH / REWARD_DIR to override the sandbox paths.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile

ANSWER_PATH = os.environ.get("ANSWER_PATH", "/workdir/answer.txt")
REWARD_DIR = os.environ.get("REWARD_DIR", "/logs/verifier")
MAX_ANSWER_BYTES = 4096

_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_NUMBER_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")


def normalize(text: str) -> str:
    s = " ".join(text.strip().split())
    prev = None
    while s != prev:
        prev = s
        s = s.strip().rstrip(".").strip()
        if len(s) >= 2 and s[0] in _QUOTES and s[-1] in _QUOTES:
            s = s[1:-1]
        s = s.strip(_QUOTES)
    return s.casefold()


def parse_number(text: str) -> float | None:
    s = normalize(text)
    s = s.replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    s = s.rstrip(".")
    if not _NUMBER_RE.match(s):
        return None
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


def read_answer(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_ANSWER_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_ANSWER_BYTES:
        return None  # an answer is one short line, not a data dump
    text = raw.decode("utf-8", errors="replace").strip()
    return text or None


def grade() -> dict[str, float]:
    expected = os.environ.get("EXPECTED_ANSWER")
    if expected is None or not expected.strip():
        print("grade.py: EXPECTED_ANSWER is not set; scoring 0", file=sys.stderr)
        return {"reward": 0.0, "exact": 0.0, "numeric_close": 0.0, "answered": 0.0}
    atol = _float_env("ATOL", 1e-6)
    rtol = _float_env("RTOL", 1e-6)

    answer = read_answer(ANSWER_PATH)
    if answer is None:
        print(f"grade.py: no usable answer at {ANSWER_PATH}", file=sys.stderr)
        return {"reward": 0.0, "exact": 0.0, "numeric_close": 0.0, "answered": 0.0}

    exact = normalize(answer) == normalize(expected)
    numeric_close = False
    want, got = parse_number(expected), parse_number(answer)
    if want is not None and got is not None:
        # tiny slack so a tolerance of 0.01 accepts a 0.01 difference despite float error
        numeric_close = math.isclose(got, want, rel_tol=rtol, abs_tol=atol + 1e-9)
    reward = 1.0 if (exact or numeric_close) else 0.0
    print(
        f"grade.py: mode={os.environ.get('REWARD_MODE', '?')} answer={answer[:200]!r} "
        f"exact={exact} numeric_close={numeric_close} reward={reward}"
    )
    return {
        "reward": reward,
        "exact": 1.0 if exact else 0.0,
        "numeric_close": 1.0 if numeric_close else 0.0,
        "answered": 1.0,
    }


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".reward-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    as_json = "--json" in argv[1:]
    try:
        result = grade()
    except Exception as exc:  # never leave the verifier without a reward
        print(f"grade.py: internal error {exc!r}; scoring 0", file=sys.stderr)
        result = {"reward": 0.0, "exact": 0.0, "numeric_close": 0.0, "answered": 0.0}
    if as_json:
        _write_atomic(os.path.join(REWARD_DIR, "reward.json"), json.dumps(result) + "\n")
    else:
        _write_atomic(os.path.join(REWARD_DIR, "reward.txt"), f"{result['reward']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
