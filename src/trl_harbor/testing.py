"""Tiny, offline CPU models for tests and smoke runs (no hub download).

:func:`build_tokenizer` trains a byte-level BPE tokenizer with ``tokenizers`` and gives it
TRL's bundled Qwen3 chat template, so TRL recognises the Qwen3 tool-call format.
:func:`build_model` makes a small random ``Qwen3ForCausalLM``. :func:`script_tool_calls`
rigs such a model into a *bigram* policy whose next token depends only on the current one,
so that after the assistant header it samples one of a few scripted tool calls and then
ends its turn: a random tiny model would almost never emit a valid tool call, and tests of
the tool loop need real calls.

Requires the ``train`` extra (torch, transformers, trl, tokenizers); each function imports what it
needs when called.

:func:`check_backend` (from :mod:`trl_harbor.rollout.conformance`, loaded on first use) checks that a
Harbor backend does what trl-harbor's rollout core relies on, as Gymnasium's ``check_env`` checks an
environment: it needs Harbor only, not the ``train`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from trl_harbor.rollout.conformance import BackendConformanceError, ConformanceReport, check_backend

__all__ = [
    "SPECIAL_TOKENS",
    "BackendConformanceError",
    "ConformanceReport",
    "build_model",
    "build_tokenizer",
    "check_backend",
    "qwen3_chat_template",
    "script_tool_calls",
    "tool_call_text",
]

#: The backend conformance check's public names, loaded from the rollout core on first use.
_CONFORMANCE = ("BackendConformanceError", "ConformanceReport", "check_backend")


def __getattr__(name: str) -> Any:
    if name in _CONFORMANCE:
        from trl_harbor.rollout import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'trl_harbor.testing' has no attribute {name!r}")


#: Control tokens (skipped when decoding) and the Qwen3 markup tokens (kept when decoding).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)

_BASE_CORPUS = (
    "You are a helpful assistant. Use the bash tool to run shell commands in the sandbox.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "ls /workdir"}}\n</tool_call><|im_end|>\n',
    "<|im_start|>user\n<tool_response>\nanswer.txt data\n</tool_response><|im_end|>\n",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", '
    '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}',
    "echo -n 42 > /workdir/answer.txt; cat /workdir/data/*.csv | head; python3 -c 'print(1)'",
)


def qwen3_chat_template() -> str:
    """Return TRL's bundled Qwen3 chat template, verbatim (TRL matches it by equality).

    Returns:
        The Jinja template text.
    """
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


def build_tokenizer(
    corpus: Iterable[str] = (), vocab_size: int = 1024, extra_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer set up like Qwen3's.

    Args:
        corpus: Extra training text (e.g. the task instructions, so prompts stay short).
        vocab_size: Target vocabulary size of the BPE model.
        extra_tokens: Extra whole-string tokens to add (not special, so they survive decoding).

    Returns:
        A ``PreTrainedTokenizerFast`` with the Qwen3 chat template, ``eos_token`` ``<|im_end|>``,
        ``pad_token`` ``<|endoftext|>`` and left padding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*_BASE_CORPUS, *corpus], trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*MARKUP_TOKENS, *extra_tokens)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    fast.chat_template = qwen3_chat_template()
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2, seed: int = 0
) -> Qwen3ForCausalLM:
    """Build a small random ``Qwen3ForCausalLM`` for the tokenizer (float32, CPU).

    Args:
        tokenizer: The tokenizer whose vocabulary the model covers.
        hidden_size: Width of the model.
        num_layers: Number of decoder layers.
        seed: Torch seed for the random initialisation.

    Returns:
        The model, with its generation config's EOS / pad tokens set from the tokenizer.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """Qwen3's text for one tool call.

    Args:
        name: The tool's name.
        arguments: The call's arguments.

    Returns:
        ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``.
    """
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def script_tool_calls(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, calls: Sequence[str], strength: float = 6.0
) -> None:
    """Rig ``model`` so that after the assistant header it emits one of ``calls``, then ends its turn.

    Each entry of ``calls`` must be a single token of ``tokenizer`` (add it with
    ``build_tokenizer(extra_tokens=...)``). The decoder layers' output projections are
    zeroed, so the model's next token depends only on the current token (a bigram model);
    the embeddings and ``lm_head`` are then set so that the last token of the generation
    prompt leads to each scripted call with equal probability, and each call to
    ``<|im_end|>``. The model stays a regular, trainable ``Qwen3ForCausalLM``.

    Args:
        model: The model from :func:`build_model` (modified in place).
        tokenizer: Its tokenizer.
        calls: Whole-token tool-call texts to choose from.
        strength: Logit scale of the scripted transitions (``8 * strength`` with the default
            width).

    Raises:
        ValueError: When a call is not a single token.
    """
    import torch

    header = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    source = tokenizer(header, add_special_tokens=False)["input_ids"][-1]
    call_ids = []
    for call in calls:
        ids = tokenizer(call, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"scripted call {call!r} is {len(ids)} tokens; add it to the tokenizer as one token")
        call_ids.append(ids[0])
    transitions = {source: call_ids, **{c: [tokenizer.eos_token_id] for c in call_ids}}
    hidden = model.config.hidden_size
    if len(transitions) > hidden:
        raise ValueError(f"at most {hidden} scripted source tokens fit in the model width")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis = torch.eye(hidden)
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        for slot, (src, targets) in enumerate(transitions.items()):
            embed[src] = basis[slot]
            for target in targets:
                head[target] += strength * basis[slot]
