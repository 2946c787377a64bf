"""What makes a GRPO step cheap on a CPU, each checked against TRL's own path on a tiny real model.

- :class:`~trl_harbor.training.trainer.SharedPrefixMixin`: the prompts' shared beginning runs once per turn
  (greedy completions are TRL's, token for token) and once in the loss's forward pass
  (log-probabilities, entropies and gradients are TRL's).
- :func:`~trl_harbor.training.trl_compat.completion_only_lm_head`: the fused LM head scores the completion's
  positions only; the log-probabilities are TRL's.
- :func:`~trl_harbor.training.freezing.train_top_layers`: only the top blocks get gradients.
- The trainer reports its generation and model update as progress phases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import one_step_grpo_config

from trl_harbor import progress


def _trainer(tmp_path: Path, tokenizer, model, **config):
    from datasets import Dataset

    from trl_harbor.training.trainer import HarborGRPOTrainer

    args = one_step_grpo_config(tmp_path, max_completion_length=12, seed=1, **config)
    return HarborGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "Count the files."}]}] * 2),
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
    )


@pytest.fixture
def tiny():
    from trl_harbor.testing import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    return tokenizer, build_model(tokenizer, seed=3)


def _prompts(tokenizer) -> list[list[int]]:
    """Four prompts sharing a long system message, then different requests."""
    system = {"role": "system", "content": "You are brief. You answer with one shell command and nothing else. " * 3}
    asks = ["List the files.", "Count the lines of /workdir/data/a.csv, please.", "Hi", "Print the date."]
    return [
        list(tokenizer.apply_chat_template([system, {"role": "user", "content": a}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for a in asks
    ]  # fmt: skip


def test_the_trainer_generates_as_trl_does_running_the_shared_beginning_once(tmp_path: Path, tiny) -> None:
    from trl import GRPOTrainer

    tokenizer, model = tiny
    trainer = _trainer(tmp_path, tokenizer, model, generation_kwargs={"do_sample": False})
    prompts = _prompts(tokenizer)
    run: list[int] = []  # tokens each forward pass is given
    hook = model.register_forward_pre_hook(lambda _m, a, kw: run.append(kw["input_ids"].numel()), with_kwargs=True)
    try:
        theirs, _ = GRPOTrainer._generate_single_turn(trainer, prompts, None, {}, 1)
        their_tokens, run[:] = sum(run), []
        ours, logprobs = trainer._generate_single_turn(prompts, None, {}, 1)
        our_tokens = sum(run)
    finally:
        hook.remove()
    assert ours == theirs and logprobs is None  # greedy: the same completions, token for token
    assert any(len(ids) > 1 for ids in ours)
    shared = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)
    assert shared >= 32
    assert our_tokens <= their_tokens - 2 * shared  # the shared part ran once, not four times


def test_prompts_sharing_little_keep_trls_path(tmp_path: Path, tiny) -> None:
    from trl import GRPOTrainer

    tokenizer, model = tiny
    trainer = _trainer(tmp_path, tokenizer, model, generation_kwargs={"do_sample": False})
    prompts = [tokenizer.encode("Hi there"), tokenizer.encode("List the files, then count them.")]
    theirs, _ = GRPOTrainer._generate_single_turn(trainer, prompts, None, {}, 1)
    assert trainer._generate_single_turn(prompts, None, {}, 1)[0] == theirs


def _scoring_batch(tokenizer, prompts: list[list[int]], completion_lengths: list[int]):
    """TRL's scoring layout: prompts left-padded, completions right-padded after them."""
    import torch

    generator = torch.Generator().manual_seed(0)
    width, longest = max(map(len, prompts)), max(completion_lengths)
    ids, mask = [], []
    for prompt, length in zip(prompts, completion_lengths, strict=True):
        completion = torch.randint(5, len(tokenizer) - 1, (length,), generator=generator).tolist()
        pad = width - len(prompt)
        ids.append([tokenizer.pad_token_id] * pad + prompt + completion + [tokenizer.pad_token_id] * (longest - length))
        mask.append([0] * pad + [1] * (len(prompt) + length) + [0] * (longest - length))
    return torch.tensor(ids), torch.tensor(mask), longest


