"""What the capture endpoint costs per model call, against calling the model directly, in the same run.

A loop-owning agent (Terminus-2) calls its model over HTTP with its whole history; the capture
endpoint turns each call into token-in/token-out (the previous tokens plus the bridge of the new
message, and a drift check that re-renders the history), samples, and answers with token ids and
log-probabilities. This measures that per call, on conversations whose context grows turn by
turn (each turn adds an observation of ``--observation`` characters). Every endpoint call is
**paired** with a direct call of the same sampler on the exact prompt token ids the endpoint
built (same seed, same worker-thread hop), so the overhead is a per-call difference that the
machine's noise affects alike on both sides. Three clients:

* **raw HTTP**: an aiohttp client posting the messages, as any OpenAI client does;
* **raw HTTP, no drift check**: the same, the endpoint's drift check off (it runs after each reply,
  on its own thread, so it costs CPU, not latency, unless the CPU is saturated);
* **Harbor's LiteLLM**: Harbor's ``Chat``/``LiteLLM`` with rollout details, exactly what
  Terminus-2 calls (litellm's own client cost included).

Two policies: a *null sampler* that answers at once (the endpoint's cost alone) and the tiny CPU
test model (two tokens per reply). Prints the median direct call, the median endpoint call and
the median and p95 of the paired overhead, per context size.

    .venv/bin/python benchmarks/capture.py [--conversations 4] [--turns 10] [--observation 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from terminus_helpers import RIGHT, WRONG, scripted_policy  # noqa: E402

from trl_harbor import runtime  # noqa: E402
from trl_harbor.loop.capture import (  # noqa: E402
    CaptureEndpoint,
    Generation,
    GenerationRequest,
    ModelSampler,
    Renderer,
    SamplingParams,
    derive_seed,
)

WORDS = ["readings", "sensor", "building", "mean", "value", "flag", "timestamp", "offset", "answer", "workdir"]


class NullSampler:
    """Answers every call at once with one fixed reply: what the endpoint costs without a model."""

    max_batch = 1
    concurrency = 1

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply

    def generate(self, requests):
        return [Generation(list(self.reply), [-0.5] * len(self.reply), "stop") for _ in requests]


def observation(rng: random.Random, chars: int) -> str:
    """A terminal-like observation of about ``chars`` characters."""
    lines, size = [], 0
    while size < chars:
        line = "root@box:/workdir# " + " ".join(rng.choice(WORDS) for _ in range(8))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


class RawClient:
    """An OpenAI client over plain HTTP (aiohttp), keeping the history as agents do."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url
        self.session = aiohttp.ClientSession()
        self.messages: list[dict] = []

    async def call(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        body = {"messages": self.messages, "temperature": 0.7, "max_tokens": 512}
        async with self.session.post(f"{self.url}/chat/completions", json=body) as response:
            reply = (await response.json())["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": reply})

    async def close(self) -> None:
        await self.session.close()


class LiteLLMClient:
    """Harbor's ``Chat`` over ``LiteLLM`` with rollout details: what Terminus-2 calls its model through."""

    def __init__(self, url: str) -> None:
        from harbor.llms.chat import Chat
        from harbor.llms.lite_llm import LiteLLM

        from trl_harbor.loop.terminus import MODEL_NAME, model_info

        llm = LiteLLM(
            model_name=MODEL_NAME,
            api_base=url,
            collect_rollout_details=True,
            session_id="bench",
            model_info=model_info(None),
            api_key="bench",
        )
        self.chat = Chat(llm)

    async def call(self, text: str) -> None:
        await self.chat.chat(text)

    async def close(self) -> None:
        return None


async def measure(sampler, renderer: Renderer, sampling: SamplingParams, client_cls, drift: bool, args) -> list:
    """``(prompt tokens, endpoint seconds, direct seconds)`` per call, paired."""
    endpoint = CaptureEndpoint(sampler, renderer, sampling, check_drift=drift)
    await endpoint.start()
    rows = []
    try:
        for conversation in range(-1, args.conversations):  # -1: a warm-up conversation, not recorded
            rng = random.Random(conversation)
            route = endpoint.open_route(seed=conversation)
            client = client_cls(route.url)
            for turn in range(args.turns if conversation >= 0 else 2):
                began = time.perf_counter()
                await client.call(observation(rng, args.observation))
                served = time.perf_counter() - began
                prompt = route.trace.turns[-1].prompt_ids
                request = GenerationRequest(list(prompt), sampling.max_tokens, derive_seed(conversation, turn))
                began = time.perf_counter()
                await asyncio.to_thread(sampler.generate, [request])
                direct = time.perf_counter() - began
                if conversation >= 0:
                    rows.append((len(prompt), served, direct))
            await client.close()
            endpoint.close_route(route)
    finally:
        await endpoint.stop()
    return rows


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def report(policy: str, results: dict[str, list], args) -> None:
    sizes = sorted(tokens for rows in results.values() for tokens, _, _ in rows)
    edges = sorted({sizes[len(sizes) // 3], sizes[(2 * len(sizes)) // 3], sizes[-1]})
    print(f"\n{policy}: {args.conversations} conversations x {args.turns} turns, +{args.observation} chars per turn")
    print(f"{'client':<28}{'context':>12}{'calls':>7}{'direct ms':>11}{'endpoint ms':>13}{'overhead ms':>13}{'p95':>8}")
    for name, rows in results.items():
        ranges = [(low, high) for low, high in zip([0, *edges], edges, strict=False)]
        for label, chosen in [*((f"<={high}", [r for r in rows if low < r[0] <= high]) for low, high in ranges),
                              ("all", rows)]:  # fmt: skip
            if not chosen:
                continue
            over = [(served - direct) * 1000 for _, served, direct in chosen]
            print(
                f"{name:<28}{label:>12}{len(chosen):>7}"
                f"{statistics.median(d * 1000 for _, _, d in chosen):>11.2f}"
                f"{statistics.median(s * 1000 for _, s, _ in chosen):>13.2f}"
                f"{statistics.median(over):>13.2f}{p95(over):>8.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--observation", type=int, default=1500, help="characters added per turn")
    parser.add_argument("--skip-model", action="store_true", help="only the null sampler")
    args = parser.parse_args()
    model, tokenizer = scripted_policy([RIGHT, WRONG])
    renderer = Renderer(tokenizer)
    sampling = SamplingParams(max_tokens=16, seed=0)
    reply = [tokenizer.convert_tokens_to_ids(RIGHT), tokenizer.eos_token_id]
    policies = [("null sampler (the endpoint alone)", NullSampler(reply))]
    if not args.skip_model:
        policies.append(("tiny CPU model, 2 tokens per reply", ModelSampler(model, [tokenizer.eos_token_id], sampling)))
    clients = [("raw HTTP", RawClient, True), ("raw HTTP, no drift check", RawClient, False)]
    clients.append(("Harbor's LiteLLM", LiteLLMClient, True))
    for policy, sampler in policies:
        results = {
            name: runtime.run(measure(sampler, renderer, sampling, client, drift, args))
            for name, client, drift in clients
        }
        report(policy, results, args)


if __name__ == "__main__":
    main()
