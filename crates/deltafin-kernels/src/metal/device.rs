//! The Metal device wrapper (macOS with feature `metal`): device discovery, run-time library
//! compilation, shared-storage buffers, dispatches, read-back, and the doctor canaries.
//!
//! Untested on Apple hardware until someone runs `cargo test -p deltafin-kernels --features
//! metal` on a Mac; `.ci/run` type-checks it for `aarch64-apple-darwin`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;

use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_foundation::NSString;
use objc2_metal::{
    MTLBuffer, MTLCommandBuffer, MTLCommandEncoder, MTLCommandQueue, MTLCompileOptions,
    MTLComputeCommandEncoder, MTLComputePipelineState, MTLCreateSystemDefaultDevice, MTLDevice,
    MTLLibrary, MTLResourceOptions, MTLSize,
};

use super::sources::{
    KERNELS, KdaParams, MATVEC_THREADS, MLA_THREADS, MatvecParams, ROWS_PER_GROUP, SIMD_WIDTH,
    batch_split, kda_threadgroup_bytes, kda_threads, library_source, mla_threadgroup_bytes,
};
use crate::gpu::{Element, GpuBackend, KdaStep, MlaDecode, ShapeError, index};

type Buffer = Retained<ProtocolObject<dyn MTLBuffer>>;
type Pipeline = Retained<ProtocolObject<dyn MTLComputePipelineState>>;

/// Errors of the Metal backend; each says what is missing or wrong.
#[derive(Debug, thiserror::Error)]
pub enum MetalError {
    /// `MTLCreateSystemDefaultDevice` returned no device.
    #[error(
        "Metal unavailable: this Mac reports no Metal device (MTLCreateSystemDefaultDevice returned nil)"
    )]
    NoDevice,
    /// Inputs disagree with the shapes (or a size exceeds the kernels' 32-bit indices).
    #[error("Metal {0}")]
    Shape(#[from] ShapeError),
    /// The weight format has no Metal kernel.
    #[error("Metal: no kernel for {0} weights")]
    Unsupported(&'static str),
    /// The kernel library did not compile.
    #[error("Metal: compiling kernels/metal failed: {0}")]
    Compile(String),
    /// A pipeline could not be built or does not fit the kernels' assumptions.
    #[error("Metal pipeline {kernel}: {detail}")]
    Pipeline {
        /// The kernel function.
        kernel: String,
        /// What went wrong.
        detail: String,
    },
    /// A Metal object could not be created or a command buffer failed.
    #[error("Metal {what}: {detail}")]
    Device {
        /// What was being done.
        what: String,
        /// Why it failed.
        detail: String,
    },
}

fn device_err(what: impl Into<String>, detail: impl Into<String>) -> MetalError {
    MetalError::Device {
        what: what.into(),
        detail: detail.into(),
    }
}

fn system_device() -> Option<Retained<ProtocolObject<dyn MTLDevice>>> {
    std::panic::catch_unwind(|| MTLCreateSystemDefaultDevice())
        .ok()
        .flatten()
}

/// Whether a Metal device exists; `Err(NoDevice)` if not. Never panics.
pub fn metal_available() -> Result<DeviceInfo, MetalError> {
    system_device()
        .map(|d| info_of(&d))
        .ok_or(MetalError::NoDevice)
}

/// What the device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (e.g. "Apple M2 Max").
    pub name: String,
    /// Whether CPU and GPU share memory (Apple silicon).
    pub unified_memory: bool,
    /// Bytes the GPU can use without hurting performance.
    pub recommended_working_set: u64,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mps {} ({}, {:.1} GiB working set)",
            self.name,
            if self.unified_memory {
                "unified memory"
            } else {
                "discrete memory"
            },
            self.recommended_working_set as f64 / (1u64 << 30) as f64
        )
    }
}

fn info_of(d: &ProtocolObject<dyn MTLDevice>) -> DeviceInfo {
    DeviceInfo {
        name: d.name().to_string(),
        unified_memory: d.hasUnifiedMemory(),
        recommended_working_set: d.recommendedMaxWorkingSetSize(),
    }
}

/// A weight matrix resident in shared-storage Metal buffers.
pub type DeviceMatrix = crate::gpu::DeviceMatrix<MetalDevice>;

