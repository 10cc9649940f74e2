//! Tokenizer encode throughput on a few MB of deterministic mixed prose and code.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use deltafin_k3::text::tokenizer::Tokenizer;

const PROSE: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. ",
    "It was the best of times, it was the worst of times; ",
    "We don't know what they'll say, but I'm sure it's fine. ",
    "In 2024, revenue grew by 12.5% to $3,141,592 across 27 regions.\n",
    "你好世界，今天天气很好。我们一起去公园散步吧！",
    "Ελληνικά και Русский текст, مرحبا بالعالم, שלום עולם. ",
    "Emoji: 😀 👍🏽 🦀 ❤️ and combining e\u{301}. ",
    "\n\n",
];

const CODE: &[&str] = &[
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n        sum += a[i] * b[i];\n    }\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;\n",
    "{\"key\": \"value\", \"list\": [1, 2, 3], \"nested\": {\"a\": null}}\n",
    "        self.weights = np.zeros((hidden_size, vocab_size), dtype=np.float32)\n",
];

/// About `target` bytes of text, mixing the fragments with a fixed xorshift sequence.
fn corpus(target: usize) -> String {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = String::with_capacity(target + 256);
    while out.len() < target {
        let r = next();
        let pool = if r % 3 == 0 { CODE } else { PROSE };
        out.push_str(pool[(r >> 8) as usize % pool.len()]);
        if r % 7 == 0 {
            out.push_str(&format!("id_{} ", r % 100_000));
        }
    }
    out
}

fn bench_encode(c: &mut Criterion) {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/kimi"));
    let tok = Tokenizer::from_dir(dir).expect("load assets/kimi");
    let text = corpus(4 << 20);
    let mut group = c.benchmark_group("tokenizer");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    group.bench_function("encode_ordinary_4MiB", |b| {
        b.iter(|| black_box(tok.encode_ordinary(black_box(&text))))
    });
    group.bench_function("encode_allow_special_4MiB", |b| {
        b.iter(|| black_box(tok.encode(black_box(&text), true)))
    });
    let ids = tok.encode_ordinary(&text);
    group.bench_function("decode_4MiB", |b| {
        b.iter(|| black_box(tok.decode(black_box(&ids)).expect("in range")))
    });
    group.finish();
}

criterion_group!(benches, bench_encode);
criterion_main!(benches);
