#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_filter::fuzz_checks::canonical_json(data));
