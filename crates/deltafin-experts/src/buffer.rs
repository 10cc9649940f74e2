//! Page-aligned, reusable read buffers that `Bytes` views can share.

use crate::layout::ALIGN;
use deltafin_tensor::storage::ByteOwner;

/// One aligned block (the unit of allocation).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(4096))]
struct Block([u8; ALIGN as usize]);

/// A buffer whose start address and length are multiples of [`ALIGN`] (what O_DIRECT needs).
pub struct ExpertBuffer {
    blocks: Vec<Block>,
}

impl ExpertBuffer {
    /// A zeroed buffer of at least `len` bytes (rounded up to [`ALIGN`]).
    pub fn new(len: u64) -> ExpertBuffer {
        let n = len.div_ceil(ALIGN) as usize;
        ExpertBuffer {
            blocks: vec![Block([0; ALIGN as usize]); n],
        }
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.blocks.len() * ALIGN as usize
    }

    /// True for a zero-capacity buffer.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The whole buffer, writable.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.blocks)
    }
}

impl ByteOwner for ExpertBuffer {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded() {
        let mut b = ExpertBuffer::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_mut_bytes().as_ptr() as usize % ALIGN as usize, 0);
        b.as_mut_bytes()[4999] = 7;
        assert_eq!(b.bytes()[4999], 7);
    }
}
