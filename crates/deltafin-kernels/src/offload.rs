//! Weight products on an accelerator (issue 11): the object-safe [`ProductDevice`] interface
//! the model offloads its spine and its routed experts through, and [`HostDevice`], a CPU
//! stand-in that keeps its own copies of the weights and counts what went through it.
//!
//! A device holds uploaded matrices behind opaque [`DeviceWeights`] handles (dropping a handle
//! frees its memory) and multiplies `n` activation rows by one of them. Calls may come from
//! several threads at once; each implementation serialises them on its device as it needs.
//!
//! Implementations: [`HostDevice`] (always built; used by the tests, which prove through its
//! counters which products ran on "the device" — it multiplies with the CPU kernels, so its
//! results are bit-identical to the CPU path) and, with feature `cuda`,
//! `cuda::CudaProducts` (one CUDA device, one stream, calls serialised by a mutex).

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix};

use crate::matvec::{Weights, matmul};

/// What went wrong on a device; each variant names the device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Not enough free device memory for an upload.
    #[error("{device}: out of memory uploading {what}: needs {need} bytes, {free} free")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The matrix.
        what: String,
        /// Bytes it needs.
        need: u64,
        /// Bytes free.
        free: u64,
    },
    /// The device has no kernel for this weight format.
    #[error("{device}: no product kernel for {dtype} weights ({what})")]
    Unsupported {
        /// The device.
        device: String,
        /// The weight format.
        dtype: &'static str,
        /// The matrix.
        what: String,
    },
    /// Inputs disagree with the matrix shape.
    #[error("{device}: {detail}")]
    Shape {
        /// The device.
        device: String,
        /// What disagrees.
        detail: String,
    },
    /// A handle made by another device.
    #[error("{device}: the weights of {what} were uploaded to a different device")]
    ForeignHandle {
        /// The device.
        device: String,
        /// The matrix.
        what: String,
    },
    /// A device operation (copy, launch, synchronisation) failed.
    #[error("{device}: {message}")]
    Failed {
        /// The device.
        device: String,
        /// The driver's message.
        message: String,
    },
}

/// A matrix resident on a device: an opaque handle made by [`ProductDevice::upload`].
/// Dropping it frees the device memory.
pub struct DeviceWeights {
    name: String,
    rows: usize,
    cols: usize,
    bytes: u64,
    dtype: &'static str,
    device_id: u64,
    handle: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWeights")
            .field("name", &self.name)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("dtype", &self.dtype)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DeviceWeights {
    /// Wrap a device's own matrix type (for [`ProductDevice`] implementations).
    /// `device_id` is the device's [`next_device_id`] value.
    pub fn new(
        name: &str,
        w: &Weights<'_>,
        device_id: u64,
        handle: Box<dyn Any + Send + Sync>,
    ) -> DeviceWeights {
        DeviceWeights {
            name: name.to_string(),
            rows: w.rows(),
            cols: w.cols(),
            bytes: w.weight_bytes() as u64,
            dtype: w.dtype(),
            device_id,
            handle,
        }
    }
    /// The name it was uploaded under (the tensor name).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Weight bytes as the host holds them (what the upload copied).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// `"bf16"`, `"row-int8"`, `"mxfp4"`, `"f32"`.
    pub fn dtype(&self) -> &'static str {
        self.dtype
    }
    /// The device's own matrix, if `device_id` made it (for implementations).
    pub fn handle<T: 'static>(&self, device_id: u64) -> Option<&T> {
        if self.device_id != device_id {
            return None;
        }
        self.handle.downcast_ref::<T>()
    }
    /// The device's own matrix for a product of `n` rows with `xs` inputs and `ys` outputs
    /// (for implementations): [`DeviceError::ForeignHandle`] unless `device_id` made it, then
    /// [`DeviceWeights::check_io`].
    pub fn handle_for<T: 'static>(
        &self,
        device: &str,
        device_id: u64,
        xs: usize,
        n: usize,
        ys: usize,
    ) -> Result<&T, DeviceError> {
        let Some(m) = self.handle::<T>(device_id) else {
            return Err(DeviceError::ForeignHandle {
                device: device.to_string(),
                what: self.name.clone(),
            });
        };
        self.check_io(device, xs, n, ys)?;
        Ok(m)
    }
    /// Check `xs`/`ys` against the shape for `n` rows (for implementations).
    pub fn check_io(
        &self,
        device: &str,
        xs: usize,
        n: usize,
        ys: usize,
    ) -> Result<(), DeviceError> {
        if xs != n * self.cols || ys != n * self.rows {
            return Err(DeviceError::Shape {
                device: device.to_string(),
                detail: format!(
                    "{}: {n} rows of [{}, {}] need {} inputs and {} outputs, got {xs} and {ys}",
                    self.name,
                    self.rows,
                    self.cols,
                    n * self.cols,
                    n * self.rows
                ),
            });
        }
        Ok(())
    }
}

