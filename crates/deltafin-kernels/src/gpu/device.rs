//! The device types: what a GPU backend implements ([`GpuBackend`]), the weight matrix
//! resident on a device ([`DeviceMatrix`]) and the checked operations written once over them
//! ([`GpuDevice`]); the kernels' inputs uploaded to a device.

use deltafin_tensor::bf16;

use super::shapes::{KdaStep, MlaDecode, ShapeError, expect_len};
use crate::matvec::Weights;

impl KdaStep<'_> {
    /// The inputs on a device, in the kernels' argument order: q, k, v, g, beta.
    #[cfg_attr(
        not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))),
        allow(dead_code)
    )]
    pub(crate) fn upload<B: GpuBackend>(&self, dev: &B) -> Result<[B::Buf<f32>; 5], B::Error> {
        Ok([
            dev.upload("q", self.q)?,
            dev.upload("k", self.k)?,
            dev.upload("v", self.v)?,
            dev.upload("g", self.g)?,
            dev.upload("beta", self.beta)?,
        ])
    }
}

/// The buffers of one MLA decode on a device: the inputs, then the scores and the outputs
/// (built by the device backends: feature `cuda`, or `metal` on macOS).
#[cfg_attr(
    not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))),
    allow(dead_code)
)]
pub(crate) struct MlaBuffers<B: GpuBackend> {
    pub(crate) q: B::Buf<f32>,
    pub(crate) kv_b: B::Buf<u16>,
    pub(crate) latent: B::Buf<u16>,
    pub(crate) tail: B::Buf<u16>,
    pub(crate) gate: B::Buf<f32>,
    pub(crate) scores: B::Buf<f32>,
    pub(crate) out: B::Buf<f32>,
}

impl MlaDecode<'_> {
    /// The inputs on a device (bf16 as their bits), with zeroed scores and outputs.
    #[cfg_attr(
        not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))),
        allow(dead_code)
    )]
    pub(crate) fn upload<B: GpuBackend>(&self, dev: &B) -> Result<MlaBuffers<B>, B::Error> {
        let sh = self.shape;
        Ok(MlaBuffers {
            q: dev.upload("q", self.q)?,
            kv_b: dev.upload("kv_b_proj", &bf16_bits(self.kv_b))?,
            latent: dev.upload("latent cache", &bf16_bits(self.latent))?,
            tail: dev.upload("tail cache", &bf16_bits(self.tail))?,
            gate: dev.upload("gate", self.gate)?,
            scores: dev.zeros(sh.heads * self.tokens)?,
            out: dev.zeros(sh.heads * sh.v)?,
        })
    }
}

/// bf16 values as the bits the kernels read.
fn bf16_bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|b| b.to_bits()).collect()
}

/// A value type of device buffers (with feature `cuda` also the driver's `DeviceRepr`).
#[cfg(feature = "cuda")]
pub trait Element: Copy + cudarc::driver::DeviceRepr {}
/// A value type of device buffers.
#[cfg(not(feature = "cuda"))]
pub trait Element: Copy {}
impl Element for u8 {}
impl Element for i8 {}
impl Element for u16 {}
impl Element for f32 {}

/// The primitive operations of a GPU backend (implemented by `cuda::CudaDevice` and
/// `metal::MetalDevice`): what [`DeviceMatrix`] and the checked operations of [`GpuDevice`]
/// are written once against.
pub trait GpuBackend: Sized {
    /// A device buffer of `T` values.
    type Buf<T>;
    /// The backend's error.
    type Error: From<ShapeError> + std::fmt::Display;
    /// The kernels' index type (`i32` for CUDA, `u32` for Metal).
    type Index: TryFrom<usize>;
    /// A new device buffer holding a copy of `v` (`what` names it in errors).
    fn upload<T: Element>(&self, what: &str, v: &[T]) -> Result<Self::Buf<T>, Self::Error>;
    /// A zeroed device buffer of `len` f32.
    fn zeros(&self, len: usize) -> Result<Self::Buf<f32>, Self::Error>;
    /// The first `len` values of `buf`, once the work queued before has completed.
    fn download(
        &self,
        what: &str,
        buf: &Self::Buf<f32>,
        len: usize,
    ) -> Result<Vec<f32>, Self::Error>;
    /// Wait for all queued work.
    fn synchronize(&self) -> Result<(), Self::Error>;
    /// The error for weights of a format without a kernel.
    fn unsupported(dtype: &'static str) -> Self::Error;
    /// Queue `ys[b, r] = W[r] · xs[b]` for `n` activation rows already on the device (`xs`:
    /// `n · cols`, `ys`: `n · rows`).
    fn launch_matmul(
        &self,
        w: &DeviceMatrix<Self>,
        xs: &Self::Buf<f32>,
        n: usize,
        ys: &mut Self::Buf<f32>,
    ) -> Result<(), Self::Error>;
    /// [`GpuDevice::kda_step`] on this device, the inputs checked (`d` in the index type).
    fn run_kda_step(
        &self,
        state: &mut [f32],
        x: &KdaStep<'_>,
        d: Self::Index,
    ) -> Result<Vec<f32>, Self::Error>;
    /// [`GpuDevice::mla_decode`] on this device, the inputs checked.
    fn run_mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, Self::Error>;

    /// Seconds per [`GpuBackend::launch_matmul`] of `n` rows through `w`, averaged over
    /// `iters` back-to-back launches after one warm-up.
    fn time_matmul(
        &self,
        w: &DeviceMatrix<Self>,
        n: usize,
        iters: usize,
    ) -> Result<f64, Self::Error> {
        let (rows, cols) = w.shape();
        let x = self.upload("activations", &vec![0.5f32; n * cols])?;
        let mut y = self.zeros(n * rows)?;
        self.launch_matmul(w, &x, n, &mut y)?;
        self.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            self.launch_matmul(w, &x, n, &mut y)?;
        }
        self.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
    }
}

