//! Kernel settings: which instruction set the products use, the activation format of MXFP4
//! products, the worker pool's two switches, and where the CUDA backend finds NVRTC and
//! precompiled kernels ([`CudaPaths`]).
//!
//! The library never reads the environment. A binary parses its settings once at startup
//! (each value has a strict parser; [`KernelSettings::from_lookup`] applies them to named
//! variables, e.g. the process environment) and installs them with [`configure`] before the
//! first product. A process that installs nothing runs [`KernelSettings::default`]: the best
//! backend this CPU has, `q8x3` MXFP4 activations, both pool switches on.
//!
//! Why one process-wide installation instead of a settings argument on every product: the
//! settings are read at the start of each product and by the pool's waiting workers, in the
//! middle of the decode loop, through every caller of the public products (the model, the
//! speculative drafters, the device stand-ins). A `OnceLock` read costs one load there and
//! keeps every product signature unchanged; the values are fixed once the first kernel has run,
//! so a product never sees them change.

use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::dispatch::{Backend, BackendError, vnni_available};

/// The name by which binaries read the MXFP4 activation format from the environment.
pub const MXFP4_ACT_VAR: &str = "DELTAFIN_MXFP4_ACT";
/// The name by which binaries read the keep-warm switch (`pool`).
pub const POOL_SPIN_VAR: &str = "DELTAFIN_POOL_SPIN";
/// The name by which binaries read the idle workers' prefetch switch (`lookahead`).
pub const POOL_PREFETCH_VAR: &str = "DELTAFIN_POOL_PREFETCH";

/// The name by which binaries read the original's AVX2 off switch: any value but `0` keeps
/// the products off AVX2 and AVX-512 (which builds on it), i.e. on the portable scalar kernels
/// on x86-64 (the way out when a SIMD kernel misbehaves on a CPU); no effect on aarch64.
pub const DISABLE_AVX2_VAR: &str = "K3_MXFP4_DISABLE_AVX2";

/// The name by which binaries read the NVRTC library (a file, or a directory holding
/// `libnvrtc.so*`) for the CUDA backend ([`CudaPaths::nvrtc`]).
pub const NVRTC_VAR: &str = "DELTAFIN_NVRTC";
/// The names by which binaries read CUDA toolkit roots, in search order
/// ([`CudaPaths::toolkit_roots`]).
pub const CUDA_TOOLKIT_VARS: [&str; 2] = ["CUDA_HOME", "CUDA_PATH"];
/// The name by which binaries read a directory of precompiled CUDA kernels
/// ([`CudaPaths::ptx_dir`]).
pub const CUDA_PTX_DIR_VAR: &str = "DELTAFIN_CUDA_PTX_DIR";

/// Activation format of MXFP4 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mxfp4Act {
    /// f32 activations, f32 accumulation (every backend).
    F32,
    /// int8 activations per 32-column block, three digits folded into one exact int32 sum
    /// (about f32's own precision; `mxfp4_q8x3`; AVX-512 VNNI only, elsewhere the
    /// f32 path runs).
    Q8x3,
}

/// The activation format when none is chosen: `q8x3`, f32's precision at the instruction
/// cost of a one-level int8 product (docs/PERFORMANCE.md, docs/NUMERICS.md).
pub const DEFAULT_ACT: Mxfp4Act = Mxfp4Act::Q8x3;

impl Mxfp4Act {
    /// Every format.
    pub const ALL: [Mxfp4Act; 2] = [Mxfp4Act::F32, Mxfp4Act::Q8x3];

    /// The name parsed by [`Mxfp4Act::from_str`] and shown in logs.
    pub fn name(self) -> &'static str {
        match self {
            Mxfp4Act::F32 => "f32",
            Mxfp4Act::Q8x3 => "q8x3",
        }
    }
}

/// A bad MXFP4 activation format name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mxfp4ActError {
    #[error("{MXFP4_ACT_VAR}={value:?} is not one of f32, q8x3")]
    Unknown { value: String },
}

impl FromStr for Mxfp4Act {
    type Err = Mxfp4ActError;

    /// Parse a format name strictly (`f32` or `q8x3`, nothing else).
    fn from_str(value: &str) -> Result<Mxfp4Act, Mxfp4ActError> {
        Mxfp4Act::ALL
            .into_iter()
            .find(|a| a.name() == value)
            .ok_or_else(|| Mxfp4ActError::Unknown {
                value: value.to_string(),
            })
    }
}

