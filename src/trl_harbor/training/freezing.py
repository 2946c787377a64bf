"""Train only a model's top transformer blocks: the cheap way to fine-tune on a CPU.

The blocks below, the embeddings (and an output head tied to them) are frozen before the
optimizer is made. The backward pass then stops at the lowest trained block, the frozen blocks
keep no activations for it, and the optimizer holds state for the trained blocks only. For the
embedded default run (SmolLM2-135M, 30 blocks, prompts of ~600 tokens on 2 cores) backward was
the largest part of a step; see ``docs/cli.md`` for the measured effect.

Example:
    ```python
    from trl_harbor.training.freezing import train_top_layers

    trainer = HarborGRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", ...)
    train_top_layers(trainer.model, 4)  # before trainer.train(): its optimizer sees the rest frozen
    trainer.train()
    ```
"""

from __future__ import annotations

from typing import Any

__all__ = ["FreezeError", "train_top_layers"]

#: Names of a decoder's final normalization, across the common architectures (Llama/Qwen/Mistral/SmolLM,
#: GPT-2/GPT-J, OPT/Phi).
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


class FreezeError(ValueError):
    """The model's blocks cannot be found, or fewer blocks than asked for exist."""


def _blocks(model: Any) -> tuple[Any, Any]:
    """The decoder module and its list of transformer blocks."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if count is not None:
        lists = [m for m in lists if len(m) == count] or lists
    if len(lists) != 1:
        raise FreezeError(
            f"cannot tell the transformer blocks of {type(model).__name__} (found {len(lists)} lists of modules "
            "on its decoder); train the whole model (leave --trainable_layers out)"
        )
    return decoder, lists[0]


def train_top_layers(model: Any, layers: int) -> tuple[int, int]:
    """Freeze everything but the top ``layers`` transformer blocks and the final norm.

    Call it before the trainer makes its optimizer (before ``trainer.train()``).

    Args:
        model: A Hugging Face causal language model (its decoder's blocks are one ``ModuleList``).
        layers: How many blocks, counted from the top, train (at least 1, at most all).

    Returns:
        ``(trainable, total)`` parameter counts after freezing.

    Raises:
        FreezeError: When the model's blocks cannot be told apart, or it has fewer than ``layers``.
    """
    decoder, blocks = _blocks(model)
    if not 1 <= layers <= len(blocks):
        raise FreezeError(
            f"--trainable_layers {layers}: {type(model).__name__} has {len(blocks)} transformer blocks; "
            f"give 1 to {len(blocks)}, or leave it out to train the whole model"
        )
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trained = list(blocks)[-layers:]
    trained += [getattr(decoder, name) for name in _FINAL_NORMS if getattr(decoder, name, None) is not None]
    for module in trained:
        for parameter in module.parameters():
            parameter.requires_grad_(True)
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
