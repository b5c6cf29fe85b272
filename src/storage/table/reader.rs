//! Reading tables: metadata decoding (pure) and the DMA shell ([`Table`], [`TableCursor`]).
//!
//! A table is opened by reading its footer and metadata blocks (index, bloom, props), all
//! checksummed; a failure there is a `StoreError::Corrupt` naming the file and the table is
//! refused. A data block is checked every time it is read: one whose checksum or decode fails
//! (or an event value that is not a valid `StoredMessage` archive) is *skipped* by gets and
//! cursors, never served: the table remembers it ([`Table::unreadable`], logged once per table
//! and block), its keys are counted (the block's entry count when its trailer is still
//! plausible, else 1), and reads go on past it, so one rotten block does not stall the keys
//! after it. [`Table::verify`] and [`check_table_bytes`] (`pinq doctor`) report such blocks
//! instead. An I/O error reading a block stays an error.
//!
//! A `Table` is immutable and shared (`Rc`) by the engine's current version, by scans in flight
//! and by compaction; when compaction replaces it, the engine removes the file once the last
//! reader has dropped it. Called by the engine, recovery and compaction.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use glommio::io::DmaFile;

use super::block::{
    decode_index, seek_block, Block, EntryRef, IndexEntry, BLOCK_TRAILER_BYTES, ENTRY_HEADER_BYTES,
};
use super::bloom::Bloom;
use super::{Footer, TableError, TableProps, FOOTER_BYTES};
use crate::key::{EventKey, Key};
use crate::message::Value;
use crate::storage::corrupt;
use crate::storage::io as dio;
use crate::storage::memtable::Entry;
use crate::storage::StoreError;

/// A table's decoded metadata.
#[derive(Debug, Clone)]
pub struct TableMeta {
    pub footer: Footer,
    pub index: Vec<IndexEntry>,
    pub bloom: Bloom,
    pub props: TableProps,
}

impl TableMeta {
    /// Decodes the metadata from the bytes after the last data block (`tail` starts at the index
    /// block's offset and runs to the end of the file).
    pub fn decode(file_len: u64, tail: &[u8], tail_offset: u64) -> Result<TableMeta, TableError> {
        if tail.len() < FOOTER_BYTES {
            return Err(TableError::TooShort {
                what: "table",
                len: tail.len(),
            });
        }
        let footer = Footer::decode(&tail[tail.len() - FOOTER_BYTES..], file_len)?;
        let slice = |h: super::BlockHandle| -> Result<&[u8], TableError> {
            let start = h
                .offset
                .checked_sub(tail_offset)
                .ok_or(TableError::Malformed {
                    what: "footer",
                    detail: "metadata block before the metadata region",
                })? as usize;
            tail.get(start..start + h.len as usize)
                .ok_or(TableError::Malformed {
                    what: "footer",
                    detail: "metadata block outside the file",
                })
        };
        let index = decode_index(slice(footer.index)?, footer.index.offset)?;
        let bloom = Bloom::decode(slice(footer.bloom)?)?;
        let props = TableProps::decode(slice(footer.props)?)?;
        if props.data_blocks as usize != index.len() {
            return Err(TableError::Malformed {
                what: "props block",
                detail: "block count disagrees with the index",
            });
        }
        Ok(TableMeta {
            footer,
            index,
            bloom,
            props,
        })
    }
}

/// Decodes the footer and metadata of a whole table held in memory. Pure.
fn decode_meta_bytes(bytes: &[u8]) -> Result<TableMeta, TableError> {
    if bytes.len() < FOOTER_BYTES {
        return Err(TableError::TooShort {
            what: "table",
            len: bytes.len(),
        });
    }
    let footer = Footer::decode(&bytes[bytes.len() - FOOTER_BYTES..], bytes.len() as u64)?;
    let tail_offset = footer.index.offset;
    let meta = TableMeta::decode(
        bytes.len() as u64,
        &bytes[tail_offset as usize..],
        tail_offset,
    )?;
    Ok(meta)
}

