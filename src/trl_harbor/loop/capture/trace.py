"""Token-in/token-out conversations: what the model saw and sampled, token for token, turn after turn.

A loop-owning agent (Terminus-2, ...) keeps its own chat history and sends the whole of it with
every model call. Re-tokenising that history each turn is the classic silent bug of multi-turn RL:
the chat template renders a past assistant message differently from how it was sampled (Qwen3
drops an empty ``<think>`` block, a reasoning parser moved text, a decode/encode round trip
merges bytes differently), so the tokens trained on are not the tokens sampled, and the
log-probabilities do not belong to them.

A :class:`Trace` does not re-tokenise. The first call's prompt is the chat template's rendering
of the agent's messages; every later call's prompt is **the previous prompt, the tokens the
model sampled, and the tokens of the messages the agent added** (the *bridge*: the end of the
assistant's turn, the new user message, the next generation prompt). One trajectory is then one
training row — the first prompt, and a completion in which the sampled tokens are trained
(mask 1) and the bridges are not (mask 0).

That holds only while the agent's history **extends** the previous turn: the previous request's
messages, then the reply exactly as returned, then new messages. When it does not (the agent
summarised, unwound or edited its history) the trace **forks**: the new prompt is rendered from
the messages, a new segment starts, and the fork is counted with where and why. A request that
repeats the previous one exactly is a **retry** (the agent never saw the reply): its turn is
sampled again in place. For every extending turn the trace also measures **drift**: how many
tokens a re-tokenisation of the agent's messages would have got wrong — the bug that
token-in/token-out avoids, made visible (:func:`drift`; the capture endpoint measures it off the
reply's critical path).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Fork", "Pending", "Renderer", "Row", "Trace", "Turn", "common_prefix", "drift"]

#: An assistant message's content that no real conversation contains (locates a turn's end).
_SENTINEL = "\x00trl-harbor-capture-sentinel\x00"


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """What of a chat message the template renders and the trace compares: role, content, reasoning."""
    kept = {"role": message.get("role"), "content": message.get("content")}
    if message.get("reasoning_content"):
        kept["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return kept


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class Renderer:
    """The chat template, as token-in/token-out needs it: a first prompt, and a bridge.

    Args:
        tokenizer: The policy's tokenizer (with its chat template).
        chat_template_kwargs: Extra arguments of the template (``enable_thinking=False``, ...).

    Raises:
        ValueError: When the template does not render an assistant message as its content
            followed by the end-of-turn token (``tokenizer.eos_token``): a bridge cannot be cut.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # a fast tokenizer must not be used by two threads at once
        self.kwargs = dict(chat_template_kwargs or {})
        self.eos_text: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.convert_tokens_to_ids(self.eos_text)
        probe = self._text([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], False)
        if _SENTINEL + self.eos_text not in probe:
            raise ValueError(
                "the chat template does not end an assistant message with its end-of-turn token "
                f"{self.eos_text!r} right after the content; token-in/token-out cannot cut a bridge"
            )

    def copy(self) -> Renderer:
        """The same template on a copy of the tokenizer (for another thread, without waiting on this one)."""
        import copy

        return Renderer(copy.deepcopy(self.tokenizer), self.kwargs)

    def _text(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        with self.lock:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs
            )

    def encode(self, text: str) -> list[int]:
        """Tokens of a rendered text (no special tokens added: the template wrote them)."""
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The template's rendering of ``messages`` with the generation prompt, as tokens."""
        return self.encode(self._text(messages, True))

    def bridge(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens that follow an assistant turn's end-of-turn token when ``messages`` come next.

        The template renders a placeholder conversation (a user message, an assistant message, then
        ``messages``, then the generation prompt); the bridge is everything after the assistant's
        end-of-turn token. It does not depend on the real history, so nothing already sampled is
        rendered again.

        Args:
            messages: The messages the agent added after the model's reply (at least one).

        Returns:
            The bridge's tokens.
        """
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._text([*base, *messages], True)
        marker = _SENTINEL + self.eos_text
        return self.encode(text[text.index(marker) + len(marker) :])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of sampled tokens, as the agent gets it (special tokens skipped)."""
        with self.lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's strings of some tokens (for per-token log-probability entries)."""
        with self.lock:
            return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]


