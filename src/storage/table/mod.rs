//! Immutable sorted tables (`tbl-<id>.sst`): what a flushed memtable or a compaction leaves on
//! disk.
//!
//! ```text
//! file   = data block* | index block | bloom block | props block | footer (52 bytes)
//! block  = body | crc32c u32 LE (over body)       — every block carries its own checksum
//! footer = index_off u64 | index_len u32 | bloom_off u64 | bloom_len u32 | props_off u64 |
//!          props_len u32 | format_version u32 | magic u64 | crc32c u32 (over the 48 bytes before)
//! ```
//!
//! Data blocks (about `block_bytes`, 16 KiB by default) hold entries in key order; the index
//! holds each block's last key, offset and length; the bloom filter answers "may this table hold
//! key K" without I/O, which the memtable's annihilation and compaction's tombstone dropping rely
//! on; the props block carries counts and TTL statistics for the compaction policy.
//!
//! Owns the format. [`block`], [`bloom`] and [`builder`] are pure; [`reader`] is the glommio
//! shell that reads blocks through DMA and refuses a corrupt table with an error naming the
//! file; [`writer`] is the shell that streams a builder into a new file. Called by the engine's
//! flush and compaction (building) and by scans and gets (reading).

pub mod block;
pub mod bloom;
pub mod builder;
pub mod reader;
pub mod writer;

pub use builder::TableBuilder;
pub use reader::{Table, TableCursor};
pub use writer::TableWriter;

/// `PINQTBL1`, little-endian, at the end of every table.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"PINQTBL1");
/// Version of the layout described in the module docs.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of the footer.
pub const FOOTER_BYTES: usize = 52;

/// File name of table `id`.
pub fn table_name(id: u64) -> String {
    format!("tbl-{id:020}.sst")
}

/// Parses a table file name back into its id.
pub fn parse_table_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("tbl-")?.strip_suffix(".sst")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Why table bytes are not valid. The reader turns it into `StoreError::Corrupt` naming the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("{what}: {len} bytes is too short")]
    TooShort { what: &'static str, len: usize },
    #[error("{what}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("bad magic {found:#018x}: not a pinq table")]
    BadMagic { found: u64 },
    #[error("unsupported table format version {found} (this build reads {FORMAT_VERSION})")]
    BadVersion { found: u32 },
    #[error("{what}: malformed ({detail})")]
    Malformed {
        what: &'static str,
        detail: &'static str,
    },
}