/// One buffer binding of a dispatch.
enum Arg<'a> {
    Buf(&'a ProtocolObject<dyn MTLBuffer>, usize),
    Bytes(&'a [u8]),
}

/// A binding resolved for encoding.
enum Bind<'a> {
    Buf(&'a ProtocolObject<dyn MTLBuffer>, usize),
    Bytes(NonNull<c_void>, usize),
}

fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: the params structs are #[repr(C)] plain old data without padding.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// The system Metal device with the deltafin kernels compiled.
pub struct MetalDevice {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    pipelines: HashMap<&'static str, Pipeline>,
    info: DeviceInfo,
}

impl std::fmt::Debug for MetalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetalDevice")
            .field("info", &self.info)
            .finish()
    }
}

impl MetalDevice {
    /// Open the system default Metal device and compile `kernels/metal` from source (fast
    /// math off), one pipeline per kernel function; every pipeline must run 32-wide SIMD groups
    /// and at least 256 threads per threadgroup.
    pub fn open() -> Result<MetalDevice, MetalError> {
        let device = system_device().ok_or(MetalError::NoDevice)?;
        let info = info_of(&device);
        let options = MTLCompileOptions::new();
        // The kernels' numerics assume IEEE f32 (no fast math); setFastMathEnabled exists on
        // every macOS version (setMathMode only from macOS 15).
        #[allow(deprecated)]
        options.setFastMathEnabled(false);
        let source = NSString::from_str(&library_source());
        let library = device
            .newLibraryWithSource_options_error(&source, Some(&options))
            .map_err(|e| MetalError::Compile(e.localizedDescription().to_string()))?;
        let mut pipelines = HashMap::new();
        for k in KERNELS {
            for &entry in k.entries {
                let f = library
                    .newFunctionWithName(&NSString::from_str(entry))
                    .ok_or_else(|| MetalError::Pipeline {
                        kernel: entry.into(),
                        detail: format!("function missing from the compiled {}", k.file),
                    })?;
                let p = device
                    .newComputePipelineStateWithFunction_error(&f)
                    .map_err(|e| MetalError::Pipeline {
                        kernel: entry.into(),
                        detail: e.localizedDescription().to_string(),
                    })?;
                let width = p.threadExecutionWidth();
                if width != SIMD_WIDTH {
                    return Err(MetalError::Pipeline {
                        kernel: entry.into(),
                        detail: format!(
                            "SIMD groups are {width} wide on {}; the kernels need 32",
                            info.name
                        ),
                    });
                }
                let max = p.maxTotalThreadsPerThreadgroup();
                if max < MATVEC_THREADS.max(MLA_THREADS) {
                    return Err(MetalError::Pipeline {
                        kernel: entry.into(),
                        detail: format!(
                            "at most {max} threads per threadgroup; the kernels need 256"
                        ),
                    });
                }
                pipelines.insert(entry, p);
            }
        }
        let queue = device
            .newCommandQueue()
            .ok_or_else(|| device_err("creating a command queue", "the device returned nil"))?;
        Ok(MetalDevice {
            device,
            queue,
            pipelines,
            info,
        })
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Where the kernels came from.
    pub fn kernel_origin(&self) -> &'static str {
        "kernels/metal compiled at run time (newLibraryWithSource, fast math off)"
    }

