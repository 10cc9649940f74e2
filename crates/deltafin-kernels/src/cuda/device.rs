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
use deltafin_tensor::bf16;

use super::nvrtc::{Nvrtc, NvrtcError};
use super::sources::{BATCH_WIDTHS, KERNELS};
use crate::matvec::Weights;
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
    #[error("CUDA {kernel}: {detail}")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// What disagrees.
        detail: String,
    },
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

/// A weight matrix resident on the device.
#[derive(Debug)]
pub enum DeviceMatrix {
    /// bf16 bits, row-major.
    Bf16 {
        /// `rows · cols` values.
        data: CudaSlice<u16>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// int8 codes with the row scales widened to f32 (exact).
    RowInt8 {
        /// `rows · cols` codes.
        data: CudaSlice<i8>,
        /// One scale per row.
        scales: CudaSlice<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// MXFP4 packed nibbles and E8M0 scales, as in the checkpoint.
    Mxfp4 {
        /// `rows · cols / 2` bytes.
        packed: CudaSlice<u8>,
        /// `rows · cols / 32` bytes.
        scales: CudaSlice<u8>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
}

impl DeviceMatrix {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            DeviceMatrix::Bf16 { rows, cols, .. }
            | DeviceMatrix::RowInt8 { rows, cols, .. }
            | DeviceMatrix::Mxfp4 { rows, cols, .. } => (*rows, *cols),
        }
    }
    /// Bytes one product reads from the device (codes and scales as stored there).
    pub fn weight_bytes(&self) -> usize {
        let (r, c) = self.shape();
        match self {
            DeviceMatrix::Bf16 { .. } => r * c * 2,
            DeviceMatrix::RowInt8 { .. } => r * c + r * 4,
            DeviceMatrix::Mxfp4 { .. } => r * c / 2 + r * c / 32,
        }
    }
    fn kind(&self) -> &'static str {
        match self {
            DeviceMatrix::Bf16 { .. } => "bf16",
            DeviceMatrix::RowInt8 { .. } => "rowint8",
            DeviceMatrix::Mxfp4 { .. } => "mxfp4",
        }
    }
}

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

