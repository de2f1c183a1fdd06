//! The TOML config parser never panics, and what it accepts is valid: each
//! accepted service has a VIP and a backend of that VIP's family.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(config) = socklb::config::parse_toml(text) {
        for service in &config.services {
            assert!(!service.vips.is_empty() && !service.backends.is_empty());
            for vip in &service.vips {
                assert!(
                    service
                        .backends
                        .iter()
                        .any(|backend| backend.addr.is_ipv4() == vip.is_ipv4())
                );
            }
        }
        // What check-config prints for an accepted config never panics.
        let _ = config.to_string();
    }
});