@dataclass
class Turn:
    """One model call.

    Attributes:
        prompt_ids: The whole prompt of the call.
        bridge_ids: The tokens added since the previous turn's completion (the whole prompt for a
            segment's first turn).
        completion_ids: The tokens sampled.
        logprobs: Their log-probabilities under the policy that sampled them.
        finish_reason: ``"stop"`` (an end-of-turn token) or ``"length"`` (the turn's token budget).
        text: The reply as returned to the agent.
        drift: For a turn that extended the previous one: how many tokens of the prompt a
            re-tokenisation of the agent's messages would have changed (``None``: not checked).
    """

    prompt_ids: list[int]
    bridge_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    drift: int | None = None


@dataclass(frozen=True)
class Fork:
    """A turn whose history did not extend the previous turn.

    Attributes:
        turn: The index of the turn (over the whole trace) that started a new segment.
        reason: Where the history diverged.
    """

    turn: int
    reason: str


@dataclass
class Pending:
    """A prompt prepared for a request, not yet sampled.

    Attributes:
        kind: ``"first"``, ``"extend"``, ``"retry"`` or ``"fork"``.
        prompt_ids: The prompt to sample from.
        bridge_ids: What it adds to the previous turn (the whole prompt for ``first``/``fork``).
        messages: The request's messages (role and content).
        reason: For a fork: where the history diverged.
        drift: For ``extend``: the re-tokenisation drift (``None`` when not checked).
    """

    kind: str
    prompt_ids: list[int]
    bridge_ids: list[int]
    messages: list[dict[str, Any]]
    reason: str = ""
    drift: int | None = None