/// Decodes a whole table held in memory: metadata and every data block. Used by tests, tools and
/// the fuzz harness; the engine reads block by block instead.
pub fn decode_table_bytes(bytes: &[u8]) -> Result<(TableMeta, Vec<Block>), TableError> {
    let meta = decode_meta_bytes(bytes)?;
    let mut blocks = Vec::with_capacity(meta.index.len());
    let mut prev_last: Option<&[u8]> = None;
    for entry in &meta.index {
        let start = entry.handle.offset as usize;
        let block = Block::decode(bytes[start..start + entry.handle.len as usize].to_vec())?;
        check_block_against_index(&block, entry, prev_last)?;
        prev_last = Some(entry.last_key.as_slice());
        blocks.push(block);
    }
    Ok((meta, blocks))
}

/// What [`check_table_bytes`] found in one table file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableCheck {
    pub blocks: usize,
    pub entries: u64,
    /// Data blocks that fail their checksum or decode: (block number, why).
    pub unreadable: Vec<(usize, String)>,
}

/// Checks a whole table held in memory block by block, for `pinq doctor`: metadata damage is an
/// error (the broker refuses such a table at start-up), data-block damage is listed (the broker
/// skips those blocks). Pure.
pub fn check_table_bytes(bytes: &[u8]) -> Result<TableCheck, TableError> {
    let meta = decode_meta_bytes(bytes)?;
    let mut unreadable = Vec::new();
    for (i, entry) in meta.index.iter().enumerate() {
        let start = entry.handle.offset as usize;
        let raw = &bytes[start..start + entry.handle.len as usize];
        let prev = i.checked_sub(1).map(|p| meta.index[p].last_key.as_slice());
        let checked = Block::decode(raw.to_vec())
            .and_then(|block| check_block_against_index(&block, entry, prev).map(|()| block));
        match checked {
            Ok(block) => {
                for j in 0..block.len() {
                    if let Err(e) = check_value(block.key(j), block.entry(j)) {
                        unreadable.push((i, format!("entry {j}: {e}")));
                        break;
                    }
                }
            }
            Err(e) => unreadable.push((i, e.to_string())),
        }
    }
    Ok(TableCheck {
        blocks: meta.index.len(),
        entries: meta.props.entries(),
        unreadable,
    })
}

/// An event key's value must be a valid stored-message archive (it came from disk).
fn check_value(key: &[u8], entry: EntryRef<'_>) -> Result<(), String> {
    match entry {
        EntryRef::Put(bytes) if EventKey::parse(key).is_ok() => Value::copy_from_slice(bytes)
            .message()
            .map(|_| ())
            .map_err(|e| e.to_string()),
        _ => Ok(()),
    }
}

/// How many keys a block that failed to decode held, as far as its trailer tells: its entry
/// count when that is plausible for the block's size, else 1. Pure.
fn keys_in_damaged_block(raw: &[u8]) -> u64 {
    let Some(at) = raw.len().checked_sub(BLOCK_TRAILER_BYTES) else {
        return 1;
    };
    let count = u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]) as usize;
    if count == 0 || count > at / ENTRY_HEADER_BYTES {
        return 1;
    }
    count as u64
}

/// The blocks of one table found unreadable, each counted once.
#[derive(Debug, Default)]
struct Damage {
    /// Whole blocks that fail their checksum or decode → keys they held.
    blocks: BTreeMap<usize, u64>,
    /// Single entries of readable blocks whose value is not a valid archive: (block, entry).
    entries: BTreeSet<(usize, usize)>,
}

/// A table's unreadable blocks so far (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unreadable {
    /// Distinct blocks (whole or with a bad entry).
    pub blocks: u64,
    /// Keys skipped in them.
    pub values: u64,
}

impl std::ops::AddAssign for Unreadable {
    fn add_assign(&mut self, other: Unreadable) {
        self.blocks += other.blocks;
        self.values += other.values;
    }
}

/// A block's keys must lie in `(previous block's last key, its own last key]` and end exactly at
/// its index key: a valid checksum on a block from the wrong place is still corruption.
fn check_block_against_index(
    block: &Block,
    entry: &IndexEntry,
    prev_last: Option<&[u8]>,
) -> Result<(), TableError> {
    let bad = |detail| {
        Err(TableError::Malformed {
            what: "data block",
            detail,
        })
    };
    if block.is_empty() {
        return bad("empty block");
    }
    if block.key(block.len() - 1) != entry.last_key.as_slice() {
        return bad("last key disagrees with the index");
    }
    if prev_last.is_some_and(|p| block.key(0) <= p) {
        return bad("first key not after the previous block");
    }
    Ok(())
}

