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

    # What Codex CLI sends on every turn (docs/AGENTS.md): the base prompt as a developer item,
    # item ids it made up, function tools, a namespace of tools, the hosted web search it sends
    # by default, reasoning with a summary, store off, the encrypted reasoning, a cache key and
    # client metadata.
    exec_tool = {
        "type": "function",
        "name": "exec_command",
        "description": "Run a command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    }
    namespace = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "close_agent",
                "description": "Close an agent.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"target": {"type": "string", "enum": ["a1", "a2"]}},
                    "required": ["target"],
                    "additionalProperties": False,
                },
            }
        ],
    }
    turn1 = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "id": "msg_c1", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]},
    ]
    codex = dict(
        model=MODEL,
        tools=[exec_tool, namespace, {"type": "web_search", "external_web_access": False}],
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"effort": "low", "summary": "auto"},
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="thread-1",
        max_output_tokens=24,
        extra_body={"client_metadata": {"x-codex-installation-id": "test"}},
    )
    c1 = client.responses.create(input=turn1, **codex)
    check(c1.status in ("completed", "incomplete"), f"codex turn {c1.status}")
    for item in c1.output:
        if item.type == "reasoning":
            check(bool(item.encrypted_content), f"encrypted reasoning {item}")
    # Turn 2 sends turn 1's output back as Codex does (reasoning with its encrypted content):
    # the prompt is turn 1's prompt, its answer and the new message, so a changed byte of the
    # encrypted content is refused rather than misread.
    back = [i.model_dump(exclude_none=True) for i in c1.output]
    turn2 = turn1 + back + [
        {"type": "message", "id": "msg_c2", "role": "user", "content": [{"type": "input_text", "text": "again"}]}
    ]
    c2 = client.responses.create(input=turn2, **codex)
    check(c2.usage.input_tokens > c1.usage.input_tokens, "turn 2 renders turn 1")
    for item in back:
        if item.get("type") == "reasoning" and item.get("encrypted_content"):
            item["encrypted_content"] = item["encrypted_content"][:-4] + "AAAA"
            expect_bad_request(lambda: client.responses.create(input=turn2, **codex), "encrypted_content", "tampered")
    # A call of a namespaced tool comes back with its namespace (how Codex dispatches it).
    call = client.responses.create(
        input=turn1, **dict(codex, tool_choice={"type": "function", "name": "close_agent"}, reasoning={"effort": "none"})
    )
    calls = [i for i in call.output if i.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "close_agent", f"namespaced call {call.output}")
    check(calls[0].model_dump().get("namespace") == "agents", f"namespace {calls[0].model_dump()}")
    # The web search tool is not offered to the model (there is no search backend) and
    # forcing it is refused.
    expect_bad_request(
        lambda: client.responses.create(input=turn1, **dict(codex, tool_choice={"type": "web_search"})),
        "web_search",
        "forced web search",
    )

    # Stored responses: continue with previous_response_id, read back, list the input, delete.
    first = client.responses.create(
        model=MODEL, input="Say hello", max_output_tokens=8, store=True, reasoning={"effort": "none"}
    )
    got = client.responses.retrieve(first.id)
    check(got.id == first.id and items(got) == items(first), "retrieve")
    listed = client.responses.input_items.list(first.id)
    check(len(listed.data) == 1, f"input items {listed.data}")
    nxt = client.responses.create(
        model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=8, reasoning={"effort": "none"}
    )
    same = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Say hello"}]
        + [i.model_dump(exclude_none=True) for i in first.output]
        + [{"role": "user", "content": "More"}],
        max_output_tokens=8,
        reasoning={"effort": "none"},
        store=False,
    )
    check(nxt.usage.input_tokens == same.usage.input_tokens, "previous_response_id is the history")
    check(items(nxt) == items(same), "previous_response_id answers as the history does")
    deleted = client.responses.delete(first.id)
    check(deleted is None or True, "delete")
    try:
        client.responses.retrieve(first.id)
        raise AssertionError("a deleted response was found")
    except openai.NotFoundError:
        check(True, "deleted")

    # Refusals.
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", background=True),
        "background",
        "background",
    )
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", temperature=2.5), "0..=2", "temperature"
    )
    expect_bad_request(
        lambda: client.responses.create(model=MODEL, input="x", tools=[{"type": "file_search", "vector_store_ids": ["v"]}]),
        "file_search",
        "hosted tools",
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
