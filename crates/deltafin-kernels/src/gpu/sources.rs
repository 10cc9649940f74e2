//! The source registry: the kernel files of a GPU backend, their entry points, and the batch
//! widths the product kernels are compiled for.

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
