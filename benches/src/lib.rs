//! Criterion benchmarks for deltafin live in `benches/benches/`; run `cargo bench -p deltafin-benches`.
