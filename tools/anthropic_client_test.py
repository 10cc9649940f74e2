#!/usr/bin/env python3
"""Checks `deltafin serve`'s /v1/messages with the official `anthropic` Python package.

Usage: anthropic_client_test.py BASE_URL   (e.g. http://127.0.0.1:8000)

The server must run a model (tests use a synthesized checkpoint, so the text is gibberish:
only structure and exactness are checked). Run by the Rust test
crates/deltafin-openai/tests/api_clients.rs; CI installs the pinned package (.ci/run).
Exits non-zero with the failing check on the first failure.
"""

import sys

import anthropic
from anthropic import Anthropic

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
    except anthropic.BadRequestError as e:
        check(e.status_code == 400, f"{what}: status {e.status_code}")
        body = e.body if isinstance(e.body, dict) else {}
        check(body.get("type") == "error", f"{what}: body {body}")
        err = body.get("error", {})
        check(err.get("type") == "invalid_request_error", f"{what}: error type {err}")
        check(fragment in err.get("message", ""), f"{what}: message {err!r} lacks {fragment!r}")
        return
    raise AssertionError(f"{what}: no BadRequestError")


def blocks(message):
    return [b.model_dump(exclude_none=True) for b in message.content]


def main():
    client = Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Say hello"}]

    # Non-streaming.
    m = client.messages.create(model=MODEL, max_tokens=12, messages=msgs)
    check(m.type == "message" and m.role == "assistant" and m.model == MODEL, f"message {m}")
    check(m.id.startswith("msg_"), f"id {m.id}")
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    check(m.usage.input_tokens > 0, f"usage {m.usage}")
    check(m.usage.output_tokens <= 12, f"usage {m.usage}")
    kinds = [b.type for b in m.content]
    check(kinds in ([], ["thinking"], ["text"], ["thinking", "text"]), f"content kinds {kinds}")
    for b in m.content:
        if b.type == "thinking":
            check(isinstance(b.signature, str) and b.signature, "thinking signature")

    # The stream helper rebuilds the same message; its text stream is the text block.
    with client.messages.stream(model=MODEL, max_tokens=12, messages=msgs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(blocks(final) == blocks(m), f"streamed {blocks(final)} != {blocks(m)}")
    check(final.stop_reason == m.stop_reason, "stream stop_reason")
    check(final.usage.output_tokens == m.usage.output_tokens, "stream usage")
    check(final.usage.input_tokens == m.usage.input_tokens, "stream input usage")
    check(text == "".join(b.text for b in m.content if b.type == "text"), "text_stream")

    # Raw events: message_start first, message_stop last.
    events = list(client.messages.create(model=MODEL, max_tokens=4, messages=msgs, stream=True))
    check(events[0].type == "message_start" and events[-1].type == "message_stop", f"events {events}")
    check(events[-2].type == "message_delta", "message_delta before message_stop")

    # Thinking off / on with a budget; both answer.
    off = client.messages.create(model=MODEL, max_tokens=6, messages=msgs, thinking={"type": "disabled"})
    check(off.stop_reason in ("end_turn", "max_tokens"), "thinking disabled")
    on = client.messages.create(
        model=MODEL, max_tokens=2048, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    check(on.usage.output_tokens > 0, "thinking enabled")

    # The answer sent back as history (thinking block with its signature) is accepted.
    history = msgs + [{"role": "assistant", "content": blocks(m) or "ok"}, {"role": "user", "content": "More"}]
    again = client.messages.create(model=MODEL, max_tokens=4, messages=history, system="Be brief.")
    check(again.usage.input_tokens > m.usage.input_tokens, "history is rendered")

    # Tool history: tool_use in the assistant turn, tool_result (with is_error) in the user turn.
    tool_history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout", "is_error": True},
                {"type": "text", "text": "Try again?"},
            ],
        },
    ]
    t = client.messages.create(model=MODEL, max_tokens=4, messages=tool_history, stop_sequences=["\u0000never"])
    check(t.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"tool history {t.stop_reason}")

    # A forced tool call (random weights never choose one: `tool_choice` forces it, enforced by
    # constrained decoding), its result sent back, the model's answer; streamed the same.
    tools = [
        {
            "name": "get_weather",
            "description": "The current weather.",
            "input_schema": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["unit"],
            },
        }
    ]
    ask = [{"role": "user", "content": "What is the weather?"}]
    forced = dict(
        model=MODEL,
        max_tokens=64,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
    )
    call = client.messages.create(**forced)
    check(call.stop_reason == "tool_use", f"forced call: {call.stop_reason}")
    uses = [b for b in call.content if b.type == "tool_use"]
    check(len(uses) == 1 and uses[0].name == "get_weather", f"forced call: {call.content}")
    check(uses[0].input in ({"unit": "celsius"}, {"unit": "fahrenheit"}), f"input {uses[0].input}")
    check(uses[0].id.startswith("toolu_"), f"tool_use id {uses[0].id}")
    with client.messages.stream(**forced) as stream:
        streamed = stream.get_final_message()
    s_uses = [b for b in streamed.content if b.type == "tool_use"]
    check(
        [(b.name, b.input) for b in s_uses] == [(b.name, b.input) for b in uses],
        f"streamed call {streamed.content}",
    )
    back = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]},
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=8, messages=back, tools=tools, tool_choice={"type": "none"}, thinking={"type": "disabled"}
    )
    check(answer.stop_reason in ("end_turn", "max_tokens"), f"answer {answer.stop_reason}")
    check(all(b.type == "text" for b in answer.content), f"answer {answer.content}")
    check(answer.usage.input_tokens > call.usage.input_tokens, "the call and its result are rendered")

    # Without `thinking` there is no thinking (Anthropic's default), whatever the server's effort.
    check("thinking" not in [b.type for b in m.content], f"no thinking asked, got {blocks(m)}")

    # What Claude Code sends on every turn (docs/AGENTS.md): its betas, the billing block,
    # adaptive thinking with the display omitted, context management that keeps every thinking
    # block, an effort, a system message after the first user turn, a deferred tool, metadata.
    betas = [
        "claude-code-20250219",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
        "advanced-tool-use-2025-11-20",
        "effort-2025-11-24",
    ]
    billing = "x-anthropic-billing-header: cc_version=2.1.0.{}; cc_entrypoint=sdk-cli;"
    agent = dict(
        model=MODEL,
        max_tokens=8,
        betas=betas,
        system=[
            {"type": "text", "text": billing.format("a1")},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Environment: a test."},
        ],
        tools=tools
        + [
            {
                "name": "Later",
                "description": "A deferred tool.",
                "input_schema": {"type": "object", "properties": {}},
                "defer_loading": True,
            }
        ],
        thinking={"type": "adaptive", "display": "omitted"},
        metadata={"user_id": "device-1"},
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
        },
    )
    a1 = client.beta.messages.create(**agent)
    check(a1.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"agent turn {a1.stop_reason}")
    for b in a1.content:
        if b.type == "thinking":
            check(b.thinking == "" and b.signature, f"display omitted: {b}")
    # The billing block changes every session: it is kept out of the prompt.
    other = dict(agent, system=[{"type": "text", "text": billing.format("b2")}, agent["system"][1]])
    a2 = client.beta.messages.create(**other)
    check(a2.usage.input_tokens == a1.usage.input_tokens, "the billing block is not in the prompt")
    check(blocks(a2) == blocks(a1), "the billing block changes no answer")
    # count_tokens counts the prompt the same request would prefill.
    n = client.beta.messages.count_tokens(
        model=MODEL,
        betas=betas,
        system=agent["system"],
        messages=agent["messages"],
        tools=agent["tools"],
        thinking=agent["thinking"],
        extra_body=agent["extra_body"],
    )
    check(n.input_tokens == a1.usage.input_tokens, f"count_tokens {n.input_tokens} != {a1.usage.input_tokens}")
    plain = client.messages.count_tokens(model=MODEL, messages=msgs)
    check(plain.input_tokens == m.usage.input_tokens, f"count_tokens {plain.input_tokens} != {m.usage.input_tokens}")
    # A deferred tool is not in the prompt until a tool_reference in a tool result loads it:
    # then its definition is rendered there.
    def loading(result):
        return dict(
            agent,
            messages=[
                {"role": "user", "content": "Load the tool"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_ts", "name": "get_weather", "input": {"unit": "celsius"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_ts", "content": result}]},
            ],
            thinking={"type": "disabled"},
            extra_body={},
        )

    loaded = client.beta.messages.create(**loading([{"type": "tool_reference", "tool_name": "Later"}]))
    unloaded = client.beta.messages.create(**loading("none"))
    check(loaded.usage.input_tokens > unloaded.usage.input_tokens + 10, "a tool_reference renders the definition")
    counted = client.beta.messages.count_tokens(
        **{k: v for k, v in loading([{"type": "tool_reference", "tool_name": "Later"}]).items() if k != "max_tokens" and k != "metadata"}
    )
    check(counted.input_tokens == loaded.usage.input_tokens, "count_tokens with a tool_reference")
    # An effort with thinking off is refused naming what was sent.
    expect_bad_request(
        lambda: client.messages.create(
            model=MODEL, max_tokens=4, messages=msgs, thinking={"type": "disabled"}, extra_body={"output_config": {"effort": "max"}}
        ),
        "output_config.effort",
        "effort without thinking",
    )

    # Refusals.
    expect_bad_request(
        # Anthropic's temperature range is 0..1 (sent raw: current clients no longer take it).
        lambda: client.messages.create(model=MODEL, max_tokens=4, messages=msgs, extra_body={"temperature": 1.5}),
        "0..=1",
        "temperature",
    )
    # A model this server does not serve (nor names with --model-alias): Anthropic's 404.
    try:
        client.messages.create(model="claude-x", max_tokens=4, messages=msgs)
        raise AssertionError("model: no NotFoundError")
    except anthropic.NotFoundError as e:
        err = e.body.get("error", {}) if isinstance(e.body, dict) else {}
        check(err.get("type") == "not_found_error", f"model: error {err}")
        check("claude-x" in err.get("message", ""), f"model: message {err}")
    expect_bad_request(
        lambda: client.messages.create(model=MODEL, max_tokens=4, messages=msgs, extra_body={"frobnicate": 1}),
        "`frobnicate` is not supported",
        "unknown field",
    )
    expect_bad_request(
        lambda: client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        ),
        "text-only",
        "image",
    )
    forged = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "made up", "signature": "sig"}]},
        {"role": "user", "content": "y"},
    ]
    expect_bad_request(
        lambda: client.messages.create(model=MODEL, max_tokens=4, messages=forged), "signature", "forged thinking"
    )

    print(f"anthropic_client_test: {CHECKS} checks passed (anthropic {anthropic.__version__})")


if __name__ == "__main__":
    main()