/// A bad keep-warm switch value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{POOL_SPIN_VAR}={value:?} is not valid (expected `on` or `off`)")]
pub struct SpinEnvError {
    /// The rejected value.
    pub value: String,
}

/// A bad idle-prefetch switch value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{POOL_PREFETCH_VAR}={value:?} is not valid (expected `on` or `off`)")]
pub struct PrefetchEnvError {
    /// The rejected value.
    pub value: String,
}

/// `on` → true, `off` → false, nothing else.
fn on_off(value: &str) -> Option<bool> {
    match value {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

/// Parse the keep-warm switch strictly (`on` or `off`).
pub fn parse_spin(value: &str) -> Result<bool, SpinEnvError> {
    on_off(value).ok_or_else(|| SpinEnvError {
        value: value.to_string(),
    })
}

/// Parse the idle-prefetch switch strictly (`on` or `off`).
pub fn parse_prefetch(value: &str) -> Result<bool, PrefetchEnvError> {
    on_off(value).ok_or_else(|| PrefetchEnvError {
        value: value.to_string(),
    })
}

/// A bad kernel setting, or settings that cannot be installed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Mxfp4Act(#[from] Mxfp4ActError),
    #[error(transparent)]
    PoolSpin(#[from] SpinEnvError),
    #[error(transparent)]
    PoolPrefetch(#[from] PrefetchEnvError),
    #[error(
        "{}={backend} uses AVX2, which {DISABLE_AVX2_VAR}={value:?} turns off: unset one of them",
        crate::dispatch::ENV_VAR
    )]
    Avx2Disabled { backend: String, value: String },
    #[error(
        "kernel settings are already fixed ({installed}); they are installed once, before the first product"
    )]
    AlreadyConfigured { installed: String },
}

/// Where the CUDA backend (feature `cuda`) finds NVRTC and the kernels: `cuda::Nvrtc::load`
/// and `cuda::CudaDevice::open`. Nothing set (the default): NVRTC from
/// `/usr/local/cuda/lib64` or the loader's path, kernels compiled by it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CudaPaths {
    /// A libnvrtc file, or a directory holding `libnvrtc.so*`, tried first ([`NVRTC_VAR`]).
    pub nvrtc: Option<PathBuf>,
    /// Toolkit roots whose `lib64` is searched next, in order ([`CUDA_TOOLKIT_VARS`]).
    pub toolkit_roots: Vec<PathBuf>,
    /// A directory of precompiled `<file>.ptx` (JIT-compiled by the driver), loaded instead of
    /// compiling with NVRTC ([`CUDA_PTX_DIR_VAR`]).
    pub ptx_dir: Option<PathBuf>,
}

impl CudaPaths {
    /// The paths named by variables ([`NVRTC_VAR`], [`CUDA_TOOLKIT_VARS`],
    /// [`CUDA_PTX_DIR_VAR`]) as `lookup` gives them, each taken as it is (a binary passes the
    /// process environment, `std::env::var_os`).
    pub fn from_lookup<V: Into<OsString>>(lookup: impl Fn(&str) -> Option<V>) -> CudaPaths {
        let path = |name: &str| lookup(name).map(|v| PathBuf::from(v.into()));
        CudaPaths {
            nvrtc: path(NVRTC_VAR),
            toolkit_roots: CUDA_TOOLKIT_VARS.iter().filter_map(|v| path(v)).collect(),
            ptx_dir: path(CUDA_PTX_DIR_VAR),
        }
    }

    /// The paths set, as log words (` nvrtc=… cuda_toolkit=… cuda_ptx_dir=…`, empty when none is).
    fn words(&self) -> String {
        let mut out = String::new();
        if let Some(p) = &self.nvrtc {
            out.push_str(&format!(" nvrtc={}", p.display()));
        }
        for p in &self.toolkit_roots {
            out.push_str(&format!(" cuda_toolkit={}", p.display()));
        }
        if let Some(p) = &self.ptx_dir {
            out.push_str(&format!(" cuda_ptx_dir={}", p.display()));
        }
        out
    }
}

/// Everything the kernels let a caller choose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSettings {
    /// The instruction set of every product (must be supported by this CPU).
    pub backend: Backend,
    /// The activation format of MXFP4 products on AVX-512 with VNNI (every other CPU runs
    /// f32, see [`KernelSettings::mxfp4_act_in_use`]).
    pub mxfp4_act: Mxfp4Act,
    /// The pool's keep-warm loops during a generation (`pool::run_warm`).
    pub pool_spin: bool,
    /// The waiting workers' prefetch of the next products' weights (`lookahead`).
    pub pool_prefetch: bool,
    /// Where the CUDA backend finds NVRTC and the kernels.
    pub cuda: CudaPaths,
}

