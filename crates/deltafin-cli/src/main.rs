//! `deltafin`: run Kimi K3 on one machine.

fn main() {
    println!("deltafin {}", env!("CARGO_PKG_VERSION"));
}
