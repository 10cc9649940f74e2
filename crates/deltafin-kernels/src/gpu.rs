//! What the GPU backends (CUDA, Metal) share and the CPU can check without a device: the
//! inputs of the KDA and MLA kernels and their checks, the resident weight matrix, the device
//! operations written once over each backend's primitives ([`GpuBackend`], [`GpuDevice`]),
//! and the doctor's canaries.

use crate::matvec::Weights;
use deltafin_tensor::bf16;

/// One kernel file of a GPU backend (`kernels/cuda/`, `kernels/metal/`) and the entry points
/// it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under the backend's kernel directory.
    pub file: &'static str,
    /// The file's text (without the prelude).
    pub text: &'static str,
    /// Entry points the file must define.
    pub entries: &'static [&'static str],
}

impl KernelSource {
    /// The file as it follows the prelude in a translation unit (after a `// ---- file ----`
    /// line).
    pub fn section(&self) -> String {
        format!("\n// ---- {} ----\n{}", self.file, self.text)
    }
}

/// The product entry points, one per weight format and batch width (`matmul_<kind>_nb<N>`,
/// `N` in [`BATCH_WIDTHS`]), in `matvec.cu` and in `matvec.metal`.
pub const MATMUL_ENTRIES: [&str; 15] = [
    "matmul_mxfp4_nb1",
    "matmul_mxfp4_nb2",
    "matmul_mxfp4_nb4",
    "matmul_mxfp4_nb8",
    "matmul_mxfp4_nb16",
    "matmul_bf16_nb1",
    "matmul_bf16_nb2",
    "matmul_bf16_nb4",
    "matmul_bf16_nb8",
    "matmul_bf16_nb16",
    "matmul_rowint8_nb1",
    "matmul_rowint8_nb2",
    "matmul_rowint8_nb4",
    "matmul_rowint8_nb8",
    "matmul_rowint8_nb16",
];

/// The kernel files of a backend: `matvec`, `kda` and `mla` with extension `$ext`, embedded
/// from `$dir` (relative to the invoking file).
macro_rules! kernel_sources {
    ($dir:literal, $ext:literal) => {
        [
            $crate::gpu::KernelSource {
                file: concat!("matvec.", $ext),
                text: include_str!(concat!($dir, "matvec.", $ext)),
                entries: &$crate::gpu::MATMUL_ENTRIES,
            },
            $crate::gpu::KernelSource {
                file: concat!("kda.", $ext),
                text: include_str!(concat!($dir, "kda.", $ext)),
                entries: &["kda_step"],
            },
            $crate::gpu::KernelSource {
                file: concat!("mla.", $ext),
                text: include_str!(concat!($dir, "mla.", $ext)),
                entries: &["mla_decode"],
            },
        ]
    };
}
pub(crate) use kernel_sources;

/// Activation-row widths with a compiled small-batch kernel; larger batches are split.
pub const BATCH_WIDTHS: [usize; 5] = [16, 8, 4, 2, 1];

/// How `n` activation rows are split into launches: `(first row, width)` pairs, widths from
/// [`BATCH_WIDTHS`], largest first.
pub fn batch_split(n: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut done = 0;
    while done < n {
        let nb = BATCH_WIDTHS
            .into_iter()
            .find(|&b| b <= n - done)
            .unwrap_or(1);
        out.push((done, nb));
        done += nb;
    }
    out
}