impl Default for KernelSettings {
    fn default() -> KernelSettings {
        KernelSettings {
            backend: Backend::detect(),
            mxfp4_act: DEFAULT_ACT,
            pool_spin: true,
            pool_prefetch: true,
            cuda: CudaPaths::default(),
        }
    }
}

impl KernelSettings {
    /// The settings named by variables (the names of [`crate::dispatch::ENV_VAR`],
    /// [`DISABLE_AVX2_VAR`], [`MXFP4_ACT_VAR`], [`POOL_SPIN_VAR`], [`POOL_PREFETCH_VAR`], and
    /// the CUDA paths of
    /// [`CudaPaths::from_lookup`]) as `lookup` gives them, the default for each one it does not
    /// have, each parsed strictly. A binary passes the process environment
    /// (`std::env::var_os`): a choice that is not UTF-8 is refused showing it lossily, a path
    /// is taken as it is.
    pub fn from_lookup<V: Into<OsString>>(
        lookup: impl Fn(&str) -> Option<V>,
    ) -> Result<KernelSettings, KernelError> {
        let text = |name: &str| {
            lookup(name).map(|v| {
                v.into()
                    .into_string()
                    .unwrap_or_else(|v| v.to_string_lossy().into_owned())
            })
        };
        let mut s = KernelSettings {
            cuda: CudaPaths::from_lookup(&lookup),
            ..KernelSettings::default()
        };
        if let Some(v) = text(MXFP4_ACT_VAR) {
            s.mxfp4_act = v.parse()?;
        }
        if let Some(v) = text(POOL_SPIN_VAR) {
            s.pool_spin = parse_spin(&v)?;
        }
        if let Some(v) = text(POOL_PREFETCH_VAR) {
            s.pool_prefetch = parse_prefetch(&v)?;
        }
        let no_avx2 = text(DISABLE_AVX2_VAR).filter(|v| v != "0");
        if no_avx2.is_some() {
            s.backend = Backend::available()
                .into_iter()
                .find(|b| !b.uses_avx2())
                .unwrap_or(Backend::Scalar);
        }
        if let Some(v) = text(crate::dispatch::ENV_VAR) {
            s.backend = v.parse()?;
            if let Some(value) = no_avx2
                && s.backend.uses_avx2()
            {
                return Err(KernelError::Avx2Disabled { backend: v, value });
            }
        }
        Ok(s)
    }

    /// The MXFP4 activation format these settings run: [`KernelSettings::mxfp4_act`] on
    /// AVX-512 with VNNI, f32 everywhere else.
    pub fn mxfp4_act_in_use(&self) -> Mxfp4Act {
        if self.backend == Backend::Avx512 && vnni_available() {
            self.mxfp4_act
        } else {
            Mxfp4Act::F32
        }
    }

    /// The settings as log words: `kernels=… mxfp4_act=… pool_spin=on|off pool_prefetch=on|off`,
    /// then the CUDA paths that are set.
    fn words(&self) -> String {
        format!(
            "kernels={} mxfp4_act={} {}{}",
            self.backend.name(),
            self.mxfp4_act_in_use().name(),
            self.pool_words(),
            self.cuda.words()
        )
    }

    /// `pool_spin=on|off pool_prefetch=on|off`.
    fn pool_words(&self) -> String {
        let word = |on: bool| if on { "on" } else { "off" };
        format!(
            "pool_spin={} pool_prefetch={}",
            word(self.pool_spin),
            word(self.pool_prefetch)
        )
    }
}

static INSTALLED: OnceLock<KernelSettings> = OnceLock::new();

