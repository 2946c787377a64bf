"""A stand-in for a vLLM server, for the one thing this project's CI cannot run: vLLM itself (it needs a GPU).

It answers the two routes :class:`trl_harbor.loop.capture.VLLMSampler` calls — ``GET /v1/models`` and
``POST /v1/completions`` with token-id prompts, ``logprobs=0``, ``return_token_ids`` and
``return_tokens_as_token_ids`` — in vLLM's response shape, sampling from a CPU model with
:class:`trl_harbor.loop.capture.ModelSampler`. It tests the sampler's wire format and plumbing, not
vLLM. Every request body is kept in :attr:`FakeVLLM.requests`.
"""

from __future__ import annotations

from typing import Any


class FakeVLLM:
    """An aiohttp server on loopback answering like ``trl vllm-serve`` (see the module docstring).

    Args:
        model: The CPU model that samples.
        tokenizer: Its tokenizer (for the stop token).
        model_name: The name ``/v1/models`` reports.
    """

    def __init__(self, model: Any, tokenizer: Any, model_name: str = "fake-policy") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.requests: list[dict[str, Any]] = []
        self.base_url: str | None = None
        self._runner: Any = None

    async def start(self) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _completions(self, request: Any) -> Any:
        import asyncio

        from aiohttp import web

        from trl_harbor.loop.capture import GenerationRequest, ModelSampler, SamplingParams

        body = await request.json()
        self.requests.append(body)
        sampling = SamplingParams(
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=max(0, body["top_k"]),
            min_p=body["min_p"],
            max_tokens=body["max_tokens"],
        )
        sampler = ModelSampler(self.model, [self.tokenizer.eos_token_id], sampling)
        choices = []
        for prompt in body["prompt"]:
            [generation] = await asyncio.to_thread(
                sampler.generate, [GenerationRequest(list(prompt), body["max_tokens"], body.get("seed"))]
            )
            choices.append(
                {
                    "index": len(choices),
                    "text": "",
                    "prompt_token_ids": list(prompt),
                    "token_ids": generation.completion_ids,
                    "finish_reason": generation.finish_reason,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in generation.completion_ids],
                        "token_logprobs": generation.logprobs,
                        "top_logprobs": [{} for _ in generation.completion_ids],
                        "text_offset": [0 for _ in generation.completion_ids],
                    },
                }
            )
        return web.json_response(
            {"id": "cmpl-fake", "object": "text_completion", "model": self.model_name, "choices": choices}
        )
