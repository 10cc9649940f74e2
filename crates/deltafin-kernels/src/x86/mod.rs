//! x86-64 row dot products: AVX2+FMA (8 f32 lanes, [`avx2`]) and AVX-512 F/BW/VL (16 f32
//! lanes, [`avx512`]; the MXFP4 × q8x3 kernels of AVX-512 VNNI in [`avx512_q8x3`]).
//!
//! Every function handles `NB` activation rows against one weight row, which is loaded and
//! widened once; each activation row has its own accumulators and sees exactly the same
//! instruction sequence whatever `NB` is, so a row's result does not depend on the batch.
//! Reductions use a fixed order (accumulator tree, then a fixed horizontal sum).
//!
//! MXFP4 activations are pre-arranged once per call (`layout::mxfp4_f32_image`): the AVX2
//! kernel takes the *paired* layout, each 32-column block as `[x0, x2, …, x30, x1, x3, …,
//! x31]`, so low nibbles (even columns) and high nibbles (odd columns) of 16 packed bytes meet
//! contiguous activations; the AVX-512 kernel takes the *span* layout described at its
//! `dot_mxfp4`.
//!
//! # Safety
//! All functions require the CPU features named in their `target_feature` attribute, and
//! every activation row must be at least as long as the weight row.

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod avx512_q8x3;
