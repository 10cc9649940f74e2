//! Whether the resident spine is copied into huge-page memory: the [`HugePages`] setting and
//! the system's transparent-huge-page mode. The copy itself rebuilds model values and lives in
//! `deltafin_k3::weights::resident`.

/// Whether resident spine weights are copied into huge-page memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Copy when the system grants transparent huge pages to an advised mapping.
    #[default]
    Auto,
    /// Keep the spine mapped from its files (zero-copy).
    Off,
}

impl HugePages {
    /// The environment variable the CLI reads.
    pub const ENV: &'static str = "DELTAFIN_HUGE_PAGES";

    /// Parse `auto` or `off` (strict; the error names the accepted values).
    pub fn parse(text: &str) -> Result<HugePages, String> {
        match text.trim() {
            "auto" => Ok(HugePages::Auto),
            "off" => Ok(HugePages::Off),
            other => Err(format!("{other:?} is not one of auto, off")),
        }
    }

    /// Whether to copy on this system.
    pub fn copies(self) -> bool {
        self == HugePages::Auto && transparent_huge_pages().is_some_and(|m| m != "never")
    }
}

/// The system's transparent-huge-page mode (`always`, `madvise` or `never`), `None` where
/// the system has none (not Linux, or the kernel was built without them).
pub fn transparent_huge_pages() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    selected_mode(&text)
}

/// The bracketed entry of a sysfs choice list such as `always [madvise] never`.
fn selected_mode(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    Some(text[start + 1..end].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_parses_strictly_and_the_sysfs_choice_is_read() {
        assert_eq!(HugePages::parse("auto"), Ok(HugePages::Auto));
        assert_eq!(HugePages::parse(" off\n"), Ok(HugePages::Off));
        let e = HugePages::parse("on").unwrap_err();
        assert!(e.contains("\"on\"") && e.contains("auto, off"), "{e}");
        assert!(!HugePages::Off.copies());
        assert_eq!(
            selected_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            selected_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(selected_mode("always madvise never"), None);
    }
}
