//! Builds a table's bytes from entries in key order. Pure: the caller drains
//! [`TableBuilder::take_output`] into a file as it grows, so a table of any size is built in
//! bounded memory (one block plus the index and bloom hashes).
//!
//! Called by the engine's flush (from a frozen memtable) and by compaction (from a merge).

use super::block::{encode_index_entry, seal_index, BlockBuilder, EntryRef};
use super::bloom::{key_hash, Bloom};
use super::{BlockHandle, Footer, TableProps, FOOTER_BYTES};
use crate::key::Key;

/// Misuse of the builder (a bug in the caller, reported instead of writing a bad table).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    #[error("keys must be added in strictly increasing order")]
    OutOfOrder,
    #[error("key of {len} bytes is too long for a table")]
    KeyTooLong { len: usize },
    #[error("value of {len} bytes is too long for a table")]
    ValueTooLong { len: usize },
}

pub struct TableBuilder {
    block_bytes: usize,
    bloom_bits_per_key: usize,
    /// Bytes ready for the file, not yet taken.
    out: Vec<u8>,
    /// Bytes already taken by the caller.
    taken: u64,
    block: BlockBuilder,
    index: Vec<u8>,
    index_count: u32,
    hashes: Vec<u64>,
    props: TableProps,
    last_key: Option<Key>,
}

impl TableBuilder {
    /// `block_bytes` is the target size of a data block (one entry larger than it gets a block of
    /// its own); `bloom_bits_per_key` sizes the filter.
    pub fn new(block_bytes: usize, bloom_bits_per_key: usize) -> TableBuilder {
        TableBuilder {
            block_bytes: block_bytes.max(256),
            bloom_bits_per_key,
            out: Vec::new(),
            taken: 0,
            block: BlockBuilder::new(),
            index: Vec::new(),
            index_count: 0,
            hashes: Vec::new(),
            props: TableProps {
                expires_min_ms: u64::MAX,
                ..TableProps::default()
            },
            last_key: None,
        }
    }

    /// Adds the next entry. `expires_at_ms` is the put's expiry, if it has one (feeds the TTL
    /// statistics the compaction policy reads).
    pub fn add(
        &mut self,
        key: &[u8],
        entry: EntryRef<'_>,
        expires_at_ms: Option<u64>,
    ) -> Result<(), BuildError> {
        if key.len() > u16::MAX as usize {
            return Err(BuildError::KeyTooLong { len: key.len() });
        }
        if let EntryRef::Put(value) = entry {
            if value.len() > (u32::MAX as usize) / 2 {
                return Err(BuildError::ValueTooLong { len: value.len() });
            }
        }
        if self
            .last_key
            .as_ref()
            .is_some_and(|last| last.as_slice() >= key)
        {
            return Err(BuildError::OutOfOrder);
        }
        let entry_len = super::block::ENTRY_HEADER_BYTES
            + key.len()
            + match entry {
                EntryRef::Put(v) => v.len(),
                EntryRef::Tombstone => 0,
            };
        if !self.block.is_empty() && self.block.sealed_len() + entry_len > self.block_bytes {
            self.finish_block();
        }
        self.block.add(key, entry);
        self.hashes.push(key_hash(key));
        if self.props.entries() == 0 {
            self.props.min_key = key.to_vec();
        }
        self.props.key_bytes += key.len() as u64;
        match entry {
            EntryRef::Put(value) => {
                self.props.puts += 1;
                self.props.value_bytes += value.len() as u64;
                if let Some(at) = expires_at_ms {
                    self.props.ttl_value_bytes += value.len() as u64;
                    self.props.expires_min_ms = self.props.expires_min_ms.min(at);
                    self.props.expires_max_ms = self.props.expires_max_ms.max(at);
                }
            }
            EntryRef::Tombstone => self.props.tombstones += 1,
        }
        self.last_key = Some(Key::from_slice(key));
        Ok(())
    }

    fn finish_block(&mut self) {
        if self.block.is_empty() {
            return;
        }
        let offset = self.taken + self.out.len() as u64;
        self.block.finish_into(&mut self.out);
        let len = (self.taken + self.out.len() as u64 - offset) as u32;
        let last_key = self.last_key.as_deref().unwrap_or(&[]);
        encode_index_entry(&mut self.index, last_key, BlockHandle { offset, len });
        self.index_count += 1;
        self.props.data_blocks += 1;
    }

    /// Entries added so far.
    pub fn entries(&self) -> u64 {
        self.props.entries()
    }

    /// Bytes ready to be taken.
    pub fn output_len(&self) -> usize {
        self.out.len()
    }

    /// Takes the bytes produced so far (whole blocks); write them to the file in order.
    pub fn take_output(&mut self) -> Vec<u8> {
        self.taken += self.out.len() as u64;
        std::mem::take(&mut self.out)
    }

    /// Seals the table: the last block, index, bloom filter, props and footer. Returns the
    /// remaining bytes to write, the props, and the total file length.
    pub fn finish(mut self) -> (Vec<u8>, TableProps, u64) {
        self.finish_block();
        if let Some(last) = &self.last_key {
            self.props.max_key = last.to_vec();
        }
        if self.props.ttl_value_bytes == 0 {
            self.props.expires_min_ms = u64::MAX;
            self.props.expires_max_ms = 0;
        }
        let pos = |b: &TableBuilder| b.taken + b.out.len() as u64;

        let index_off = pos(&self);
        let start = self.out.len();
        self.out.extend_from_slice(&self.index);
        seal_index(&mut self.out, start, self.index_count);
        let index = BlockHandle {
            offset: index_off,
            len: (pos(&self) - index_off) as u32,
        };

        let bloom_off = pos(&self);
        Bloom::build(&self.hashes, self.bloom_bits_per_key).encode(&mut self.out);
        let bloom = BlockHandle {
            offset: bloom_off,
            len: (pos(&self) - bloom_off) as u32,
        };

        let props_off = pos(&self);
        self.props.encode(&mut self.out);
        let props = BlockHandle {
            offset: props_off,
            len: (pos(&self) - props_off) as u32,
        };

        self.out.extend_from_slice(
            &Footer {
                index,
                bloom,
                props,
            }
            .encode(),
        );
        let total = pos(&self);
        debug_assert!(total >= FOOTER_BYTES as u64);
        (self.out, self.props, total)
    }
}