/// Install the settings every product of this process uses. Call it once, before the first
/// kernel runs; installing the same settings again is accepted, different ones are an error
/// (as is a backend this CPU cannot run).
pub fn configure(settings: KernelSettings) -> Result<(), KernelError> {
    if !settings.backend.is_supported() {
        return Err(BackendError::Unsupported {
            name: settings.backend.name().to_string(),
            supported: Backend::available()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    let installed = INSTALLED.get_or_init(|| settings.clone());
    if *installed != settings {
        return Err(KernelError::AlreadyConfigured {
            installed: installed.words(),
        });
    }
    Ok(())
}

/// The settings in force: those [`configure`] installed, else the defaults (fixed from then on).
#[inline]
pub fn current() -> &'static KernelSettings {
    INSTALLED.get_or_init(KernelSettings::default)
}

/// The backend the public kernels use.
#[inline]
pub fn backend() -> Backend {
    current().backend
}

/// Name of the backend in use, for `--stats` and logs (`"avx512"`, `"avx2"`, `"neon"`, `"scalar"`).
pub fn kernel_backend() -> &'static str {
    backend().name()
}

/// One log line: the backend in use, the MXFP4 activation format it runs, the relevant CPU
/// features present, the worker count and the pool switches, e.g. `kernels=avx512
/// mxfp4_act=q8x3 cpu=[avx512f avx512bw avx512vl avx512_bf16 avx512_vnni avx2 fma] threads=2
/// pool_spin=on pool_prefetch=on`.
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
    let s = current();
    format!(
        "kernels={} mxfp4_act={} cpu=[{}] threads={} {}",
        s.backend.name(),
        s.mxfp4_act_in_use().name(),
        feats.join(" "),
        rayon::current_num_threads(),
        s.pool_words(),
    )
}

