//! The kernel table: for each instruction set ([`Isa`], selected once per backend and CPU),
//! one [`Kernel`] entry per weight format × activation format — how the activations are
//! prepared, the row function, the scalar model of the arithmetic. A product looks its
//! entry up once ([`Isa::kernel`]); nothing below that branches on the format or the ISA again.
//!
//! | ISA | f32 | bf16 | row-int8 | MXFP4 (f32 act.) | MXFP4 (q8x3 act.) |
//! |---|---|---|---|---|---|
//! | scalar | dot | dot | dot | dot | — |
//! | AVX2 + FMA | dot | dot, paired 16 | dot on the q16 image | dot, paired | — |
//! | AVX-512 | dot | tiles, paired 32 | dot | dot, spans | — |
//! | AVX-512 + VNNI | dot | tiles, paired 32 | tiles on the q16 image | dot, spans | tiles on the q8x3 image |
//! | NEON | dot | dot | dot | dot, paired | — |
//!
//! Where an ISA has no q8x3 entry its MXFP4 products take f32 activations, whatever the
//! setting (`KernelSettings::mxfp4_act_in_use`).

use std::borrow::Cow;

use deltafin_tensor::mxfp4::GROUP;

use crate::dispatch::Backend;
use crate::layout::{Image, mxfp4_f32_image};
use crate::prepared::{Kernel, Layout, Reference};
use crate::rows::{Dot, rows_dot};
use crate::settings::Mxfp4Act;
use crate::weights::{Raw, Weights};

/// One instruction set's entries.
pub(crate) struct Isa {
    pub(crate) f32: Kernel,
    pub(crate) bf16: Kernel,
    pub(crate) rowint8: Kernel,
    pub(crate) mxfp4_f32: Kernel,
    /// MXFP4 against q8x3 activations, where the ISA has the kernel.
    pub(crate) mxfp4_q8x3: Option<Kernel>,
}

impl Isa {
    /// The entry of a product over `w` with MXFP4 activation format `act`.
    #[inline]
    pub(crate) fn kernel(&'static self, w: &Weights<'_>, act: Mxfp4Act) -> &'static Kernel {
        match w {
            Weights::F32 { .. } => &self.f32,
            Weights::Bf16(_) => &self.bf16,
            Weights::RowInt8(_) => &self.rowint8,
            Weights::Mxfp4(_) => match (act, &self.mxfp4_q8x3) {
                (Mxfp4Act::Q8x3, Some(k)) => k,
                _ => &self.mxfp4_f32,
            },
        }
    }

    /// Every entry (the MXFP4 f32 one, then the q8x3 one where there is one).
    #[cfg(test)]
    pub(crate) fn entries(&'static self) -> impl Iterator<Item = &'static Kernel> {
        [&self.f32, &self.bf16, &self.rowint8, &self.mxfp4_f32]
            .into_iter()
            .chain(self.mxfp4_q8x3.as_ref())
    }
}

/// The table of `be` on this CPU (AVX-512 with or without VNNI).
///
/// # Panics
/// If `be` is not compiled for this target (e.g. `Neon` on x86-64).
pub(crate) fn isa(be: Backend) -> &'static Isa {
    match be {
        Backend::Scalar => &SCALAR,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => &x86::AVX2,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512 if crate::dispatch::vnni_available() => &x86::AVX512_VNNI,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512 => &x86::AVX512,
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => &neon::NEON,
        #[allow(unreachable_patterns)]
        other => panic!(
            "kernel backend {} is not supported by this CPU",
            other.name()
        ),
    }
}

/// The input as it is.
fn plain(xs: &[f32], cols: usize) -> Image<'_> {
    (Cow::Borrowed(xs), 0, cols)
}

/// The f32 layout of the AVX2 and NEON MXFP4 kernels: every block paired.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
fn mxfp4_paired(xs: &[f32], cols: usize) -> Image<'_> {
    (mxfp4_f32_image(xs, cols, 0), 0, cols)
}

