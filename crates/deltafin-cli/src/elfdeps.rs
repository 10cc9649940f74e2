//! The direct dynamic-library dependencies (`DT_NEEDED`) of a 64-bit little-endian ELF file,
//! read from the file itself (no `ldd`), so `doctor` and `upgrade` can refuse a binary that
//! links a Python runtime (product contract §6.3, §7).

use std::path::Path;

/// Library name prefixes a deltafin binary must never load.
pub const FORBIDDEN_PREFIXES: [&str; 2] = ["libpython", "libtorch_python"];

/// What the audit found.
#[derive(Debug, PartialEq, Eq)]
pub enum LoaderDeps {
    /// Not an ELF file (e.g. a Mach-O binary): nothing was audited.
    NotElf,
    /// The `DT_NEEDED` names, in file order (empty for a static binary).
    Needed(Vec<String>),
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

/// Parse the dependencies of the ELF image `b`; `Err` names what is malformed.
pub fn parse(b: &[u8]) -> Result<LoaderDeps, String> {
    if b.len() < 4 || &b[..4] != b"\x7fELF" {
        return Ok(LoaderDeps::NotElf);
    }
    if b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err("only 64-bit little-endian ELF files are audited".into());
    }
    let bad = |what: &str| format!("malformed ELF: {what}");
    let phoff = u64_at(b, 0x20).ok_or_else(|| bad("header"))? as usize;
    let phentsize = u16_at(b, 0x36).ok_or_else(|| bad("header"))? as usize;
    let phnum = u16_at(b, 0x38).ok_or_else(|| bad("header"))? as usize;
    // (vaddr, offset, filesz) of PT_LOAD segments; the PT_DYNAMIC (offset, size).
    let mut loads: Vec<(u64, u64, u64)> = Vec::new();
    let mut dynamic: Option<(usize, usize)> = None;
    for i in 0..phnum {
        let p = phoff + i * phentsize;
        let kind = u32_at(b, p).ok_or_else(|| bad("program header"))?;
        let offset = u64_at(b, p + 8).ok_or_else(|| bad("program header"))?;
        let vaddr = u64_at(b, p + 16).ok_or_else(|| bad("program header"))?;
        let filesz = u64_at(b, p + 32).ok_or_else(|| bad("program header"))?;
        match kind {
            1 => loads.push((vaddr, offset, filesz)),
            2 => dynamic = Some((offset as usize, filesz as usize)),
            _ => {}
        }
    }
    let Some((doff, dsize)) = dynamic else {
        return Ok(LoaderDeps::Needed(Vec::new()));
    };
    let mut needed_offsets = Vec::new();
    let mut strtab_vaddr = None;
    let mut e = doff;
    while e + 16 <= doff + dsize {
        let tag = u64_at(b, e).ok_or_else(|| bad("dynamic section"))?;
        let val = u64_at(b, e + 8).ok_or_else(|| bad("dynamic section"))?;
        match tag {
            0 => break,
            1 => needed_offsets.push(val),
            5 => strtab_vaddr = Some(val),
            _ => {}
        }
        e += 16;
    }
    if needed_offsets.is_empty() {
        return Ok(LoaderDeps::Needed(Vec::new()));
    }
    let strtab_vaddr = strtab_vaddr.ok_or_else(|| bad("DT_NEEDED without DT_STRTAB"))?;
    let strtab = loads
        .iter()
        .find(|(v, _, sz)| strtab_vaddr >= *v && strtab_vaddr < v + sz)
        .map(|(v, o, _)| (strtab_vaddr - v + o) as usize)
        .ok_or_else(|| bad("DT_STRTAB outside every loaded segment"))?;
    needed_offsets
        .iter()
        .map(|&off| {
            let start = strtab + off as usize;
            let rest = b.get(start..).ok_or_else(|| bad("DT_NEEDED name"))?;
            let end = rest
                .iter()
                .position(|&c| c == 0)
                .ok_or_else(|| bad("unterminated DT_NEEDED name"))?;
            Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
        })
        .collect::<Result<Vec<_>, String>>()
        .map(LoaderDeps::Needed)
}

