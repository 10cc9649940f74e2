//! The K3 tensor inventory (`k3-meta/tensor_inventory_offsets.json`, product contract §4.2),
//! rebuilt from the shard headers fetched with range requests.
//!
//! Format: one JSON object, keys = tensor names in shard order then header order, each value
//! `{"dtype": …, "shape": […], "offsets": [start, end], "shard": "model-…", "hlen": H}`,
//! serialized like Python's `json.dump` (separators `", "` and `": "`, ASCII only) so that
//! the bytes — and the sha256 pinned in the manifest — match the original's file. The
//! absolute file offset of a tensor is `8 + hlen + offsets[0]`.

use crate::error::FetchError;
use crate::hub::HubClient;
use crate::manifest::{InventoryPin, K3Manifest};
use deltafin_k3::text::chat::write_py_str;
use deltafin_tensor::DType;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Relative path of the inventory under the model root.
pub const INVENTORY_PATH: &str = "k3-meta/tensor_inventory_offsets.json";
/// Largest safetensors header accepted.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Data-section offsets `[start, end)`.
    pub start: u64,
    pub end: u64,
    pub shard: String,
    /// The shard's header length (without the 8-byte prefix).
    pub hlen: u64,
}

impl Record {
    /// Absolute `[start, end)` inside the shard file.
    pub fn file_range(&self) -> (u64, u64) {
        (8 + self.hlen + self.start, 8 + self.hlen + self.end)
    }

    /// Whether this is a routed-expert tensor.
    pub fn is_expert(&self) -> bool {
        self.name.contains(".block_sparse_moe.experts.")
    }
}

/// A parsed, validated inventory.
#[derive(Clone, Debug)]
pub struct Inventory {
    records: Vec<Record>,
    index: HashMap<String, usize>,
    hlens: HashMap<String, u64>,
}

/// One shard's header as read from the hub.
#[derive(Clone, Debug)]
pub struct ShardHeader {
    pub file: String,
    /// The JSON bytes (length = hlen).
    pub json: Vec<u8>,
}

fn inv_err(msg: impl Into<String>) -> FetchError {
    FetchError::Inventory(msg.into())
}