/// An open table.
pub struct Table {
    id: u64,
    path: PathBuf,
    file: DmaFile,
    file_len: u64,
    meta: TableMeta,
    /// The last block read: scans page through the same block many times.
    cache: RefCell<Option<(usize, Rc<Block>)>>,
    /// Blocks found unreadable: skipped by reads without reading them again.
    damage: RefCell<Damage>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("id", &self.id)
            .field("path", &self.path)
            .field("file_len", &self.file_len)
            .field("props", &self.meta.props)
            .finish()
    }
}

impl Table {
    /// Opens and checks a table's metadata.
    pub async fn open(path: &Path, id: u64) -> Result<Table, StoreError> {
        let file = dio::open_read(path).await?;
        let file_len = dio::file_size(&file, path).await?;
        if file_len < FOOTER_BYTES as u64 {
            return Err(corrupt(
                path,
                format!("table of {file_len} bytes has no footer"),
            ));
        }
        let footer_bytes =
            dio::read_exact_at(&file, path, file_len - FOOTER_BYTES as u64, FOOTER_BYTES).await?;
        let footer =
            Footer::decode(&footer_bytes, file_len).map_err(|e| corrupt(path, e.to_string()))?;
        let tail_offset = footer.index.offset;
        let tail =
            dio::read_exact_at(&file, path, tail_offset, (file_len - tail_offset) as usize).await?;
        let meta = TableMeta::decode(file_len, &tail, tail_offset)
            .map_err(|e| corrupt(path, e.to_string()))?;
        Ok(Table {
            id,
            path: path.to_path_buf(),
            file,
            file_len,
            meta,
            cache: RefCell::new(None),
            damage: RefCell::new(Damage::default()),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    pub fn props(&self) -> &TableProps {
        &self.meta.props
    }

    pub fn blocks(&self) -> usize {
        self.meta.index.len()
    }

    /// False when the table certainly does not hold `key` (range check, then bloom filter).
    pub fn may_contain(&self, key: &[u8]) -> bool {
        let props = &self.meta.props;
        props.entries() > 0
            && key >= props.min_key.as_slice()
            && key <= props.max_key.as_slice()
            && self.meta.bloom.may_contain(key)
    }

    /// Reads and checks data block `i`; a damaged block is an error (see [`Table::try_block`]).
    pub async fn block(&self, i: usize) -> Result<Rc<Block>, StoreError> {
        match self.read_block(i).await? {
            Ok(block) => Ok(block),
            Err((_, e)) => Err(corrupt(&self.path, format!("block {i}: {e}"))),
        }
    }

    /// Data block `i`, or `None` when it is unreadable (checksum or decode failure): then it is
    /// remembered, logged once and its keys counted, and later calls skip it without I/O.
    pub async fn try_block(&self, i: usize) -> Result<Option<Rc<Block>>, StoreError> {
        if self.damage.borrow().blocks.contains_key(&i) {
            return Ok(None);
        }
        match self.read_block(i).await? {
            Ok(block) => Ok(Some(block)),
            Err((keys, e)) => {
                let first = self.damage.borrow_mut().blocks.insert(i, keys).is_none();
                if first {
                    tracing::error!(
                        file = %self.path.display(),
                        block = i,
                        keys,
                        "unreadable table block skipped: {e} (its messages are lost; see pinq doctor --data-dir)"
                    );
                }
                Ok(None)
            }
        }
    }

    /// Reads block `i`: the checked block, or (keys it seems to hold, why) when it is damaged.
    async fn read_block(
        &self,
        i: usize,
    ) -> Result<Result<Rc<Block>, (u64, TableError)>, StoreError> {
        if let Some((cached, block)) = self.cache.borrow().as_ref() {
            if *cached == i {
                return Ok(Ok(Rc::clone(block)));
            }
        }
        let Some(entry) = self.meta.index.get(i) else {
            return Err(corrupt(
                &self.path,
                format!("block {i} is not in the index"),
            ));
        };
        let bytes = dio::read_exact_at(
            &self.file,
            &self.path,
            entry.handle.offset,
            entry.handle.len as usize,
        )
        .await?;
        let prev = i
            .checked_sub(1)
            .map(|p| self.meta.index[p].last_key.as_slice());
        let checked = Block::decode(bytes.to_vec())
            .and_then(|block| check_block_against_index(&block, entry, prev).map(|()| block));
        let block = match checked {
            Ok(block) => Rc::new(block),
            Err(e) => return Ok(Err((keys_in_damaged_block(&bytes), e))),
        };
        *self.cache.borrow_mut() = Some((i, Rc::clone(&block)));
        Ok(Ok(block))
    }

    /// The unreadable blocks found so far, and the keys skipped in them.
    pub fn unreadable(&self) -> Unreadable {
        let damage = self.damage.borrow();
        let mut blocks: BTreeSet<usize> = damage.blocks.keys().copied().collect();
        blocks.extend(damage.entries.iter().map(|(b, _)| *b));
        Unreadable {
            blocks: blocks.len() as u64,
            values: damage.blocks.values().sum::<u64>() + damage.entries.len() as u64,
        }
    }

    /// Entry `j` of block `i` as an owned entry, or `None` when its value is not a valid archive
    /// (remembered and logged once per block, like a damaged block).
    fn readable_entry(&self, i: usize, block: &Block, j: usize) -> Option<Entry> {
        match self.materialize(block.key(j), block.entry(j)) {
            Ok(entry) => Some(entry),
            Err(e) => {
                let mut damage = self.damage.borrow_mut();
                let first_in_block = damage.entries.range((i, 0)..(i + 1, 0)).next().is_none();
                damage.entries.insert((i, j));
                drop(damage);
                if first_in_block {
                    tracing::error!(
                        file = %self.path.display(),
                        block = i,
                        "unreadable value skipped: {e} (the message is lost; see pinq doctor --data-dir)"
                    );
                }
                None
            }
        }
    }

    /// Turns a stored entry into an owned one, validating event values.
    pub fn materialize(&self, key: &[u8], entry: EntryRef<'_>) -> Result<Entry, StoreError> {
        match entry {
            EntryRef::Tombstone => Ok(Entry::Tombstone),
            EntryRef::Put(bytes) => {
                let value = Value::copy_from_slice(bytes);
                if EventKey::parse(key).is_ok() {
                    value.message().map_err(|e| {
                        corrupt(&self.path, format!("value of event key {key:02x?}: {e}"))
                    })?;
                }
                Ok(Entry::Put(value))
            }
        }
    }

    /// The entry stored for `key`, if any.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Entry>, StoreError> {
        if !self.may_contain(key) {
            return Ok(None);
        }
        let i = seek_block(&self.meta.index, key);
        if i >= self.meta.index.len() {
            return Ok(None);
        }
        let Some(block) = self.try_block(i).await? else {
            return Ok(None);
        };
        let j = block.seek(key);
        if j < block.len() && block.key(j) == key {
            return Ok(self.readable_entry(i, &block, j));
        }
        Ok(None)
    }

    /// Reads and checks every block (recovery's optional deep check).
    pub async fn verify(&self) -> Result<(), StoreError> {
        for i in 0..self.blocks() {
            let block = self.block(i).await?;
            for j in 0..block.len() {
                self.materialize(block.key(j), block.entry(j))?;
            }
            glommio::yield_if_needed().await;
        }
        Ok(())
    }

    /// Closes the file.
    pub async fn close(self) -> Result<(), StoreError> {
        dio::close(self.file, &self.path).await
    }
}

/// Walks a table's entries in `[start, end)` in key order.
pub struct TableCursor {
    table: Rc<Table>,
    start: Key,
    end: Option<Key>,
    block_idx: usize,
    block: Option<Rc<Block>>,
    pos: usize,
    positioned: bool,
    done: bool,
}

impl TableCursor {
    pub fn new(table: Rc<Table>, start: &[u8], end: Option<&[u8]>) -> TableCursor {
        let done = table.props().entries() == 0
            || end.is_some_and(|e| e <= table.props().min_key.as_slice())
            || start > table.props().max_key.as_slice();
        TableCursor {
            table,
            start: Key::from_slice(start),
            end: end.map(Key::from_slice),
            block_idx: 0,
            block: None,
            pos: 0,
            positioned: false,
            done,
        }
    }

    /// The next entry, or `None` past the end of the range. Unreadable blocks and values are
    /// skipped (see [`Table::try_block`]): every key of the block after a skipped one is above
    /// the skipped block's keys, so the walk resumes at its first.
    pub async fn next(&mut self) -> Result<Option<(Key, Entry)>, StoreError> {
        if self.done {
            return Ok(None);
        }
        if !self.positioned {
            self.positioned = true;
            self.block_idx = seek_block(&self.table.meta.index, &self.start);
            if self.block_idx < self.table.blocks() {
                self.block = self.table.try_block(self.block_idx).await?;
                self.pos = self.block.as_ref().map_or(0, |b| b.seek(&self.start));
            }
        }
        loop {
            if let Some(block) = self.block.as_ref() {
                if self.pos < block.len() {
                    let j = self.pos;
                    let key = block.key(j);
                    if self.end.as_ref().is_some_and(|end| key >= end.as_slice()) {
                        self.done = true;
                        self.block = None;
                        return Ok(None);
                    }
                    self.pos += 1;
                    if let Some(entry) = self.table.readable_entry(self.block_idx, block, j) {
                        return Ok(Some((Key::from_slice(key), entry)));
                    }
                    continue;
                }
            }
            // This block is done (or was unreadable): the next one.
            self.block_idx += 1;
            self.pos = 0;
            if self.block_idx >= self.table.blocks() {
                self.done = true;
                self.block = None;
                return Ok(None);
            }
            self.block = self.table.try_block(self.block_idx).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::builder::TableBuilder;
    use super::*;

    fn build(n: u64, block_bytes: usize) -> Vec<u8> {
        let mut b = TableBuilder::new(block_bytes, 10);
        let mut bytes = Vec::new();
        for i in 0..n {
            let key = (i * 2).to_be_bytes();
            if i % 5 == 0 {
                b.add(&key, EntryRef::Tombstone, None).unwrap();
            } else {
                b.add(&key, EntryRef::Put(&[i as u8; 40]), Some(1000 + i))
                    .unwrap();
            }
            if b.output_len() > 1000 {
                bytes.extend(b.take_output());
            }
        }
        let (tail, props, total) = b.finish();
        bytes.extend(tail);
        assert_eq!(bytes.len() as u64, total);
        assert_eq!(props.entries(), n);
        bytes
    }

    #[test]
    fn table_bytes_round_trip() {
        let bytes = build(500, 512);
        let (meta, blocks) = decode_table_bytes(&bytes).unwrap();
        assert!(blocks.len() > 10);
        assert_eq!(meta.props.tombstones, 100);
        assert_eq!(meta.props.puts, 400);
        assert_eq!(meta.props.expires_min_ms, 1001);
        assert_eq!(meta.props.expires_max_ms, 1499);
        let keys: Vec<u64> = blocks
            .iter()
            .flat_map(|b| {
                (0..b.len()).map(move |i| u64::from_be_bytes(b.key(i).try_into().unwrap()))
            })
            .collect();
        assert_eq!(keys, (0..500).map(|i| i * 2).collect::<Vec<_>>());
        assert!(meta.bloom.may_contain(&8u64.to_be_bytes()));
    }

    #[test]
    fn empty_table_round_trips() {
        let (tail, props, _) = TableBuilder::new(4096, 10).finish();
        assert_eq!(props.entries(), 0);
        let (meta, blocks) = decode_table_bytes(&tail).unwrap();
        assert!(blocks.is_empty());
        assert_eq!(meta.index.len(), 0);
    }

    #[test]
    fn every_flipped_byte_of_a_small_table_is_refused() {
        let bytes = build(40, 256);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x08;
            assert!(
                decode_table_bytes(&bad).is_err(),
                "flip at {i} of {}",
                bytes.len()
            );
        }
    }

    #[test]
    fn builder_refuses_out_of_order_keys() {
        let mut b = TableBuilder::new(4096, 10);
        b.add(b"b", EntryRef::Tombstone, None).unwrap();
        assert!(b.add(b"a", EntryRef::Tombstone, None).is_err());
        assert!(b.add(b"b", EntryRef::Tombstone, None).is_err());
    }
}
