//! `deltafin-tensor`: the bottom of the deltafin stack.
//!
//! It knows how weights are laid out in bytes and nothing about any model:
//! element types ([`DType`], bf16, f32, MXFP4 E2M1/E8M0, row-int8), reference-counted
//! byte ranges over memory-mapped files or owned buffers ([`Bytes`]), typed matrix views
//! that kernels consume ([`Bf16Matrix`], [`Mxfp4Matrix`], [`RowInt8Matrix`]), and the safetensors
//! container format (header parsing and validation of sharded checkpoints).
//!
//! Everything that reads file data returns a [`TensorError`] naming the file and tensor
//! at fault; nothing here panics on malformed input.

pub mod append;
pub mod dtype;
pub mod error;
pub mod int8;
pub mod matrix;
pub mod mxfp4;
pub mod safetensors;
pub mod storage;

pub use dtype::DType;
pub use error::TensorError;
pub use half::{bf16, f16};
pub use int8::RowInt8Matrix;
pub use matrix::{Bf16Matrix, Mxfp4Matrix};
pub use safetensors::{SafetensorsFile, SafetensorsWriter, TensorEntry, TensorInfo};
pub use storage::Bytes;
