#!/usr/bin/env python3
"""The official `ollama` Python client against deltafin's Ollama API (docs/SERVER.md, "Ollama API").

    python3 tools/ollama_client_test.py http://127.0.0.1:PORT

Run by crates/deltafin-openai/tests/api_clients.rs. Exits non-zero on the first failed check.
"""

import sys
from importlib.metadata import version

from ollama import Client, ResponseError

MODEL = "deltafin-kimi-k3"
CHECKS = 0


def check(cond, what):
    global CHECKS
    if not cond:
        sys.exit(f"FAILED: {what}")
    CHECKS += 1


def expect_error(fn, status, fragment, what):
    try:
        fn()
    except ResponseError as e:
        check(e.status_code == status, f"{what}: status {e.status_code} != {status} ({e.error})")
        check(fragment in str(e.error), f"{what}: {fragment!r} not in {e.error!r}")
        return
    sys.exit(f"FAILED: {what}: no error")


def main():
    c = Client(host=sys.argv[1], timeout=60)
    msgs = [{"role": "user", "content": "Say hello"}]
    greedy = {"num_predict": 8, "temperature": 0}

    # The model is listed, shown and loaded under the name clients use.
    names = [m.model for m in c.list().models]
    check(any(n.split(":")[0] == MODEL for n in names), f"tags {names}")
    shown = c.show(MODEL)
    check("completion" in (shown.capabilities or []), f"capabilities {shown.capabilities}")
    ctx = [v for k, v in (shown.modelinfo or {}).items() if k.endswith(".context_length")]
    check(ctx and ctx[0] > 0, f"model_info {shown.modelinfo}")
    check(any(m.model.split(":")[0] == MODEL for m in c.ps().models), "ps")

    # Chat, whole and streamed: the streamed pieces make the same answer and counts.
    r = c.chat(model=MODEL, messages=msgs, options=greedy, think=False)
    check(r.done and r.message.role == "assistant", f"chat {r}")
    check(r.done_reason in ("stop", "length"), f"done_reason {r.done_reason}")
    check(0 < r.eval_count <= 8 and r.prompt_eval_count > 0, f"counts {r}")
    parts = list(c.chat(model=MODEL, messages=msgs, options=greedy, think=False, stream=True))
    check(parts[-1].done and not any(p.done for p in parts[:-1]), "one final chunk")
    text = "".join(p.message.content or "" for p in parts)
    check(text == r.message.content, f"streamed {text!r} != {r.message.content!r}")
    check(parts[-1].eval_count == r.eval_count, "streamed eval_count")

    # Thinking on: the reasoning comes in `thinking`, apart from the answer.
    t = c.chat(model=MODEL, messages=msgs, options={"num_predict": 16, "temperature": 0}, think=True)
    check(t.done and isinstance(t.message.thinking or "", str), f"think {t}")

    # Generate, templated and raw, and the same seed gives the same sample.
    g = c.generate(model=MODEL, prompt="Once upon a time", options=greedy)
    check(g.done and g.eval_count <= 8, f"generate {g}")
    raw = c.generate(model=MODEL, prompt="Once upon a time", raw=True, options=greedy)
    check(raw.done and raw.eval_count <= 8, f"raw {raw}")
    seeded = {"num_predict": 8, "temperature": 0.9, "seed": 7}
    a = c.generate(model=MODEL, prompt="Once", raw=True, options=seeded)
    b = c.generate(model=MODEL, prompt="Once", raw=True, options=seeded)
    check(a.response == b.response, "seeded sampling repeats")

    # Tools are declared and the answer parses (a call or text).
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    w = c.chat(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
               tools=tools, options=greedy, think=False)
    check(w.done, f"tools {w}")
    for call in w.message.tool_calls or []:
        check(call.function.name == "get_weather", f"call {call}")

    # JSON mode: the answer is a JSON value.
    j = c.chat(model=MODEL, messages=msgs, format="json", options={"num_predict": 24, "temperature": 0}, think=False)
    check(j.done, f"format json {j}")

    # Runner knobs that change no answer are accepted; what would change it is refused by name.
    k = c.chat(model=MODEL, messages=msgs, think=False,
               options={"num_predict": 8, "temperature": 0, "num_thread": 2, "num_gpu": 0, "use_mmap": True},
               keep_alive="5m")
    check(k.message.content == r.message.content, "runner knobs change nothing")
    expect_error(lambda: c.chat(model=MODEL, messages=msgs, options={"mirostat": 1}), 400, "mirostat", "mirostat")
    expect_error(lambda: c.chat(model="llama3", messages=msgs), 404, "llama3", "unknown model")
    expect_error(lambda: c.embed(model=MODEL, input="hi"), 501, "embedding", "embeddings")
    expect_error(lambda: c.pull(MODEL), 501, "install", "pull")

    print(f"ollama_client_test: {CHECKS} checks passed (ollama {version('ollama')})")


if __name__ == "__main__":
    main()
