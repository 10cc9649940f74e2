//! The contract between the product drivers and the kernel table: a [`Kernel`] entry (one
//! weight format × activation format on one instruction set) and a [`Prepared`] product (the
//! weights, the activations in the entry's layout, the output) that its row function fills.

use std::borrow::Cow;

use crate::dispatch::Backend;
use crate::layout::Image;
use crate::weights::{Raw, Weights};

/// Which activation image a kernel reads. Two products with the same layout, the same
/// number of columns and the same input read the same image, so a group builds it once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // most layouts serve x86 kernels
pub(crate) enum Layout {
    /// The input as it is (no image).
    Plain,
    /// bf16-paired groups of 32 columns (AVX-512).
    Bf16Pairs32,
    /// bf16-paired groups of 16 columns (AVX2).
    Bf16Pairs16,
    /// The int16 image of row-int8 products.
    RowInt8Q16,
    /// The f32 layout of the AVX-512 MXFP4 kernel (spans transposed, the rest paired).
    Mxfp4Spans,
    /// The f32 layout of the AVX2 and NEON MXFP4 kernels (blocks paired).
    Mxfp4Paired,
    /// The three-digit int8 image of MXFP4 × q8x3 products.
    Mxfp4Q8x3,
}

/// A scalar model of one product value: weight row `r` against one activation row of the
/// kernel's image.
pub(crate) type Reference = fn(Raw<'_>, usize, &[f32]) -> f32;

/// One weight format × activation format on one instruction set, like ggml's per-type
/// traits: how its activations are prepared, the row function that computes a product's
/// rows, and the scalar model of its arithmetic where the row function equals one bit for bit.
pub(crate) struct Kernel {
    /// `format/activations/isa`, for tests and failure messages.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) name: &'static str,
    /// The instruction set the row function needs.
    pub(crate) backend: Backend,
    /// The activation image [`Kernel::prepare`] builds.
    pub(crate) layout: Layout,
    /// The image of `n` activation rows of `cols` values (called once per product).
    pub(crate) prepare: for<'x> fn(&'x [f32], usize) -> Image<'x>,
    /// Output rows `r0..r1` of a prepared product, every activation row.
    ///
    /// # Safety
    /// The CPU supports [`Kernel::backend`] (checked by [`Prepared::new`]), the product was
    /// prepared for this entry, and no other task writes rows `r0..r1` of its output meanwhile.
    pub(crate) rows: unsafe fn(&Prepared<'_>, usize, usize),
    /// The scalar model of one value, weight row `r` against one activation row of the
    /// image, that [`Kernel::rows`] equals bit for bit (entries without one are compared
    /// with the scalar entry of their weight format within a tolerance).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) reference: Option<Reference>,
}

/// What is done with each product value `v = (W·x_b)[r]`.
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    /// `y[b][r] = v`.
    Store,
    /// `y[b][r] += alpha[b] · v` (e.g. a routing-weighted expert output added to the sum).
    Axpy(&'a [f32]),
}

/// Output written by row ranges into a batch-major buffer: `ys[b * rows + r]`.
struct BatchOut {
    ptr: *mut f32,
    rows: usize,
}
// SAFETY: every task writes a disjoint set of weight rows `r` (for all batch rows `b`), so
// the index sets `b * rows + r` written by different tasks never overlap.
unsafe impl Send for BatchOut {}
unsafe impl Sync for BatchOut {}

/// One product ready to run: weights, activations in the kernel's layout, the output.
pub(crate) struct Prepared<'a> {
    /// The table entry that computes it.
    pub(crate) kernel: &'static Kernel,
    pub(crate) w: Weights<'a>,
    /// `w`'s raw slices, fetched once (the byte owner's accessor is a dynamic call, and a
    /// decode product runs its rows in many small pieces).
    pub(crate) raw: Raw<'a>,
    xs: Cow<'a, [f32]>,
    base: usize,
    stride: usize,
    pub(crate) n: usize,
    out: BatchOut,
    epi: Epilogue<'a>,
}

impl<'a> Prepared<'a> {
    /// Check the lengths against the shape and arrange the activations for `kernel`
    /// (`image`: the image of `xs` for `kernel`, as [`Kernel::prepare`] returns it, or built
    /// here when `None`).
    ///
    /// # Panics
    /// If the CPU does not support the kernel's backend or the lengths disagree with the shape.
    pub(crate) fn new(
        kernel: &'static Kernel,
        w: Weights<'a>,
        xs: &'a [f32],
        n: usize,
        ys: &mut [f32],
        epi: Epilogue<'a>,
        image: Option<Image<'a>>,
    ) -> Prepared<'a> {
        assert!(
            kernel.backend.is_supported(),
            "kernel backend {} is not supported by this CPU",
            kernel.backend.name()
        );
        let (rows, cols) = (w.rows(), w.cols());
        if let Weights::F32 { data, .. } = w {
            assert_eq!(data.len(), rows * cols, "f32 weights: data length");
        }
        assert_eq!(xs.len(), n * cols, "{} product: input length", w.dtype());
        assert_eq!(ys.len(), n * rows, "{} product: output length", w.dtype());
        if let Epilogue::Axpy(alpha) = epi {
            assert_eq!(alpha.len(), n, "{} product: alpha length", w.dtype());
        }
        let (xs, base, stride) = if n == 0 || rows == 0 {
            (Cow::Borrowed(xs), 0, cols)
        } else if let Some(image) = image {
            image
        } else {
            (kernel.prepare)(xs, cols)
        };
        Prepared {
            kernel,
            w,
            raw: Raw::of(w),
            xs,
            base,
            stride,
            n,
            out: BatchOut {
                ptr: ys.as_mut_ptr(),
                rows,
            },
            epi,
        }
    }

    /// Activation row `b` in the kernel's layout.
    #[inline(always)]
    pub(crate) fn x(&self, b: usize) -> &[f32] {
        let at = self.base + b * self.stride;
        &self.xs[at..at + self.stride]
    }

    /// Store or accumulate value `v` of activation row `b`, weight row `r`.
    ///
    /// # Safety
    /// `b < n`, `r` is a row of the weights, and no other task writes row `r` meanwhile.
    #[inline(always)]
    pub(crate) unsafe fn apply(&self, b: usize, r: usize, v: f32) {
        // SAFETY: upheld by the caller.
        let y = unsafe { &mut *self.out.ptr.add(b * self.out.rows + r) };
        match self.epi {
            Epilogue::Store => *y = v,
            Epilogue::Axpy(alpha) => *y += alpha[b] * v,
        }
    }

    /// Multiply-adds of one output row over the whole batch.
    pub(crate) fn work_per_row(&self) -> usize {
        self.w.cols() * self.n
    }

    /// Output rows `r0..r1` for every activation row, by the kernel's row function.
    ///
    /// # Safety
    /// No other task may write rows `r0..r1` of this product's output while this runs.
    #[inline]
    pub(crate) unsafe fn rows(&self, r0: usize, r1: usize) {
        // SAFETY: `new` checked the CPU and prepared the activations for this kernel; the
        // row ownership is forwarded from the caller.
        unsafe { (self.kernel.rows)(self, r0, r1) }
    }
}