impl Inventory {
    /// Build from the shard headers, validating each against the manifest: tensor count,
    /// dtype × shape = byte length, and the offsets tiling `[0, data_bytes)` contiguously.
    pub fn from_headers(m: &K3Manifest, headers: &[ShardHeader]) -> Result<Inventory, FetchError> {
        if headers.len() != m.shards.len() {
            return Err(inv_err(format!(
                "{} headers for {} shards",
                headers.len(),
                m.shards.len()
            )));
        }
        let mut records = Vec::new();
        for (s, h) in m.shards.iter().zip(headers) {
            if s.file != h.file {
                return Err(inv_err(format!(
                    "header of {} given for {}",
                    h.file, s.file
                )));
            }
            let e = |msg: String| inv_err(format!("{}: header: {msg}", s.file));
            let v: Value = serde_json::from_slice(&h.json).map_err(|x| e(x.to_string()))?;
            let obj = v.as_object().ok_or_else(|| e("not a JSON object".into()))?;
            let hlen = h.json.len() as u64;
            let mut recs = Vec::new();
            for (name, t) in obj {
                if name == "__metadata__" {
                    continue;
                }
                let dtype = t
                    .get("dtype")
                    .and_then(Value::as_str)
                    .ok_or_else(|| e(format!("{name}: no dtype")))?;
                let dt = DType::from_safetensors(dtype)
                    .ok_or_else(|| e(format!("{name}: unknown dtype {dtype}")))?;
                let shape: Vec<u64> = t
                    .get("shape")
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().map(Value::as_u64).collect())
                    .ok_or_else(|| e(format!("{name}: bad shape")))?;
                let offs: Vec<u64> = t
                    .get("data_offsets")
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().map(Value::as_u64).collect())
                    .filter(|o: &Vec<u64>| o.len() == 2)
                    .ok_or_else(|| e(format!("{name}: bad data_offsets")))?;
                let n: u64 = shape
                    .iter()
                    .try_fold(dt.size() as u64, |a, &d| a.checked_mul(d))
                    .ok_or_else(|| {
                        e(format!("{name}: {dtype} {shape:?} overflows a byte length"))
                    })?;
                if offs[1] < offs[0] || offs[1] - offs[0] != n {
                    return Err(e(format!(
                        "{name}: offsets {offs:?} do not span {n} bytes of {dtype} {shape:?}"
                    )));
                }
                recs.push(Record {
                    name: name.clone(),
                    dtype: dtype.to_string(),
                    shape,
                    start: offs[0],
                    end: offs[1],
                    shard: s.file.clone(),
                    hlen,
                });
            }
            if recs.len() as u64 != s.tensors {
                return Err(e(format!(
                    "{} tensors, the manifest says {}",
                    recs.len(),
                    s.tensors
                )));
            }
            let mut spans: Vec<(u64, u64)> = recs.iter().map(|r| (r.start, r.end)).collect();
            spans.sort_unstable();
            let mut at = 0;
            for (a, b) in spans {
                if a != at {
                    return Err(e(format!("data section not contiguous at byte {at}")));
                }
                at = b;
            }
            if at != s.data_bytes {
                return Err(e(format!(
                    "data section is {at} bytes, the manifest says {}",
                    s.data_bytes
                )));
            }
            records.extend(recs);
        }
        Self::from_records(records)
    }

    fn from_records(records: Vec<Record>) -> Result<Inventory, FetchError> {
        let mut index = HashMap::with_capacity(records.len());
        let mut hlens = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            if index.insert(r.name.clone(), i).is_some() {
                return Err(inv_err(format!("{} appears twice", r.name)));
            }
            if let Some(h) = hlens.insert(r.shard.clone(), r.hlen)
                && h != r.hlen
            {
                return Err(inv_err(format!("{}: two header lengths", r.shard)));
            }
        }
        Ok(Inventory {
            records,
            index,
            hlens,
        })
    }

    /// Fetch every shard header with two range requests each (length, then JSON), in
    /// parallel, and build the inventory.
    pub fn fetch(
        client: &HubClient,
        m: &K3Manifest,
        workers: usize,
    ) -> Result<Inventory, FetchError> {
        let headers = fetch_headers(client, m, workers)?;
        Self::from_headers(m, &headers)
    }

    /// All records in file order.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// The record of `name`.
    pub fn get(&self, name: &str) -> Option<&Record> {
        self.index.get(name).map(|&i| &self.records[i])
    }

    /// Header length of `shard`.
    pub fn hlen(&self, shard: &str) -> Option<u64> {
        self.hlens.get(shard).copied()
    }

    /// Serialize exactly as Python's `json.dump(obj, f)`.
    pub fn to_pinned_json(&self) -> String {
        let mut s = String::with_capacity(self.records.len() * 220);
        s.push('{');
        for (i, r) in self.records.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            write_py_str(&mut s, &r.name, true);
            s.push_str(": {\"dtype\": ");
            write_py_str(&mut s, &r.dtype, true);
            s.push_str(", \"shape\": [");
            for (k, d) in r.shape.iter().enumerate() {
                if k > 0 {
                    s.push_str(", ");
                }
                s.push_str(&d.to_string());
            }
            s.push_str(&format!(
                "], \"offsets\": [{}, {}], \"shard\": ",
                r.start, r.end
            ));
            write_py_str(&mut s, &r.shard, true);
            s.push_str(&format!(", \"hlen\": {}}}", r.hlen));
        }
        s.push('}');
        s
    }

    /// The pin of this inventory (size, sha256, record count).
    pub fn pin(&self) -> InventoryPin {
        let text = self.to_pinned_json();
        InventoryPin {
            size: text.len() as u64,
            sha256: hex::encode(Sha256::digest(text.as_bytes())),
            records: self.records.len() as u64,
        }
    }

    /// Parse the stored format (strict: exactly the five fields per record).
    pub fn parse(text: &str) -> Result<Inventory, FetchError> {
        let v: Value = serde_json::from_str(text).map_err(|e| inv_err(e.to_string()))?;
        let obj = v.as_object().ok_or_else(|| inv_err("not a JSON object"))?;
        let mut records = Vec::with_capacity(obj.len());
        for (name, t) in obj {
            let e = |f: &str| inv_err(format!("{name}: bad or missing {f}"));
            let o = t.as_object().ok_or_else(|| e("record"))?;
            if o.len() != 5 {
                return Err(inv_err(format!("{name}: expected exactly 5 fields")));
            }
            let u = |v: &Value| v.as_u64();
            let offs: Vec<u64> = o
                .get("offsets")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(u).collect())
                .filter(|x: &Vec<u64>| x.len() == 2 && x[0] <= x[1])
                .ok_or_else(|| e("offsets"))?;
            records.push(Record {
                name: name.clone(),
                dtype: o
                    .get("dtype")
                    .and_then(Value::as_str)
                    .ok_or_else(|| e("dtype"))?
                    .to_string(),
                shape: o
                    .get("shape")
                    .and_then(Value::as_array)
                    .and_then(|a| a.iter().map(u).collect())
                    .ok_or_else(|| e("shape"))?,
                start: offs[0],
                end: offs[1],
                shard: o
                    .get("shard")
                    .and_then(Value::as_str)
                    .ok_or_else(|| e("shard"))?
                    .to_string(),
                hlen: o.get("hlen").and_then(u).ok_or_else(|| e("hlen"))?,
            });
        }
        Self::from_records(records)
    }

    /// Load `root/k3-meta/tensor_inventory_offsets.json`: a regular file (not a symlink)
    /// whose size and sha256 equal the pin, checked before parsing.
    pub fn load(root: &Path, pin: &InventoryPin) -> Result<Inventory, FetchError> {
        let path = root.join(INVENTORY_PATH);
        let text = read_pinned(&path, pin.size, &pin.sha256)?;
        let inv = Self::parse(&text)?;
        if inv.records.len() as u64 != pin.records {
            return Err(inv_err(format!(
                "{} records, the pin says {}",
                inv.records.len(),
                pin.records
            )));
        }
        Ok(inv)
    }

    /// Write the pinned JSON to `root/k3-meta/…` atomically, checking it against `pin`.
    pub fn store(&self, root: &Path, pin: &InventoryPin) -> Result<PathBuf, FetchError> {
        let text = self.to_pinned_json();
        let got = hex::encode(Sha256::digest(text.as_bytes()));
        if got != pin.sha256 || text.len() as u64 != pin.size {
            return Err(inv_err(format!(
                "the shard headers give an inventory of {} bytes with sha256 {got}, but the pin is {} bytes with sha256 {}: the hub's headers differ from the pinned release",
                text.len(),
                pin.size,
                pin.sha256
            )));
        }
        let path = root.join(INVENTORY_PATH);
        write_atomic(&path, text.as_bytes())?;
        Ok(path)
    }
}

