//! The instruction-set families the kernels are compiled for, and what this CPU supports.
//!
//! Which one the products use is a kernel setting (`KernelSettings::backend`, default
//! [`Backend::detect`]); a name is parsed strictly by [`Backend::from_str`]: anything else, or
//! a backend this CPU cannot run, is an error.

use std::str::FromStr;

/// The name by which binaries read a forced backend from the environment (the library
/// itself never reads it).
pub const ENV_VAR: &str = "DELTAFIN_KERNEL";

/// An instruction-set family the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Portable Rust; the reference every SIMD path is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA, 8 f32 lanes.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL, 16 f32 lanes.
    Avx512,
    /// aarch64 Advanced SIMD, 4 f32 lanes.
    Neon,
}

/// A bad backend name (the messages name [`ENV_VAR`], where binaries read it from).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("{ENV_VAR}={value:?} is not one of scalar, avx2, avx512, neon")]
    UnknownBackend { value: String },
    #[error("{ENV_VAR}={name} is not supported by this CPU (supported: {supported})")]
    Unsupported { name: String, supported: String },
}

impl Backend {
    /// Every backend, best first.
    pub const ALL: [Backend; 4] = [
        Backend::Avx512,
        Backend::Avx2,
        Backend::Neon,
        Backend::Scalar,
    ];

    /// The name parsed by [`Backend::from_str`] and shown in logs.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
            Backend::Neon => "neon",
        }
    }

    /// Whether the running CPU can execute this backend.
    pub fn is_supported(self) -> bool {
        match self {
            Backend::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "aarch64")]
            Backend::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether the backend's kernels use AVX2 instructions (AVX-512's build on them), which
    /// `K3_MXFP4_DISABLE_AVX2` turns off (`crate::settings::DISABLE_AVX2_VAR`).
    pub fn uses_avx2(self) -> bool {
        matches!(self, Backend::Avx2 | Backend::Avx512)
    }

    /// Supported backends, best first (always ends with `Scalar`).
    pub fn available() -> Vec<Backend> {
        Backend::ALL
            .into_iter()
            .filter(|b| b.is_supported())
            .collect()
    }

    /// The best supported backend.
    pub fn detect() -> Backend {
        Backend::ALL
            .into_iter()
            .find(|b| b.is_supported())
            .unwrap_or(Backend::Scalar)
    }

    /// [`Backend::from_str`]'s error for a backend this CPU cannot run, listing those it can.
    fn unsupported(name: &str) -> BackendError {
        BackendError::Unsupported {
            name: name.to_string(),
            supported: Backend::available()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

impl FromStr for Backend {
    type Err = BackendError;

    /// Parse a backend name strictly (`scalar`, `avx2`, `avx512`, `neon`) and check that this
    /// CPU supports it.
    fn from_str(value: &str) -> Result<Backend, BackendError> {
        let b = Backend::ALL
            .into_iter()
            .find(|b| b.name() == value)
            .ok_or_else(|| BackendError::UnknownBackend {
                value: value.to_string(),
            })?;
        if !b.is_supported() {
            return Err(Backend::unsupported(value));
        }
        Ok(b)
    }
}

/// Whether this CPU has AVX-512 VNNI (`vpdpbusd`, `vpdpwssd` on 512-bit registers), which the
/// integer-activation AVX-512 kernels need.
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parsing() {
        assert_eq!("scalar".parse(), Ok(Backend::Scalar));
        for bad in ["", "AVX2", " scalar", "avx512 ", "sse", "auto"] {
            let e = bad.parse::<Backend>().unwrap_err();
            assert!(
                matches!(e, BackendError::UnknownBackend { .. }),
                "{bad:?}: {e}"
            );
            assert!(e.to_string().contains(ENV_VAR));
        }
        for b in Backend::ALL {
            match b.name().parse::<Backend>() {
                Ok(p) => assert!(p == b && b.is_supported()),
                Err(e) => {
                    assert!(!b.is_supported());
                    assert!(e.to_string().contains("not supported"), "{e}");
                }
            }
        }
        assert_eq!(Backend::available().last(), Some(&Backend::Scalar));
        assert!(Backend::detect().is_supported());
    }
}
