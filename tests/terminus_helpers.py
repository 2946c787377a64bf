"""Shared pieces of the Terminus-2 tests: a bundled task with tmux, and tiny scripted policies in Terminus-2's format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The bundled task the Terminus-2 tests play, and its gold answer.
TASK = "building_b_humidity"
ANSWER = "51.46"

#: The layer that gives the bundled task's image tmux (Terminus-2 drives the terminal with it).
TMUX_LAYER = (
    "RUN apt-get update \\\n && apt-get install -y --no-install-recommends tmux \\\n && rm -rf /var/lib/apt/lists/*\n\n"
)


def terminus_reply(keystrokes: str, analysis: str = "The data is in /workdir/data.", complete: bool = True) -> str:
    """One Terminus-2 reply in its JSON format: one command, and the task marked complete.

    Args:
        keystrokes: What is typed into the terminal (end it with a newline to run it).
        analysis: The reply's analysis.
        complete: Whether the reply marks the task complete.

    Returns:
        The reply's text.
    """
    return json.dumps(
        {
            "analysis": analysis,
            "plan": "Write the answer.",
            "commands": [{"keystrokes": keystrokes, "duration": 0.1}],
            "task_complete": complete,
        }
    )


RIGHT = terminus_reply(f"echo {ANSWER} > /workdir/answer.txt\n")
WRONG = terminus_reply("echo 12.00 > /workdir/answer.txt\n")
#: A wrong answer, then a fake ``python3`` ahead of the image's on ``PATH`` that writes reward 1, a
#: reward file, and a background loop that keeps writing it while the verifier runs.
TAMPER = terminus_reply(
    "echo 12.00 > /workdir/answer.txt; mkdir -p /logs/verifier; "
    "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /usr/local/bin/python3; "
    "chmod +x /usr/local/bin/python3; (while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.05; done) &\n",
    analysis="Make the grader pass.",
)


def tmux_suite(root: Path) -> Path:
    """A suite holding the bundled task with a tmux layer in its Dockerfile, its image built.

    Args:
        root: An empty folder.

    Returns:
        The suite's folder.
    """
    suite = root / "suite"
    shutil.copytree(REPO / "examples" / "tasks" / TASK, suite / TASK)
    dockerfile = suite / TASK / "environment" / "Dockerfile"
    text = dockerfile.read_text()
    marker = "ENV PYTHONDONTWRITEBYTECODE"
    assert marker in text, "the bundled Dockerfile changed; put the tmux layer elsewhere"
    dockerfile.write_text(text.replace(marker, TMUX_LAYER + marker, 1))
    if os.geteuid() == 0 and shutil.which("buildah"):
        result = subprocess.run(
            [sys.executable, "-m", "trl_harbor.cli", "images", "build", str(suite)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return suite


def terminus_prompt_corpus() -> list[str]:
    """Texts the tiny tokenizer is trained on, so that Terminus-2's prompts stay short in tokens."""
    import harbor.agents.terminus_2 as terminus

    templates = Path(terminus.__file__).parent / "templates"
    return [
        (templates / "terminus-json-plain.txt").read_text(),
        (REPO / "examples" / "tasks" / TASK / "instruction.md").read_text(),
        "Current terminal state:\nNew Terminal Output:\nroot@building-b-humidity:/workdir# \n"
        "Are you sure you want to mark the task as complete? This will trigger your solution to be graded "
        'and you won\'t be able to make any further corrections. If so, include "task_complete": true in '
        "your JSON response again.",
    ]


def scripted_policy(replies: Sequence[str], seed: int = 0):
    """A tiny Qwen3 model and tokenizer that answer every turn with one of ``replies`` (each one token).

    Args:
        replies: Whole Terminus-2 replies; each becomes one token of the tokenizer.
        seed: The model's initialisation seed.

    Returns:
        ``(model, tokenizer)``.
    """
    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls

    tokenizer = build_tokenizer(corpus=terminus_prompt_corpus(), extra_tokens=list(replies))
    model = build_model(tokenizer, seed=seed)
    script_tool_calls(model, tokenizer, list(replies))
    return model, tokenizer


def policy_distribution(model, tokenizer, temperature: float = 1.0):
    """The scripted policy's next-token distribution after a generation prompt (the same every turn).

    It is computed as the capture endpoint's sampler computes it, so that :func:`seed_for` can
    replay the sampler's draws.
    """
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
    return torch.softmax(logits, dim=-1)


def seed_for(choices: Sequence[Sequence[int]], probs, turns: int, limit: int = 5000) -> int:
    """A trainer seed under which rollout ``i`` of the first step samples the tokens ``choices[i]``, turn by turn.

    The rollout function seeds each rollout from the trainer's seed, the step, the batch, the rank
    and the rollout, and the endpoint each call from that and the call
    (``trl_harbor.loop.capture.derive_seed``), drawing with ``torch.multinomial``; this replays those
    draws for the scripted policy (first step, first batch, rank 0), whose distribution is the same
    every turn.

    Args:
        choices: For each rollout, the token (a whole reply) it must sample at each turn.
        probs: The policy's next-token distribution (:func:`policy_distribution`).
        turns: How many turns to match.
        limit: How many seeds to try.

    Returns:
        The seed.
    """
    import torch

    from trl_harbor.loop.capture import derive_seed

    for seed in range(limit):
        if all(
            int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(
                derive_seed(derive_seed(seed, 0, 0, 0, rollout), call)))) == wanted[call]
            for rollout, wanted in enumerate(choices)
            for call in range(turns)
        ):  # fmt: skip
            return seed
    raise AssertionError(f"no seed below {limit} draws {choices}")
