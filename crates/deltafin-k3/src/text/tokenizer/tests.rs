use super::*;

fn kimi() -> Tokenizer {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/kimi"));
    Tokenizer::from_dir(dir).expect("load assets/kimi tokenizer")
}

#[test]
fn loads_real_files() {
    let t = kimi();
    assert_eq!(t.vocab_size(), 163_840);
    assert_eq!(t.num_ranks(), 163_584);
    assert_eq!(t.special_id("[BOS]"), Some(BOS));
    assert_eq!(t.special_id("[EOS]"), Some(EOS));
    assert_eq!(t.special_id("<|end_of_msg|>"), Some(END_OF_MSG));
    assert_eq!(t.special_id("<|open|>"), Some(OPEN));
    assert_eq!(t.special_id("<|close|>"), Some(CLOSE));
    assert_eq!(t.special_id("<|sep|>"), Some(SEP));
    assert_eq!(t.special_id("<|reserved_token_163837|>"), Some(163837));
    assert_eq!(t.special_id("[PAD]"), Some(163839));
    assert_eq!(t.special_id("hello"), None);
    assert_eq!(t.token_bytes(SEP), Some(&b"<|sep|>"[..]));
    assert_eq!(t.token_bytes(163_840), None);
}

#[test]
fn spec_goldens() {
    let t = kimi();
    assert_eq!(t.encode_ordinary("Hello world"), vec![19180, 2695]);
    assert_eq!(t.encode_ordinary("你好世界"), vec![33845, 2243]);
    assert_eq!(t.encode_ordinary("Hello, world!"), vec![19180, 11, 2695, 0]);
    assert_eq!(t.encode_ordinary("<|open|>"), vec![27, 91, 4454, 91, 29]);
    assert_eq!(t.encode("<|open|>", true), vec![OPEN]);
    assert_eq!(
        t.encode_ordinary("The capital of France is"),
        vec![1008, 10484, 318, 15383, 387]
    );
}

#[test]
fn py_space_set() {
    for c in [
        '\t', '\n', '\u{b}', '\u{c}', '\r', '\u{1c}', '\u{1f}', ' ', '\u{85}',
    ] {
        assert!(is_py_space(c), "{c:?}");
    }
    for c in [
        '\u{a0}', '\u{1680}', '\u{2000}', '\u{200a}', '\u{2028}', '\u{2029}',
    ] {
        assert!(is_py_space(c), "{c:?}");
    }
    for c in ['\u{202f}', '\u{205f}', '\u{3000}'] {
        assert!(is_py_space(c), "{c:?}");
    }
    for c in [
        'a', '\u{1b}', '\u{200b}', '\u{feff}', '\u{180e}', '\u{7f}', '\u{0}',
    ] {
        assert!(!is_py_space(c), "{c:?}");
    }
}

#[test]
fn run_splitting() {
    let spaces = " ".repeat(25_001);
    assert_eq!(split_for_encoding(&spaces), vec![&spaces[..25_000], " "]);
    let abc = "abc".repeat(8334);
    let parts = split_for_encoding(&abc);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].len(), 25_000);
    // U+001C counts as whitespace (Python), so it resets a non-whitespace run.
    let s = format!("{}\u{1c}{}", "x".repeat(20_000), "y".repeat(20_000));
    assert_eq!(split_for_encoding(&s), vec![s.as_str()]);
    assert_eq!(split_for_encoding(""), vec![""]);
}

/// The explicit lookahead rule agrees with fancy-regex on the verbatim pattern.
#[test]
fn lookahead_rule_matches_fancy_regex() {
    let t = kimi();
    let fancy = fancy_regex::Regex::new(PATTERN).expect("verbatim pattern compiles");
    let alphabet = [
        " ", "  ", "\t", "\n", "\r\n", "\u{a0}", "\u{3000}", "\u{1c}", "\u{2028}", "a", "B",
        "Word", "don't", "X'LL", "1234", "你好", "!?", "é", "\u{301}", "😀", "-", "'s", ".\n",
    ];
    let mut state = 0x2545_f491_u64;
    for _ in 0..3000 {
        let mut s = String::new();
        for _ in 0..12 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            s.push_str(alphabet[(state % alphabet.len() as u64) as usize]);
        }
        let expected: Vec<&str> = fancy
            .find_iter(&s)
            .map(|m| m.expect("no backtrack limit").as_str())
            .collect();
        assert_eq!(t.split_pieces(&s), expected, "text {s:?}");
    }
}

#[test]
fn heap_and_scan_merges_agree() {
    let t = kimi();
    let samples = [
        "abcabcabcabcabcabcabcabc".repeat(20),
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".repeat(10),
        "ThisIsAVeryLongIdentifierWithoutAnySpacesAtAll_1234".repeat(8),
        "κόσμεκόσμεκόσμε".repeat(20),
    ];
    for s in &samples {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        t.bpe_scan(s.as_bytes(), &mut a);
        t.bpe_heap(s.as_bytes(), &mut b);
        assert_eq!(a, b, "{s}");
        assert_eq!(t.decode_bytes(&a).unwrap(), s.as_bytes());
    }
}