/// Audit `path`: `Ok(deps)` when no forbidden library is linked, `Err` naming it otherwise
/// (or the read/parse failure).
pub fn audit(path: &Path) -> Result<LoaderDeps, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let deps = parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    if let LoaderDeps::Needed(names) = &deps
        && let Some(bad) = names
            .iter()
            .find(|n| FORBIDDEN_PREFIXES.iter().any(|p| n.starts_with(p)))
    {
        return Err(format!(
            "{} links {bad}: a deltafin binary must not load a Python runtime",
            path.display()
        ));
    }
    Ok(deps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_test_binary_is_audited() {
        let exe = std::env::current_exe().unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        match parse(&bytes).unwrap() {
            LoaderDeps::Needed(names) => {
                if cfg!(all(target_os = "linux", target_env = "gnu")) {
                    assert!(names.iter().any(|n| n.starts_with("libc.so")), "{names:?}");
                }
            }
            LoaderDeps::NotElf => assert_ne!(std::env::consts::OS, "linux"),
        }
        assert!(audit(&exe).is_ok());
    }

    /// A minimal ELF64 image: header, PT_LOAD over the whole file, PT_DYNAMIC with
    /// DT_NEEDED entries for `libs`, and the string table.
    fn tiny_elf(libs: &[&str]) -> Vec<u8> {
        let (ph, dynoff) = (64usize, 64 + 2 * 56);
        let dynsize = (libs.len() + 2) * 16;
        let stroff = dynoff + dynsize;
        let mut strtab = vec![0u8];
        let mut name_offs = Vec::new();
        for l in libs {
            name_offs.push(strtab.len() as u64);
            strtab.extend_from_slice(l.as_bytes());
            strtab.push(0);
        }
        let total = stroff + strtab.len();
        let mut b = vec![0u8; total];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x20..0x28].copy_from_slice(&(ph as u64).to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        let mut phdr = |i: usize, kind: u32, off: u64, size: u64| {
            let p = ph + i * 56;
            b[p..p + 4].copy_from_slice(&kind.to_le_bytes());
            b[p + 8..p + 16].copy_from_slice(&off.to_le_bytes());
            b[p + 16..p + 24].copy_from_slice(&off.to_le_bytes());
            b[p + 32..p + 40].copy_from_slice(&size.to_le_bytes());
        };
        phdr(0, 1, 0, total as u64);
        phdr(1, 2, dynoff as u64, dynsize as u64);
        let mut e = dynoff;
        let mut put = |tag: u64, val: u64, e: &mut usize| {
            b[*e..*e + 8].copy_from_slice(&tag.to_le_bytes());
            b[*e + 8..*e + 16].copy_from_slice(&val.to_le_bytes());
            *e += 16;
        };
        for o in &name_offs {
            put(1, *o, &mut e);
        }
        put(5, stroff as u64, &mut e);
        b[stroff..].copy_from_slice(&strtab);
        b
    }

    #[test]
    fn python_runtime_is_refused() {
        let ok = tiny_elf(&["libc.so.6", "libm.so.6"]);
        assert_eq!(
            parse(&ok).unwrap(),
            LoaderDeps::Needed(vec!["libc.so.6".into(), "libm.so.6".into()])
        );
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("deltafin");
        std::fs::write(&p, tiny_elf(&["libc.so.6", "libpython3.12.so.1.0"])).unwrap();
        let err = audit(&p).unwrap_err();
        assert!(err.contains("libpython3.12.so.1.0"), "{err}");
    }

    #[test]
    fn non_elf_and_truncated_inputs() {
        assert_eq!(parse(b"#!/bin/sh\n").unwrap(), LoaderDeps::NotElf);
        assert!(parse(b"\x7fELF\x02\x01").is_err());
        assert!(parse(b"\x7fELF\x01\x01").is_err());
    }
}
