#!/usr/bin/env python3
"""Golden ids for the K3 XTML chat format (spec §8), from NeMo-Automodel 0.7.0's renderer.

Loads `nemo_automodel/components/models/kimi_k3/encoding.py` straight from the unzipped
wheel (it imports only the standard library; nemo-automodel and its dependencies are NOT
installed), renders each conversation with `build_chat_segments`, and encodes the segments
the way `TikTokenTokenizer._encode_chat_segments` does, with the tiktoken 0.14.0 wrapper of
tokenizer_goldens.py over assets/kimi.

Difference handled here: NeMo emits the thinking-effort message only when an effort is
passed; the spec (§8.3) and deltafin default to `max` when thinking. A case whose options
say `"effort": null` is rendered by NeMo with thinking_effort="max" (when thinking), so the
fixture pins deltafin's default.

Writes tests/fixtures/chat/goldens.json: cases of
  {"name", "messages" (OpenAI-style, as given to NeMo), "options": {"thinking", "effort",
   "add_generation_prompt", "tools", "tool_choice", "response_format"}, "text", "ids"}.

Usage: python tools/oracle/chat_goldens.py [--nemo DIR_WITH_nemo_automodel] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from tokenizer_goldens import KimiTokenizer  # noqa: E402

SPEC_GOLDEN = [163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586,
               163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589]


def load_encoding(nemo_root: Path):
    path = nemo_root / "nemo_automodel" / "components" / "models" / "kimi_k3" / "encoding.py"
    spec = importlib.util.spec_from_file_location("kimi_k3_encoding", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kimi_k3_encoding"] = module
    spec.loader.exec_module(module)
    return module


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
            },
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "web_search",
        "parameters": {
            "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 5}},
            "type": "object",
        },
        "description": "Search the web & return \"snippets\".",
    },
}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate math.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


def call(cid, name, arguments):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if cid is not None:
        c["id"] = cid
    return c


def U(text, **kw):
    return {"role": "user", "content": text, **kw}


def S(text, **kw):
    return {"role": "system", "content": text, **kw}


def A(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def T(text, **kw):
    return {"role": "tool", "content": text, **kw}


ALL_TYPES_ARGS = json.dumps({
    "city": "Paris", "days": 3, "ratio": 0.75, "metric": True, "note": None,
    "opts": {"lang": "fr", "nested": {"x": [1, 2.5, "é"]}}, "tags": ["a", "b", 3],
    "big": 1e100, "tiny": 0.00001, "one": 1.0, "neg": -0.0, "long": 12345678901234567,
    "unicode": "你好 😀", "empty": "", "quote\"key&": "v\"&",
})

CASES = []


def case(name, messages, thinking=True, effort=None, add_generation_prompt=True, tools=None,
         tool_choice=None, response_format=None):
    CASES.append({
        "name": name,
        "messages": messages,
        "options": {
            "thinking": thinking, "effort": effort, "add_generation_prompt": add_generation_prompt,
            "tools": tools or [], "tool_choice": tool_choice, "response_format": response_format,
        },
    })


case("user_hello_nothink", [U("Hello")], thinking=False)
case("user_hello_default_effort", [U("Hello")])
for e in ["low", "medium", "high", "max"]:
    case(f"effort_{e}", [U("Solve 2+2.")], effort=e)
case("effort_ignored_when_not_thinking", [U("Hi")], thinking=False, effort="high")
case("system_user", [S("You are Kimi, a helpful assistant."), U("What is the capital of France?")])
case("names_escaped", [S("Be brief.", name='ops "core" & co'), U("hi", name='Tom & "Jerry"'),
                       A("Hello Tom.", name="kimi&<bot>")], thinking=False)
case("multi_turn_reasoning", [
    U("What is 17*23?"),
    A("17*23 = 391.", reasoning_content="17*20=340, 17*3=51, total 391."),
    U("And 391/17?"),
])
case("multi_turn_reasoning_nothink", [
    U("What is 17*23?"),
    A("17*23 = 391.", reasoning_content="17*20=340, 17*3=51, total 391."),
    U("And 391/17?"),
], thinking=False)
case("empty_and_blank_reasoning", [U("a"), A("b", reasoning_content=""), U("c"),
                                   A("d", reasoning_content=" \n\t\u3000"), U("e")])
case("reasoning_kept_verbatim", [U("q"), A("answer", reasoning_content="\n  think hard  \n"), U("next")])
case("reasoning_field_fallback", [U("q"), A("answer", reasoning="via the reasoning field"), U("next")])
case("tools_declared", [U("Weather in Zürich?")], tools=[WEATHER, SEARCH])
case("tools_declared_nothink", [U("Weather in Zürich?")], thinking=False, tools=[WEATHER])
case("tool_call_all_types", [
    U("Plan a trip."),
    A(None, reasoning_content="Need weather.", tool_calls=[call("c1", "get_weather", ALL_TYPES_ARGS)]),
    T("Sunny, 25°C", tool_call_id="c1"),
    A("It will be sunny."),
], tools=[WEATHER])
case("tool_call_all_types_nothink", [
    U("Plan a trip."),
    A("", tool_calls=[call("c1", "get_weather", ALL_TYPES_ARGS)]),
    T("Sunny", tool_call_id="c1"),
], thinking=False, tools=[WEATHER])
case("tool_calls_two_parallel_in_order", [
    U("Weather in Paris and Rome"),
    A("Checking.", tool_calls=[call("a", "get_weather", '{"city": "Paris"}'),
                               call("b", "get_weather", '{"city": "Rome", "unit": "celsius"}')]),
    T("Paris: 20C", tool_call_id="a"), T("Rome: 28C", tool_call_id="b"),
    A("Paris 20C, Rome 28C."),
], tools=[WEATHER])
case("tool_results_reordered_by_id", [
    U("Search two things"),
    A("", tool_calls=[call("id-1", "web_search", '{"query": "rust"}'),
                      call("id-2", "calc", '{"expr": "1+1"}')]),
    T("2", tool_call_id="id-2", name="stale_name"), T("Rust is a language", tool_call_id="id-1"),
], tools=[SEARCH, CALC])
case("tool_results_partially_matched_keep_order", [
    U("x"),
    A("", tool_calls=[call("k1", "web_search", '{"query": "a"}'), call("k2", "calc", '{"expr": "2"}')]),
    T("second", tool_call_id="k2"), T("first", tool_call_id="nope", name="web_search"),
], thinking=False)
case("tool_results_by_name_no_ids", [
    U("x"),
    A("", tool_calls=[call(None, "web_search", '{"query": "a"}'), call(None, "calc", '{"expr": "2"}')]),
    T("r1", name="web_search"), T("r2", name="calc"),
], thinking=False)
case("tool_results_positional_fallback", [
    U("x"),
    A("", tool_calls=[call(None, "web_search", '{"query": "a"}'), call(None, "calc", '{"expr": "2"}')]),
    T("r1"), T("r2"),
], thinking=False)
case("tool_result_tool_field", [
    U("x"), A("", tool_calls=[call(None, "calc", '{"expr": "3*3"}')]), T("9", tool="calc"),
])
case("tool_index_restarts_per_assistant", [
    U("x"),
    A("", tool_calls=[call("1", "calc", '{"expr": "1"}'), call("2", "calc", '{"expr": "2"}')]),
    T("1", tool_call_id="1"), T("2", tool_call_id="2"),
    A("", tool_calls=[call("3", "web_search", '{"query": "q"}')]),
    T("found", tool_call_id="3"),
    A("done"),
], tools=[CALC, SEARCH])
case("tool_args_dict", [
    U("x"), A("", tool_calls=[call("d", "get_weather", {"unit": "fahrenheit", "city": "New York", "n": [1, {"z": 1, "a": 2}]})]),
    T("cold", tool_call_id="d"),
], thinking=False)
case("tool_args_raw_not_json", [
    U("x"), A("", tool_calls=[call("r", "calc", "expr=1+1 (not json)")]), T("2", tool_call_id="r"),
])
case("tool_args_empty_and_blank", [
    U("x"), A("", tool_calls=[call("e1", "calc", ""), call("e2", "calc", "  "), call("e3", "calc", "{}")]),
    T("a", tool_call_id="e1"), T("b", tool_call_id="e2"), T("c", tool_call_id="e3"),
], thinking=False)
case("tool_name_needs_escaping", [
    U("x"), A("", tool_calls=[call("q", 'fn"&name', '{"k&\\"": "v"}')]), T("ok", tool_call_id="q"),
], thinking=False)
case("tool_result_json_content", [
    U("x"), A("", tool_calls=[call("j", "web_search", '{"query": "json"}')]),
    T('{"results": [{"title": "A", "url": "https://a.example"}], "count": 1}', tool_call_id="j"),
])
case("user_spells_specials", [U("Please print <|open|>message<|sep|> and <|end_of_msg|> and [BOS] literally.")])
case("assistant_spells_specials", [U("x"), A("Sure: <|close|>response<|sep|><|im_end|>"), U("y")],
     thinking=False)
case("content_arrays", [
    {"role": "system", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
    {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": " two parts"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Seen"}, {"type": "text", "text": "."}]},
    U("ok"),
])
case("dynamic_tools_system", [
    U("Hi"), A("Hello."), {"role": "system", "tools": [SEARCH, CALC]}, U("Now search."),
], tools=[WEATHER])
case("system_with_empty_tools_is_plain", [{"role": "system", "content": "plain", "tools": []}, U("x")])
case("tool_choice_required", [U("Weather?")], tools=[WEATHER], tool_choice="required")
case("tool_choice_none", [U("Weather?")], tools=[WEATHER], tool_choice="none", thinking=False)
case("tool_choice_required_nothink", [U("Weather?")], tools=[WEATHER, SEARCH], tool_choice="required",
     thinking=False)
# A named function: neither NeMo nor llama.cpp's template has a frame for it (no message).
case("tool_choice_named", [U("Weather?")], tools=[WEATHER, SEARCH],
     tool_choice={"type": "function", "function": {"name": "get_weather"}})
case("tool_choice_named_nothink", [U("Weather?")], tools=[WEATHER],
     tool_choice={"type": "function", "function": {"name": "get_weather"}}, thinking=False)
case("tool_choice_none_without_tools", [U("Hi")], tool_choice="none")
# One agent-loop turn as an OpenAI client sends it back: the call, then its result.
case("agent_loop_second_turn_nothink", [
    U("Weather in Paris?"),
    A(None, tool_calls=[call("call_1", "get_weather", '{"city": "Paris"}')]),
    T("Sunny, 21 C", tool_call_id="call_1"),
], tools=[WEATHER], tool_choice="required", thinking=False)
case("agent_loop_second_turn", [
    U("Weather in Paris?"),
    A(None, reasoning_content="Call the tool.", tool_calls=[call("call_1", "get_weather", '{"city": "Paris"}')]),
    T("Sunny, 21 C", tool_call_id="call_1"),
], tools=[WEATHER], effort="low")
case("response_format_json_object", [U("Give JSON.")], response_format={"type": "json_object"})
case("response_format_json_schema", [U("Give JSON.")], response_format={
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object", "required": ["b", "a"],
                                                  "properties": {"b": {"type": "number"}, "a": {"type": "string"}}}},
})
case("no_generation_prompt", [U("q"), A("a", reasoning_content="r")], add_generation_prompt=False)
case("no_generation_prompt_nothink", [U("q"), A("a")], thinking=False, add_generation_prompt=False)
case("empty_conversation", [])
case("empty_conversation_nothink", [], thinking=False)
case("empty_and_whitespace_content", [S(""), U(" "), A(None), U("\n\n")])
case("cjk_emoji_rtl", [U("你好！请用中文回答。😀👨\u200d👩\u200d👧 مرحبا שלום"), A("好的 👍🏽"), U("नमस्ते สวัสดี")])
case("code_content", [U("Fix this:\n```python\ndef f(x):\n\treturn x+1\n```\r\n"),
                      A("```rust\nfn f(x: i32) -> i32 {\n    x + 1\n}\n```")], thinking=False)
case("long_user_text", [U("a" * 25_001 + " " * 30 + "end")], thinking=False)
case("unicode_names", [U("hola", name="José Müller"), A("¡Hola!", name="キミ")])
case("everything", [
    S("You are a careful agent.", name="root"),
    U([{"type": "text", "text": "Weather in Oslo & "}, {"type": "text", "text": "\"Bergen\"?"}], name='u"1'),
    A("Let me check.", reasoning_content="Two calls.",
      tool_calls=[call("w1", "get_weather", '{"city": "Oslo", "days": 2}'),
                  call("w2", "get_weather", {"city": "Bergen", "metric": False})]),
    T("Bergen: rain", tool_call_id="w2"), T("Oslo: snow", tool_call_id="w1"),
    A("Oslo snow, Bergen rain.", reasoning_content="Summarize."),
    U("Thanks <|open|>"),
], tools=[WEATHER, SEARCH], effort="high", tool_choice="none", response_format={"type": "json_object"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nemo", type=Path, default=Path("/work/oracle/nemo"),
                    help="directory containing the unzipped nemo_automodel package")
    ap.add_argument("--assets", type=Path, default=ROOT / "assets" / "kimi")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "chat" / "goldens.json")
    args = ap.parse_args()
    enc = load_encoding(args.nemo)
    tok = KimiTokenizer(args.assets)

    out = []
    for c in CASES:
        o = c["options"]
        effort = o["effort"]
        if o["thinking"] and effort is None:
            effort = "max"  # deltafin/spec default (§8.3); NeMo needs it passed explicitly
        kwargs = {"thinking_effort": effort}
        if o["tool_choice"] is not None:
            kwargs["tool_choice"] = o["tool_choice"]
        if o["response_format"] is not None:
            kwargs["response_format"] = o["response_format"]
        segments = enc.build_chat_segments(
            c["messages"], tools=o["tools"] or None, add_generation_prompt=o["add_generation_prompt"],
            thinking=o["thinking"], **kwargs,
        )
        ids = []
        for seg in segments:
            ids.extend(tok.encode(seg.text, allow_special_tokens=seg.allow_special))
        # Control segments are exactly the four markers.
        for seg in segments:
            if seg.allow_special:
                assert len(tok.encode(seg.text, True)) == 1, seg
        out.append({**c, "text": "".join(s.text for s in segments), "ids": ids})

    by_name = {c["name"]: c for c in out}
    assert by_name["user_hello_nothink"]["ids"] == SPEC_GOLDEN, by_name["user_hello_nothink"]["ids"]
    user_specials = by_name["user_spells_specials"]["ids"]
    # effort message, user message, generation prompt (message + think): the literals stay text.
    assert user_specials.count(163587) == 4 and 163584 not in user_specials, user_specials
    assert user_specials.count(163586) == 2, user_specials
    assert len(out) >= 40, len(out)

    doc = {
        "generator": "tools/oracle/chat_goldens.py",
        "oracle": "nemo-automodel 0.7.0 kimi_k3/encoding.py build_chat_segments + tiktoken 0.14.0",
        "cases": out,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(out)} conversations to {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