/// A distinct id for a device instance (handles remember which device made them).
pub fn next_device_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The result of a [`ProductDevice`] operation.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// An accelerator that holds weight matrices and multiplies activation rows by them.
/// Object safe; callable from several threads at once.
pub trait ProductDevice: Send + Sync {
    /// One line naming the device (`cuda:0 NVIDIA H200 (sm_90, 139.8 GiB)`).
    fn describe(&self) -> String;
    /// Device memory free now, in bytes (what "when it fits" is measured against).
    fn free_bytes(&self) -> Result<u64, DeviceError>;
    /// Copy a matrix (bf16, row-int8 or MXFP4) to the device under `name`.
    fn upload(&self, name: &str, w: Weights<'_>) -> Result<DeviceWeights, DeviceError>;
    /// `ys[b] = W·xs[b]` for `n` row-major activation rows (`xs`: `n · cols`,
    /// `ys`: `n · rows`); returns when `ys` holds the results.
    fn matmul(&self, w: &DeviceWeights, xs: &[f32], n: usize, ys: &mut [f32]) -> DeviceResult<()>;
}

/// What a [`HostDevice`] has done so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Matrices uploaded.
    pub uploads: u64,
    /// Bytes uploaded.
    pub upload_bytes: u64,
    /// Products computed.
    pub products: u64,
    /// Activation rows multiplied (Σ n over products).
    pub product_rows: u64,
    /// Bytes held by live handles now.
    pub resident_bytes: u64,
    /// Products per upload name, in upload order (a name uploaded twice appears twice).
    pub per_matrix: Vec<(String, u64)>,
}

/// The host copy a [`HostDevice`] keeps for one upload.
struct HostMatrix {
    slot: usize,
    m: HostOwned,
    bytes: u64,
    used: Arc<AtomicU64>,
}

enum HostOwned {
    F32(Vec<f32>),
    Bf16(Bf16Matrix),
    RowInt8(RowInt8Matrix),
    Mxfp4(Mxfp4Matrix),
}

