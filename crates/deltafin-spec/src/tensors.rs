//! Strict reading of a BF16 safetensors checkpoint: every tensor read is checked (present,
//! BF16, the shape the config implies) and [`Tensors::finish`] rejects tensors never read.

use deltafin_tensor::{Bf16Matrix, Bytes, DType, SafetensorsFile, TensorError};
use std::marker::PhantomData;

/// A missing, mistyped, misshapen or unexpected tensor.
#[derive(Debug)]
pub(crate) struct TensorIssue {
    pub tensor: String,
    pub message: String,
}

/// Tensor-by-tensor reader over a checkpoint; errors are the drafter's own `E`.
pub(crate) struct Tensors<'a, E> {
    file: &'a SafetensorsFile,
    used: Vec<String>,
    _err: PhantomData<E>,
}

impl<'a, E: From<TensorIssue> + From<TensorError>> Tensors<'a, E> {
    pub(crate) fn new(file: &'a SafetensorsFile) -> Self {
        Tensors {
            file,
            used: Vec::new(),
            _err: PhantomData,
        }
    }

    fn err(name: &str, message: String) -> E {
        E::from(TensorIssue {
            tensor: name.to_owned(),
            message,
        })
    }

    /// Whether the checkpoint holds `name` (read or not).
    pub(crate) fn has(&self, name: &str) -> bool {
        self.file.info(name).is_some()
    }

    /// Check that `name` is a BF16 tensor of `shape` and mark it read.
    pub(crate) fn check(&mut self, name: &str, shape: &[usize]) -> Result<(), E> {
        let info = self
            .file
            .info(name)
            .ok_or_else(|| Self::err(name, "missing from model.safetensors".into()))?;
        if info.dtype != DType::BF16 {
            return Err(Self::err(
                name,
                format!("dtype {:?}, expected BF16", info.dtype),
            ));
        }
        if info.shape != shape {
            return Err(Self::err(
                name,
                format!("shape {:?}, expected {shape:?}", info.shape),
            ));
        }
        self.used.push(name.to_owned());
        Ok(())
    }

    /// The bytes of the BF16 tensor `name` of `shape`.
    pub(crate) fn bytes(&mut self, name: &str, shape: &[usize]) -> Result<Bytes, E> {
        self.check(name, shape)?;
        Ok(self.file.bytes(name)?)
    }

    /// The BF16 matrix `name` of `rows × cols`.
    pub(crate) fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Bf16Matrix, E> {
        let bytes = self.bytes(name, &[rows, cols])?;
        Ok(Bf16Matrix::new(name, bytes, rows, cols)?)
    }

    /// The BF16 tensor `name` of `shape`, widened to f32.
    pub(crate) fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, E> {
        let bytes = self.bytes(name, shape)?;
        Ok(bytes
            .as_slice()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect())
    }

    /// Fail on the first tensor never read: it is not part of the `layout` the config
    /// describes.
    pub(crate) fn finish(self, layout: &str) -> Result<(), E> {
        match self
            .file
            .tensors()
            .iter()
            .find(|t| !self.used.contains(&t.name))
        {
            Some(extra) => Err(Self::err(
                &extra.name,
                format!("not part of the {layout} layout this config describes"),
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_tensor::{SafetensorsWriter, TensorEntry};

    #[derive(Debug)]
    enum E {
        Issue(TensorIssue),
        // Read only through `Debug`, when a test fails.
        #[allow(dead_code)]
        File(TensorError),
    }
    impl From<TensorIssue> for E {
        fn from(e: TensorIssue) -> Self {
            E::Issue(e)
        }
    }
    impl From<TensorError> for E {
        fn from(e: TensorError) -> Self {
            E::File(e)
        }
    }

    fn issue(r: Result<impl std::fmt::Debug, E>) -> (String, String) {
        match r {
            Err(E::Issue(i)) => (i.tensor, i.message),
            other => panic!("expected a tensor issue, got {other:?}"),
        }
    }

    #[test]
    fn every_tensor_is_checked_and_every_tensor_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let entry = |name: &str, dtype, shape: Vec<usize>| TensorEntry {
            name: name.into(),
            dtype,
            shape,
        };
        SafetensorsWriter::new(vec![
            entry("m", DType::BF16, vec![2, 3]),
            entry("v", DType::BF16, vec![2]),
            entry("f", DType::F32, vec![2]),
            entry("extra", DType::BF16, vec![1]),
        ])
        .write(&path, |_, e, out| {
            // bf16 1.0 = 0x3f80 (little-endian).
            out.write_all(&[0x80, 0x3f].repeat(e.byte_len() / 2))
        })
        .unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        let mut rd = Tensors::<E>::new(&file);
        assert_eq!(rd.matrix("m", 2, 3).unwrap().rows(), 2);
        assert_eq!(rd.vector("v", &[2]).unwrap(), vec![1.0, 1.0]);
        let (t, m) = issue(rd.vector("f", &[2]));
        assert_eq!((t.as_str(), m.as_str()), ("f", "dtype F32, expected BF16"));
        let (t, m) = issue(rd.vector("v", &[3]));
        assert_eq!((t.as_str(), m.as_str()), ("v", "shape [2], expected [3]"));
        let (t, m) = issue(rd.check("nope", &[1]));
        assert_eq!(
            (t, m.as_str()),
            ("nope".into(), "missing from model.safetensors")
        );
        assert!(rd.has("extra"));
        rd.check("f", &[2]).unwrap_err();
        // The first tensor never read, in file order.
        let (t, m) = issue(rd.finish("Test"));
        assert_eq!(t, "f");
        assert_eq!(m, "not part of the Test layout this config describes");
    }
}
