//! The CUDA device wrapper (feature `cuda`): presence check, kernel loading, uploads,
//! launches, downloads, and the timing probes of the GPU check.
//!
//! cudarc is built with dynamic loading and panics if `libcuda` is absent, so every entry
//! point first calls [`cuda_available`], which only tries to open the library.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx as DriverPtx;

use super::nvrtc::{Nvrtc, NvrtcError};
use super::sources::{KERNELS, translation_unit};
use crate::gpu::{Element, GpuBackend, KdaStep, MlaDecode, ShapeError, batch_split, index};
use crate::settings::CudaPaths;

/// Rows per block of the matvec kernels (`ROWS_PER_BLOCK` in `matvec.cu`).
const ROWS_PER_BLOCK: usize = 8;

/// Errors of the CUDA backend; each says what is missing or wrong.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No NVIDIA driver library.
    #[error(
        "CUDA unavailable: the NVIDIA driver library libcuda.so was not found (no NVIDIA \
         driver installed, or not on the loader path)"
    )]
    NoDriver,
    /// A driver call failed.
    #[error("CUDA {what}: {source}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        source: DriverError,
    },
    /// The ordinal is not a device of this machine.
    #[error("CUDA device cuda:{ordinal} does not exist: this machine has {count} CUDA device(s)")]
    NoDevice {
        /// The requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// The kernels could not be compiled.
    #[error(
        "CUDA kernels unavailable: {0} (or set DELTAFIN_CUDA_PTX_DIR to a directory of \
         precompiled <file>.ptx)"
    )]
    Nvrtc(#[from] NvrtcError),
    /// A precompiled PTX file could not be read.
    #[error("reading precompiled PTX {path}: {reason}")]
    Ptx {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Inputs disagree with the shapes (or a size exceeds the kernels' 32-bit indices).
    #[error("CUDA {0}")]
    Shape(#[from] ShapeError),
    /// The weight format has no CUDA kernel.
    #[error("CUDA: no kernel for {0} weights")]
    Unsupported(&'static str),
}

fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
    let what = what.into();
    move |source| CudaError::Driver { what, source }
}

/// Whether the NVIDIA driver library can be loaded; `Err(NoDriver)` if not. Never panics.
pub fn cuda_available() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the driver library under its usual names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

/// Number of CUDA devices (errors if the driver is absent or fails to initialise).
pub fn device_count() -> Result<usize, CudaError> {
    cuda_available()?;
    let n = CudaContext::device_count().map_err(driver("initialising the driver"))?;
    Ok(n.max(0) as usize)
}

/// What one device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cuda:N`.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// `(major, minor)` compute capability.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (a, b) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} (sm_{a}{b}, {:.1} GiB)",
            self.ordinal,
            self.name,
            self.total_mem as f64 / (1u64 << 30) as f64
        )
    }
}

fn info_of(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let what = format!("querying cuda:{ordinal}");
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(driver(what.clone()))?,
        compute_capability: ctx.compute_capability().map_err(driver(what.clone()))?,
        total_mem: ctx.total_mem().map_err(driver(what))?,
    })
}

/// Every CUDA device of this machine (empty when the driver reports none).
pub fn list_devices() -> Result<Vec<DeviceInfo>, CudaError> {
    let n = device_count()?;
    (0..n)
        .map(|i| {
            let ctx = CudaContext::new(i).map_err(driver(format!("opening cuda:{i}")))?;
            info_of(&ctx, i)
        })
        .collect()
}

pub use crate::gpu::MlaShape;

/// A weight matrix resident on a CUDA device.
pub type DeviceMatrix = crate::gpu::DeviceMatrix<CudaDevice>;

/// One opened CUDA device with the deltafin kernels loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    kernel_origin: String,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .field("kernels", &self.kernel_origin)
            .finish()
    }
}

