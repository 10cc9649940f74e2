//! `cargo xtask`: developer tasks (checkpoint synthesis, conversions).

fn main() {}