/// A little-endian cursor that refuses to read past the end of its slice.
pub(crate) struct Cursor<'a> {
    pub buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Cursor<'a> {
        Cursor { buf, what }
    }

    pub fn take(&mut self, n: usize, detail: &'static str) -> Result<&'a [u8], TableError> {
        if self.buf.len() < n {
            return Err(TableError::Malformed {
                what: self.what,
                detail,
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub fn u8(&mut self, detail: &'static str) -> Result<u8, TableError> {
        Ok(self.take(1, detail)?[0])
    }

    pub fn u16(&mut self, detail: &'static str) -> Result<u16, TableError> {
        let b = self.take(2, detail)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self, detail: &'static str) -> Result<u32, TableError> {
        let b = self.take(4, detail)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&mut self, detail: &'static str) -> Result<u64, TableError> {
        let b = self.take(8, detail)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// Splits `bytes` into body and checked trailing crc32c.
pub(crate) fn checked_body<'a>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<&'a [u8], TableError> {
    if bytes.len() < 4 {
        return Err(TableError::TooShort {
            what,
            len: bytes.len(),
        });
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(TableError::Checksum {
            what,
            stored,
            computed,
        });
    }
    Ok(body)
}

/// Appends the crc32c of `out[start..]` to `out`.
pub(crate) fn seal(out: &mut Vec<u8>, start: usize) {
    let crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Where a block lives in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHandle {
    pub offset: u64,
    pub len: u32,
}

/// The footer: where the metadata blocks are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub index: BlockHandle,
    pub bloom: BlockHandle,
    pub props: BlockHandle,
}

impl Footer {
    pub fn encode(&self) -> [u8; FOOTER_BYTES] {
        let mut out = Vec::with_capacity(FOOTER_BYTES);
        for handle in [self.index, self.bloom, self.props] {
            out.extend_from_slice(&handle.offset.to_le_bytes());
            out.extend_from_slice(&handle.len.to_le_bytes());
        }
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&TABLE_MAGIC.to_le_bytes());
        seal(&mut out, 0);
        let mut fixed = [0u8; FOOTER_BYTES];
        fixed.copy_from_slice(&out);
        fixed
    }

    /// Decodes and checks a footer; `file_len` bounds the handles.
    pub fn decode(bytes: &[u8], file_len: u64) -> Result<Footer, TableError> {
        if bytes.len() != FOOTER_BYTES {
            return Err(TableError::TooShort {
                what: "footer",
                len: bytes.len(),
            });
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&bytes[40..48]);
        let magic = u64::from_le_bytes(magic);
        if magic != TABLE_MAGIC {
            return Err(TableError::BadMagic { found: magic });
        }
        let body = checked_body(bytes, "footer")?;
        let mut c = Cursor::new(body, "footer");
        let handle = |c: &mut Cursor| -> Result<BlockHandle, TableError> {
            let offset = c.u64("offset")?;
            let len = c.u32("length")?;
            let end = offset.checked_add(len as u64);
            if end.is_none_or(|end| end > file_len.saturating_sub(FOOTER_BYTES as u64)) {
                return Err(TableError::Malformed {
                    what: "footer",
                    detail: "block handle points outside the file",
                });
            }
            Ok(BlockHandle { offset, len })
        };
        let index = handle(&mut c)?;
        let bloom = handle(&mut c)?;
        let props = handle(&mut c)?;
        let version = c.u32("version")?;
        if version != FORMAT_VERSION {
            return Err(TableError::BadVersion { found: version });
        }
        Ok(Footer {
            index,
            bloom,
            props,
        })
    }
}

/// What a table holds, for the compaction policy and stats. Written in the props block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableProps {
    pub puts: u64,
    pub tombstones: u64,
    pub key_bytes: u64,
    pub value_bytes: u64,
    /// Value bytes of puts that carry a TTL.
    pub ttl_value_bytes: u64,
    /// Earliest and latest expiry among puts with a TTL (`u64::MAX`/0 when none).
    pub expires_min_ms: u64,
    pub expires_max_ms: u64,
    pub data_blocks: u32,
    pub min_key: Vec<u8>,
    pub max_key: Vec<u8>,
}

impl TableProps {
    pub fn entries(&self) -> u64 {
        self.puts + self.tombstones
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        for v in [
            self.puts,
            self.tombstones,
            self.key_bytes,
            self.value_bytes,
            self.ttl_value_bytes,
            self.expires_min_ms,
            self.expires_max_ms,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.data_blocks.to_le_bytes());
        for key in [&self.min_key, &self.max_key] {
            out.extend_from_slice(&(key.len() as u16).to_le_bytes());
            out.extend_from_slice(key);
        }
        seal(out, start);
    }

    pub fn decode(bytes: &[u8]) -> Result<TableProps, TableError> {
        let body = checked_body(bytes, "props block")?;
        let mut c = Cursor::new(body, "props block");
        let mut props = TableProps {
            puts: c.u64("puts")?,
            tombstones: c.u64("tombstones")?,
            key_bytes: c.u64("key bytes")?,
            value_bytes: c.u64("value bytes")?,
            ttl_value_bytes: c.u64("ttl bytes")?,
            expires_min_ms: c.u64("expires min")?,
            expires_max_ms: c.u64("expires max")?,
            data_blocks: c.u32("data blocks")?,
            ..TableProps::default()
        };
        let len = c.u16("min key length")? as usize;
        props.min_key = c.take(len, "min key")?.to_vec();
        let len = c.u16("max key length")? as usize;
        props.max_key = c.take(len, "max key")?.to_vec();
        if !c.buf.is_empty() {
            return Err(TableError::Malformed {
                what: "props block",
                detail: "trailing bytes",
            });
        }
        if props.entries() > 0 && props.min_key > props.max_key {
            return Err(TableError::Malformed {
                what: "props block",
                detail: "min key above max key",
            });
        }
        Ok(props)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footer_round_trips_and_refuses_damage() {
        let footer = Footer {
            index: BlockHandle {
                offset: 1000,
                len: 50,
            },
            bloom: BlockHandle {
                offset: 1050,
                len: 20,
            },
            props: BlockHandle {
                offset: 1070,
                len: 90,
            },
        };
        let bytes = footer.encode();
        assert_eq!(Footer::decode(&bytes, 1160 + 52), Ok(footer));
        assert!(Footer::decode(&bytes, 1100).is_err(), "handle past the end");
        for i in 0..FOOTER_BYTES {
            let mut bad = bytes;
            bad[i] ^= 0x10;
            assert!(Footer::decode(&bad, 1160 + 52).is_err(), "flip at {i}");
        }
        assert!(matches!(
            Footer::decode(&[0u8; FOOTER_BYTES], 10_000),
            Err(TableError::BadMagic { .. })
        ));
    }

    #[test]
    fn props_round_trip_and_refuse_damage() {
        let props = TableProps {
            puts: 3,
            tombstones: 1,
            key_bytes: 96,
            value_bytes: 300,
            ttl_value_bytes: 100,
            expires_min_ms: 5,
            expires_max_ms: 9,
            data_blocks: 2,
            min_key: vec![1, 2],
            max_key: vec![3],
        };
        let mut out = Vec::new();
        props.encode(&mut out);
        assert_eq!(TableProps::decode(&out), Ok(props));
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 1;
            assert!(TableProps::decode(&bad).is_err(), "flip at {i}");
        }
        assert!(TableProps::decode(&out[..out.len() - 1]).is_err());
    }

    #[test]
    fn table_names_round_trip() {
        assert_eq!(parse_table_name(&table_name(42)), Some(42));
        assert_eq!(parse_table_name("tbl-42.sst"), None);
        assert_eq!(parse_table_name("wal-00000000000000000042.log"), None);
    }
}
