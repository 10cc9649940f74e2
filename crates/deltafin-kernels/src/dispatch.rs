//! Runtime CPU dispatch: which instruction set the kernels use.
//!
//! The best supported backend is detected once (cached in a `OnceLock`); the environment
//! variable `DELTAFIN_KERNEL=scalar|avx2|avx512|neon` forces one. The value is parsed strictly:
//! anything else, or a backend this CPU cannot run, is an error. Binaries should call
//! [`select_backend`] at startup to report that error; a kernel called with an invalid
//! setting panics with the same message.

use std::sync::OnceLock;

/// Environment variable that forces a backend.
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

/// A bad `DELTAFIN_KERNEL` setting.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{ENV_VAR}={value:?} is not one of scalar, avx2, avx512, neon")]
    UnknownBackend { value: String },
    #[error("{ENV_VAR}={name} is not supported by this CPU (supported: {supported})")]
    Unsupported { name: String, supported: String },
    #[error(transparent)]
    Mxfp4Act(#[from] crate::mxfp4_q8::Mxfp4ActError),
    #[error(transparent)]
    PoolSpin(#[from] crate::pool::SpinEnvError),
    #[error(transparent)]
    PoolPrefetch(#[from] crate::lookahead::PrefetchEnvError),
}

impl Backend {
    /// Every backend, best first.
    pub const ALL: [Backend; 4] = [
        Backend::Avx512,
        Backend::Avx2,
        Backend::Neon,
        Backend::Scalar,
    ];

    /// The name used by `DELTAFIN_KERNEL` and in logs.
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
}

/// Parse a `DELTAFIN_KERNEL` value strictly and check the CPU supports it.
pub fn parse_backend(value: &str) -> Result<Backend, KernelError> {
    let b = Backend::ALL
        .into_iter()
        .find(|b| b.name() == value)
        .ok_or_else(|| KernelError::UnknownBackend {
            value: value.to_string(),
        })?;
    if !b.is_supported() {
        return Err(KernelError::Unsupported {
            name: value.to_string(),
            supported: Backend::available()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(b)
}

/// Resolve the backend from the environment (unset → [`Backend::detect`]), once per process;
/// also checks `DELTAFIN_MXFP4_ACT` ([`crate::mxfp4_q8::select_mxfp4_act`]),
/// `DELTAFIN_POOL_SPIN` ([`crate::pool::spin_enabled`]) and `DELTAFIN_POOL_PREFETCH`
/// ([`crate::lookahead::prefetch_enabled`]), so binaries that call this at startup report
/// any bad setting.
pub fn select_backend() -> Result<Backend, KernelError> {
    crate::mxfp4_q8::select_mxfp4_act()?;
    crate::pool::spin_enabled()?;
    crate::lookahead::prefetch_enabled()?;
    static SELECTED: OnceLock<Result<Backend, KernelError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| match std::env::var(ENV_VAR) {
            Err(std::env::VarError::NotPresent) => Ok(Backend::detect()),
            Err(std::env::VarError::NotUnicode(v)) => Err(KernelError::UnknownBackend {
                value: v.to_string_lossy().into_owned(),
            }),
            Ok(v) => parse_backend(&v),
        })
        .clone()
}

/// The backend the public kernels use.
///
/// # Panics
/// If `DELTAFIN_KERNEL` is invalid (call [`select_backend`] first to report it as an error).
pub fn backend() -> Backend {
    match select_backend() {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    }
}

/// Name of the backend in use, for `--stats` and logs (`"avx512"`, `"avx2"`, `"neon"`, `"scalar"`).
///
/// # Panics
/// As [`backend`].
pub fn kernel_backend() -> &'static str {
    backend().name()
}

/// One log line: the backend in use, the relevant CPU features present and the worker count,
/// e.g. `kernels=avx512 mxfp4_act=q8x3 cpu=[avx512f avx512bw avx512vl avx512_bf16 avx512_vnni avx2 fma] threads=2 pool_spin=on pool_prefetch=on`.
///
/// # Panics
/// As [`backend`].
pub fn kernel_summary() -> String {
    let mut feats: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        for (name, on) in [
            ("avx512f", has!("avx512f")),
            ("avx512bw", has!("avx512bw")),
            ("avx512vl", has!("avx512vl")),
            ("avx512_bf16", has!("avx512bf16")),
            ("avx512_vnni", has!("avx512vnni")),
            ("avx2", has!("avx2")),
            ("fma", has!("fma")),
        ] {
            if on {
                feats.push(name);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        feats.push("neon");
    }
    let be = kernel_backend();
    // The MXFP4 activation format: int8 (q8) only on AVX-512 with VNNI unless forced to f32.
    let mx = if be == "avx512" {
        crate::mxfp4_q8::avx512_mxfp4_act().name()
    } else {
        "f32"
    };
    format!(
        "kernels={be} mxfp4_act={mx} cpu=[{}] threads={} {}",
        feats.join(" "),
        rayon::current_num_threads(),
        pool_settings(),
    )
}

/// The pool's switches as log words, `pool_spin=on|off pool_prefetch=on|off` (an invalid
/// setting shows as `off`, which is how it runs).
pub fn pool_settings() -> String {
    let on_off = |on: bool| if on { "on" } else { "off" };
    format!(
        "pool_spin={} pool_prefetch={}",
        on_off(crate::pool::spin_enabled().unwrap_or(false)),
        on_off(crate::lookahead::prefetch_enabled().unwrap_or(false)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parsing() {
        assert_eq!(parse_backend("scalar"), Ok(Backend::Scalar));
        for bad in ["", "AVX2", " scalar", "avx512 ", "sse", "auto"] {
            let e = parse_backend(bad).unwrap_err();
            assert!(
                matches!(e, KernelError::UnknownBackend { .. }),
                "{bad:?}: {e}"
            );
            assert!(e.to_string().contains(ENV_VAR));
        }
        for b in Backend::ALL {
            match parse_backend(b.name()) {
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
