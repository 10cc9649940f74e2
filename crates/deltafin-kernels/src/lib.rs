//! `deltafin-kernels`: the compute kernels of deltafin.
//!
//! Matrix-vector and small-batch matrix products over bf16, MXFP4 and row-int8 weights with
//! f32 activations and f32 accumulation, plus the element-wise pieces the K3 blocks need
//! (RMS norms, SiTU, sigmoid, softmax). CPU kernels dispatch on the running CPU's features;
//! CUDA (cudarc) and Metal backends live behind features. Kernels know shapes, not models.
