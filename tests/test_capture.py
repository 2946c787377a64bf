"""The capture endpoint on its own: token-in/token-out, budgets, forks, retries, drift, pinned sampling, samplers.

Clients are Harbor's own ``LiteLLM``/``Chat`` (what Terminus-2 calls its model through) or plain
HTTP; the policy is a tiny CPU model rigged to answer with one of a few whole-token replies.
"""

from __future__ import annotations

import json

import pytest
from terminus_helpers import RIGHT, WRONG, scripted_policy

from trl_harbor import runtime
from trl_harbor.loop.capture import (
    CaptureEndpoint,
    GenerationRequest,
    ModelSampler,
    Renderer,
    SamplingParams,
    VLLMSampler,
    serving,
)


@pytest.fixture(scope="module")
def policy():
    return scripted_policy([RIGHT, WRONG])


def _endpoint(policy, sampling: SamplingParams | None = None, sampler=None, **kwargs) -> CaptureEndpoint:
    model, tokenizer = policy
    sampling = sampling or SamplingParams(max_tokens=16, seed=0)
    sampler = sampler or ModelSampler(model, [tokenizer.eos_token_id], sampling)
    return CaptureEndpoint(sampler, Renderer(tokenizer, kwargs.pop("chat_template_kwargs", None)), sampling, **kwargs)


def _harbor_chat(url: str, **kwargs):
    from harbor.llms.chat import Chat
    from harbor.llms.lite_llm import LiteLLM

    from trl_harbor.loop.terminus import MODEL_NAME, model_info

    llm = LiteLLM(
        model_name=MODEL_NAME,
        api_base=url,
        collect_rollout_details=True,
        session_id="test",
        model_info=model_info(None),
        api_key="unused",
        **kwargs,
    )
    return Chat(llm)


