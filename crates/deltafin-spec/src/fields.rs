//! Strict key-by-key reading of JSON configs: every key is used or rejected.

use serde_json::{Map, Value};
use std::marker::PhantomData;

/// Key-by-key reader over a JSON object; [`Fields::finish`] rejects keys never read.
pub(crate) struct Fields<E> {
    prefix: &'static str,
    map: Map<String, Value>,
    _err: PhantomData<E>,
}

/// A bad configuration field.
#[derive(Debug)]
pub(crate) struct FieldError {
    pub field: String,
    pub message: String,
}

impl<E: From<FieldError>> Fields<E> {
    pub(crate) fn new(prefix: &'static str, map: Map<String, Value>) -> Self {
        Fields {
            prefix,
            map,
            _err: PhantomData,
        }
    }
    pub(crate) fn err(&self, key: &str, message: impl Into<String>) -> E {
        E::from(FieldError {
            field: format!("{}{key}", self.prefix),
            message: message.into(),
        })
    }
    pub(crate) fn take(&mut self, key: &str) -> Result<Value, E> {
        self.map.remove(key).ok_or_else(|| self.err(key, "missing"))
    }
    pub(crate) fn usize(&mut self, key: &str) -> Result<usize, E> {
        let v = self.take(key)?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(key, format!("expected a non-negative integer, found {v}")))
    }
    pub(crate) fn positive(&mut self, key: &str) -> Result<usize, E> {
        let v = self.usize(key)?;
        if v == 0 {
            return Err(self.err(key, "must be positive"));
        }
        Ok(v)
    }
    pub(crate) fn u32(&mut self, key: &str) -> Result<u32, E> {
        let v = self.usize(key)?;
        u32::try_from(v).map_err(|_| self.err(key, format!("{v} does not fit a token id")))
    }
    pub(crate) fn f64(&mut self, key: &str) -> Result<f64, E> {
        let v = self.take(key)?;
        v.as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.err(key, format!("expected a finite number, found {v}")))
    }
    pub(crate) fn bool(&mut self, key: &str) -> Result<bool, E> {
        let v = self.take(key)?;
        v.as_bool()
            .ok_or_else(|| self.err(key, format!("expected true or false, found {v}")))
    }
    pub(crate) fn string(&mut self, key: &str) -> Result<String, E> {
        let v = self.take(key)?;
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| self.err(key, format!("expected a string, found {v}")))
    }
    pub(crate) fn expect_str(&mut self, key: &str, want: &str) -> Result<(), E> {
        let s = self.string(key)?;
        if s != want {
            return Err(self.err(key, format!("`{s}` is not supported (expected `{want}`)")));
        }
        Ok(())
    }
    pub(crate) fn expect_bool(&mut self, key: &str, want: bool) -> Result<(), E> {
        if self.bool(key)? != want {
            return Err(self.err(key, format!("only {want} is supported")));
        }
        Ok(())
    }
    pub(crate) fn finish(self) -> Result<(), E> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(self.err(k, "unknown field")),
        }
    }
}
