//! The manifest: which tables are live and how far the command log is already in them.
//!
//! ```text
//! MANIFEST = magic "PINQMAN1" u64 | version u32 | next_table_id u64 | applied_index u64 |
//!            event_id_high_water u64 |
//!            table_count u32 | (table_id u64 | file_len u64)* (newest first) | crc32c u32
//! ```
//!
//! Every command with a log index at or below `applied_index` is in the listed tables; recovery
//! replays only the log after it. `event_id_high_water` is the shard's metadata (the highest
//! event id any applied command assigned): it lives here, outside the event tables' key range,
//! so no table's key range reaches past the event keys. The file is replaced atomically: write
//! `MANIFEST.tmp`, fdatasync it, rename it over `MANIFEST`, fsync the directory. A crash at any
//! point leaves either the old or the new manifest, never a mix, and table files not listed are
//! orphans recovery removes.
//!
//! The codec is pure; [`write`] is the only writer (called by the engine with its manifest lock
//! held, so flushes and compactions never interleave), [`read_blocking`] the only reader
//! (recovery, before the shard serves).

use std::path::Path;

use super::io::{self as dio, DmaWriter};
use super::{corrupt, io_error};
use crate::storage::StoreError;

pub const MANIFEST_FILE: &str = "MANIFEST";
pub const MANIFEST_TMP_FILE: &str = "MANIFEST.tmp";
const MANIFEST_MAGIC: u64 = u64::from_le_bytes(*b"PINQMAN1");
/// Version 1 (before the command log) kept the high-water mark as a key in the tables; a
/// directory written by it is refused by name.
const MANIFEST_VERSION: u32 = 2;
/// A manifest longer than this is refused before allocating for it.
const TABLES_MAX: usize = 1 << 20;

/// One live table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableEntry {
    pub id: u64,
    pub file_len: u64,
}

/// The durable state of the store's file set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest {
    /// Ids below this may have been used; new tables take ids from here.
    pub next_table_id: u64,
    /// Every command at or below this log index is in the tables.
    pub applied_index: u64,
    /// The highest event id assigned by a command at or below `applied_index`.
    pub event_id_high_water: u64,
    /// Live tables, newest first (a newer table's entries shadow an older one's).
    pub tables: Vec<TableEntry>,
}

/// Why manifest bytes are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest of {len} bytes is truncated")]
    Truncated { len: usize },
    #[error("bad magic: not a pinq manifest")]
    BadMagic,
    #[error("unsupported manifest version {found} (this build reads version 2; version 1 is a data directory of a pinq from before the command log: move it aside)")]
    BadVersion { found: u32 },
    #[error("manifest checksum mismatch")]
    Checksum,
    #[error("manifest malformed: {what}")]
    Malformed { what: &'static str },
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(44 + 16 * self.tables.len());
        out.extend_from_slice(&MANIFEST_MAGIC.to_le_bytes());
        out.extend_from_slice(&MANIFEST_VERSION.to_le_bytes());
        out.extend_from_slice(&self.next_table_id.to_le_bytes());
        out.extend_from_slice(&self.applied_index.to_le_bytes());
        out.extend_from_slice(&self.event_id_high_water.to_le_bytes());
        out.extend_from_slice(&(self.tables.len() as u32).to_le_bytes());
        for t in &self.tables {
            out.extend_from_slice(&t.id.to_le_bytes());
            out.extend_from_slice(&t.file_len.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        const HEADER: usize = 8 + 4 + 8 + 8 + 8 + 4;
        if bytes.len() < HEADER + 4 {
            return Err(ManifestError::Truncated { len: bytes.len() });
        }
        let u64_at = |at: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |at: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(a)
        };
        if u64_at(0) != MANIFEST_MAGIC {
            return Err(ManifestError::BadMagic);
        }
        let version = u32_at(8);
        if version != MANIFEST_VERSION {
            return Err(ManifestError::BadVersion { found: version });
        }
        let count = u32_at(36) as usize;
        if count > TABLES_MAX {
            return Err(ManifestError::Malformed {
                what: "table count out of range",
            });
        }
        let total = HEADER + 16 * count + 4;
        if bytes.len() != total {
            return Err(ManifestError::Truncated { len: bytes.len() });
        }
        if u32_at(total - 4) != crc32c::crc32c(&bytes[..total - 4]) {
            return Err(ManifestError::Checksum);
        }
        let manifest = Manifest {
            next_table_id: u64_at(12),
            applied_index: u64_at(20),
            event_id_high_water: u64_at(28),
            tables: (0..count)
                .map(|i| TableEntry {
                    id: u64_at(HEADER + 16 * i),
                    file_len: u64_at(HEADER + 16 * i + 8),
                })
                .collect(),
        };
        let mut ids: Vec<u64> = manifest.tables.iter().map(|t| t.id).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != count {
            return Err(ManifestError::Malformed {
                what: "a table is listed twice",
            });
        }
        if ids.last().is_some_and(|&max| max >= manifest.next_table_id) {
            return Err(ManifestError::Malformed {
                what: "a table id is not below next_table_id",
            });
        }
        Ok(manifest)
    }
}

/// Replaces the manifest atomically (write temp, fdatasync, rename, fsync directory).
pub async fn write(dir: &Path, manifest: &Manifest) -> Result<(), StoreError> {
    let tmp = dir.join(MANIFEST_TMP_FILE);
    let mut out = DmaWriter::create(&tmp, 4096).await?;
    out.append(&manifest.encode()).await?;
    out.finish().await?;
    dio::rename(&tmp, &dir.join(MANIFEST_FILE)).await?;
    dio::sync_dir(dir).await
}

/// Reads the manifest, if the directory has one. Blocking: recovery only.
pub fn read_blocking(dir: &Path) -> Result<Option<Manifest>, StoreError> {
    let path = dir.join(MANIFEST_FILE);
    match dio::read_blocking(&path) {
        Ok(bytes) => Manifest::decode(&bytes)
            .map(Some)
            .map_err(|e| corrupt(&path, e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(&path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            next_table_id: 10,
            applied_index: 12345,
            event_id_high_water: 777,
            tables: vec![
                TableEntry {
                    id: 9,
                    file_len: 4096,
                },
                TableEntry {
                    id: 3,
                    file_len: 52,
                },
            ],
        }
    }

    #[test]
    fn manifest_round_trips() {
        let m = sample();
        assert_eq!(Manifest::decode(&m.encode()), Ok(m));
        let empty = Manifest::default();
        assert_eq!(Manifest::decode(&empty.encode()), Ok(empty));
    }

    #[test]
    fn damaged_manifests_are_refused() {
        let bytes = sample().encode();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x04;
            assert!(Manifest::decode(&bad).is_err(), "flip at {i}");
        }
        for cut in 0..bytes.len() {
            assert!(Manifest::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let mut m = sample();
        m.tables.push(TableEntry { id: 9, file_len: 1 });
        assert!(Manifest::decode(&m.encode()).is_err());
        let mut m = sample();
        m.next_table_id = 9;
        assert!(Manifest::decode(&m.encode()).is_err());
    }
}