/// Shapes of one MLA absorbed decode (docs/K3.md §4.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    /// Heads `H`.
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`.
    pub kvl: usize,
}

impl MlaShape {
    /// The softmax scale `1/√(nope + rope)`.
    pub fn scale(&self) -> f32 {
        1.0 / ((self.nope + self.rope) as f32).sqrt()
    }
}

/// Inputs that disagree with their shapes, or a size beyond the kernels' 32-bit indices.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kernel}: {detail}")]
pub struct ShapeError {
    /// The kernel.
    pub kernel: &'static str,
    /// What disagrees.
    pub detail: String,
}

/// `Ok` when `what` has the `want` values it should, else the error naming both counts.
pub(crate) fn expect_len(
    kernel: &'static str,
    what: &str,
    got: usize,
    want: usize,
) -> Result<(), ShapeError> {
    if got == want {
        return Ok(());
    }
    Err(ShapeError {
        kernel,
        detail: format!("{what} has {got} values, expected {want}"),
    })
}

/// `v` in the kernels' index type `I` (`i32` for CUDA, `u32` for Metal), else the error naming
/// `what`.
pub(crate) fn index<I: TryFrom<usize>>(
    kernel: &'static str,
    what: &str,
    v: usize,
) -> Result<I, ShapeError> {
    I::try_from(v).map_err(|_| ShapeError {
        kernel,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

/// One KDA recurrent step's inputs for `heads` heads of `d` (`kda.cu`, `kda.metal`; the
/// state, `[heads, d, d]`, is passed beside them and updated in place).
#[derive(Clone, Copy, Debug)]
pub struct KdaStep<'a> {
    /// Heads.
    pub heads: usize,
    /// Queries `[heads, d]`.
    pub q: &'a [f32],
    /// Keys `[heads, d]`.
    pub k: &'a [f32],
    /// Values `[heads, d]`.
    pub v: &'a [f32],
    /// Log-decays `[heads, d]`.
    pub g: &'a [f32],
    /// Write strengths `[heads]`.
    pub beta: &'a [f32],
    /// Head dimension.
    pub d: usize,
}

impl KdaStep<'_> {
    /// Every length against the shapes (`state`: the state's length) and the sizes the kernel
    /// indexes in `I`; `d` as `I`.
    pub(crate) fn check<I: TryFrom<usize>>(&self, state: usize) -> Result<I, ShapeError> {
        const K: &str = "kda_step";
        let (heads, d) = (self.heads, self.d);
        expect_len(K, "state", state, heads * d * d)?;
        for (name, x) in [("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g)] {
            expect_len(K, name, x.len(), heads * d)?;
        }
        expect_len(K, "beta", self.beta.len(), heads)?;
        index::<I>(K, "heads·d·d", heads * d * d)?;
        index(K, "d", d)
    }

    /// The step by the CPU reference (`reference::kda_step`, head by head) from `state`,
    /// which it updates; the outputs.
    pub fn reference(&self, state: &mut [f32]) -> Vec<f32> {
        let d = self.d;
        let mut out = Vec::with_capacity(self.heads * d);
        for (h, s) in state.chunks_exact_mut(d * d).enumerate() {
            let sl = h * d..(h + 1) * d;
            out.extend(crate::reference::kda_step(
                s,
                &self.q[sl.clone()],
                &self.k[sl.clone()],
                &self.v[sl.clone()],
                &self.g[sl],
                self.beta[h],
            ));
        }
        out
    }

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

/// One absorbed MLA decode's inputs over `tokens` cached tokens (`mla.cu`, `mla.metal`).
#[derive(Clone, Copy, Debug)]
pub struct MlaDecode<'a> {
    /// The shapes.
    pub shape: MlaShape,
    /// The query `[heads, nope + rope]`.
    pub q: &'a [f32],
    /// `kv_b_proj` `[heads · (nope + v), kv_lora]`.
    pub kv_b: &'a [bf16],
    /// Cached tokens attended to (at least one).
    pub tokens: usize,
    /// The latent cache `[tokens, kv_lora]`.
    pub latent: &'a [bf16],
    /// The rope tail cache `[tokens, rope]`.
    pub tail: &'a [bf16],
    /// The output gate `[heads, v]`.
    pub gate: &'a [f32],
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
    /// Every length against the shapes and the sizes the kernel indexes in `I`.
    pub(crate) fn check<I: TryFrom<usize>>(&self) -> Result<(), ShapeError> {
        const K: &str = "mla_decode";
        let MlaShape {
            heads,
            nope,
            rope,
            v,
            kvl,
        } = self.shape;
        let n = self.tokens;
        if n == 0 {
            return Err(ShapeError {
                kernel: K,
                detail: "no cached tokens to attend to".into(),
            });
        }
        expect_len(K, "q", self.q.len(), heads * (nope + rope))?;
        expect_len(K, "kv_b_proj", self.kv_b.len(), heads * (nope + v) * kvl)?;
        expect_len(K, "latent cache", self.latent.len(), n * kvl)?;
        expect_len(K, "tail cache", self.tail.len(), n * rope)?;
        expect_len(K, "gate", self.gate.len(), heads * v)?;
        index::<I>(K, "kv_b_proj values", self.kv_b.len())?;
        index::<I>(K, "cache values", n * kvl)?;
        index::<I>(K, "scores", heads * n)?;
        Ok(())
    }

    /// The decode by the CPU reference (`reference::mla_decode`).
    pub fn reference(&self) -> Vec<f32> {
        let s = self.shape;
        crate::reference::mla_decode(
            (s.heads, s.nope, s.rope, s.v, s.kvl),
            self.tokens,
            self.q,
            self.kv_b,
            self.latent,
            self.tail,
            self.gate,
        )
    }

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

/// Deterministic test values in (−1, 1).
fn pattern(i: usize, salt: usize) -> f32 {
    let x = (i
        .wrapping_mul(2_654_435_761)
        .wrapping_add(salt.wrapping_mul(40_503)))
        % 2001;
    x as f32 / 1000.0 - 1.0
}

/// Worst `|a − b|` relative to the largest `|b|`.
fn worst_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

/// The doctor's device canaries (docs/OPERATIONS.md (doctor)) on any GPU backend: each kernel at a
/// small shape against the CPU reference. Returns `(name, worst relative error or the failure)`; an error above
/// 1e-4 is reported as a failure.
pub fn canaries<D: GpuDevice>(dev: &D) -> Vec<(String, Result<f64, String>)> {
    use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix};
    let mut out = Vec::new();
    let judge = |r: Result<f64, D::Error>| match r {
        Ok(e) if e <= 1e-4 => Ok(e),
        Ok(e) => Err(format!("worst relative error {e:.2e} > 1e-4")),
        Err(e) => Err(e.to_string()),
    };
    let (rows, cols, n) = (32usize, 64usize, 3usize);
    let vals: Vec<f32> = (0..rows * cols).map(|i| pattern(i, 1)).collect();
    let xs: Vec<f32> = (0..n * cols).map(|i| pattern(i, 2)).collect();
    let bv: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
    let mats = (
        Bf16Matrix::from_values(rows, cols, &bv),
        RowInt8Matrix::quantize("canary", rows, cols, &vals),
        Mxfp4Matrix::new(
            "canary",
            Bytes::from_vec((0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect()),
            Bytes::from_vec((0..rows * cols / 32).map(|i| 120 + (i % 9) as u8).collect()),
            rows,
            cols,
        ),
    );
    let (Ok(bf), Ok(i8m), Ok(mx)) = mats else {
        out.push((
            "matmul".into(),
            Err("building the canary matrices failed".into()),
        ));
        return out;
    };
    for w in [
        Weights::Bf16(&bf),
        Weights::RowInt8(&i8m),
        Weights::Mxfp4(&mx),
    ] {
        let r = dev
            .upload_weights(w)
            .and_then(|m| dev.matmul(&m, &xs, n))
            .map(|gpu| {
                let mut cpu = vec![0f32; n * rows];
                crate::matmul(w, &xs, n, &mut cpu);
                worst_rel(&gpu, &cpu)
            });
        out.push((format!("matmul_{}", w.dtype()), judge(r)));
    }
    // KDA decode: 2 heads of 32, two steps from a zero state.
    let (h, d) = (2usize, 32usize);
    let mut s_gpu = vec![0f32; h * d * d];
    let mut s_cpu = s_gpu.clone();
    let mut r = Ok(0.0);
    for step in 0..2 {
        let v = |salt: usize| {
            (0..h * d)
                .map(|i| pattern(i, salt + 10 * step))
                .collect::<Vec<_>>()
        };
        let (q, k, vv) = (v(3), v(4), v(5));
        let g: Vec<f32> = v(6).iter().map(|x| -0.5 * (x + 1.0)).collect();
        let beta = [0.7f32, 0.3];
        let x = KdaStep {
            heads: h,
            d,
            q: &q,
            k: &k,
            v: &vv,
            g: &g,
            beta: &beta,
        };
        let gpu = dev.kda_step(&mut s_gpu, &x);
        r = gpu.map(|o| {
            let cpu = x.reference(&mut s_cpu);
            worst_rel(&o, &cpu).max(worst_rel(&s_gpu, &s_cpu))
        });
        if r.is_err() {
            break;
        }
    }
    out.push(("kda_decode".into(), judge(r)));
    // MLA decode: 2 heads, nope 16, rope 8, v 16, kv_lora 64, 5 cached tokens.
    let sh = MlaShape {
        heads: 2,
        nope: 16,
        rope: 8,
        v: 16,
        kvl: 64,
    };
    let tokens = 5;
    let bfv = |len: usize, salt: usize| -> Vec<bf16> {
        (0..len).map(|i| bf16::from_f32(pattern(i, salt))).collect()
    };
    let q: Vec<f32> = (0..sh.heads * (sh.nope + sh.rope))
        .map(|i| pattern(i, 7))
        .collect();
    let kvb = bfv(sh.heads * (sh.nope + sh.v) * sh.kvl, 8);
    let latent = bfv(tokens * sh.kvl, 9);
    let tail = bfv(tokens * sh.rope, 10);
    let gate: Vec<f32> = (0..sh.heads * sh.v).map(|i| pattern(i, 11)).collect();
    let x = MlaDecode {
        shape: sh,
        tokens,
        q: &q,
        kv_b: &kvb,
        latent: &latent,
        tail: &tail,
        gate: &gate,
    };
    let r = dev
        .mla_decode(&x)
        .map(|gpu| worst_rel(&gpu, &x.reference()));
    out.push(("mla_decode".into(), judge(r)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix};

    /// A "device" that runs the CPU kernels and the CUDA reference, optionally off by a
    /// relative `error` in every result: the canaries' logic checked without a GPU.
    struct Cpu {
        error: f32,
    }

    enum Owned {
        Bf16(Bf16Matrix),
        RowInt8(RowInt8Matrix),
        Mxfp4(Mxfp4Matrix),
    }

    impl Cpu {
        fn off(&self, mut v: Vec<f32>) -> Vec<f32> {
            for x in &mut v {
                *x += self.error * (x.abs() + 1.0);
            }
            v
        }
    }

    impl GpuDevice for Cpu {
        type Matrix = Owned;
        type Error = String;
        fn upload_weights(&self, w: Weights<'_>) -> Result<Owned, String> {
            match w {
                Weights::Bf16(m) => Ok(Owned::Bf16(m.clone())),
                Weights::RowInt8(m) => Ok(Owned::RowInt8(m.clone())),
                Weights::Mxfp4(m) => Ok(Owned::Mxfp4(m.clone())),
                Weights::F32 { .. } => Err("f32 weights are not uploaded".into()),
            }
        }
        fn matmul(&self, w: &Owned, xs: &[f32], n: usize) -> Result<Vec<f32>, String> {
            let w = match w {
                Owned::Bf16(m) => Weights::Bf16(m),
                Owned::RowInt8(m) => Weights::RowInt8(m),
                Owned::Mxfp4(m) => Weights::Mxfp4(m),
            };
            let mut ys = vec![0f32; n * w.rows()];
            crate::matmul(w, xs, n, &mut ys);
            Ok(self.off(ys))
        }
        fn kda_step(&self, state: &mut [f32], x: &KdaStep<'_>) -> Result<Vec<f32>, String> {
            Ok(self.off(x.reference(state)))
        }
        fn mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, String> {
            Ok(self.off(x.reference()))
        }
    }

    #[test]
    fn canaries_pass_an_exact_device_and_name_a_wrong_one() {
        let good = canaries(&Cpu { error: 0.0 });
        let names: Vec<&str> = good.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "matmul_bf16",
                "matmul_row-int8",
                "matmul_mxfp4",
                "kda_decode",
                "mla_decode"
            ]
        );
        for (name, r) in &good {
            assert!(matches!(r, Ok(e) if *e <= 1e-6), "{name}: {r:?}");
        }
        for (name, r) in canaries(&Cpu { error: 1e-3 }) {
            let e = r.expect_err(&name);
            assert!(e.contains("> 1e-4"), "{name}: {e}");
        }
    }
}
