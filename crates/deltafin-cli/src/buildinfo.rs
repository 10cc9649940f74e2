//! How this binary was built, recorded at compile time by `build.rs`: the cargo profile
//! (`release` or `debug`), the target triple and the enabled features of `deltafin-cli`.

/// Cargo profile of this build (`release`, `debug`).
pub const PROFILE: &str = env!("DELTAFIN_BUILD_PROFILE");
/// Target triple this binary was compiled for.
pub const TARGET: &str = env!("DELTAFIN_BUILD_TARGET");
/// Enabled cargo features of `deltafin-cli`, comma-separated (empty: none).
pub const FEATURES: &str = env!("DELTAFIN_BUILD_FEATURES");

/// The enabled features as a list.
pub fn features() -> Vec<&'static str> {
    FEATURES.split(',').filter(|f| !f.is_empty()).collect()
}

/// `none` or the comma-separated features.
pub fn features_text() -> &'static str {
    if FEATURES.is_empty() {
        "none"
    } else {
        FEATURES
    }
}
