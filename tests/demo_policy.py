"""Test fixture: a hand-wired tiny policy whose tool calls are known in advance (not a language model).

(It was the embedded default run's "demo policy" until that run trained a real model; tests keep
it because its outcomes are predictable: a checkpoint that calls known commands per task, cheap
enough to train and evaluate many times.)

A random tiny model almost never writes a well-formed tool call, so this is a one-layer
``Qwen3ForCausalLM`` (a regular, fully trainable transformers model) whose weights are set so
that, for each task, it calls the ``bash`` tool with one of a few candidate commands:

- the **right** one: the task's reference solution (``solution/solve.sh``, which computes the
  answer from the task's data), or, for a task without one, writing its ``gold_answer``;
- three **wrong** ones, shared by every task: looking at the data without answering
  (``ls /workdir/data``), answering with the first line of the data, answering ``0``.

At the start each candidate is equally likely, so about a quarter of the rollouts score 1. The
sandboxes, the tool calls and Harbor's verifier are all real: GRPO has to discover from the
verifier's rewards which command each task rewards, and the mean reward rises as it does.

How the weights make it work (hidden size 64, one decoder layer, MLP switched off):

- every task's instruction has a distinctive first line (its title); the tokenizer holds it as
  one token, embedded on a *feature* direction plus the task's own direction;
- the attention's keys are non-zero only for feature tokens (task titles and candidate calls),
  and the query of the generation header is large, so the header attends to the feature tokens
  of its context only: before any tool call that is the task's title, which puts the task's
  direction into the residual stream; after a call, the call token dominates and puts a *done*
  direction there;
- ``lm_head`` maps a task direction to that task's right call and to the three shared wrong
  calls (each with the same logit), the *done* direction to ``<|im_end|>`` (the turn ends
  after one tool call), and each call token to ``<|im_end|>``.

Nothing stops the gradient: GRPO updates every weight (embeddings, attention, ``lm_head``).

Requires the ``train`` extra (torch, transformers, trl, tokenizers).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from trl_harbor.rollout.suite import TaskInfo

__all__ = ["WRONG_COMMANDS", "DemoPolicy", "DemoPolicyError", "build_demo_policy", "task_title"]

#: Wrong candidate commands, offered on every task: look without answering, answer with the
#: first line of the data, answer 0.
WRONG_COMMANDS: tuple[str, ...] = (
    "ls /workdir/data",
    "head -q -n 1 /workdir/data/* > /workdir/answer.txt",
    "echo -n 0 > /workdir/answer.txt",
)

_HIDDEN = 64
_HEADS = 4
_HEAD_DIM = _HIDDEN // _HEADS
# Residual-stream directions (the rest of the 64 are left to the random initialisation).
_BIAS, _FEATURE, _CALL, _DONE = 0, 1, 2, 3
_FIRST_TASK = 4
#: The largest suite the demo policy can tell apart (one residual direction per task).
MAX_TASKS = _HIDDEN - _FIRST_TASK
# The query/key live on the lowest-frequency rotary pair of each head, where RoPE hardly rotates.
_QK_DIM = _HEAD_DIM // 2 - 1


class DemoPolicyError(ValueError):
    """The suite cannot be played by the demo policy (too many tasks, indistinct instructions)."""


@dataclass
class DemoPolicy:
    """The demo policy and what it chooses from.

    Attributes:
        model: The tiny ``Qwen3ForCausalLM``.
        tokenizer: Its tokenizer (Qwen3 chat template, so TRL parses its tool calls).
        right: Task name → the right candidate command.
        wrong: The wrong candidate commands (shared by every task).
        titles: Task name → the instruction line that identifies the task.
    """

    model: Qwen3ForCausalLM
    tokenizer: PreTrainedTokenizerFast
    right: dict[str, str] = field(default_factory=dict)
    wrong: tuple[str, ...] = WRONG_COMMANDS
    titles: dict[str, str] = field(default_factory=dict)


def task_title(instruction: str) -> str:
    """The first non-empty line of an instruction, stripped.

    Args:
        instruction: The task's ``instruction.md`` text.

    Returns:
        The line (empty when the instruction is blank).
    """
    return next((line.strip() for line in instruction.splitlines() if line.strip()), "")


def _right_command(task: TaskInfo) -> str:
    solve = Path(task.path, "solution", "solve.sh")
    if solve.is_file():
        return solve.read_text(encoding="utf-8").strip()
    gold = (task.metadata or {}).get("gold_answer")
    if gold is None:
        raise DemoPolicyError(
            f"{task.path}: the demo policy needs a reference solution (solution/solve.sh) or a "
            "[metadata] gold_answer for every task."
        )
    return f"echo -n {shlex.quote(str(gold))} > /workdir/answer.txt"


def build_demo_policy(
    tasks: Sequence[TaskInfo], instructions: Sequence[str], prompt_suffix: str = "", seed: int = 0
) -> DemoPolicy:
    """Build the demo policy for a suite.

    Args:
        tasks: The suite's tasks (``HarborSpec.tasks``).
        instructions: Their ``instruction.md`` texts, in the same order.
        prompt_suffix: The harness's ``PROMPT_SUFFIX`` (part of every prompt).
        seed: Seed of the random initialisation of the weights the construction leaves alone.

    Returns:
        The policy.

    Raises:
        DemoPolicyError: With more than :data:`MAX_TASKS` tasks, or when two tasks share the
            first line of their instruction (the policy tells tasks apart by it).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_harbor.testing import build_tokenizer, tool_call_text

    if len(tasks) > MAX_TASKS:
        raise DemoPolicyError(
            f"the demo policy tells at most {MAX_TASKS} tasks apart, the selection has {len(tasks)}; "
            "choose fewer tasks."
        )
    titles = {task.name: task_title(text) for task, text in zip(tasks, instructions, strict=True)}
    texts = [*instructions, prompt_suffix]
    for task in tasks:
        title = titles[task.name]
        clashes = [other.name for other, t in zip(tasks, texts, strict=False) if other is not task and title in t]
        if not title or clashes or title in prompt_suffix:
            raise DemoPolicyError(
                f"{task.path}/instruction.md: the demo policy tells tasks apart by the first line of "
                f"their instruction, and {title!r} is {'empty' if not title else 'not unique'}"
                f"{' (also in ' + ', '.join(clashes) + ')' if clashes else ''}."
            )
    right = {task.name: _right_command(task) for task in tasks}
    calls = {command: tool_call_text("bash", {"command": command}) for command in [*right.values(), *WRONG_COMMANDS]}
    tokenizer = build_tokenizer(corpus=[*instructions, prompt_suffix], extra_tokens=[*titles.values(), *calls.values()])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=_HIDDEN,
            intermediate_size=2 * _HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=_HEADS,
            num_key_value_heads=_HEADS,
            head_dim=_HEAD_DIM,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def token(text: str) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:  # cannot happen for added tokens; guards the construction
            raise DemoPolicyError(f"{text[:60]!r} is {len(ids)} tokens, not one")
        return ids[0]

    header = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    header_id = tokenizer(header, add_special_tokens=False)["input_ids"][-1]
    title_ids = {name: token(title) for name, title in titles.items()}
    call_ids = {command: token(text) for command, text in calls.items()}
    eos = tokenizer.eos_token_id

    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        layer = model.model.layers[0]
        attn = layer.self_attn
        # The designated directions carry nothing but what is set below.
        embed[:, : _FIRST_TASK + len(tasks)] = 0.0
        head[:, : _FIRST_TASK + len(tasks)] = 0.0
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.down_proj):
            proj.weight.zero_()
        embed[header_id] = 0.0
        embed[header_id, _BIAS] = 1.0
        for h in range(_HEADS):  # every head attends the same way: query from the header, keys from features
            attn.q_proj.weight[h * _HEAD_DIM + _QK_DIM, _BIAS] = 1.0
            attn.k_proj.weight[h * _HEAD_DIM + _QK_DIM, _FEATURE] = 1.0
        attn.q_norm.weight.fill_(4.0)  # score 4 * 4 * 4 = 64 on a feature token, 0 elsewhere
        attn.k_norm.weight.fill_(4.0)
        for slot, name in enumerate(titles):
            direction = _FIRST_TASK + slot
            embed[title_ids[name]] = 0.0
            embed[title_ids[name], _FEATURE] = 1.0
            embed[title_ids[name], direction] = 1.0
            attn.v_proj.weight[direction, direction] = 1.0
            # ~5.66 per unit after the norms, scaled to match the header's bias direction
            attn.o_proj.weight[direction, direction] = 1.0 / 5.66
        for call in call_ids.values():
            embed[call] = 0.0
            embed[call, _FEATURE] = 10.0
            embed[call, _CALL] = 10.0
        attn.v_proj.weight[_DONE, _CALL] = 1.0
        attn.o_proj.weight[_DONE, _DONE] = 10.0
        strength = 4.0
        head[eos, _CALL] = 6.0
        head[eos, _DONE] = 6.0
        for slot, name in enumerate(titles):
            head[call_ids[right[name]], _FIRST_TASK + slot] = 2 * strength
        for command in WRONG_COMMANDS:
            head[call_ids[command], _BIAS] = strength
            head[call_ids[command], _FIRST_TASK : _FIRST_TASK + len(tasks)] = strength
    return DemoPolicy(model=model, tokenizer=tokenizer, right=right, titles=titles)