fn i32_dim(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        kernel,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

fn expect_len(kernel: &'static str, what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got == want {
        Ok(())
    } else {
        Err(CudaError::Shape {
            kernel,
            detail: format!("{what} has {got} values, expected {want}"),
        })
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
                    v.push(nvrtc.compile_ptx(k.file, &k.unit(), &arch, &[])?.text);
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
        self.funcs.get(name).ok_or(CudaError::Shape {
            kernel: "launch",
            detail: format!("kernel {name} is not loaded"),
        })
    }

    /// Copy host values to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
        v: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream
            .clone_htod(v)
            .map_err(driver(format!("uploading {what}")))
    }

    /// Copy a device buffer back.
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
        v: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let out = self
            .stream
            .clone_dtoh(v)
            .map_err(driver(format!("downloading {what}")))?;
        // Pageable copies complete before returning; the explicit wait makes it certain.
        self.synchronize()?;
        Ok(out)
    }

    /// A zeroed device buffer of `len` f32.
    pub fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.stream
            .alloc_zeros(len)
            .map_err(driver(format!("allocating {len} f32")))
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("synchronizing"))
    }

    /// Upload a weight matrix (bf16, row-int8 or MXFP4).
    pub fn upload_weights(&self, w: Weights<'_>) -> Result<DeviceMatrix, CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        Ok(match w {
            Weights::F32 { .. } => return Err(CudaError::Unsupported("f32")),
            Weights::Bf16(m) => {
                let bits: Vec<u16> = m.data().iter().map(|v| v.to_bits()).collect();
                DeviceMatrix::Bf16 {
                    data: self.upload("bf16 weights", &bits)?,
                    rows,
                    cols,
                }
            }
            Weights::RowInt8(m) => {
                let scales: Vec<f32> = (0..rows).map(|r| m.scale(r)).collect();
                DeviceMatrix::RowInt8 {
                    data: self.upload("int8 codes", m.data())?,
                    scales: self.upload("int8 row scales", &scales)?,
                    rows,
                    cols,
                }
            }
            Weights::Mxfp4(m) => DeviceMatrix::Mxfp4 {
                packed: self.upload("MXFP4 codes", m.packed())?,
                scales: self.upload("MXFP4 scales", m.scales())?,
                rows,
                cols,
            },
        })
    }

    /// `ys[b, r] = W[r] · xs[b]` for `n` activation rows already on the device (`xs`:
    /// `n · cols`, `ys`: `n · rows`). Queued on the stream; returns without waiting.
    pub fn matmul_on_device(
        &self,
        w: &DeviceMatrix,
        xs: &CudaSlice<f32>,
        n: usize,
        ys: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const K: &str = "matmul";
        let (rows, cols) = w.shape();
        if xs.len() < n * cols || ys.len() < n * rows {
            return Err(CudaError::Shape {
                kernel: K,
                detail: format!(
                    "{n} rows need {} inputs and {} outputs, buffers hold {} and {}",
                    n * cols,
                    n * rows,
                    xs.len(),
                    ys.len()
                ),
            });
        }
        let (ri, ci) = (i32_dim(K, "rows", rows)?, i32_dim(K, "cols", cols)?);
        i32_dim(K, "rows·cols", rows * cols)?;
        let grid = rows.div_ceil(ROWS_PER_BLOCK) as u32;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut done = 0;
        while done < n {
            let nb = BATCH_WIDTHS
                .into_iter()
                .find(|&b| b <= n - done)
                .unwrap_or(1);
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
            done += nb;
        }
        Ok(())
    }

    /// `n` activation rows through `w`: upload, launch, download (`n · rows` results).
    pub fn matmul(&self, w: &DeviceMatrix, xs: &[f32], n: usize) -> Result<Vec<f32>, CudaError> {
        let (rows, cols) = w.shape();
        expect_len("matmul", "xs", xs.len(), n * cols)?;
        let x = self.upload("activations", xs)?;
        let mut y = self.zeros(n * rows)?;
        self.matmul_on_device(w, &x, n, &mut y)?;
        self.download("products", &y)
    }

    /// One KDA recurrent step for all `heads` (see `kda.cu`): `state` is `[heads, d, d]` and
    /// is updated in place; q, k, v, g are `[heads, d]`, beta `[heads]`; returns `[heads, d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_step(
        &self,
        heads: usize,
        d: usize,
        state: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        const K: &str = "kda_step";
        expect_len(K, "state", state.len(), heads * d * d)?;
        for (name, x) in [("q", q), ("k", k), ("v", v), ("g", g)] {
            expect_len(K, name, x.len(), heads * d)?;
        }
        expect_len(K, "beta", beta.len(), heads)?;
        let di = i32_dim(K, "d", d)?;
        i32_dim(K, "heads·d·d", heads * d * d)?;
        let mut s = self.upload("KDA state", state)?;
        let (qd, kd, vd, gd, bd) = (
            self.upload("q", q)?,
            self.upload("k", k)?,
            self.upload("v", v)?,
            self.upload("g", g)?,
            self.upload("beta", beta)?,
        );
        let mut out = self.zeros(heads * d)?;
        let threads = d.div_ceil(32).clamp(1, 8) * 32;
        let cfg = LaunchConfig {
            grid_dim: (heads as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: (3 * d * 4) as u32,
        };
        let f = self.func(K)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut s)
            .arg(&qd)
            .arg(&kd)
            .arg(&vd)
            .arg(&gd)
            .arg(&bd)
            .arg(&mut out)
            .arg(&di);
        // SAFETY: arguments match `kda_step`; lengths checked above.
        unsafe { b.launch(cfg) }.map_err(driver("launching kda_step"))?;
        self.stream
            .memcpy_dtoh(&s, state)
            .map_err(driver("downloading the KDA state"))?;
        self.synchronize()?;
        self.download("KDA output", &out)
    }

    /// Absorbed MLA decode for one token over `n` cached tokens (see `mla.cu`); returns the
    /// gated head outputs `[heads, v]`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_decode(
        &self,
        shape: MlaShape,
        n: usize,
        q: &[f32],
        kv_b: &[bf16],
        latent: &[bf16],
        tail: &[bf16],
        gate: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        const K: &str = "mla_decode";
        let MlaShape {
            heads,
            nope,
            rope,
            v,
            kvl,
        } = shape;
        if n == 0 {
            return Err(CudaError::Shape {
                kernel: K,
                detail: "no cached tokens to attend to".into(),
            });
        }
        expect_len(K, "q", q.len(), heads * (nope + rope))?;
        expect_len(K, "kv_b_proj", kv_b.len(), heads * (nope + v) * kvl)?;
        expect_len(K, "latent cache", latent.len(), n * kvl)?;
        expect_len(K, "tail cache", tail.len(), n * rope)?;
        expect_len(K, "gate", gate.len(), heads * v)?;
        i32_dim(K, "kv_b_proj values", kv_b.len())?;
        i32_dim(K, "cache values", n * kvl)?;
        let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
        let qd = self.upload("q", q)?;
        let kvd = self.upload("kv_b_proj", &bits(kv_b))?;
        let lat = self.upload("latent cache", &bits(latent))?;
        let tl = self.upload("tail cache", &bits(tail))?;
        let gd = self.upload("gate", gate)?;
        let mut scores = self.zeros(heads * n)?;
        let mut out = self.zeros(heads * v)?;
        let scale = 1.0 / ((nope + rope) as f32).sqrt();
        let dims = [n, nope, rope, v, kvl].map(|x| x as i32);
        let cfg = LaunchConfig {
            grid_dim: (heads as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((kvl + rope + 32) * 4) as u32,
        };
        let f = self.func(K)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&qd)
            .arg(&kvd)
            .arg(&lat)
            .arg(&tl)
            .arg(&gd)
            .arg(&mut scores)
            .arg(&mut out);
        for d in &dims {
            b.arg(d);
        }
        b.arg(&scale);
        // SAFETY: arguments match `mla_decode`; lengths checked above.
        unsafe { b.launch(cfg) }.map_err(driver("launching mla_decode"))?;
        self.download("MLA output", &out)
    }

    /// Seconds per `matmul_on_device` call, averaged over `iters` back-to-back launches
    /// after one warm-up.
    pub fn time_matmul(&self, w: &DeviceMatrix, n: usize, iters: usize) -> Result<f64, CudaError> {
        let (rows, cols) = w.shape();
        let x = self.upload("activations", &vec![0.5f32; n * cols])?;
        let mut y = self.zeros(n * rows)?;
        self.matmul_on_device(w, &x, n, &mut y)?;
        self.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters.max(1) {
            self.matmul_on_device(w, &x, n, &mut y)?;
        }
        self.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
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

crate::gpu::impl_canary_device!(CudaDevice, CudaError);

/// The doctor's device canaries ([`crate::gpu::canaries`] on this device).
pub fn canaries(dev: &CudaDevice) -> Vec<(String, Result<f64, String>)> {
    crate::gpu::canaries(dev)
}