impl Drop for HostMatrix {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A CPU stand-in for a GPU: `upload` copies the weights into buffers of its own (so a
/// product can only read what was uploaded), `matmul` multiplies them with the CPU kernels
/// (bit-identical to the CPU path), and every upload and product is counted. It has a fixed
/// capacity (uploads beyond it fail like a full GPU) and can be told to fail its `k`-th
/// product, to test error paths. For tests and library users; the CLI never offers it.
pub struct HostDevice {
    id: u64,
    capacity: u64,
    used: Arc<AtomicU64>,
    uploads: AtomicU64,
    upload_bytes: AtomicU64,
    products: AtomicU64,
    product_rows: AtomicU64,
    fail_at: AtomicU64,
    per_matrix: Mutex<Vec<(String, u64)>>,
}

impl HostDevice {
    /// A stand-in with `capacity` bytes of "device memory".
    pub fn new(capacity: u64) -> HostDevice {
        HostDevice {
            id: next_device_id(),
            capacity,
            used: Arc::new(AtomicU64::new(0)),
            uploads: AtomicU64::new(0),
            upload_bytes: AtomicU64::new(0),
            products: AtomicU64::new(0),
            product_rows: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            per_matrix: Mutex::new(Vec::new()),
        }
    }

    /// Make product number `k` (0-based, counted from the device's creation) and every
    /// later one fail with [`DeviceError::Failed`].
    pub fn fail_products_from(&self, k: u64) {
        self.fail_at.store(k, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn counters(&self) -> HostCounters {
        HostCounters {
            uploads: self.uploads.load(Ordering::Relaxed),
            upload_bytes: self.upload_bytes.load(Ordering::Relaxed),
            products: self.products.load(Ordering::Relaxed),
            product_rows: self.product_rows.load(Ordering::Relaxed),
            resident_bytes: self.used.load(Ordering::Relaxed),
            per_matrix: self
                .per_matrix
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

impl ProductDevice for HostDevice {
    fn describe(&self) -> String {
        format!(
            "host stand-in device ({:.3} GB, CPU kernels)",
            self.capacity as f64 / 1e9
        )
    }

    fn free_bytes(&self) -> Result<u64, DeviceError> {
        Ok(self
            .capacity
            .saturating_sub(self.used.load(Ordering::Relaxed)))
    }

    fn upload(&self, name: &str, w: Weights<'_>) -> Result<DeviceWeights, DeviceError> {
        let bytes = w.weight_bytes() as u64;
        let free = self.free_bytes()?;
        if bytes > free {
            return Err(DeviceError::OutOfMemory {
                device: self.describe(),
                what: name.to_string(),
                need: bytes,
                free,
            });
        }
        let copy = |e: deltafin_tensor::TensorError| DeviceError::Failed {
            device: self.describe(),
            message: format!("copying {name}: {e}"),
        };
        // Real copies: the stand-in must not read the caller's buffers after the upload.
        let own = |b: &[u8]| Bytes::from_vec(b.to_vec());
        let (rows, cols) = (w.rows(), w.cols());
        let m = match w {
            Weights::F32 { data, .. } => HostOwned::F32(data.to_vec()),
            Weights::Bf16(m) => HostOwned::Bf16(
                Bf16Matrix::new(name, own(m.bytes().as_slice()), rows, cols).map_err(copy)?,
            ),
            Weights::RowInt8(m) => {
                let (codes, scales) = (
                    own(m.data_bytes().as_slice()),
                    own(m.scale_bytes().as_slice()),
                );
                let m = RowInt8Matrix::new_unscanned(name, codes, scales, rows, cols);
                HostOwned::RowInt8(m.map_err(copy)?)
            }
            Weights::Mxfp4(m) => {
                let m = Mxfp4Matrix::new(name, own(m.packed()), own(m.scales()), rows, cols);
                HostOwned::Mxfp4(m.map_err(copy)?)
            }
        };
        let slot = {
            let mut per = self
                .per_matrix
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            per.push((name.to_string(), 0));
            per.len() - 1
        };
        self.used.fetch_add(bytes, Ordering::Relaxed);
        self.uploads.fetch_add(1, Ordering::Relaxed);
        self.upload_bytes.fetch_add(bytes, Ordering::Relaxed);
        let held = HostMatrix {
            slot,
            m,
            bytes,
            used: self.used.clone(),
        };
        Ok(DeviceWeights::new(name, &w, self.id, Box::new(held)))
    }

    fn matmul(&self, w: &DeviceWeights, xs: &[f32], n: usize, ys: &mut [f32]) -> DeviceResult<()> {
        let h: &HostMatrix = w.handle_for(&self.describe(), self.id, xs.len(), n, ys.len())?;
        let k = self.products.fetch_add(1, Ordering::Relaxed);
        if k >= self.fail_at.load(Ordering::Relaxed) {
            return Err(DeviceError::Failed {
                device: self.describe(),
                message: format!("injected failure of product {k} ({})", w.name()),
            });
        }
        self.product_rows.fetch_add(n as u64, Ordering::Relaxed);
        if let Some(e) = self
            .per_matrix
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(h.slot)
        {
            e.1 += 1;
        }
        let weights = match &h.m {
            HostOwned::F32(data) => Weights::F32 {
                data,
                rows: w.rows(),
                cols: w.cols(),
            },
            HostOwned::Bf16(m) => Weights::Bf16(m),
            HostOwned::RowInt8(m) => Weights::RowInt8(m),
            HostOwned::Mxfp4(m) => Weights::Mxfp4(m),
        };
        matmul(weights, xs, n, ys);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn bf16_matrix(rows: usize, cols: usize, seed: u32) -> Bf16Matrix {
        let v: Vec<bf16> = (0..rows * cols)
            .map(|i| {
                bf16::from_f32(
                    (((i as u32).wrapping_mul(2654435761) ^ seed) % 97) as f32 / 48.0 - 1.0,
                )
            })
            .collect();
        Bf16Matrix::from_values(rows, cols, &v).unwrap()
    }

    #[test]
    fn host_device_multiplies_its_own_copy_and_counts() {
        let m = bf16_matrix(13, 64, 5);
        let q = RowInt8Matrix::from_bf16("q", &m).unwrap();
        let dev = HostDevice::new(1 << 20);
        let a = dev.upload("a", Weights::Bf16(&m)).unwrap();
        let b = dev.upload("b", Weights::RowInt8(&q)).unwrap();
        assert_eq!(a.bytes(), 13 * 64 * 2);
        let xs: Vec<f32> = (0..3 * 64).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        for (h, w) in [(&a, Weights::Bf16(&m)), (&b, Weights::RowInt8(&q))] {
            let mut want = vec![0f32; 3 * 13];
            matmul(w, &xs, 3, &mut want);
            let mut got = vec![0f32; 3 * 13];
            dev.matmul(h, &xs, 3, &mut got).unwrap();
            assert_eq!(got, want);
        }
        let c = dev.counters();
        assert_eq!((c.uploads, c.products, c.product_rows), (2, 2, 6));
        assert_eq!(c.resident_bytes, a.bytes() + b.bytes());
        assert_eq!(c.per_matrix, vec![("a".into(), 1), ("b".into(), 1)]);
        drop(a);
        assert_eq!(dev.counters().resident_bytes, b.bytes());
        // Wrong sizes, a foreign handle, a full device and injected failures are errors.
        let mut ys = vec![0f32; 13];
        let e = dev.matmul(&b, &xs[..63], 1, &mut ys).unwrap_err();
        assert!(e.to_string().contains("b: 1 rows of [13, 64]"), "{e}");
        let other = HostDevice::new(1 << 20);
        let e = other.matmul(&b, &xs[..64], 1, &mut ys).unwrap_err();
        assert!(matches!(e, DeviceError::ForeignHandle { .. }), "{e}");
        let small = HostDevice::new(100);
        let e = small.upload("big", Weights::Bf16(&m)).unwrap_err();
        assert!(e.to_string().contains("out of memory uploading big"), "{e}");
        dev.fail_products_from(2);
        let e = dev.matmul(&b, &xs[..64], 1, &mut ys).unwrap_err();
        assert!(
            e.to_string().contains("injected failure of product 2 (b)"),
            "{e}"
        );
    }
}