/// The pool's switches as log words, `pool_spin=on|off pool_prefetch=on|off`.
pub fn pool_settings() -> String {
    current().pool_words()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `K3_MXFP4_DISABLE_AVX2`: any value but `0` keeps the default off AVX2 and AVX-512;
    /// naming one of them as well is an error; `0` changes nothing.
    #[test]
    fn disabling_avx2_keeps_the_default_off_avx2_and_avx512() {
        let set = |vars: &[(&str, &str)]| {
            KernelSettings::from_lookup(|k| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        for v in ["1", "yes", ""] {
            let s = set(&[(DISABLE_AVX2_VAR, v)]).unwrap();
            assert!(!s.backend.uses_avx2(), "{v:?}: {:?}", s.backend);
            assert_eq!(
                s.backend,
                Backend::available()
                    .into_iter()
                    .find(|b| !matches!(b, Backend::Avx2 | Backend::Avx512))
                    .unwrap()
            );
        }
        assert_eq!(
            set(&[(DISABLE_AVX2_VAR, "0")]).unwrap(),
            KernelSettings::default()
        );
        let s = set(&[(DISABLE_AVX2_VAR, "1"), ("DELTAFIN_KERNEL", "scalar")]).unwrap();
        assert_eq!(s.backend, Backend::Scalar);
        for b in [Backend::Avx2, Backend::Avx512]
            .into_iter()
            .filter(|b| b.is_supported())
        {
            let e = set(&[(DISABLE_AVX2_VAR, "1"), ("DELTAFIN_KERNEL", b.name())]).unwrap_err();
            assert!(matches!(e, KernelError::Avx2Disabled { .. }), "{e}");
            assert!(e.to_string().contains(DISABLE_AVX2_VAR), "{e}");
        }
    }

    #[test]
    fn each_value_parses_strictly() {
        assert_eq!("f32".parse(), Ok(Mxfp4Act::F32));
        assert_eq!("q8x3".parse(), Ok(Mxfp4Act::Q8x3));
        // The formats the kernels do not have are refused, naming the accepted ones.
        for bad in ["", "Q8X3", "q8x3 ", "bf16", "q8", "q16", "q16x2"] {
            let e = bad.parse::<Mxfp4Act>().unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(MXFP4_ACT_VAR) && msg.contains("f32, q8x3"),
                "{bad:?}: {msg}"
            );
        }
        assert_eq!((parse_spin("on"), parse_spin("off")), (Ok(true), Ok(false)));
        assert_eq!(
            (parse_prefetch("on"), parse_prefetch("off")),
            (Ok(true), Ok(false))
        );
        for bad in ["", "ON", "1", "yes", " on"] {
            let e = parse_spin(bad).unwrap_err().to_string();
            assert!(e.contains(POOL_SPIN_VAR), "{e}");
            let e = parse_prefetch(bad).unwrap_err().to_string();
            assert!(e.contains(POOL_PREFETCH_VAR), "{e}");
        }
    }

    #[test]
    fn from_lookup_takes_each_named_value_and_defaults_the_rest() {
        let none = KernelSettings::from_lookup(|_| None::<String>).unwrap();
        assert_eq!(none, KernelSettings::default());
        assert!(none.pool_spin && none.pool_prefetch);
        assert_eq!(none.mxfp4_act, Mxfp4Act::Q8x3);
        let set = |pairs: &'static [(&'static str, &'static str)]| {
            KernelSettings::from_lookup(move |k| {
                pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
            })
        };
        let s = set(&[
            ("DELTAFIN_KERNEL", "scalar"),
            ("DELTAFIN_MXFP4_ACT", "f32"),
            ("DELTAFIN_POOL_SPIN", "off"),
            ("DELTAFIN_POOL_PREFETCH", "off"),
            ("DELTAFIN_NVRTC", "/opt/nvrtc"),
            ("CUDA_PATH", "/opt/cuda-b"),
            ("CUDA_HOME", "/opt/cuda-a"),
            ("DELTAFIN_CUDA_PTX_DIR", "ptx"),
        ])
        .unwrap();
        assert_eq!(
            s,
            KernelSettings {
                backend: Backend::Scalar,
                mxfp4_act: Mxfp4Act::F32,
                pool_spin: false,
                pool_prefetch: false,
                cuda: CudaPaths {
                    nvrtc: Some("/opt/nvrtc".into()),
                    toolkit_roots: vec!["/opt/cuda-a".into(), "/opt/cuda-b".into()],
                    ptx_dir: Some("ptx".into()),
                },
            }
        );
        assert_eq!(s.mxfp4_act_in_use(), Mxfp4Act::F32);
        assert_eq!(
            s.words(),
            "kernels=scalar mxfp4_act=f32 pool_spin=off pool_prefetch=off nvrtc=/opt/nvrtc \
             cuda_toolkit=/opt/cuda-a cuda_toolkit=/opt/cuda-b cuda_ptx_dir=ptx"
        );
        // No CUDA path set: no words for them.
        let plain = set(&[("DELTAFIN_POOL_SPIN", "off")]).unwrap().words();
        assert!(
            plain.ends_with(" pool_spin=off pool_prefetch=on"),
            "{plain}"
        );
        for (var, bad) in [
            ("DELTAFIN_KERNEL", "sse"),
            ("DELTAFIN_MXFP4_ACT", "q16x2"),
            ("DELTAFIN_POOL_SPIN", "maybe"),
            ("DELTAFIN_POOL_PREFETCH", "ON"),
        ] {
            let e = KernelSettings::from_lookup(|k| (k == var).then(|| bad.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(var) && e.contains(bad), "{e}");
        }
    }

    /// The process environment hands over `OsString`s: a path is kept byte for byte, a choice
    /// that is not UTF-8 is refused showing what it holds.
    #[cfg(unix)]
    #[test]
    fn from_lookup_keeps_paths_as_they_are_and_refuses_non_utf8_choices() {
        use std::os::unix::ffi::OsStringExt;
        let odd = || OsString::from_vec(b"/opt/cu\xffda".to_vec());
        let s = KernelSettings::from_lookup(|k| (k == "DELTAFIN_CUDA_PTX_DIR").then(odd)).unwrap();
        assert_eq!(s.cuda.ptx_dir, Some(PathBuf::from(odd())));
        assert_eq!(
            CudaPaths::from_lookup(|k| (k == "CUDA_PATH").then(odd)).toolkit_roots,
            [PathBuf::from(odd())]
        );
        let e = KernelSettings::from_lookup(|k| (k == "DELTAFIN_POOL_SPIN").then(odd))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DELTAFIN_POOL_SPIN") && e.contains("/opt/cu\u{fffd}da"),
            "{e}"
        );
    }

    #[test]
    fn installed_settings_are_fixed() {
        // Whatever this test process installed first (or the defaults) stays.
        let now = current().clone();
        assert_eq!(configure(now.clone()), Ok(()));
        let other = KernelSettings {
            pool_spin: !now.pool_spin,
            ..now.clone()
        };
        let e = configure(other).unwrap_err();
        assert!(matches!(e, KernelError::AlreadyConfigured { .. }), "{e}");
        assert!(e.to_string().contains(&now.words()), "{e}");
        let other = KernelSettings {
            cuda: CudaPaths {
                ptx_dir: Some("elsewhere".into()),
                ..now.cuda.clone()
            },
            ..now.clone()
        };
        let e = configure(other).unwrap_err().to_string();
        assert!(e.contains(&now.words()) && !e.contains("elsewhere"), "{e}");
        assert_eq!(*current(), now);
        assert!(kernel_summary().starts_with(&format!("kernels={}", now.backend.name())));
        assert!(kernel_summary().ends_with(&pool_settings()));
    }
}
