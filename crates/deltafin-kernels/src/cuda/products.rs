//! [`CudaProducts`]: one CUDA device as a [`ProductDevice`] (feature `cuda`).
//!
//! Every call locks the device: uploads, products and memory queries from several rayon
//! threads are serialised on the device's one stream, so each product's activation upload,
//! launches and result download run back to back and no two callers interleave their
//! buffers. The lock is held for the whole product (the download synchronises the stream).

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::device::{CudaDevice, CudaError, DeviceMatrix};
use crate::gpu::{GpuBackend, GpuDevice};
use crate::matvec::Weights;
use crate::offload::{DeviceError, DeviceResult, DeviceWeights, ProductDevice, next_device_id};

/// A CUDA device serving weight products.
#[derive(Debug)]
pub struct CudaProducts {
    dev: Mutex<CudaDevice>,
    desc: String,
    id: u64,
}

impl CudaProducts {
    /// Wrap an opened device.
    pub fn new(dev: CudaDevice) -> CudaProducts {
        let desc = format!("{} (kernels: {})", dev.info(), dev.kernel_origin());
        CudaProducts {
            dev: Mutex::new(dev),
            desc,
            id: next_device_id(),
        }
    }

    /// Open `cuda:ordinal` and load the kernels ([`CudaDevice::open`]).
    pub fn open(ordinal: usize) -> Result<CudaProducts, CudaError> {
        CudaDevice::open(ordinal).map(CudaProducts::new)
    }

    fn lock(&self) -> MutexGuard<'_, CudaDevice> {
        // A panic inside a driver call cannot leave the device in a state this wrapper
        // relies on (each call is self-contained), so a poisoned lock is still usable.
        self.dev.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn failed(&self, e: CudaError) -> DeviceError {
        DeviceError::Failed {
            device: self.desc.clone(),
            message: e.to_string(),
        }
    }
}

impl ProductDevice for CudaProducts {
    fn describe(&self) -> String {
        self.desc.clone()
    }

    fn free_bytes(&self) -> Result<u64, DeviceError> {
        let dev = self.lock();
        dev.context()
            .mem_get_info()
            .map(|(free, _total)| free as u64)
            .map_err(|e| DeviceError::Failed {
                device: self.desc.clone(),
                message: format!("querying free memory: {e}"),
            })
    }

    fn upload(&self, name: &str, w: Weights<'_>) -> Result<DeviceWeights, DeviceError> {
        let dev = self.lock();
        let m = dev.upload_weights(w).map_err(|e| match e {
            CudaError::Unsupported(dtype) => DeviceError::Unsupported {
                device: self.desc.clone(),
                dtype,
                what: name.to_string(),
            },
            other => DeviceError::Failed {
                device: self.desc.clone(),
                message: format!("uploading {name}: {other}"),
            },
        })?;
        // The copies are queued on the stream; wait so an upload error surfaces here.
        dev.synchronize().map_err(|e| self.failed(e))?;
        Ok(DeviceWeights::new(name, &w, self.id, Box::new(m)))
    }

    fn matmul(&self, w: &DeviceWeights, xs: &[f32], n: usize, ys: &mut [f32]) -> DeviceResult<()> {
        let m: &DeviceMatrix = w.handle_for(&self.desc, self.id, xs.len(), n, ys.len())?;
        let out = {
            let dev = self.lock();
            dev.matmul(m, xs, n).map_err(|e| DeviceError::Failed {
                device: self.desc.clone(),
                message: format!("{}: {e}", w.name()),
            })?
        };
        if out.len() != ys.len() {
            return Err(DeviceError::Shape {
                device: self.desc.clone(),
                detail: format!(
                    "{}: the device returned {} values for {} outputs",
                    w.name(),
                    out.len(),
                    ys.len()
                ),
            });
        }
        ys.copy_from_slice(&out);
        Ok(())
    }
}