    /// Copy `len` values of type `T` out of a shared-storage buffer (after the work that wrote
    /// it has completed).
    fn read_back<T: Copy + Default>(
        &self,
        what: &str,
        buf: &ProtocolObject<dyn MTLBuffer>,
        len: usize,
    ) -> Result<Vec<T>, MetalError> {
        let bytes = len * std::mem::size_of::<T>();
        if buf.length() < bytes {
            return Err(device_err(
                format!("downloading {what}"),
                format!("buffer holds {} bytes, {bytes} requested", buf.length()),
            ));
        }
        let mut out = vec![T::default(); len];
        // SAFETY: shared storage is CPU-visible; `bytes` is within the buffer (checked above)
        // and the command buffer that wrote it has completed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                buf.contents().as_ptr().cast::<u8>(),
                out.as_mut_ptr().cast::<u8>(),
                bytes,
            );
        }
        Ok(out)
    }

    fn pipeline(&self, name: &str) -> Result<&Pipeline, MetalError> {
        self.pipelines
            .get(name)
            .ok_or_else(|| MetalError::Pipeline {
                kernel: name.into(),
                detail: "not compiled".into(),
            })
    }

    /// Encode the dispatches `(kernel, bindings, threadgroups, threads, threadgroup bytes)`
    /// into one command buffer, commit it and wait.
    fn run(
        &self,
        what: &str,
        launches: &[(String, Vec<Arg<'_>>, usize, usize, usize)],
    ) -> Result<(), MetalError> {
        // Everything fallible happens before encoding starts: an encoder must be ended.
        let mut resolved = Vec::with_capacity(launches.len());
        for (kernel, args, groups, threads, tg_bytes) in launches {
            let mut binds = Vec::with_capacity(args.len());
            for a in args {
                binds.push(match a {
                    Arg::Buf(b, off) => Bind::Buf(b, *off),
                    Arg::Bytes(b) => Bind::Bytes(
                        NonNull::new(b.as_ptr() as *mut c_void).ok_or_else(|| {
                            device_err(format!("{what}: parameters"), "null pointer")
                        })?,
                        b.len(),
                    ),
                });
            }
            resolved.push((self.pipeline(kernel)?, binds, *groups, *threads, *tg_bytes));
        }
        let cb = self
            .queue
            .commandBuffer()
            .ok_or_else(|| device_err(format!("{what}: creating a command buffer"), "nil"))?;
        let enc = cb
            .computeCommandEncoder()
            .ok_or_else(|| device_err(format!("{what}: creating a compute encoder"), "nil"))?;
        for (pipeline, binds, groups, threads, tg_bytes) in resolved {
            enc.setComputePipelineState(pipeline);
            for (i, b) in binds.into_iter().enumerate() {
                match b {
                    // SAFETY: the buffers outlive the command buffer (we wait below); offsets
                    // are within them (the callers check lengths).
                    Bind::Buf(buf, off) => unsafe {
                        enc.setBuffer_offset_atIndex(Some(buf), off, i)
                    },
                    // SAFETY: `ptr` points at `len` bytes; Metal copies them during the call.
                    Bind::Bytes(ptr, len) => unsafe { enc.setBytes_length_atIndex(ptr, len, i) },
                }
            }
            if tg_bytes > 0 {
                // Threadgroup memory lengths must be multiples of 16 bytes.
                // SAFETY: index 0 is the kernels' only [[threadgroup(0)]] argument.
                unsafe { enc.setThreadgroupMemoryLength_atIndex(tg_bytes.next_multiple_of(16), 0) };
            }
            enc.dispatchThreadgroups_threadsPerThreadgroup(
                MTLSize {
                    width: groups,
                    height: 1,
                    depth: 1,
                },
                MTLSize {
                    width: threads,
                    height: 1,
                    depth: 1,
                },
            );
        }
        enc.endEncoding();
        cb.commit();
        cb.waitUntilCompleted();
        match cb.error() {
            Some(e) => Err(device_err(
                what.to_string(),
                e.localizedDescription().to_string(),
            )),
            None => Ok(()),
        }
    }
}

impl GpuBackend for MetalDevice {
    type Buf<T> = Buffer;
    type Error = MetalError;
    type Index = u32;

    /// A shared-storage buffer (at least 4 bytes: Metal has no empty buffers).
    fn upload<T: Element>(&self, what: &str, v: &[T]) -> Result<Buffer, MetalError> {
        let len = std::mem::size_of_val(v);
        let buf = if len == 0 {
            self.device
                .newBufferWithLength_options(4, MTLResourceOptions::StorageModeShared)
        } else {
            let ptr = NonNull::new(v.as_ptr() as *mut c_void)
                .ok_or_else(|| device_err(format!("uploading {what}"), "null slice pointer"))?;
            // SAFETY: `ptr` points at `len` readable bytes; Metal copies them.
            unsafe {
                self.device.newBufferWithBytes_length_options(
                    ptr,
                    len,
                    MTLResourceOptions::StorageModeShared,
                )
            }
        };
        buf.ok_or_else(|| {
            device_err(
                format!("uploading {what} ({len} bytes)"),
                "allocation failed",
            )
        })
    }

    fn zeros(&self, len: usize) -> Result<Buffer, MetalError> {
        self.upload("zeros", &vec![0f32; len])
    }

    fn download(&self, what: &str, buf: &Buffer, len: usize) -> Result<Vec<f32>, MetalError> {
        self.read_back(what, buf, len)
    }

    /// Nothing to wait for: every dispatch waits for its command buffer.
    fn synchronize(&self) -> Result<(), MetalError> {
        Ok(())
    }

    fn unsupported(dtype: &'static str) -> MetalError {
        MetalError::Unsupported(dtype)
    }

    /// One command buffer, committed and waited for.
    fn launch_matmul(
        &self,
        w: &DeviceMatrix,
        x: &Buffer,
        n: usize,
        y: &mut Buffer,
    ) -> Result<(), MetalError> {
        const K: &str = "matmul";
        let (rows, cols) = w.shape();
        let params = MatvecParams {
            rows: index(K, "rows", rows)?,
            cols: index(K, "cols", cols)?,
        };
        index::<u32>(K, "rows·cols", rows * cols)?;
        index::<u32>(K, "n·cols", n * cols)?;
        index::<u32>(K, "n·rows", n * rows)?;
        let groups = rows.div_ceil(ROWS_PER_GROUP);
        let pb = bytes_of(&params);
        let mut launches = Vec::new();
        for (done, nb) in batch_split(n) {
            let mut args = match w {
                DeviceMatrix::Bf16 { data, .. } => vec![Arg::Buf(data, 0)],
                DeviceMatrix::RowInt8 { data, scales, .. }
                | DeviceMatrix::Mxfp4 {
                    packed: data,
                    scales,
                    ..
                } => {
                    vec![Arg::Buf(data, 0), Arg::Buf(scales, 0)]
                }
            };
            args.push(Arg::Buf(x, done * cols * 4));
            args.push(Arg::Buf(y, done * rows * 4));
            args.push(Arg::Bytes(pb));
            launches.push((
                format!("matmul_{}_nb{nb}", w.kind()),
                args,
                groups,
                MATVEC_THREADS,
                0,
            ));
        }
        self.run("matmul", &launches)
    }

    /// `kda.metal`: one threadgroup per head.
    fn run_kda_step(&self, s: &mut [f32], x: &KdaStep<'_>, d: u32) -> Result<Vec<f32>, MetalError> {
        const K: &str = "kda_step";
        let (heads, dim) = (x.heads, x.d);
        let params = KdaParams { d };
        let state = self.upload("KDA state", s)?;
        let bufs = x.upload(self)?;
        let out = self.zeros(heads * dim)?;
        let mut args = vec![Arg::Buf(&state, 0)];
        args.extend(bufs.iter().map(|b| Arg::Buf(b, 0)));
        args.push(Arg::Buf(&out, 0));
        args.push(Arg::Bytes(bytes_of(&params)));
        let (threads, tg_bytes) = (kda_threads(dim), kda_threadgroup_bytes(dim));
        self.run(K, &[(K.into(), args, heads, threads, tg_bytes)])?;
        s.copy_from_slice(&self.download("KDA state", &state, heads * dim * dim)?);
        self.download("KDA output", &out, heads * dim)
    }

    /// `mla.metal`: one threadgroup per head.
    fn run_mla_decode(&self, x: &MlaDecode<'_>) -> Result<Vec<f32>, MetalError> {
        const K: &str = "mla_decode";
        let sh = x.shape;
        let params = sh.params(x.tokens).ok_or(ShapeError {
            kernel: K,
            detail: "a dimension exceeds 32 bits".into(),
        })?;
        let b = x.upload(self)?;
        let args = vec![
            Arg::Buf(&b.q, 0),
            Arg::Buf(&b.kv_b, 0),
            Arg::Buf(&b.latent, 0),
            Arg::Buf(&b.tail, 0),
            Arg::Buf(&b.gate, 0),
            Arg::Buf(&b.scores, 0),
            Arg::Buf(&b.out, 0),
            Arg::Bytes(bytes_of(&params)),
        ];
        let tg_bytes = mla_threadgroup_bytes(sh.kvl, sh.rope);
        self.run(K, &[(K.into(), args, sh.heads, MLA_THREADS, tg_bytes)])?;
        self.download("MLA output", &b.out, sh.heads * sh.v)
    }
}

/// The doctor's device canaries ([`crate::gpu::canaries`] on this device).
pub fn canaries(dev: &MetalDevice) -> Vec<(String, Result<f64, String>)> {
    crate::gpu::canaries(dev)
}
