#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| deltafin_fuzz_harness::request_ollama_generate(data));
