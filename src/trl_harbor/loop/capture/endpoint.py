"""The capture endpoint: an OpenAI-compatible server on loopback that serves the policy being trained.

A loop-owning agent (Terminus-2, ...) owns its turn loop and calls a model through an OpenAI
API. Point it at a **route** of this endpoint — one per rollout, ``{base}/r/<route>/v1`` — and
every call is answered by the policy being trained, while the route's :class:`~.trace.Trace`
records what the policy saw and sampled, token for token (token-in/token-out, forks, retries,
re-tokenisation drift). Every reply carries, besides the text, the exact prompt and completion
token ids and the log-probabilities, in vLLM's fields (``prompt_token_ids``,
``choices[0].token_ids``, ``choices[0].logprobs.content``), which is what Harbor records as its
agents' rollout details.

The endpoint, not the agent, decides how to sample (:class:`~.samplers.SamplingParams`): the
agent's ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ... are ignored and counted on the
route (:attr:`Route.overridden`). A route may have a token **budget**: the tokens of the rollout
after its first prompt (sampled and bridged alike, as TRL's ``max_completion_length`` counts a
multi-turn completion). A call that would pass it is refused with OpenAI's context-length error,
which agents treat as the end of their context.

Only ``POST .../chat/completions`` (not streamed) and ``GET .../models`` are served. The server
binds ``127.0.0.1`` on a free port; a route's id is random and is its only credential, so other
local processes cannot use a route they were not given, and sandboxes (which cannot reach the
host's loopback) never reach it at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trl_harbor.loop.capture.samplers import Generation, GenerationRequest, Sampler, SamplingParams, derive_seed
from trl_harbor.loop.capture.trace import Pending, Renderer, Trace, Turn, drift

__all__ = ["CaptureEndpoint", "Route", "serving"]

logger = logging.getLogger(__name__)

#: Request fields that ask for a way of sampling, which the endpoint overrides.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
)


@dataclass(eq=False)
class Route:
    """One rollout's door into the endpoint.

    Attributes:
        id: The route's random id (part of its URL, its only credential).
        url: The OpenAI base URL to give the agent (``{base}/r/<id>/v1``).
        trace: What the policy saw and sampled on this route.
        budget: The most tokens after the first prompt (``None``: no budget but the model's).
        seed: The base of the route's per-call seeds (``None``: unseeded).
        label: A name for logs (the task).
        calls: Model calls answered.
        overridden: How often the agent asked for each sampling field the endpoint ignored.
        refused: Why the last call was refused (``"budget"``, ``"context"``), or ``None``.
        failure: Why the policy backend could not answer (the rollout is lost), or ``None``.
        sample_seconds: Time spent sampling this route's calls.
    """

    id: str
    url: str
    trace: Trace
    budget: int | None = None
    seed: int | None = None
    label: str = ""
    calls: int = 0
    overridden: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: str | None = None
    failure: str | None = None
    sample_seconds: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _failed: asyncio.Event = field(default_factory=asyncio.Event)
    _checks: set[asyncio.Future[None]] = field(default_factory=set)

    async def wait_failed(self) -> None:
        """Return once the policy backend failed on this route (never, if it does not)."""
        await self._failed.wait()


class _Dispatcher:
    """Hands requests to the sampler on worker threads: ``concurrency`` calls at once, ``max_batch`` per call."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.pool = ThreadPoolExecutor(max_workers=max(1, sampler.concurrency), thread_name_prefix="capture-sampler")
        self.pending: list[tuple[GenerationRequest, asyncio.Future[Generation]]] = []
        self.running = 0

    async def generate(self, request: GenerationRequest) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        self._pump()
        return await future

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending and self.running < max(1, self.sampler.concurrency):
            batch = self.pending[: max(1, self.sampler.max_batch)]
            del self.pending[: len(batch)]
            self.running += 1
            job = loop.run_in_executor(self.pool, self.sampler.generate, [request for request, _ in batch])
            job.add_done_callback(lambda done, batch=batch: self._finished(done, batch))

    def _finished(self, job: asyncio.Future[list[Generation]], batch: list[Any]) -> None:
        self.running -= 1
        error = job.exception() if not job.cancelled() else asyncio.CancelledError()
        results = None if error is not None else job.result()
        if results is not None and len(results) != len(batch):
            error = RuntimeError(f"the sampler answered {len(results)} of {len(batch)} requests")
        for index, (_, future) in enumerate(batch):
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(results[index])  # type: ignore[index]
        self._pump()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class CaptureEndpoint:
    """An OpenAI-compatible chat-completions server on loopback, one route per rollout.

    Start it on the event loop the agents run on (:meth:`start`), open a route per rollout
    (:meth:`open_route`), give the agent ``route.url``; when the rollout is over, :meth:`close_route`,
    ``await`` :meth:`settle` and read ``route.trace``.

    Args:
        sampler: The policy backend (:class:`~.samplers.ModelSampler`, :class:`~.samplers.VLLMSampler`).
        renderer: The policy's chat template.
        sampling: How to sample (pinned: the agent's parameters are ignored).
        model_name: The model name the endpoint reports.
        max_model_len: The policy's context (prompt and completion); ``None``: unbounded.
        check_drift: Measure on every turn what re-tokenising the agent's history would change (after
            the reply, on a copy of the tokenizer: it does not delay the agent; :meth:`settle` waits for it).
        host: The address to bind (loopback).
        port: The port (0: a free one).
    """

    def __init__(
        self,
        sampler: Sampler,
        renderer: Renderer,
        sampling: SamplingParams,
        *,
        model_name: str = "policy",
        max_model_len: int | None = None,
        check_drift: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.sampler = sampler
        self.renderer = renderer
        self.sampling = sampling
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.check_drift = check_drift
        self.host = host
        self.port = port
        self.routes: dict[str, Route] = {}
        self.base_url: str | None = None
        self._runner: Any = None
        self._dispatcher: _Dispatcher | None = None
        self._drift_renderer: Renderer | None = None

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self._runner is not None

    async def start(self) -> str:
        """Start listening (idempotent).

        Returns:
            The server's base URL (``http://127.0.0.1:<port>``).
        """
        if self._runner is not None:
            return self.base_url  # type: ignore[return-value]
        from aiohttp import web

        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/r/{route}/v1/chat/completions", self._chat)
        app.router.add_get("/r/{route}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        port = runner.addresses[0][1]
        self._runner = runner
        self._dispatcher = _Dispatcher(self.sampler)
        self.base_url = f"http://{self.host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        """Stop listening and drop every route (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self._dispatcher is not None:
            self._dispatcher.close()
            self._dispatcher = None
        self.routes.clear()

    def open_route(self, *, budget: int | None = None, seed: int | None = None, label: str = "") -> Route:
        """Open a route for one rollout.

        Args:
            budget: The most tokens after the first prompt (``None``: none but the model's context).
            seed: The base of the route's per-call seeds (``None``: unseeded).
            label: A name for logs.

        Returns:
            The route (give the agent ``route.url``; any API key is accepted).

        Raises:
            RuntimeError: When the endpoint is not started.
        """
        if self.base_url is None:
            raise RuntimeError("the capture endpoint is not started")
        route_id = secrets.token_hex(12)
        route = Route(
            route_id,
            f"{self.base_url}/r/{route_id}/v1",
            Trace(self.renderer, check_drift=False),  # measured here, after each reply
            budget=budget,
            seed=seed,
            label=label,
        )
        self.routes[route_id] = route
        return route

    def close_route(self, route: Route) -> None:
        """Stop answering a route (its trace stays readable)."""
        self.routes.pop(route.id, None)

    # ── HTTP ───────────────────────────────────────────────────────────────────────

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        if request.match_info["route"] not in self.routes:
            return _error(404, "no such route", "not_found")
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _chat(self, request: Any) -> Any:
        route = self.routes.get(request.match_info["route"])
        if route is None:
            return _error(404, "no such route (the rollout is over, or it was never opened)", "not_found")
        try:
            body = await request.json()
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("`messages` must be a non-empty list")
        except Exception as exc:  # noqa: BLE001 - any malformed request is the client's error
            return _error(400, f"malformed request: {exc}", "invalid_request_error")
        if body.get("stream"):
            return _error(400, "streaming is not supported by the capture endpoint", "invalid_request_error")
        for name in SAMPLING_FIELDS:
            if body.get(name) is not None:
                route.overridden[name] += 1
        async with route._lock:
            return await self._answer(route, messages)

    async def _answer(self, route: Route, messages: list[Any]) -> Any:
        from aiohttp import web

        pending = await asyncio.to_thread(route.trace.prepare, messages)
        prompt = pending.prompt_ids
        start = len(prompt) if pending.kind in ("first", "fork") else len(route.trace.segments[-1][0].prompt_ids)
        used = len(prompt) - start
        room = self.sampling.max_tokens
        if route.budget is not None:
            room = min(room, route.budget - used)
            if route.budget - used <= 0:
                route.refused = "budget"
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(prompt))
            if self.max_model_len - len(prompt) <= 0 and route.refused is None:
                route.refused = "context"
        if room <= 0:
            return _error(
                400,
                f"This model's maximum context length is exceeded: the request has {len(prompt)} prompt tokens, "
                f"{used} of them past the rollout's first prompt ({route.refused or 'budget'} exhausted).",
                "context_length_exceeded",
            )
        seed = None if route.seed is None else derive_seed(route.seed, route.calls)
        began = time.perf_counter()
        try:
            assert self._dispatcher is not None, "the capture endpoint is stopped"
            generation = await self._dispatcher.generate(GenerationRequest(list(prompt), room, seed))
        except Exception as exc:  # noqa: BLE001 - the backend's failure is the rollout's loss, not the agent's
            route.failure = f"the policy backend failed: {type(exc).__name__}: {exc}"
            route._failed.set()
            logger.warning("trl-harbor: capture route %s (%s): %s", route.id, route.label, route.failure)
            return _error(500, route.failure, "server_error")
        finally:
            route.sample_seconds += time.perf_counter() - began
        turn = route.trace.commit(pending, generation.completion_ids, generation.logprobs, generation.finish_reason)
        route.calls += 1
        if self.check_drift and pending.kind == "extend":  # diagnostic: measured after the reply, on its own tokenizer
            job = asyncio.ensure_future(asyncio.to_thread(self._measure_drift, turn, pending))
            route._checks.add(job)
            job.add_done_callback(route._checks.discard)
        return web.json_response(self._completion(route, turn))

    def _measure_drift(self, turn: Turn, pending: Pending) -> None:
        if self._drift_renderer is None:
            self._drift_renderer = self.renderer.copy()
        turn.drift = drift(self._drift_renderer, pending)

    async def settle(self, route: Route) -> None:
        """Wait until the route's trace is complete (its drift checks done); call before reading it."""
        while route._checks:
            await asyncio.gather(*list(route._checks), return_exceptions=True)

    def _completion(self, route: Route, turn: Turn) -> dict[str, Any]:
        tokens = self.renderer.token_strings(turn.completion_ids)
        return {
            "id": f"chatcmpl-{route.id}-{route.calls}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "prompt_token_ids": turn.prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": turn.text},
                    "finish_reason": turn.finish_reason,
                    "token_ids": turn.completion_ids,
                    "logprobs": {
                        "content": [
                            {"token": str(token), "logprob": _json_float(lp), "bytes": None, "top_logprobs": []}
                            for token, lp in zip(tokens, turn.logprobs, strict=True)
                        ]
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(turn.prompt_ids),
                "completion_tokens": len(turn.completion_ids),
                "total_tokens": len(turn.prompt_ids) + len(turn.completion_ids),
            },
        }


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _error(status: int, message: str, code: str) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if status == 400 else ("not_found_error" if status == 404 else "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


@contextlib.asynccontextmanager
async def serving(endpoint: CaptureEndpoint) -> Any:
    """Run ``endpoint`` for the duration of a block (a convenience for scripts and tests)."""
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.stop()