impl CudaDevice {
    /// Open `cuda:ordinal` and load the kernels where the installed kernel settings say
    /// ([`crate::settings::KernelSettings::cuda`]; [`CudaDevice::open_with`]).
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        CudaDevice::open_with(ordinal, &crate::settings::current().cuda)
    }

    /// Open `cuda:ordinal` and load the kernels: from `paths.ptx_dir` (precompiled
    /// `<file>.ptx`, JIT-compiled by the driver) when set, else compiled for the device's
    /// architecture by the NVRTC that [`Nvrtc::load`] finds through `paths`.
    pub fn open_with(ordinal: usize, paths: &CudaPaths) -> Result<CudaDevice, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("opening cuda:{ordinal}")))?;
        // One stream per device: cudarc's per-buffer events are not needed.
        // SAFETY: no buffer of this context is used from another stream.
        unsafe { ctx.disable_event_tracking() };
        let info = info_of(&ctx, ordinal)?;
        let stream = ctx.default_stream();
        let (major, minor) = info.compute_capability;
        let arch = format!("compute_{major}{minor}");
        let (ptxs, kernel_origin) = match &paths.ptx_dir {
            Some(dir) => {
                let mut v = Vec::new();
                for k in KERNELS {
                    let path = dir.join(format!("{}.ptx", k.file));
                    let text = std::fs::read_to_string(&path).map_err(|e| CudaError::Ptx {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                    v.push(text);
                }
                (v, format!("precompiled PTX from {}", dir.display()))
            }
            None => {
                let nvrtc = Nvrtc::load(paths)?;
                let mut v = Vec::new();
                for k in KERNELS {
                    v.push(
                        nvrtc
                            .compile_ptx(k.file, &translation_unit(&k), &arch, &[])?
                            .text,
                    );
                }
                (v, format!("NVRTC {} for {arch}", nvrtc.path()))
            }
        };
        let mut funcs = HashMap::new();
        for (k, ptx) in KERNELS.iter().zip(ptxs) {
            let module = ctx
                .load_module(DriverPtx::from_src(ptx))
                .map_err(driver(format!("loading {}", k.file)))?;
            for &entry in k.entries {
                let f = module
                    .load_function(entry)
                    .map_err(driver(format!("finding {entry} in {}", k.file)))?;
                funcs.insert(entry, f);
            }
        }
        Ok(CudaDevice {
            ctx,
            stream,
            funcs,
            info,
            kernel_origin,
        })
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Where the kernels came from (NVRTC path and arch, or the PTX directory).
    pub fn kernel_origin(&self) -> &str {
        &self.kernel_origin
    }

    fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        let missing = || ShapeError {
            kernel: "launch",
            detail: format!("kernel {name} is not loaded"),
        };
        self.funcs.get(name).ok_or_else(|| missing().into())
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written per second)
    /// for a `bytes` buffer, best of `iters` timed copies.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64, CudaError> {
        let n = bytes / 4;
        let src = self.zeros(n)?;
        let mut dst = self.zeros(n)?;
        let mut best = f64::INFINITY;
        for _ in 0..iters.max(1) + 1 {
            self.synchronize()?;
            let t = Instant::now();
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(driver("device-to-device copy"))?;
            self.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n * 4) as f64 / best / 1e9)
    }

    /// The context (for callers that manage their own buffers).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl GpuBackend for CudaDevice {
    type Buf<T> = CudaSlice<T>;
    type Error = CudaError;
    type Index = i32;

    fn upload<T: Element>(&self, what: &str, v: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream
            .clone_htod(v)
            .map_err(driver(format!("uploading {what}")))
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.stream
            .alloc_zeros(len)
            .map_err(driver(format!("allocating {len} f32")))
    }

    /// The whole buffer is copied back, then cut to `len` values.
    fn download(
        &self,
        what: &str,
        buf: &CudaSlice<f32>,
        len: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let mut out = self
            .stream
            .clone_dtoh(buf)
            .map_err(driver(format!("downloading {what}")))?;
        // Pageable copies complete before returning; the explicit wait makes it certain.
        self.synchronize()?;
        out.truncate(len);
        Ok(out)
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("synchronizing"))
    }

    fn unsupported(dtype: &'static str) -> CudaError {
        CudaError::Unsupported(dtype)
    }

    /// Queued on the stream; returns without waiting.
    fn launch_matmul(
        &self,
        w: &DeviceMatrix,
        xs: &CudaSlice<f32>,
        n: usize,
        ys: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const K: &str = "matmul";
        let (rows, cols) = w.shape();
        if xs.len() < n * cols || ys.len() < n * rows {
            let detail = format!(
                "{n} rows need {} inputs and {} outputs, buffers hold {} and {}",
                n * cols,
                n * rows,
                xs.len(),
                ys.len()
            );
            return Err(ShapeError { kernel: K, detail }.into());
        }
        let (ri, ci): (i32, i32) = (index(K, "rows", rows)?, index(K, "cols", cols)?);
        index::<i32>(K, "rows·cols", rows * cols)?;
        let grid = rows.div_ceil(ROWS_PER_BLOCK) as u32;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for (done, nb) in batch_split(n) {
            let f = self.func(&format!("matmul_{}_nb{nb}", w.kind()))?;
            let x = xs.slice(done * cols..(done + nb) * cols);
            let mut y = ys.slice_mut(done * rows..(done + nb) * rows);
            let mut b = self.stream.launch_builder(f);
            match w {
                DeviceMatrix::Bf16 { data, .. } => {
                    b.arg(data);
                }
                DeviceMatrix::RowInt8 { data, scales, .. } => {
                    b.arg(data).arg(scales);
                }
                DeviceMatrix::Mxfp4 { packed, scales, .. } => {
                    b.arg(packed).arg(scales);
                }
            }
            b.arg(&x).arg(&mut y).arg(&ri).arg(&ci);
            // SAFETY: argument list matches the kernel signature; buffer bounds checked above.
            unsafe { b.launch(cfg) }.map_err(driver(format!("launching matmul nb={nb}")))?;
        }
        Ok(())
    }

    /// `kda.cu`: one block per head.
    fn run_kda_step(&self, s: &mut [f32], x: &KdaStep<'_>, d: i32) -> Result<Vec<f32>, CudaError> {
        const K: &str = "kda_step";
        let mut state = self.upload("KDA state", s)?;
        let inputs = x.upload(self)?;
        let mut out = self.zeros(x.heads * x.d)?;
        let threads = x.d.div_ceil(32).clamp(1, 8) * 32;
        let cfg = LaunchConfig {
            grid_dim: (x.heads as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: (3 * x.d * 4) as u32,
        };
        let f = self.func(K)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut state);
        for input in &inputs {
            b.arg(input);
        }
        b.arg(&mut out).arg(&d);
        // SAFETY: arguments match `kda_step`; lengths checked by `KdaStep::check`.
        unsafe { b.launch(cfg) }.map_err(driver("launching kda_step"))?;
        self.stream
            .memcpy_dtoh(&state, s)
            .map_err(driver("downloading the KDA state"))?;
        self.synchronize()?;
        self.download("KDA output", &out, x.heads * x.d)
    }

    /// `mla.cu`: one block per head.
    fn run_mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, CudaError> {
        const K: &str = "mla_decode";
        let sh = x.shape;
        let mut bufs = x.upload(self)?;
        let dims = [x.tokens, sh.nope, sh.rope, sh.v, sh.kvl].map(|v| v as i32);
        let cfg = LaunchConfig {
            grid_dim: (sh.heads as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((sh.kvl + sh.rope + 32) * 4) as u32,
        };
        let f = self.func(K)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&bufs.q)
            .arg(&bufs.kv_b)
            .arg(&bufs.latent)
            .arg(&bufs.tail)
            .arg(&bufs.gate)
            .arg(&mut bufs.scores)
            .arg(&mut bufs.out);
        for d in &dims {
            b.arg(d);
        }
        let scale = sh.scale();
        b.arg(&scale);
        // SAFETY: arguments match `mla_decode`; lengths checked by `MlaDecode::check`.
        unsafe { b.launch(cfg) }.map_err(driver("launching mla_decode"))?;
        self.download("MLA output", &bufs.out, sh.heads * sh.v)
    }
}

/// The doctor's device canaries ([`crate::gpu::canaries`] on this device).
pub fn canaries(dev: &CudaDevice) -> Vec<(String, Result<f64, String>)> {
    crate::gpu::canaries(dev)
}
