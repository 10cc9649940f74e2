#!/usr/bin/env python3
"""An agent loop against `deltafin serve` with the official `openai` Python package.

Usage: openai_tools_test.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

Declares a tool, makes the model call it, sends the tool's result back as a `tool` message
and lets the model answer, non-streaming and streaming, with thinking off and on. The
checkpoint is synthesized (random weights: the text is gibberish and the model would never
choose a tool by itself), so the calls are forced with `tool_choice` (a named function, or
`required`), which the server enforces by constrained decoding. Only structure, agreement
between streaming and non-streaming, and the protocol are checked. Such a model also never
closes its thinking, so the agent loop runs with thinking off; with thinking on, a forced
call is checked to stay out of the reasoning until the budget ends. Run by
crates/deltafin-openai/tests/openai_client.rs. Exits non-zero on the first failing check.
"""

import json
import sys

import openai
from openai import OpenAI

MODEL = "deltafin-kimi-k3"
CHECKS = 0
UNITS = ["celsius", "fahrenheit"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather.",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": UNITS}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Room for the most calls a constrained answer holds (16 without parallel_tool_calls false): the
# random-weight model keeps calling while it may.
MAX_TOKENS = 900


def check(cond, what):
    global CHECKS
    if not cond:
        raise AssertionError(what)
    CHECKS += 1


def check_call(call, names, what):
    """A complete call: an id, a declared function, arguments a JSON object per its schema."""
    check(call.type == "function", f"{what}: type {call.type}")
    check(isinstance(call.id, str) and call.id.startswith("call_"), f"{what}: id {call.id!r}")
    check(call.function.name in names, f"{what}: name {call.function.name!r}")
    args = json.loads(call.function.arguments)
    check(isinstance(args, dict), f"{what}: arguments {call.function.arguments!r}")
    if call.function.name == "get_weather":
        check(set(args) == {"unit"} and args["unit"] in UNITS, f"{what}: arguments {args}")
    else:
        check(args == {}, f"{what}: arguments {args}")
    return args


def streamed(client, **kw):
    """Streams one answer; returns (content, reasoning, calls as dicts, finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        d = c.delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # The first entry of a call carries its id, type and name, arguments "".
                check(tc.id and tc.type == "function" and tc.function.name, f"first call delta {tc}")
                check(tc.function.arguments == "", f"first call delta arguments {tc}")
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                check(tc.id is None and tc.function.name is None, f"later call delta {tc}")
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        if c.finish_reason is not None:
            finish = c.finish_reason
    check(sorted(calls) == list(range(len(calls))), f"call indexes {sorted(calls)}")
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def same_calls(message, calls, what):
    got = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    # Ids are unique per answer; everything else is the same greedy answer.
    check([dict(c, id=None) for c in got] == [dict(c, id=None) for c in calls], f"{what}: {got} vs {calls}")
    check(len({c["id"] for c in got + calls}) == 2 * len(got), f"{what}: ids not unique")


def agent_turn(client, thinking):
    effort = {} if thinking else {"reasoning_effort": "none"}
    messages = [{"role": "user", "content": "What is the weather?"}]
    what = f"thinking={thinking}"

    # 1. The model calls the named tool.
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=MAX_TOKENS, **effort
    )
    choice = first.choices[0]
    check(choice.finish_reason == "tool_calls", f"{what}: finish {choice.finish_reason}")
    msg = choice.message
    check(msg.tool_calls and len(msg.tool_calls) >= 1, f"{what}: no tool_calls in {msg}")
    check(msg.content is None or isinstance(msg.content, str), f"{what}: content {msg.content!r}")
    for call in msg.tool_calls:
        check(call.function.name == "get_weather", f"{what}: named choice called {call.function.name}")
        check_call(call, {"get_weather"}, what)
    if not thinking:
        check(not getattr(msg, "reasoning_content", ""), f"{what}: reasoning with thinking off")
    content, _, calls, finish = streamed(
        client, model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=MAX_TOKENS, **effort
    )
    check(finish == "tool_calls", f"{what}: stream finish {finish}")
    check(content == (msg.content or ""), f"{what}: streamed content")
    same_calls(msg, calls, f"{what}: streamed calls")

    # 2. The client runs the tool and sends the result back; the model answers.
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, **effort
    )
    answer = second.choices[0]
    check(answer.finish_reason in ("stop", "length"), f"{what}: answer finish {answer.finish_reason}")
    check(not answer.message.tool_calls, f"{what}: tool_choice none answered with calls")
    check(isinstance(answer.message.content, str), f"{what}: answer content {answer.message.content!r}")
    check(second.usage.prompt_tokens > first.usage.prompt_tokens, f"{what}: history grew")
    content, reasoning, calls, finish = streamed(
        client, model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, **effort
    )
    check((content, finish, calls) == (answer.message.content, answer.finish_reason, []), f"{what}: streamed answer")
    check(reasoning == (getattr(answer.message, "reasoning_content", None) or ""), f"{what}: streamed reasoning")


def main():
    base = sys.argv[1]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    agent_turn(client, False)

    # Thinking on: the reasoning runs to the budget; nothing of it is a call or content.
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=48,
    )
    c = r.choices[0]
    check(c.finish_reason == "length", f"thinking: finish {c.finish_reason}")
    check(getattr(c.message, "reasoning_content", ""), "thinking: no reasoning")
    check(not c.message.tool_calls and not c.message.content, f"thinking: {c.message}")

    # `required`: some declared tool is called; with parallel_tool_calls false, exactly one.
    messages = [{"role": "user", "content": "Anything."}]
    for parallel in (True, False):
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            reasoning_effort="none",
        )
        c = r.choices[0]
        check(c.finish_reason == "tool_calls", f"required: finish {c.finish_reason}")
        check(c.message.tool_calls, "required: no call")
        if not parallel:
            check(len(c.message.tool_calls) == 1, f"parallel_tool_calls false: {len(c.message.tool_calls)} calls")
        for call in c.message.tool_calls:
            check_call(call, {"get_weather", "get_time"}, "required")

    print(f"openai_tools_test: {CHECKS} checks passed (openai {openai.__version__})")


if __name__ == "__main__":
    main()
