use super::*;
use serde_json::Map;

fn ctx() -> ReplyContext {
    ReplyContext {
        id: "resp_abc".into(),
        suffix: "abc".into(),
        created: 9,
        prompt_tokens: 7,
        max_new: 20,
    }
}

fn reply(summary: bool) -> ResponsesReply {
    let mut echo = Map::new();
    echo.insert("tools".into(), json!([]));
    echo.insert("tool_choice".into(), json!("auto"));
    echo.insert("parallel_tool_calls".into(), json!(true));
    let meta = ResponsesMeta {
        echo,
        summary,
        encrypted_reasoning: false,
        store: false,
        input_items: Vec::new(),
        conversation: Vec::new(),
        namespaces: Default::default(),
    };
    ResponsesReply::new(ctx(), meta, crate::seal::Sealer::ephemeral(), None)
}

fn usage(c: usize, r: usize) -> Usage {
    Usage {
        prompt_tokens: 7,
        completion_tokens: c,
        reasoning_tokens: r,
    }
}

fn text(reasoning: &str, content: &str) -> Delta {
    Delta {
        reasoning: reasoning.into(),
        content: content.into(),
        ..Default::default()
    }
}

fn call(index: usize, name: Option<&str>, args: &str) -> Delta {
    Delta {
        tool_calls: vec![ToolCallDelta {
            index,
            id: name.map(|n| format!("call_{n}")),
            name: name.map(str::to_string),
            arguments: args.into(),
        }],
        ..Default::default()
    }
}

fn events(frames: &[String]) -> Vec<(String, Value)> {
    frames
        .iter()
        .map(|f| {
            let (head, data) = f.strip_suffix("\n\n").unwrap().split_once('\n').unwrap();
            let name = head.strip_prefix("event: ").unwrap().to_string();
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["type"], name.as_str());
            (name, v)
        })
        .collect()
}

fn run(
    summary: bool,
    deltas: Vec<Delta>,
    finish: FinishReason,
    u: Usage,
) -> (Vec<(String, Value)>, Value) {
    let mut r = reply(summary);
    let mut frames = r.opening();
    let mut all = Delta::default();
    for d in deltas {
        frames.extend(r.delta(d.clone()).unwrap());
        all.extend(d);
    }
    frames.extend(r.done(finish, &u));
    let body = reply(summary).body(all, finish, &u).unwrap();
    let evs = events(&frames);
    for (i, (_, v)) in evs.iter().enumerate() {
        assert_eq!(v["sequence_number"], i, "sequence numbers count from 0");
    }
    (evs, body)
}

#[test]
fn reasoning_message_and_calls_stream_as_items() {
    let deltas = vec![
        text("hmm ", ""),
        text("ok", "Hi"),
        text("", " there"),
        call(0, Some("get"), "{\"a\":"),
        call(0, None, "1}"),
        call(1, Some("put"), "{}"),
    ];
    let (evs, body) = run(false, deltas, FinishReason::ToolCalls, usage(10, 3));
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(evs[0].1["response"]["status"], "in_progress");
    assert_eq!(evs[0].1["response"]["output"], json!([]));
    assert_eq!(evs[11].1["item_id"], "msg_abc_1");
    assert_eq!(evs[11].1["output_index"], 1);
    assert_eq!(evs[13].1["text"], "Hi there");
    assert_eq!(evs[19].1["arguments"], "{\"a\":1}");
    assert_eq!(evs[19].1["name"], "get");
    let done = &evs.last().unwrap().1["response"];
    // The completed response equals the non-streamed one.
    assert_eq!(done, &body);
    assert_eq!(body["status"], "completed");
    assert_eq!(body["object"], "response");
    assert_eq!(body["id"], "resp_abc");
    assert_eq!(
        body["output"],
        json!([
            {"id": "rs_abc_0", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm ok"}], "status": "completed"},
            {"id": "msg_abc_1", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}]},
            {"id": "fc_abc_2", "type": "function_call", "status": "completed", "call_id": "call_get", "name": "get", "arguments": "{\"a\":1}"},
            {"id": "fc_abc_3", "type": "function_call", "status": "completed", "call_id": "call_put", "name": "put", "arguments": "{}"},
        ])
    );
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
               "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 17})
    );
    assert_eq!(body["tool_choice"], "auto");
}

#[test]
fn summaries_and_incomplete_answers() {
    let (evs, body) = run(
        true,
        vec![text("abc", ""), text("def", "x")],
        FinishReason::Length,
        usage(20, 5),
    );
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[3], "response.reasoning_summary_part.added");
    assert_eq!(names[4], "response.reasoning_summary_text.delta");
    assert_eq!(names[6], "response.reasoning_summary_text.done");
    assert_eq!(names[7], "response.reasoning_summary_part.done");
    assert_eq!(*names.last().unwrap(), "response.incomplete");
    assert_eq!(&evs.last().unwrap().1["response"], &body);
    assert_eq!(body["status"], "incomplete");
    assert_eq!(
        body["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(
        body["output"][0]["summary"],
        json!([{"type": "summary_text", "text": "abcdef"}])
    );
    assert!(body["output"][0].get("content").is_none());
    assert_eq!(body["output"][0]["status"], "completed");
    assert_eq!(body["output"][1]["status"], "incomplete");
    let (evs, body) = run(false, vec![], FinishReason::Stop, usage(0, 0));
    assert_eq!(evs.len(), 3);
    assert_eq!(body["output"], json!([]));
}

#[test]
fn bad_pieces_and_failures() {
    let mut r = reply(false);
    let mut d = call(0, Some("f"), "{}");
    d.tool_calls[0].id = None;
    let evs = events(&r.delta(d).unwrap());
    assert_eq!(evs[0].1["item"]["call_id"], "call_abc_0");
    r.delta(call(1, Some("g"), "{}")).unwrap();
    assert!(
        r.delta(call(0, None, "x"))
            .unwrap_err()
            .message
            .contains("continued")
    );
    assert!(
        reply(false)
            .delta(call(0, None, "{}"))
            .unwrap_err()
            .message
            .contains("without its name")
    );
    let evs = events(&r.failed(&ApiError::server("boom")));
    assert_eq!(evs[0].0, "response.failed");
    let resp = &evs[0].1["response"];
    assert_eq!(resp["status"], "failed");
    assert_eq!(
        resp["error"],
        json!({"code": "server_error", "message": "boom"})
    );
    assert_eq!(resp["output"].as_array().unwrap().len(), 1);
}