/// A weight matrix resident on the device of backend `B`.
pub enum DeviceMatrix<B: GpuBackend> {
    /// bf16 bits, row-major.
    Bf16 {
        /// `rows · cols` values.
        data: B::Buf<u16>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// int8 codes with the row scales widened to f32 (exact).
    RowInt8 {
        /// `rows · cols` codes.
        data: B::Buf<i8>,
        /// One scale per row.
        scales: B::Buf<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// MXFP4 packed nibbles and E8M0 scales, as in the checkpoint.
    Mxfp4 {
        /// `rows · cols / 2` bytes.
        packed: B::Buf<u8>,
        /// `rows · cols / 32` bytes.
        scales: B::Buf<u8>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
}

impl<B: GpuBackend> std::fmt::Debug for DeviceMatrix<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rows, cols) = self.shape();
        write!(f, "DeviceMatrix({} {rows}x{cols})", self.kind())
    }
}

impl<B: GpuBackend> DeviceMatrix<B> {
    /// A copy of `w` (bf16, row-int8 or MXFP4) on `dev`.
    pub fn upload(dev: &B, w: Weights<'_>) -> Result<DeviceMatrix<B>, B::Error> {
        let (rows, cols) = (w.rows(), w.cols());
        Ok(match w {
            Weights::F32 { .. } => return Err(B::unsupported("f32")),
            Weights::Bf16(m) => DeviceMatrix::Bf16 {
                data: dev.upload("bf16 weights", &bf16_bits(m.data()))?,
                rows,
                cols,
            },
            Weights::RowInt8(m) => {
                let scales: Vec<f32> = (0..rows).map(|r| m.scale(r)).collect();
                DeviceMatrix::RowInt8 {
                    data: dev.upload("int8 codes", m.data())?,
                    scales: dev.upload("int8 row scales", &scales)?,
                    rows,
                    cols,
                }
            }
            Weights::Mxfp4(m) => DeviceMatrix::Mxfp4 {
                packed: dev.upload("MXFP4 codes", m.packed())?,
                scales: dev.upload("MXFP4 scales", m.scales())?,
                rows,
                cols,
            },
        })
    }

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

    /// The format's name in the kernels' entry points (`matmul_<kind>_nb<N>`).
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            DeviceMatrix::Bf16 { .. } => "bf16",
            DeviceMatrix::RowInt8 { .. } => "rowint8",
            DeviceMatrix::Mxfp4 { .. } => "mxfp4",
        }
    }
}

/// The device operations of a GPU backend, each checking its inputs against their shapes: the
/// interface of the doctor's canaries and the device tests (every [`GpuBackend`] has it).
pub trait GpuDevice {
    /// A weight matrix resident on the device.
    type Matrix;
    /// The backend's error.
    type Error: std::fmt::Display;
    /// Copy `w` to the device.
    fn upload_weights(&self, w: Weights<'_>) -> Result<Self::Matrix, Self::Error>;
    /// `W·xs` for `n` activation rows (`xs`: `n · cols`): upload, launch, download.
    fn matmul(&self, w: &Self::Matrix, xs: &[f32], n: usize) -> Result<Vec<f32>, Self::Error>;
    /// One KDA recurrent step: `state` (`[heads, d, d]`) updated in place; the outputs
    /// `[heads, d]`.
    fn kda_step(&self, state: &mut [f32], x: &KdaStep<'_>) -> Result<Vec<f32>, Self::Error>;
    /// One absorbed MLA decode; the gated head outputs `[heads, v]`.
    fn mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, Self::Error>;
}

impl<B: GpuBackend> GpuDevice for B {
    type Matrix = DeviceMatrix<B>;
    type Error = B::Error;

    fn upload_weights(&self, w: Weights<'_>) -> Result<DeviceMatrix<B>, B::Error> {
        DeviceMatrix::upload(self, w)
    }

    fn matmul(&self, w: &DeviceMatrix<B>, xs: &[f32], n: usize) -> Result<Vec<f32>, B::Error> {
        let (rows, cols) = w.shape();
        expect_len("matmul", "xs", xs.len(), n * cols)?;
        let x = self.upload("activations", xs)?;
        let mut y = self.zeros(n * rows)?;
        self.launch_matmul(w, &x, n, &mut y)?;
        self.download("products", &y, n * rows)
    }

    fn kda_step(&self, state: &mut [f32], x: &KdaStep<'_>) -> Result<Vec<f32>, B::Error> {
        let d = x.check::<B::Index>(state.len())?;
        self.run_kda_step(state, x, d)
    }

    fn mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, B::Error> {
        x.check::<B::Index>()?;
        self.run_mla_decode(x)
    }
}