/// Read a regular file (not a symlink) whose size and sha256 must equal the pin.
pub fn read_pinned(path: &Path, size: u64, sha256: &str) -> Result<String, FetchError> {
    let md = std::fs::symlink_metadata(path).map_err(FetchError::io(path))?;
    if !md.is_file() {
        return Err(inv_err(format!("{} is not a regular file", path.display())));
    }
    if md.len() != size {
        return Err(inv_err(format!(
            "{} has {} bytes, the pin says {size}",
            path.display(),
            md.len()
        )));
    }
    let bytes = std::fs::read(path).map_err(FetchError::io(path))?;
    let got = hex::encode(Sha256::digest(&bytes));
    if got != sha256 {
        return Err(inv_err(format!(
            "{}: sha256 {got} does not match the pin {sha256}",
            path.display()
        )));
    }
    String::from_utf8(bytes).map_err(|_| inv_err(format!("{} is not UTF-8", path.display())))
}

/// Write `bytes` to `path` through `path.part`, fsync, rename, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FetchError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(FetchError::io(dir))?;
    let part = crate::transfer::part_path(path);
    let mut f = std::fs::File::create(&part).map_err(FetchError::io(&part))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(FetchError::io(&part))?;
    std::fs::rename(&part, path).map_err(FetchError::io(path))?;
    crate::transfer::sync_dir(dir)
}

/// Fetch the header of one shard: bytes `0..8` (little-endian length), then the JSON.
pub fn fetch_header(
    client: &HubClient,
    repo: &str,
    revision: &str,
    file: &str,
) -> Result<ShardHeader, FetchError> {
    let len = client.get_range_bytes(repo, revision, file, 0, 7)?;
    let mut le = [0u8; 8];
    le.copy_from_slice(&len);
    let hlen = u64::from_le_bytes(le);
    if hlen == 0 || hlen > MAX_HEADER_BYTES {
        return Err(inv_err(format!(
            "{file}: header length {hlen} is outside 1..={MAX_HEADER_BYTES}"
        )));
    }
    let json = client.get_range_bytes(repo, revision, file, 8, 8 + hlen - 1)?;
    Ok(ShardHeader {
        file: file.to_string(),
        json,
    })
}

fn fetch_headers(
    client: &HubClient,
    m: &K3Manifest,
    workers: usize,
) -> Result<Vec<ShardHeader>, FetchError> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<Result<ShardHeader, FetchError>>>> =
        Mutex::new((0..m.shards.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, 16) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(sh) = m.shards.get(i) else { return };
                    let mut r = fetch_header(client, &m.repo, &m.revision, &sh.file);
                    let mut tries = 1;
                    while r.as_ref().is_err_and(|e| e.is_retryable()) && tries < 5 {
                        std::thread::sleep(std::time::Duration::from_millis(200 << tries));
                        r = fetch_header(client, &m.repo, &m.revision, &sh.file);
                        tries += 1;
                    }
                    out.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    out.into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(inv_err("header not fetched"))))
        .collect()
}