#[test]
fn decode_errors_name_the_id() {
    let t = kimi();
    let err = t.decode(&[1, 999_999]).unwrap_err();
    assert!(err.to_string().contains("999999"), "{err}");
    assert_eq!(t.decode(&[19180, 2695]).unwrap(), "Hello world");
    assert_eq!(t.decode(&[OPEN]).unwrap(), "<|open|>");
}

#[test]
fn stream_decoder_holds_back_split_emoji() {
    let t = kimi();
    // Find an encoding of an emoji that spans several ids.
    let text = "ok 🦀🫠 done";
    let ids = t.encode_ordinary(text);
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    let mut saw_partial = false;
    for &id in &ids {
        let piece = d.push(&t, id).unwrap();
        saw_partial |= !d.pending().is_empty();
        out.push_str(&piece);
    }
    out.push_str(&d.finish());
    assert_eq!(out, text);
    assert!(
        saw_partial,
        "expected the emoji to be split across ids: {ids:?}"
    );

    // Explicit byte-level split: ids for single bytes of U+1F980 (F0 9F A6 80).
    let byte_ids: Vec<u32> = [0xF0u8, 0x9F, 0xA6, 0x80]
        .iter()
        .map(|b| t.encoder[&vec![*b]])
        .collect();
    let mut d = StreamDecoder::new();
    assert_eq!(d.push(&t, byte_ids[0]).unwrap(), "");
    assert_eq!(d.push(&t, byte_ids[1]).unwrap(), "");
    assert_eq!(d.push(&t, byte_ids[2]).unwrap(), "");
    assert_eq!(d.push(&t, byte_ids[3]).unwrap(), "🦀");
    assert!(d.finish().is_empty());
}

#[test]
fn stream_decoder_replaces_invalid_bytes() {
    let t = kimi();
    let id = |b: u8| t.encoder[&vec![b]];
    let mut d = StreamDecoder::new();
    // A lone continuation byte is invalid, not incomplete: emitted immediately.
    assert_eq!(d.push(&t, id(0x80)).unwrap(), "\u{FFFD}");
    // A lead byte followed by ASCII: the lead byte becomes U+FFFD, the ASCII passes.
    assert_eq!(d.push(&t, id(0xE2)).unwrap(), "");
    assert_eq!(d.push(&t, id(b'a')).unwrap(), "\u{FFFD}a");
    // An unfinished sequence at the end is flushed lossily.
    assert_eq!(d.push(&t, id(0xE2)).unwrap(), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert!(StreamDecoder::new().push(&t, 200_000).is_err());
}

fn write_files(ranks: &str, config: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("tiktoken.model");
    let c = dir.path().join("tokenizer_config.json");
    std::fs::write(&r, ranks).unwrap();
    std::fs::write(&c, config).unwrap();
    (dir, r, c)
}

fn byte_ranks() -> String {
    let e = base64::engine::general_purpose::STANDARD;
    (0..=255u8)
        .map(|b| format!("{} {}\n", e.encode([b]), b))
        .collect()
}

#[test]
fn small_vocab_loads() {
    let config =
        r#"{"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "<|x|>"}}}"#;
    let (_d, r, c) = write_files(&byte_ranks(), config);
    let t = Tokenizer::from_files(&r, &c).unwrap();
    assert_eq!(t.vocab_size(), 512);
    assert_eq!(t.special_id("<|x|>"), Some(257));
    assert_eq!(t.special_id("<|reserved_token_258|>"), Some(258));
    assert_eq!(t.encode("a<|x|>b", true), vec![97, 257, 98]);
    assert_eq!(t.encode("ab", false), vec![97, 98]);
}

#[test]
fn bad_files_are_reported() {
    // A rank line after the 256 byte ranks, or a special-token config: the error names it.
    let ok_config = r#"{"added_tokens_decoder": {}}"#;
    for (extra_rank, config, wants) in [
        ("!!notbase64 256\n", ok_config, &[":257:", "base64"][..]),
        ("YWI= 5\n", ok_config, &[":257:", "duplicate rank 5"]),
        ("YWI= 300\n", ok_config, &[":257:", "contiguous"]),
        ("YQ== 256\n", ok_config, &["already defined on line 98"]),
        (
            "",
            r#"{"added_tokens_decoder": {"12": {"content": "<|x|>"}}}"#,
            &["id 12 is outside"],
        ),
        (
            "",
            r#"{"added_tokens_decoder": {"256": {"content": "<|reserved_token_300|>"}}}"#,
            &["same spelling"],
        ),
        (
            "",
            r#"{"added_tokens_decoder": {}, "eos_token": "[EOS]"}"#,
            &["eos_token"],
        ),
    ] {
        let (_d, r, c) = write_files(&(byte_ranks() + extra_rank), config);
        let err = Tokenizer::from_files(&r, &c).unwrap_err().to_string();
        assert!(wants.iter().all(|w| err.contains(w)), "{err}");
    }

    let missing = Tokenizer::from_dir(Path::new("/nonexistent/dir")).unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("/nonexistent/dir/tiktoken.model")
    );
}
