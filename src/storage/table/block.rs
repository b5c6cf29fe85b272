//! Data and index block codecs. Pure: bytes in, bytes out, every input checked.
//!
//! ```text
//! data block  = entry* | entry_count u32 | crc32c u32
//! entry       = kind u8 (1 put, 2 tombstone) | key_len u16 | val_len u32 | key | value
//! index block = (key_len u16 | last key of the block | offset u64 | len u32)* | count u32 | crc32c u32
//! ```
//!
//! A decoded [`Block`] has been fully validated (checksum, bounds, strictly increasing keys), so
//! its accessors cannot fail or panic. Values are copied out by the reader into aligned
//! [`crate::message::Value`]s, which validate the rkyv archive on access.

use super::{checked_body, seal, BlockHandle, Cursor, TableError};
use crate::key::Key;

const KIND_PUT: u8 = 1;
const KIND_TOMBSTONE: u8 = 2;
/// Bytes before an entry's key.
pub const ENTRY_HEADER_BYTES: usize = 7;
/// Bytes after a block's entries.
pub const BLOCK_TRAILER_BYTES: usize = 8;

/// An entry as stored, borrowing its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryRef<'a> {
    Put(&'a [u8]),
    Tombstone,
}

/// Accumulates one data block.
#[derive(Debug, Default)]
pub struct BlockBuilder {
    buf: Vec<u8>,
    count: u32,
}

impl BlockBuilder {
    pub fn new() -> BlockBuilder {
        BlockBuilder::default()
    }

