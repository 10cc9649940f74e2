#!/usr/bin/env python3
"""Checks `deltafin serve`'s /v1/responses with the official `openai` Python package.

Usage: openai_responses_test.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

The server must run a model (tests use a synthesized checkpoint, so the text is gibberish:
only structure and exactness are checked). Run by the Rust test
crates/deltafin-openai/tests/api_clients.rs; CI installs the pinned package (.ci/run).
Exits non-zero with the failing check on the first failure.
"""

import json
import sys

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


def items(response):
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True)
        d.pop("id", None)
        out.append(d)
    return out


def main():
    client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)

    # Non-streaming.
    r = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=12, store=False)
    check(r.object == "response" and r.id.startswith("resp_"), f"response {r}")
    check(r.status in ("completed", "incomplete"), f"status {r.status}")
    check(r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, "usage")
    check(r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens, "reasoning tokens")
    kinds = [i.type for i in r.output]
    check(kinds in ([], ["reasoning"], ["message"], ["reasoning", "message"]), f"output kinds {kinds}")
    text = r.output_text

    # Raw events: typed, numbered, ending with the finished response.
    events = list(client.responses.create(model=MODEL, input="Say hello", max_output_tokens=12, stream=True))
    check(events[0].type == "response.created" and events[1].type == "response.in_progress", "opening events")
    check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    last = events[-1]
    check(last.type in ("response.completed", "response.incomplete"), f"last event {last.type}")
    check(items(last.response) == items(r), f"streamed {items(last.response)} != {items(r)}")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(deltas == text, "output_text deltas")

    # The stream helper accumulates the same response (`get_final_response` only exists for a
    # completed one; an answer cut by max_output_tokens ends with `response.incomplete`).
    with client.responses.stream(model=MODEL, input="Say hello", max_output_tokens=12) as stream:
        for event in stream:
            pass
        if event.type == "response.completed":
            final = stream.get_final_response()
        else:
            check(event.type == "response.incomplete", f"helper's last event {event.type}")
            final = event.response
    check(items(final) == items(r), "responses.stream final response")
    check(final.output_text == text, "responses.stream output_text")

    # Reasoning off, and the summary form.
    off = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=6, reasoning={"effort": "none"})
    check(off.reasoning.effort == "none", f"reasoning echo {off.reasoning}")
    summ = client.responses.create(
        model=MODEL, input="Say hello", max_output_tokens=6, reasoning={"effort": "low", "summary": "auto"}
    )
    for item in summ.output:
        if item.type == "reasoning":
            check(len(item.summary) == 1 and not item.content, "reasoning as summary")

    # History with a function call and its output, plus the reasoning item sent back.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[i.model_dump(exclude_none=True) for i in r.output if i.type == "reasoning"],
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    h = client.responses.create(
        model=MODEL,
        input=history,
        instructions="Be brief.",
        max_output_tokens=4,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}],
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    check(h.status in ("completed", "incomplete"), "function-call history")
    check(h.usage.input_tokens > r.usage.input_tokens, "history is rendered")
    check(h.tools[0].name == "get_weather" and h.parallel_tool_calls is False, "tools echoed")

    # A forced function call (enforced by constrained decoding), its output sent back, the answer;
    # streamed the same.
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    forced = dict(
        model=MODEL,
        input="What is the weather?",
        max_output_tokens=64,
        tools=[weather],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        reasoning={"effort": "none"},
    )
    fc = client.responses.create(**forced)
    calls = [i for i in fc.output if i.type == "function_call"]
    check(fc.status == "completed" and len(calls) == 1, f"forced call: {fc.status} {fc.output}")
    check(calls[0].name == "get_weather", f"forced call name {calls[0].name}")
    check(json.loads(calls[0].arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"}), calls[0].arguments)
    done = None
    with client.responses.stream(**forced) as stream:
        for event in stream:
            if event.type == "response.completed":
                done = event.response
    s_calls = [i for i in done.output if i.type == "function_call"] if done else []
    check([(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls], "streamed call")
    after = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather?"},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
        tools=[weather],
        tool_choice="none",
        max_output_tokens=8,
        reasoning={"effort": "none"},
    )
    check(all(i.type == "message" for i in after.output), f"answer {after.output}")
    check(after.usage.input_tokens > fc.usage.input_tokens, "the call and its output are rendered")

    # Structured output through `text.format`.
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    js = client.responses.create(
        model=MODEL,
        input="JSON please",
        max_output_tokens=32,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    check(js.status == "completed", f"json_schema status {js.status}")
    check(isinstance(json.loads(js.output_text)["ok"], bool), f"json_schema {js.output_text!r}")

    # Refusals.
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id="resp_1"),
        "previous_response_id",
        "previous_response_id",
    )
    expect_bad_request(lambda: client.responses.create(model=MODEL, input="x", store=True), "store", "store")
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", temperature=2.5), "0..=2", "temperature"
    )
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}]),
        "`web_search` is not implemented",
        "server tools",
    )
    expect_bad_request(
        lambda: client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
        ),
        "text-only",
        "image input",
    )

    print(f"openai_responses_test: {CHECKS} checks passed (openai {openai.__version__})")


if __name__ == "__main__":
    main()