def test_the_loss_runs_the_shared_beginning_once_and_scores_as_trl_does(tmp_path: Path, tiny) -> None:
    import torch
    from trl import GRPOTrainer

    tokenizer, model = tiny
    trainer = _trainer(tmp_path, tokenizer, model)
    # In float64: in float32, PyTorch's CPU attention kernel rounds two layouts of the same sums apart
    # by ~1e-3; in float64 they agree to rounding.
    model.double()
    prompts = _prompts(tokenizer)
    prompts = [prompts[0], prompts[0], *prompts[1:], prompts[2]]  # samples of one task, and other tasks
    ids, mask, keep = _scoring_batch(tokenizer, prompts, [5, 7, 3, 7, 6, 2])

    def score(method):
        model.zero_grad()
        logps, entropies, _ = method(model, ids, mask, keep, batch_size=4, compute_entropy=True)
        weights = torch.linspace(-1, 1, logps.numel()).reshape(logps.shape)  # any loss of both
        ((logps * weights).sum() + entropies.sum()).backward()
        return logps.detach(), entropies.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    run: list[int] = []  # tokens each forward pass of the decoder is given
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(lambda _m, a, kw: run.append(kw["input_ids"].numel()), with_kwargs=True)
    try:
        theirs = score(lambda *a, **kw: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **kw))
        their_tokens, run[:] = sum(run), []
        ours = score(trainer._get_per_token_logps_and_entropies)
        our_tokens = sum(run)
    finally:
        hook.remove()
    completion = mask[:, -keep:].bool()
    assert torch.allclose(ours[0][completion], theirs[0][completion], atol=1e-9)
    assert torch.allclose(ours[1][completion], theirs[1][completion], atol=1e-9)
    for name, grad in theirs[2].items():  # TRL's LM head accumulates in float32: its rounding, no more
        assert torch.linalg.norm(ours[2][name] - grad) <= 1e-5 * torch.linalg.norm(grad), name
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert our_tokens <= their_tokens - (len(prompts) - 1) * shared  # the shared part ran once


def test_the_completion_only_lm_head_scores_as_trls(tmp_path: Path, tiny) -> None:
    import torch
    from trl import GRPOTrainer
    from trl.trainer import utils as trl_utils

    from trl_harbor.training.trl_compat import completion_only_lm_head

    tokenizer, model = tiny
    trainer = _trainer(tmp_path, tokenizer, model)
    model.double()  # float32 attention rounds the shared-prefix layout apart (see the test above)
    prompts = _prompts(tokenizer)
    width = max(map(len, prompts)) + 6
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    ids[:, -6:] = torch.randint(5, len(tokenizer) - 1, (len(prompts), 6))
    mask = (ids != tokenizer.pad_token_id).long()
    mask[:, -6:] = 1

    scored: list[int] = []  # positions the LM head projected
    original = trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *rest):
        scored.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return original(hidden, *rest)

    trl_utils._ChunkedLogProbFunction.apply = counting
    try:
        plain, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, 6)
        with completion_only_lm_head() as switched:
            compact, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, 6)
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 6)
    finally:
        trl_utils._ChunkedLogProbFunction.apply = original
    assert switched
    assert torch.allclose(plain, compact, atol=1e-9) and torch.allclose(compact, ours, atol=1e-9)
    # every position (but the last), then the completion's only: in the switch and in the trainer's own call
    assert scored == [len(prompts) * (width - 1), len(prompts) * 6, len(prompts) * 6]
    assert trl_utils._use_triton(torch.device("cpu")) is False  # restored


def test_only_the_top_blocks_train(tiny) -> None:
    import torch

    from trl_harbor.testing import build_model
    from trl_harbor.training.freezing import FreezeError, train_top_layers

    tokenizer, _ = tiny
    model = build_model(tokenizer, num_layers=4, seed=0)
    trainable, total = train_top_layers(model, 1)
    assert trainable == sum(p.numel() for p in [*model.model.layers[3].parameters(), *model.model.norm.parameters()])
    assert total == sum(p.numel() for p in model.parameters())
    ids = torch.tensor([tokenizer.encode("List the files and count them.")])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.model.layers[3].parameters())
    assert all(p.grad is None for p in model.model.layers[2].parameters())
    assert model.lm_head.weight.grad is None and model.model.embed_tokens.weight.grad is None
    with pytest.raises(FreezeError, match="has 4 transformer blocks"):
        train_top_layers(model, 5)


def test_a_step_reports_its_generation_and_model_update(tmp_path: Path, tiny) -> None:
    tokenizer, model = tiny
    trainer = _trainer(tmp_path, tokenizer, model)
    seen: list[tuple[str, int, int]] = []
    previous = progress.set_reporter(lambda phase, done, total: seen.append((phase, done, total)))
    try:
        trainer.train()
    finally:
        progress.set_reporter(previous)
    assert [s for s in seen if s[0] == "generation"] == [("generation", 0, 1), ("generation", 1, 1)]
    update = [s for s in seen if s[0] == "model update"]
    assert update[0] == ("model update", 0, 1) and update[-1] == ("model update", 1, 1)
    first_update = seen.index(("model update", 0, 1))
    assert seen.index(("generation", 1, 1)) < first_update  # the update follows the sampling