    /// Appends an entry; keys must arrive in strictly increasing order (the caller checks).
    pub fn add(&mut self, key: &[u8], entry: EntryRef<'_>) {
        let (kind, value): (u8, &[u8]) = match entry {
            EntryRef::Put(value) => (KIND_PUT, value),
            EntryRef::Tombstone => (KIND_TOMBSTONE, &[]),
        };
        self.buf.push(kind);
        self.buf
            .extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.buf
            .extend_from_slice(&(value.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(key);
        self.buf.extend_from_slice(value);
        self.count += 1;
    }

    /// Bytes the sealed block would take.
    pub fn sealed_len(&self) -> usize {
        self.buf.len() + BLOCK_TRAILER_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Seals the block (count and checksum) into `out` and resets the builder.
    pub fn finish_into(&mut self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&self.buf);
        out.extend_from_slice(&self.count.to_le_bytes());
        seal(out, start);
        self.buf.clear();
        self.count = 0;
    }
}

#[derive(Debug, Clone, Copy)]
struct EntryPos {
    key_off: u32,
    key_len: u16,
    tombstone: bool,
    val_off: u32,
    val_len: u32,
}

/// A validated data block.
#[derive(Debug)]
pub struct Block {
    bytes: Vec<u8>,
    entries: Vec<EntryPos>,
}

impl Block {
    /// Checks and indexes a sealed block.
    pub fn decode(bytes: Vec<u8>) -> Result<Block, TableError> {
        let body = checked_body(&bytes, "data block")?;
        if body.len() < 4 {
            return Err(TableError::TooShort {
                what: "data block",
                len: bytes.len(),
            });
        }
        let (entries_bytes, count) = body.split_at(body.len() - 4);
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
        if count > entries_bytes.len() / ENTRY_HEADER_BYTES {
            return Err(TableError::Malformed {
                what: "data block",
                detail: "entry count exceeds block size",
            });
        }
        let mut entries = Vec::with_capacity(count);
        let mut c = Cursor::new(entries_bytes, "data block");
        let mut prev: Option<&[u8]> = None;
        for _ in 0..count {
            let kind = c.u8("entry kind")?;
            let key_len = c.u16("key length")?;
            let val_len = c.u32("value length")?;
            let key_off = entries_bytes.len() - c.buf.len();
            let key = c.take(key_len as usize, "key bytes")?;
            let val_off = entries_bytes.len() - c.buf.len();
            c.take(val_len as usize, "value bytes")?;
            let tombstone = match kind {
                KIND_PUT => false,
                KIND_TOMBSTONE if val_len == 0 => true,
                _ => {
                    return Err(TableError::Malformed {
                        what: "data block",
                        detail: "bad entry kind",
                    })
                }
            };
            if prev.is_some_and(|p| p >= key) {
                return Err(TableError::Malformed {
                    what: "data block",
                    detail: "keys out of order",
                });
            }
            prev = Some(key);
            entries.push(EntryPos {
                key_off: key_off as u32,
                key_len,
                tombstone,
                val_off: val_off as u32,
                val_len,
            });
        }
        if !c.buf.is_empty() {
            return Err(TableError::Malformed {
                what: "data block",
                detail: "bytes after the last entry",
            });
        }
        Ok(Block { bytes, entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Key of entry `i` (`i < len()`).
    pub fn key(&self, i: usize) -> &[u8] {
        let e = self.entries[i];
        &self.bytes[e.key_off as usize..e.key_off as usize + e.key_len as usize]
    }

    /// Entry `i` (`i < len()`).
    pub fn entry(&self, i: usize) -> EntryRef<'_> {
        let e = self.entries[i];
        if e.tombstone {
            EntryRef::Tombstone
        } else {
            EntryRef::Put(&self.bytes[e.val_off as usize..e.val_off as usize + e.val_len as usize])
        }
    }

    /// Index of the first entry whose key is `>= key` (`len()` when none).
    pub fn seek(&self, key: &[u8]) -> usize {
        self.entries.partition_point(|e| {
            &self.bytes[e.key_off as usize..e.key_off as usize + e.key_len as usize] < key
        })
    }

    /// The entry stored for exactly `key`.
    pub fn find(&self, key: &[u8]) -> Option<EntryRef<'_>> {
        let i = self.seek(key);
        (i < self.len() && self.key(i) == key).then(|| self.entry(i))
    }
}

/// One index entry: the last key of a data block and where the block is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub last_key: Key,
    pub handle: BlockHandle,
}

/// Appends one index entry to an index block under construction.
pub fn encode_index_entry(out: &mut Vec<u8>, last_key: &[u8], handle: BlockHandle) {
    out.extend_from_slice(&(last_key.len() as u16).to_le_bytes());
    out.extend_from_slice(last_key);
    out.extend_from_slice(&handle.offset.to_le_bytes());
    out.extend_from_slice(&handle.len.to_le_bytes());
}

/// Seals an index block of `count` entries whose body starts at `start` in `out`.
pub fn seal_index(out: &mut Vec<u8>, start: usize, count: u32) {
    out.extend_from_slice(&count.to_le_bytes());
    seal(out, start);
}

/// Decodes and checks an index block: keys strictly increasing, blocks contiguous from offset 0
/// and ending at `data_end`.
pub fn decode_index(bytes: &[u8], data_end: u64) -> Result<Vec<IndexEntry>, TableError> {
    let body = checked_body(bytes, "index block")?;
    if body.len() < 4 {
        return Err(TableError::TooShort {
            what: "index block",
            len: bytes.len(),
        });
    }
    let (entries_bytes, count) = body.split_at(body.len() - 4);
    let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
    if count > entries_bytes.len() / 14 {
        return Err(TableError::Malformed {
            what: "index block",
            detail: "entry count exceeds block size",
        });
    }
    let mut c = Cursor::new(entries_bytes, "index block");
    let mut out: Vec<IndexEntry> = Vec::with_capacity(count);
    let mut expected_offset = 0u64;
    for _ in 0..count {
        let key_len = c.u16("key length")? as usize;
        let last_key = Key::from_slice(c.take(key_len, "key bytes")?);
        let offset = c.u64("block offset")?;
        let len = c.u32("block length")?;
        if offset != expected_offset || (len as usize) < BLOCK_TRAILER_BYTES {
            return Err(TableError::Malformed {
                what: "index block",
                detail: "blocks are not contiguous",
            });
        }
        expected_offset = offset + len as u64;
        if out.last().is_some_and(|p| p.last_key >= last_key) {
            return Err(TableError::Malformed {
                what: "index block",
                detail: "keys out of order",
            });
        }
        out.push(IndexEntry {
            last_key,
            handle: BlockHandle { offset, len },
        });
    }
    if !c.buf.is_empty() {
        return Err(TableError::Malformed {
            what: "index block",
            detail: "bytes after the last entry",
        });
    }
    if expected_offset != data_end {
        return Err(TableError::Malformed {
            what: "index block",
            detail: "blocks do not end where the index starts",
        });
    }
    Ok(out)
}

/// Index of the first block whose last key is `>= key` (`index.len()` when none).
pub fn seek_block(index: &[IndexEntry], key: &[u8]) -> usize {
    index.partition_point(|e| e.last_key.as_slice() < key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut b = BlockBuilder::new();
        b.add(b"a", EntryRef::Put(b"1"));
        b.add(b"b", EntryRef::Tombstone);
        b.add(b"c", EntryRef::Put(b""));
        b.add(&[0xFF; 24], EntryRef::Put(&[7; 300]));
        let mut out = Vec::new();
        let expected = b.sealed_len();
        b.finish_into(&mut out);
        assert_eq!(out.len(), expected);
        assert!(b.is_empty());
        out
    }

    #[test]
    fn block_round_trips_and_seeks() {
        let block = Block::decode(sample()).unwrap();
        assert_eq!(block.len(), 4);
        assert_eq!(block.key(0), b"a");
        assert_eq!(block.entry(0), EntryRef::Put(b"1"));
        assert_eq!(block.entry(1), EntryRef::Tombstone);
        assert_eq!(block.entry(2), EntryRef::Put(b""));
        assert_eq!(block.find(b"b"), Some(EntryRef::Tombstone));
        assert_eq!(block.find(b"bb"), None);
        assert_eq!(block.seek(b""), 0);
        assert_eq!(block.seek(b"bb"), 2);
        assert_eq!(block.seek(&[0xFF; 25]), 4);
    }

    #[test]
    fn every_flipped_byte_of_a_block_is_refused() {
        let bytes = sample();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(Block::decode(bad).is_err(), "flip at {i} accepted");
        }
        for cut in 0..bytes.len() {
            assert!(
                Block::decode(bytes[..cut].to_vec()).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_block_with_a_valid_checksum_but_unsorted_keys_is_refused() {
        let mut b = BlockBuilder::new();
        b.add(b"b", EntryRef::Put(b"1"));
        b.add(b"a", EntryRef::Put(b"1"));
        let mut out = Vec::new();
        b.finish_into(&mut out);
        assert!(matches!(
            Block::decode(out),
            Err(TableError::Malformed { .. })
        ));
    }

    #[test]
    fn index_round_trips_and_checks_contiguity() {
        let mut out = Vec::new();
        encode_index_entry(
            &mut out,
            b"k1",
            BlockHandle {
                offset: 0,
                len: 100,
            },
        );
        encode_index_entry(
            &mut out,
            b"k2",
            BlockHandle {
                offset: 100,
                len: 50,
            },
        );
        seal_index(&mut out, 0, 2);
        let index = decode_index(&out, 150).unwrap();
        assert_eq!(index.len(), 2);
        assert_eq!(seek_block(&index, b"k1"), 0);
        assert_eq!(seek_block(&index, b"k10"), 1);
        assert_eq!(seek_block(&index, b"k3"), 2);
        assert!(decode_index(&out, 151).is_err());
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 2;
            assert!(decode_index(&bad, 150).is_err(), "flip at {i}");
        }
    }
}
