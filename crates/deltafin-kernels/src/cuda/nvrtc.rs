//! A minimal NVRTC binding loaded at run time (no CUDA toolkit at build time).
//!
//! [`Nvrtc::load`] finds `libnvrtc` (first where [`CudaPaths`] points, then in the usual
//! places: [`Nvrtc::candidates`]), and [`Nvrtc::compile_ptx`] turns a CUDA C++ translation
//! unit into PTX for a virtual architecture (`compute_80`, …).
//! Used by the device backend (feature `cuda`) and by the compile check that runs in CI
//! without a GPU.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::settings::CudaPaths;

/// The library names looked for, newest first.
const SONAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Errors of the NVRTC binding; each names the library, symbol or kernel involved.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// No candidate library could be opened.
    #[error(
        "NVRTC (libnvrtc) not found; tried: {tried}. Install the CUDA toolkit or `pip install \
         nvidia-cuda-nvrtc-cu12` and point DELTAFIN_NVRTC at its libnvrtc.so.12"
    )]
    NotFound {
        /// The candidates tried, with why each failed.
        tried: String,
    },
    /// The library lacks a required function.
    #[error("{lib}: missing NVRTC symbol {symbol}: {reason}")]
    Symbol {
        /// The library path.
        lib: String,
        /// The symbol.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// An NVRTC call failed outside compilation.
    #[error("NVRTC {call} failed: {message}")]
    Call {
        /// The NVRTC function.
        call: &'static str,
        /// `nvrtcGetErrorString` of the result.
        message: String,
    },
    /// The source did not compile.
    #[error("NVRTC could not compile {name} for {arch}:\n{log}")]
    Compile {
        /// The program name (kernel file).
        name: String,
        /// The target architecture.
        arch: String,
        /// The compiler log.
        log: String,
    },
    /// The source or an option holds a NUL byte.
    #[error("{what} contains a NUL byte")]
    Nul {
        /// What held it.
        what: String,
    },
}

type Prog = *mut c_void;
type Res = c_int;

struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Res,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    destroy: unsafe extern "C" fn(*mut Prog) -> Res,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    api: Api,
    path: String,
    _lib: Library,
}

/// PTX text and the compiler log of one compilation.
#[derive(Clone, Debug)]
pub struct Ptx {
    /// The PTX (without the trailing NUL).
    pub text: String,
    /// NVRTC's log (warnings), possibly empty.
    pub log: String,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("path", &self.path).finish()
    }
}

/// Release the program on every exit path.
struct ProgGuard<'a>(&'a Api, Prog);

impl Drop for ProgGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this library and is destroyed once.
        unsafe { (self.0.destroy)(&mut self.1) };
    }
}