async def _post(url: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(f"{url}/chat/completions", json=body) as response:
        return response.status, await response.json()


def test_turns_extend_token_for_token_and_harbor_records_the_same_ids(policy) -> None:
    _, tokenizer = policy
    endpoint = _endpoint(policy)

    async def go():
        async with serving(endpoint):
            route = endpoint.open_route(seed=7)
            chat = _harbor_chat(route.url, temperature=0.0)  # asked for greedy: the endpoint samples anyway
            for turn in range(3):
                await chat.chat(f"observation {turn}", max_tokens=1)
            return route, chat

    route, chat = runtime.run(go())
    turns = route.trace.turns
    assert len(turns) == 3 and route.trace.forks == [] and route.trace.retries == 0
    renderer = endpoint.renderer
    assert turns[0].prompt_ids == renderer.prompt([{"role": "user", "content": "observation 0"}])
    for previous, turn in zip(turns, turns[1:], strict=False):
        assert turn.prompt_ids == previous.prompt_ids + previous.completion_ids + turn.bridge_ids
        assert turn.completion_ids[-1] == tokenizer.eos_token_id  # max_tokens=1 was ignored: two tokens
    assert (
        tokenizer.decode(turns[1].bridge_ids) == "\n<|im_start|>user\nobservation 1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert route.overridden == {"temperature": 3, "max_tokens": 3}
    detail = chat.rollout_details[0]
    assert detail["prompt_token_ids"] == [t.prompt_ids for t in turns]
    assert detail["completion_token_ids"] == [t.completion_ids for t in turns]
    assert [lp for call in detail["logprobs"] for lp in call] == pytest.approx([lp for t in turns for lp in t.logprobs])
    assert [m["content"] for m in chat.messages if m["role"] == "assistant"] == [RIGHT if t.completion_ids[0] ==
        tokenizer.convert_tokens_to_ids(RIGHT) else WRONG for t in turns]  # fmt: skip
    row = route.trace.row()
    assert row.prompt_ids == turns[0].prompt_ids
    assert row.completion_ids == turns[-1].prompt_ids[len(row.prompt_ids) :] + turns[-1].completion_ids
    assert row.env_mask == [1, 1] + [0] * len(turns[1].bridge_ids) + [1, 1] + [0] * len(turns[2].bridge_ids) + [1, 1]
    assert [lp for lp, m in zip(row.logprobs, row.env_mask, strict=True) if not m] == [0.0] * row.env_mask.count(0)


def test_seeded_routes_sample_the_same_tokens(policy) -> None:
    endpoint = _endpoint(policy)

    async def sample(seed: int) -> list[list[int]]:
        route = endpoint.open_route(seed=seed)
        chat = _harbor_chat(route.url)
        for turn in range(6):
            await chat.chat(f"observation {turn}")
        return [t.completion_ids for t in route.trace.turns]

    async def go():
        async with serving(endpoint):
            return [await sample(1), await sample(1), await sample(2)]

    first, again, other = runtime.run(go())
    assert first == again
    assert first != other  # six draws between two replies: another seed differs (for these seeds)


def test_a_budget_ends_the_conversation_with_harbors_context_error(policy) -> None:
    from harbor.llms.base import ContextLengthExceededError

    endpoint = _endpoint(policy)

    async def go():
        async with serving(endpoint):
            route = endpoint.open_route(budget=12, seed=0)
            chat = _harbor_chat(route.url)
            await chat.chat("first")
            with pytest.raises(ContextLengthExceededError):
                await chat.chat("a second observation longer than the budget of twelve tokens")
            return route

    route = runtime.run(go())
    assert route.refused == "budget" and len(route.trace.turns) == 1


def test_the_models_context_is_enforced(policy) -> None:
    from harbor.llms.base import ContextLengthExceededError

    endpoint = _endpoint(policy, max_model_len=8)

    async def go():
        async with serving(endpoint):
            route = endpoint.open_route()
            with pytest.raises(ContextLengthExceededError):
                await _harbor_chat(route.url).chat("a prompt longer than eight tokens, surely")
            return route

    assert runtime.run(go()).refused == "context"


def test_forks_and_retries_are_counted_not_hidden(policy) -> None:
    endpoint = _endpoint(policy)

    async def go():
        async with serving(endpoint):
            route = endpoint.open_route(seed=0)
            first = [{"role": "user", "content": "hello"}]
            status, body = await _post(route.url, {"messages": first})
            assert status == 200
            reply = body["choices"][0]["message"]["content"]
            assert body["prompt_token_ids"] == route.trace.turns[0].prompt_ids
            assert body["choices"][0]["token_ids"] == route.trace.turns[0].completion_ids
            status, _ = await _post(route.url, {"messages": first})  # the same request again: a retry
            assert status == 200 and route.trace.retries == 1 and len(route.trace.turns) == 1
            reply = route.trace.turns[0].text
            edited = [
                *first,
                {"role": "assistant", "content": reply + " (edited)"},
                {"role": "user", "content": "go on"},
            ]
            status, _ = await _post(route.url, {"messages": edited})  # the agent rewrote the reply: a fork
            assert status == 200
            extended = [
                *edited,
                {"role": "assistant", "content": route.trace.turns[-1].text},
                {"role": "user", "content": "more"},
            ]
            status, _ = await _post(route.url, {"messages": extended})  # extends the new segment
            assert status == 200
            shorter = [{"role": "user", "content": "start over"}]
            status, _ = await _post(route.url, {"messages": shorter})  # history cut: another fork
            return route, reply

    route, reply = runtime.run(go())
    trace = route.trace
    assert [len(segment) for segment in trace.segments] == [1, 2, 1]
    assert [fork.turn for fork in trace.forks] == [1, 3]
    assert "the model's reply was changed" in trace.forks[0].reason
    assert "message 0 was changed" in trace.forks[1].reason
    assert trace.row(0).completion_ids == trace.segments[0][0].completion_ids  # only the first segment trains


def test_drift_shows_what_retokenising_would_have_changed(policy) -> None:
    _, tokenizer = policy
    # Qwen3 without thinking: the generation prompt has an empty think block, a re-rendered history has not.
    endpoint = _endpoint(policy, chat_template_kwargs={"enable_thinking": False})

    async def go():
        async with serving(endpoint):
            route = endpoint.open_route(seed=0)
            chat = _harbor_chat(route.url)
            await chat.chat("one")
            await chat.chat("two")
            await endpoint.settle(route)  # drift is measured after the reply
            return route

    route = runtime.run(go())
    first, second = route.trace.turns
    assert first.drift is None and second.drift > 0 and route.trace.drift_turns == 1
    assert tokenizer.decode(first.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids  # what the model saw, kept


def test_http_errors(policy) -> None:
    class Broken:
        max_batch = 1
        concurrency = 1

        def generate(self, requests):
            raise RuntimeError("GPU on fire")

    endpoint = _endpoint(policy, sampler=Broken())

    async def go():
        async with serving(endpoint):
            assert (await _post(f"{endpoint.base_url}/r/nope/v1", {"messages": [{"role": "user", "content": "x"}]}))[
                0
            ] == 404
            route = endpoint.open_route()
            status, body = await _post(route.url, {"messages": []})
            assert status == 400 and "malformed" in body["error"]["message"]
            status, body = await _post(route.url, {"messages": [{"role": "user", "content": "x"}], "stream": True})
            assert status == 400 and "streaming" in body["error"]["message"]
            status, body = await _post(route.url, {"messages": [{"role": "user", "content": "x"}]})
            assert status == 500 and "GPU on fire" in body["error"]["message"]
            await route.wait_failed()  # returns: the failure is signalled
            endpoint.close_route(route)
            assert (await _post(route.url, {"messages": [{"role": "user", "content": "x"}]}))[0] == 404
            return route

    assert "GPU on fire" in runtime.run(go()).failure


def test_renderer_refuses_a_template_it_cannot_cut(policy) -> None:
    import copy

    _, tokenizer = policy
    broken = copy.deepcopy(tokenizer)  # a template that ends turns with no end-of-turn token
    broken.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="end-of-turn"):
        Renderer(broken)


def test_vllm_sampler_speaks_vllms_completions_api(policy) -> None:
    from fake_vllm import FakeVLLM

    model, tokenizer = policy
    sampling = SamplingParams(temperature=0.7, top_k=5, max_tokens=16, seed=0)
    fake = FakeVLLM(model, tokenizer)
    base = runtime.run(fake.start())
    try:
        prompt = Renderer(tokenizer).prompt([{"role": "user", "content": "hello"}])
        served = VLLMSampler(sampling, base_url=base, concurrency=4)
        requests = [GenerationRequest(prompt, 16, seed) for seed in (1, 2, 3)]
        got = served.generate(requests)
        local = ModelSampler(model, [tokenizer.eos_token_id], sampling).generate(requests)
    finally:
        runtime.run(fake.stop())
    assert [g.completion_ids for g in got] == [g.completion_ids for g in local]
    assert [lp for g in got for lp in g.logprobs] == pytest.approx([lp for g in local for lp in g.logprobs])
    body = fake.requests[0]
    assert body["prompt"] == [prompt] and body["model"] == "fake-policy" and body["logprobs"] == 0
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert (body["temperature"], body["top_k"], body["seed"]) == (0.7, 5, 1)
    assert json.dumps(body)  # plain JSON


def test_endpoint_serves_concurrent_routes_through_the_vllm_sampler(policy) -> None:
    from fake_vllm import FakeVLLM

    model, tokenizer = policy
    sampling = SamplingParams(max_tokens=16, seed=0)
    fake = FakeVLLM(model, tokenizer)

    async def go():
        import asyncio

        base = await fake.start()
        endpoint = _endpoint(policy, sampling, sampler=VLLMSampler(sampling, base_url=base, concurrency=8))
        async with serving(endpoint):
            routes = [endpoint.open_route(seed=i) for i in range(8)]

            async def talk(route):
                chat = _harbor_chat(route.url)
                for turn in range(2):
                    await chat.chat(f"observation {turn}")

            await asyncio.gather(*(talk(r) for r in routes))
        await fake.stop()
        return routes

    routes = runtime.run(go())
    assert all(len(r.trace.turns) == 2 and not r.trace.forks for r in routes)
    assert len(fake.requests) == 16


def test_loop_rows_rewards_and_metrics_from_traces(policy) -> None:
    """What the rollout_func hands TRL, from traces alone: rows, placeholder rows, fork policies, metrics."""
    from trl_harbor.loop.capture import Route, Trace
    from trl_harbor.loop.rollout_func import LoopRollout, LoopRolloutFunc, loop_metrics, loop_reward
    from trl_harbor.rollout.outcome import Cause, Verification

    _, tokenizer = policy
    renderer = Renderer(tokenizer)
    eos = tokenizer.eos_token_id
    reply = tokenizer.convert_tokens_to_ids(RIGHT)

    def traced(*requests: list[dict]) -> Route:
        route = Route("r", "http://x/r/r/v1", Trace(renderer))
        for messages in requests:
            route.trace.commit(route.trace.prepare(messages), [reply, eos], [-0.5, 0.0], "stop")
        return route

    first = [{"role": "user", "content": "go"}]
    linear = traced(first, [*first, {"role": "assistant", "content": RIGHT}, {"role": "user", "content": "next"}])
    forked = traced(first, [{"role": "user", "content": "summary"}])
    prompt = [{"role": "user", "content": "go", "task_dir": "/t"}]
    rollouts = [
        LoopRollout("t", "/t", route=linear, verification=Verification(1.0)),
        LoopRollout("t", "/t", route=forked, verification=Verification(0.0)),
        LoopRollout("t", "/t", route=None, verification=Verification(None, cause=Cause.INFRASTRUCTURE, reason="no")),
    ]
    for rollout in rollouts:
        rollout.row = None if rollout.route is None else rollout.route.trace.row(0)
    out = LoopRolloutFunc.fields(rollouts, renderer, [prompt] * 3)
    assert out["env_mask"][0] == [1, 1] + [0] * len(linear.trace.turns[1].bridge_ids) + [1, 1]
    assert out["completion_ids"][1] == [reply, eos]  # the forked rollout trains on its first segment
    assert out["completion_ids"][2] == [eos] and out["env_mask"][2] == [0]  # nothing sampled: a row that trains nothing
    assert out["prompt_ids"][2] == renderer.prompt([{"role": "user", "content": "go"}])
    assert out["harbor_rollout"] == rollouts
    logged: dict[str, float] = {}
    assert loop_reward(harbor_rollout=rollouts, log_metric=logged.__setitem__) == [1.0, 0.0, None]
    assert logged["harbor/loop/forks"] == 1 and logged["harbor/loop/turns"] == 4 / 3
    assert logged["harbor/infra_failures"] == 1
    rollouts[1].skipped = "the history forked; fork_policy='skip'"
    assert loop_reward(harbor_rollout=rollouts) == [1.0, None, None]
    assert loop_metrics(rollouts)["harbor/loop/skipped"] == 1
    with pytest.raises(ValueError, match="harbor_rollout"):
        loop_reward(environments=[])