/// How an entry prepares the activations ([`Kernel::prepare`]).
type Prepare = for<'x> fn(&'x [f32], usize) -> Image<'x>;
/// An entry's row function ([`Kernel::rows`]).
type Rows = unsafe fn(&crate::prepared::Prepared<'_>, usize, usize);

/// An entry of `backend` from `(name, layout, prepare, rows)` and its scalar model, if any.
const fn entry(
    backend: Backend,
    (name, layout, prepare, rows): (&'static str, Layout, Prepare, Rows),
    reference: Option<Reference>,
) -> Kernel {
    Kernel {
        name,
        backend,
        layout,
        prepare,
        rows,
        reference,
    }
}

/// The entries of `backend` from `(name, layout, prepare, rows)` for f32, bf16, row-int8 and
/// MXFP4 (f32 activations) weights: no q8x3 entry, and no scalar model of their own (each is
/// compared with the scalar entry of its weight format within a tolerance).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
const fn simd_isa(backend: Backend, entries: [(&'static str, Layout, Prepare, Rows); 4]) -> Isa {
    let [f32, bf16, rowint8, mxfp4] = entries;
    Isa {
        f32: entry(backend, f32, None),
        bf16: entry(backend, bf16, None),
        rowint8: entry(backend, rowint8, None),
        mxfp4_f32: entry(backend, mxfp4, None),
        mxfp4_q8x3: None,
    }
}

/// `pub(crate) struct $ty`, a [`Dot`] whose rows are `$body` on the `$raw` weights (the
/// pattern of their [`Raw`] variant), row `$r` against the activation rows `$xs`; the caller
/// guarantees the CPU features and the layout.
macro_rules! row_dot {
    ($ty:ident, |$raw:pat, $r:ident, $xs:ident| $body:expr) => {
        pub(crate) struct $ty;
        impl Dot for $ty {
            #[inline(always)]
            #[allow(unused_unsafe)] // the scalar kernels are safe functions
            unsafe fn dot<const NB: usize>(
                raw: Raw<'_>,
                $r: usize,
                $xs: [&[f32]; NB],
            ) -> [f32; NB] {
                let $raw = raw else {
                    unreachable!(concat!(stringify!($ty), " on other weights"))
                };
                // SAFETY: the caller guarantees the CPU features and the layout.
                unsafe { $body }
            }
        }
    };
}

/// A [`Dot`] over rows of a dense format (`f32`, bf16) with row kernel `$f`.
macro_rules! dense_dot {
    ($ty:ident, $variant:ident, $f:path) => {
        row_dot!($ty, |Raw::$variant(data, cols), r, xs| $f(
            &data[r * cols..(r + 1) * cols],
            xs
        ));
    };
}

/// A [`Dot`] over row-int8 rows with the unscaled row kernel `$f`, scaled by the row's f16
/// scale.
macro_rules! int8_dot {
    ($ty:ident, $f:path) => {
        row_dot!($ty, |Raw::RowInt8(data, scales, cols), r, xs| {
            let row = &data[r * cols..(r + 1) * cols];
            let s = scales[r].to_f32();
            $f(row, xs).map(|v| s * v)
        });
    };
}

/// A [`Dot`] over MXFP4 rows with row kernel `$f` (packed codes, E8M0 scales).
macro_rules! mxfp4_dot {
    ($ty:ident, $f:path) => {
        row_dot!($ty, |Raw::Mxfp4(packed, scales, cols), r, xs| {
            let (pb, g) = (cols / 2, cols / GROUP);
            $f(
                &packed[r * pb..(r + 1) * pb],
                &scales[r * g..(r + 1) * g],
                xs,
            )
        });
    };
}

/// A product's value by the entry's own row function on one row (the scalar entries are
/// their own reference).
fn reference_of<D: Dot>(raw: Raw<'_>, r: usize, x: &[f32]) -> f32 {
    // SAFETY: instantiated only for the scalar entries below, whose kernels need no CPU
    // feature and read the input as it is.
    let [v] = unsafe { D::dot::<1>(raw, r, [x]) };
    v
}

dense_dot!(ScalarF32, F32, crate::scalar::dot_f32);
dense_dot!(ScalarBf16, Bf16, crate::scalar::dot_bf16);
int8_dot!(ScalarI8, crate::scalar::dot_i8);
mxfp4_dot!(ScalarMxfp4, crate::scalar::dot_mxfp4);

/// The portable entries: the reference every SIMD entry is tested against.
static SCALAR: Isa = {
    const fn scalar(name: &'static str, rows: Rows, reference: Reference) -> Kernel {
        entry(
            Backend::Scalar,
            (name, Layout::Plain, plain, rows),
            Some(reference),
        )
    }
    Isa {
        f32: scalar(
            "f32/f32/scalar",
            rows_dot::<ScalarF32>,
            reference_of::<ScalarF32>,
        ),
        bf16: scalar(
            "bf16/f32/scalar",
            rows_dot::<ScalarBf16>,
            reference_of::<ScalarBf16>,
        ),
        rowint8: scalar(
            "row-int8/f32/scalar",
            rows_dot::<ScalarI8>,
            reference_of::<ScalarI8>,
        ),
        mxfp4_f32: scalar(
            "mxfp4/f32/scalar",
            rows_dot::<ScalarMxfp4>,
            reference_of::<ScalarMxfp4>,
        ),
        mxfp4_q8x3: None,
    }
};

/// The x86-64 entries.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::layout::pair_groups;
    use crate::rows::{AVX2_BATCH_TILE, rows_dot_n, rows_tiled};
    use crate::tiled::{Bf16Tiles, Mxfp4Q8x3Tiles, RowInt8Q16Tiles};
    use crate::x86::{avx2, avx512, avx512_q8x3};

    dense_dot!(Avx2F32, F32, avx2::dot_f32);
    dense_dot!(Avx2Bf16, Bf16, avx2::dot_bf16);
    int8_dot!(Avx2I8Q16, avx2::dot_i8_q16);
    mxfp4_dot!(Avx2Mxfp4, avx2::dot_mxfp4);
    dense_dot!(Avx512F32, F32, avx512::dot_f32);
    int8_dot!(Avx512I8, avx512::dot_i8);
    mxfp4_dot!(Avx512Mxfp4, avx512::dot_mxfp4);

    /// One q16 block of the row-int8 image with the widest quantiser this CPU has (every one
    /// gives the same bits as [`crate::layout::q16_block_scalar`]).
    fn q16_block(chunk: &[f32], codes: &mut [i16]) -> f32 {
        if Backend::Avx512.is_supported() {
            // SAFETY: AVX-512 F/BW/VL are present (checked above).
            return unsafe { avx512::q16_block(chunk, codes) };
        }
        if Backend::Avx2.is_supported() {
            // SAFETY: AVX2 and FMA are present (checked above).
            return unsafe { avx2::q16_block(chunk, codes) };
        }
        crate::layout::q16_block_scalar(chunk, codes)
    }

    /// The row-int8 q16 image.
    fn rowint8_q16(xs: &[f32], cols: usize) -> Image<'_> {
        crate::layout::q16_image(xs, cols, q16_block)
    }

    /// bf16-paired groups of `G` columns, the rows on 64-byte boundaries.
    fn bf16_pairs<const G: usize>(xs: &[f32], cols: usize) -> Image<'_> {
        let (img, base) = pair_groups(xs, cols, G);
        (img, base, cols.next_multiple_of(G))
    }

    /// The AVX-512 MXFP4 f32 layout: whole spans transposed, the rest paired.
    fn mxfp4_spans(xs: &[f32], cols: usize) -> Image<'_> {
        (mxfp4_f32_image(xs, cols, cols / 128), 0, cols)
    }

    /// The q8x3 image, whole blocks through the AVX-512 quantiser (this entry runs only where
    /// AVX-512 is present).
    fn mxfp4_q8x3(xs: &[f32], cols: usize) -> Image<'_> {
        let fused = |x: &[f32; GROUP], sp: &mut [f32], k: usize| {
            // SAFETY: the q8x3 entry is in the AVX-512 VNNI table only (AVX-512 F/BW/VL
            // present); `sp` is one whole span of the image and `k < 4`.
            unsafe { avx512_q8x3::q8x3_image_block(x, sp, k) }
        };
        crate::mxfp4_q8x3::q8x3_image(xs, cols, Some(fused))
    }

    /// [`crate::scalar::dot_mxfp4_q8x3`] on row `r`: the model the q8x3 tiles equal.
    fn q8x3_reference(raw: Raw<'_>, r: usize, x: &[f32]) -> f32 {
        let Raw::Mxfp4(packed, scales, cols) = raw else {
            unreachable!("the MXFP4 reference on other weights")
        };
        let (pb, g) = (cols / 2, cols / GROUP);
        crate::scalar::dot_mxfp4_q8x3(
            &packed[r * pb..(r + 1) * pb],
            &scales[r * g..(r + 1) * g],
            [x],
        )[0]
    }

    pub(super) static AVX2: Isa = simd_isa(
        Backend::Avx2,
        [
            (
                "f32/f32/avx2",
                Layout::Plain,
                plain,
                rows_dot_n::<Avx2F32, AVX2_BATCH_TILE>,
            ),
            (
                "bf16/f32/avx2",
                Layout::Bf16Pairs16,
                bf16_pairs::<16>,
                rows_dot_n::<Avx2Bf16, AVX2_BATCH_TILE>,
            ),
            (
                "row-int8/q16/avx2",
                Layout::RowInt8Q16,
                rowint8_q16,
                rows_dot::<Avx2I8Q16>,
            ),
            (
                "mxfp4/f32/avx2",
                Layout::Mxfp4Paired,
                mxfp4_paired,
                rows_dot::<Avx2Mxfp4>,
            ),
        ],
    );

    /// The AVX-512 entries of a CPU without VNNI.
    const AVX512_ENTRIES: Isa = simd_isa(
        Backend::Avx512,
        [
            (
                "f32/f32/avx512",
                Layout::Plain,
                plain,
                rows_dot::<Avx512F32>,
            ),
            (
                "bf16/f32/avx512",
                Layout::Bf16Pairs32,
                bf16_pairs::<32>,
                rows_tiled::<Bf16Tiles>,
            ),
            (
                "row-int8/f32/avx512",
                Layout::Plain,
                plain,
                rows_dot::<Avx512I8>,
            ),
            (
                "mxfp4/f32/avx512",
                Layout::Mxfp4Spans,
                mxfp4_spans,
                rows_dot::<Avx512Mxfp4>,
            ),
        ],
    );
    pub(super) static AVX512: Isa = AVX512_ENTRIES;

    /// The AVX-512 entries of a CPU with VNNI: the integer-activation tiles.
    pub(super) static AVX512_VNNI: Isa = Isa {
        rowint8: Kernel {
            name: "row-int8/q16/avx512-vnni",
            backend: Backend::Avx512,
            layout: Layout::RowInt8Q16,
            prepare: rowint8_q16,
            rows: rows_tiled::<RowInt8Q16Tiles>,
            reference: None,
        },
        mxfp4_q8x3: Some(Kernel {
            name: "mxfp4/q8x3/avx512-vnni",
            backend: Backend::Avx512,
            layout: Layout::Mxfp4Q8x3,
            prepare: mxfp4_q8x3,
            rows: rows_tiled::<Mxfp4Q8x3Tiles>,
            reference: Some(q8x3_reference),
        }),
        ..AVX512_ENTRIES
    };
}

/// The aarch64 entries.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;

    dense_dot!(NeonF32, F32, crate::neon::dot_f32);
    dense_dot!(NeonBf16, Bf16, crate::neon::dot_bf16);
    int8_dot!(NeonI8, crate::neon::dot_i8);
    mxfp4_dot!(NeonMxfp4, crate::neon::dot_mxfp4);

    pub(super) static NEON: Isa = simd_isa(
        Backend::Neon,
        [
            ("f32/f32/neon", Layout::Plain, plain, rows_dot::<NeonF32>),
            ("bf16/f32/neon", Layout::Plain, plain, rows_dot::<NeonBf16>),
            (
                "row-int8/f32/neon",
                Layout::Plain,
                plain,
                rows_dot::<NeonI8>,
            ),
            (
                "mxfp4/f32/neon",
                Layout::Mxfp4Paired,
                mxfp4_paired,
                rows_dot::<NeonMxfp4>,
            ),
        ],
    );
}