impl Nvrtc {
    /// Where [`Nvrtc::load`] looks, in order: `paths.nvrtc` (a file, or a directory holding
    /// `libnvrtc.so*`), each of `paths.toolkit_roots`' `lib64`, `/usr/local/cuda/lib64`, then
    /// the sonames `libnvrtc.so.13`, `libnvrtc.so.12`, `libnvrtc.so` on the loader's path.
    /// Binaries fill `paths` from `DELTAFIN_NVRTC`, `CUDA_HOME` and `CUDA_PATH`
    /// ([`CudaPaths::from_lookup`]).
    pub fn candidates(paths: &CudaPaths) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let push_dir = |dir: &Path, out: &mut Vec<PathBuf>| {
            for name in SONAMES {
                let p = dir.join(name);
                if p.exists() {
                    out.push(p);
                }
            }
        };
        if let Some(p) = &paths.nvrtc {
            if p.is_dir() {
                push_dir(p, &mut out);
            } else {
                out.push(p.clone());
            }
        }
        for root in &paths.toolkit_roots {
            push_dir(&root.join("lib64"), &mut out);
        }
        push_dir(Path::new("/usr/local/cuda/lib64"), &mut out);
        out.extend(SONAMES.map(PathBuf::from));
        out
    }

    /// Load the first of [`Nvrtc::candidates`] that opens and exports the NVRTC API.
    pub fn load(paths: &CudaPaths) -> Result<Nvrtc, NvrtcError> {
        let mut tried = Vec::new();
        for cand in Self::candidates(paths) {
            match Self::load_from(&cand) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(format!("{} ({e})", cand.display())),
            }
        }
        Err(NvrtcError::NotFound {
            tried: tried.join("; "),
        })
    }

    /// Load NVRTC from one path (or soname).
    pub fn load_from(path: &Path) -> Result<Nvrtc, NvrtcError> {
        let shown = path.display().to_string();
        // SAFETY: loading NVRTC runs its (trusted, vendor) initialisers only.
        let lib = unsafe { Library::new(path) }.map_err(|e| NvrtcError::NotFound {
            tried: format!("{shown}: {e}"),
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is the documented NVRTC C function of this signature.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    NvrtcError::Symbol {
                        lib: shown.clone(),
                        symbol: $name,
                        reason: e.to_string(),
                    }
                })?
            };
        }
        let api = Api {
            version: sym!("nvrtcVersion"),
            error_string: sym!("nvrtcGetErrorString"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            destroy: sym!("nvrtcDestroyProgram"),
        };
        Ok(Nvrtc {
            api,
            path: shown,
            _lib: lib,
        })
    }

    /// The library path or soname that was loaded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> Result<(i32, i32), NvrtcError> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        self.check("nvrtcVersion", unsafe {
            (self.api.version)(&mut a, &mut b)
        })?;
        Ok((a, b))
    }

    fn check(&self, call: &'static str, r: Res) -> Result<(), NvrtcError> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
        let message = unsafe {
            let p = (self.api.error_string)(r);
            if p.is_null() {
                format!("code {r}")
            } else {
                format!("{} (code {r})", CStr::from_ptr(p).to_string_lossy())
            }
        };
        Err(NvrtcError::Call { call, message })
    }

    /// Compile `source` (program `name`) to PTX for `arch` (e.g. `compute_80`) with
    /// `-std=c++17`, NVRTC's defaults otherwise (fused multiply-add on), plus `options`.
    pub fn compile_ptx(
        &self,
        name: &str,
        source: &str,
        arch: &str,
        options: &[&str],
    ) -> Result<Ptx, NvrtcError> {
        let nul = |what: &str| NvrtcError::Nul { what: what.into() };
        let src = CString::new(source).map_err(|_| nul(name))?;
        let cname = CString::new(name).map_err(|_| nul("the program name"))?;
        let mut opts = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()];
        opts.extend(options.iter().map(|s| s.to_string()));
        let copts = opts
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| nul(o)))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers.
        self.check("nvrtcCreateProgram", unsafe {
            (self.api.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        let guard = ProgGuard(&self.api, prog);
        // SAFETY: `ptrs` outlives the call; `prog` is live.
        let rc = unsafe { (self.api.compile)(guard.1, ptrs.len() as c_int, ptrs.as_ptr()) };
        let log = self.read(guard.1, self.api.log_size, self.api.log, "log")?;
        if rc != 0 {
            return Err(NvrtcError::Compile {
                name: name.into(),
                arch: arch.into(),
                log: if log.trim().is_empty() {
                    format!("(empty log, result code {rc})")
                } else {
                    log
                },
            });
        }
        let text = self.read(guard.1, self.api.ptx_size, self.api.ptx, "PTX")?;
        Ok(Ptx { text, log })
    }

    /// Read a size-then-bytes NVRTC output (log or PTX) as text without its NUL.
    fn read(
        &self,
        prog: Prog,
        size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
        what: &'static str,
    ) -> Result<String, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: valid out-pointer; `prog` is live.
        self.check(
            if what == "log" {
                "nvrtcGetProgramLogSize"
            } else {
                "nvrtcGetPTXSize"
            },
            unsafe { size(prog, &mut n) },
        )?;
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC reported.
        self.check(
            if what == "log" {
                "nvrtcGetProgramLog"
            } else {
                "nvrtcGetPTX"
            },
            unsafe { get(prog, buf.as_mut_ptr().cast()) },
        )?;
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_the_paths_then_the_usual_places() {
        // Nothing set: the toolkit's default directory, then the loader's path.
        let tail = Nvrtc::candidates(&CudaPaths::default());
        assert!(tail.ends_with(&SONAMES.map(PathBuf::from)), "{tail:?}");
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("toolkit");
        std::fs::create_dir_all(root.join("lib64")).unwrap();
        let lib = root.join("lib64").join("libnvrtc.so.12");
        std::fs::write(&lib, b"").unwrap();
        let file = tmp.path().join("my-libnvrtc.so");
        // A file first (whether it exists or not), then each toolkit root's libraries.
        let paths = CudaPaths {
            nvrtc: Some(file.clone()),
            toolkit_roots: vec![tmp.path().join("missing"), root.clone()],
            ptx_dir: None,
        };
        let mut want = vec![file.clone(), lib.clone()];
        want.extend(tail.iter().cloned());
        assert_eq!(Nvrtc::candidates(&paths), want);
        // A directory: the libraries it holds.
        let dir = CudaPaths {
            nvrtc: Some(root.join("lib64")),
            ..CudaPaths::default()
        };
        assert_eq!(Nvrtc::candidates(&dir)[0], lib);
        // What did not load is named.
        let paths = CudaPaths {
            nvrtc: Some(file.clone()),
            ..CudaPaths::default()
        };
        if let Err(e) = Nvrtc::load(&paths) {
            assert!(e.to_string().contains(&file.display().to_string()), "{e}");
        }
    }
}
