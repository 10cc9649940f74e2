//! Records the build profile, target and enabled features in the binary, so that
//! `deltafin upgrade` can rebuild the same way and `deltafin doctor` can report them.

fn main() {
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".to_string());
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".to_string());
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| {
            k.strip_prefix("CARGO_FEATURE_")
                .map(|f| f.to_ascii_lowercase().replace('_', "-"))
        })
        .collect();
    features.sort();
    println!("cargo:rustc-env=DELTAFIN_BUILD_PROFILE={profile}");
    println!("cargo:rustc-env=DELTAFIN_BUILD_TARGET={target}");
    println!(
        "cargo:rustc-env=DELTAFIN_BUILD_FEATURES={}",
        features.join(",")
    );
    println!("cargo:rerun-if-changed=build.rs");
}