@dataclass
class Row:
    """One trajectory as one training row (TRL's ``rollout_func`` fields).

    Attributes:
        prompt_ids: The first turn's prompt.
        completion_ids: Every later token: sampled tokens and bridges, in order.
        env_mask: 1 for a sampled token, 0 for a bridge token (what the agent and the sandbox wrote).
        logprobs: The sampling log-probability of each sampled token, 0.0 for bridge tokens.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float]


@dataclass
class Trace:
    """One agent's conversation with the policy, captured token for token.

    Args:
        renderer: The chat template.
        check_drift: Measure, for every extending turn, what re-tokenising would have changed.
    """

    renderer: Renderer
    check_drift: bool = True
    segments: list[list[Turn]] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    retries: int = 0
    _request: list[dict[str, Any]] | None = None
    _reply: dict[str, Any] | None = None

    @property
    def turns(self) -> list[Turn]:
        """Every turn, in order, over every segment."""
        return [turn for segment in self.segments for turn in segment]

    @property
    def tokens(self) -> list[int]:
        """The current segment's tokens: its last prompt and completion."""
        if not self.segments:
            return []
        last = self.segments[-1][-1]
        return [*last.prompt_ids, *last.completion_ids]

    @property
    def drift_turns(self) -> int:
        """How many extending turns a re-tokenisation would have got wrong."""
        return sum(1 for turn in self.turns if turn.drift)

    def prepare(self, messages: Sequence[Mapping[str, Any]]) -> Pending:
        """Build the prompt for a request carrying the agent's whole history.

        Args:
            messages: The request's messages.

        Returns:
            The prepared prompt and how it relates to the previous turn.
        """
        request = [_message(m) for m in messages]
        renderer = self.renderer
        if not self.segments:
            ids = renderer.prompt(request)
            return Pending("first", ids, ids, request)
        if request == self._request:  # the agent sent the same request again: it never saw the reply
            last = self.segments[-1][-1]
            return Pending("retry", list(last.prompt_ids), list(last.bridge_ids), request, drift=last.drift)
        expected = [*(self._request or []), self._reply]
        if len(request) > len(expected) and request[: len(expected)] == expected:
            added = request[len(expected) :]
            bridge = renderer.bridge(added)
            last = self.segments[-1][-1]
            if not last.completion_ids or last.completion_ids[-1] != renderer.eos_id:
                bridge = [renderer.eos_id, *bridge]  # a reply cut by its budget: the template closes the turn
            ids = [*self.tokens, *bridge]
            pending = Pending("extend", ids, bridge, request)
            if self.check_drift:
                pending.drift = drift(renderer, pending)
            return pending
        ids = renderer.prompt(request)
        return Pending("fork", ids, ids, request, reason=_divergence(expected, request))

    def commit(
        self, pending: Pending, completion_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str
    ) -> Turn:
        """Record what was sampled for a prepared request.

        Args:
            pending: What :meth:`prepare` returned for the request.
            completion_ids: The sampled tokens.
            logprobs: Their log-probabilities (one per token).
            finish_reason: ``"stop"`` or ``"length"``.

        Returns:
            The recorded turn (its ``text`` is the reply to return).

        Raises:
            ValueError: When ``logprobs`` does not have one entry per token.
        """
        if len(logprobs) != len(completion_ids):
            raise ValueError(f"{len(completion_ids)} sampled tokens but {len(logprobs)} log-probabilities")
        text = self.renderer.decode(
            completion_ids[:-1] if completion_ids and completion_ids[-1] == self.renderer.eos_id else completion_ids
        )
        turn = Turn(
            list(pending.prompt_ids),
            list(pending.bridge_ids),
            list(completion_ids),
            [float(x) for x in logprobs],
            finish_reason,
            text,
            pending.drift,
        )
        if pending.kind == "retry":
            self.retries += 1
            self.segments[-1][-1] = turn
        elif pending.kind == "extend":
            self.segments[-1].append(turn)
        else:
            if pending.kind == "fork":
                self.forks.append(Fork(len(self.turns), pending.reason))
            self.segments.append([turn])
        self._request = pending.messages
        self._reply = {"role": "assistant", "content": text}
        return turn

    def row(self, segment: int = 0) -> Row | None:
        """One segment as one training row (default: the first, which starts at the task's prompt).

        Args:
            segment: Which segment.

        Returns:
            The row, or ``None`` when nothing was sampled.

        Raises:
            AssertionError: When a turn's prompt is not the previous tokens plus its bridge (a bug).
        """
        if segment >= len(self.segments):
            return None
        turns = self.segments[segment]
        prompt = list(turns[0].prompt_ids)
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for index, turn in enumerate(turns):
            if index:
                ids += turn.bridge_ids
                mask += [0] * len(turn.bridge_ids)
                logprobs += [0.0] * len(turn.bridge_ids)
            assert turn.prompt_ids == prompt + ids, "a turn's prompt does not extend the previous turn"
            ids += turn.completion_ids
            mask += [1] * len(turn.completion_ids)
            logprobs += turn.logprobs
        return Row(prompt, ids, mask, logprobs)


def drift(renderer: Renderer, pending: Pending) -> int:
    """How many tokens of an extending turn's prompt a re-tokenisation of the agent's messages changes.

    Args:
        renderer: The chat template (its own tokenizer: this may run on another thread).
        pending: The turn's prepared prompt.

    Returns:
        The length past the longest common prefix of the two (0: re-tokenising would be right).
    """
    full = renderer.prompt(pending.messages)
    return max(len(full), len(pending.prompt_ids)) - common_prefix(full, pending.prompt_ids)


def _divergence(expected: list[dict[str, Any] | None], request: list[dict[str, Any]]) -> str:
    """Where a request's history stops extending the previous turn, in words."""
    for index, (want, got) in enumerate(zip(expected, request, strict=False)):
        if want != got:
            what = "the model's reply" if index == len(expected) - 1 else f"message {index}"
            return f"{what} was changed ({_brief(want)} became {_brief(got)})"
    if len(request) < len(expected):
        return f"the history was cut from {len(expected)} to {len(request)} messages"
    return "the request added no message after the model's reply"


def _brief(message: Mapping[str, Any] | None) -> str:
    if message is None:
        return "nothing"
    content = str(message.get("content") or "")
    return f"{message.get('role')}: {content[:40]!r}{'...' if len(content) > 40 else ''}"
