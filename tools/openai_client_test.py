#!/usr/bin/env python3
"""Checks `deltafin serve` with the official `openai` Python package.

Usage: openai_client_test.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

The server must run a model (any checkpoint; tests use a synthesized one, so the text is
gibberish: only structure and exactness are checked) with `--queue 0`. Run by the Rust test
crates/deltafin-openai/tests/openai_client.rs; CI installs the pinned package (.ci/run).
Exits non-zero with the failing check on the first failure.
"""

import json
import sys
import time

import openai
from openai import OpenAI

MODEL = "deltafin-kimi-k3"
CHECKS = 0


def check(cond, what):
    global CHECKS
    if not cond:
        raise AssertionError(what)
    CHECKS += 1


def expect_bad_request(fn, fragment, what):
    try:
        fn()
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"{what}: status {e.status_code}")
        message = e.body.get("message", "") if isinstance(e.body, dict) else str(e)
        check(fragment in message, f"{what}: message {message!r} lacks {fragment!r}")
        return
    raise AssertionError(f"{what}: no BadRequestError")


def extra(obj, key):
    return getattr(obj, key, None)


def main():
    base = sys.argv[1]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    chat_msgs = [{"role": "user", "content": "Say hello"}]

    # Models.
    models = client.models.list()
    check([m.id for m in models.data] == [MODEL], f"models: {models}")
    check(client.models.retrieve(MODEL).id == MODEL, "models.retrieve")

    # Chat, non-streaming.
    chat = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=8)
    choice = chat.choices[0]
    check(choice.message.role == "assistant", "chat role")
    check(choice.finish_reason in ("stop", "length"), f"chat finish {choice.finish_reason}")
    u = chat.usage
    check(u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, f"chat usage {u}")
    reasoning = extra(choice.message, "reasoning_content") or ""
    content = choice.message.content or ""

    # Chat, streaming with include_usage: same text, role frame first, usage frame last.
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=chat_msgs, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    check(chunks[0].choices[0].delta.role == "assistant", "stream role frame")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "usage frame")
    check(chunks[-1].usage.completion_tokens == u.completion_tokens, "stream usage = non-stream usage")
    s_reason = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
    s_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check((s_reason, s_content) == (reasoning, content), "streamed chat text = non-streamed")
    check(chunks[-2].choices[0].finish_reason == choice.finish_reason, "stream finish reason")

    # Completions, non-streaming and streaming.
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16)
    text = comp.choices[0].text
    check(isinstance(text, str), "completion text")
    s_text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, stream=True)
    )
    check(s_text == text, "streamed completion = non-streamed")

    # Stop sequences: the text ends right before the first match, never containing it.
    if len(text) >= 6:
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = text.find(stop)
        for stream in (False, True):
            if stream:
                got = "".join(
                    c.choices[0].text
                    for c in client.completions.create(
                        model=MODEL, prompt="The capital of France is", max_tokens=16, stop=[stop], stream=True
                    )
                )
            else:
                r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, stop=stop)
                got = r.choices[0].text
                check(r.choices[0].finish_reason == "stop", "stop finish_reason")
            check(got == text[:cut], f"stop cut (stream={stream}): {got!r} vs {text[:cut]!r}")

    # Logprobs.
    lp_chat = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=4, logprobs=True, top_logprobs=2)
    lp = lp_chat.choices[0].logprobs
    entries = (lp.content or []) + [
        openai.types.chat.ChatCompletionTokenLogprob(**e) for e in (extra(lp, "reasoning_content") or [])
    ]
    check(len(entries) > 0, "chat logprobs entries")
    for e in entries:
        check(e.logprob <= 0 and len(e.top_logprobs) == 2, f"chat logprob entry {e}")
        check(e.top_logprobs[0].logprob == e.logprob, "greedy token is the most likely")
    lp_comp = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, logprobs=2)
    clp = lp_comp.choices[0].logprobs
    check(len(clp.token_logprobs) == len(clp.tokens) == len(clp.top_logprobs), "completion logprobs lengths")
    check(all(x <= 0 for x in clp.token_logprobs), "completion logprobs <= 0")
    check(all(max(d.values()) == x for d, x in zip(clp.top_logprobs, clp.token_logprobs)), "top-1 = chosen")

    # Sampling: temperature 0.7 and 1.0 answer; the seed comes back in X-Deltafin-Seed, and the
    # same seed gives the same text, streamed or not.
    for temperature in (0.7, 1.0):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat_msgs, temperature=temperature, max_tokens=8, reasoning_effort="none"
        )
        seed = int(raw.headers["x-deltafin-seed"])
        first = raw.parse().choices[0].message.content
        again = client.chat.completions.create(
            model=MODEL, messages=chat_msgs, temperature=temperature, max_tokens=8, reasoning_effort="none", seed=seed
        )
        check(again.choices[0].message.content == first, f"seed {seed} repeats at T={temperature}")
        parts = client.chat.completions.create(
            model=MODEL,
            messages=chat_msgs,
            temperature=temperature,
            max_tokens=8,
            reasoning_effort="none",
            seed=seed,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        check(text == first, f"seed {seed} streamed at T={temperature}: {text!r} vs {first!r}")
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12)
    sampled = [
        client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=1.0, seed=s).choices[0].text
        for s in range(4)
    ]
    check(any(t != greedy.choices[0].text for t in sampled), "sampling changes the text")

    # Refused fields surface as BadRequestError with the reason.
    expect_bad_request(
        lambda: client.chat.completions.create(model=MODEL, messages=chat_msgs, temperature=2.5),
        "0..=2",
        "temperature",
    )
    expect_bad_request(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=chat_msgs,
            tools=[{"type": "function", "function": {"name": "no spaces", "parameters": {"type": "object"}}}],
        ),
        "1 to 64 characters",
        "tools",
    )
    # Structured output: the schema's JSON, K3's argmax over what the grammar allows.
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat_msgs,
        reasoning_effort="none",
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    check(r.choices[0].finish_reason == "stop", f"json_schema: finish {r.choices[0].finish_reason}")
    answer = json.loads(r.choices[0].message.content)
    check(set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool), f"json_schema: {answer}")
    check(isinstance(answer["n"], int) and 0 <= answer["n"] <= 99, f"json_schema: {answer}")
    expect_bad_request(
        lambda: client.chat.completions.create(
            model=MODEL, messages=chat_msgs, response_format={"type": "json_schema", "json_schema": {"schema": {}}}
        ),
        "json_schema.name",
        "response_format",
    )
    expect_bad_request(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        ),
        "text-only",
        "image content",
    )
    expect_bad_request(
        lambda: client.chat.completions.create(model=MODEL, messages=chat_msgs, n=2), "`n` must be 1", "n"
    )
    expect_bad_request(
        lambda: client.completions.create(model="gpt-4", prompt="x"), "unavailable", "model"
    )

    # Fields agents and proxies send on chat completions (docs/AGENTS.md): vLLM's thinking
    # switch, the effort names of the other endpoints, cache and user identification.
    plain = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=6, reasoning_effort="none")
    switched = client.chat.completions.create(
        model=MODEL,
        messages=chat_msgs,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"thinking": False}, "prompt_cache_key": "thread-1", "safety_identifier": "u1"},
    )
    check(
        switched.choices[0].message.content == plain.choices[0].message.content,
        "chat_template_kwargs thinking=false is reasoning_effort none",
    )
    xhigh = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=6, reasoning_effort="xhigh")
    check(xhigh.choices[0].finish_reason in ("stop", "length"), "reasoning_effort xhigh")
    expect_bad_request(
        lambda: client.chat.completions.create(
            model=MODEL, messages=chat_msgs, max_tokens=6, extra_body={"chat_template_kwargs": {"add_vision_id": True}}
        ),
        "add_vision_id",
        "unknown template switch",
    )

    # 429 under contention (queue 0): hold the slot with a long stream.
    held = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=1000000, stream=True)
    it = iter(held)
    next(it)
    next(it)
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        raise AssertionError("no 429 while the slot is held")
    except openai.RateLimitError as e:
        check(e.status_code == 429, "429 status")
        check(e.response.headers.get("retry-after") == "1", "Retry-After: 1")
        check(e.body.get("code") == "server_busy", f"429 body {e.body}")
    held.close()
    deadline = time.time() + 20
    while True:
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            break
        except openai.RateLimitError:
            check(time.time() < deadline, "slot freed after the stream closed")
            time.sleep(0.05)

    print(f"openai_client_test: {CHECKS} checks passed (openai {openai.__version__})")


if __name__ == "__main__":
    main()
