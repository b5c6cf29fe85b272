//! Writes a table file: a [`TableBuilder`] drained into a [`DmaWriter`] as it grows, so a table
//! of any size is written in bounded memory with aligned DMA writes.
//!
//! The file is durable (fdatasync) when [`TableWriter::finish`] returns, but it is not part of
//! the store until the manifest lists it: a crash before that leaves an orphan that recovery
//! removes. Called by the engine's flush and compaction; never by a read path.

use std::path::Path;

use super::block::EntryRef;
use super::builder::TableBuilder;
use super::TableProps;
use crate::storage::corrupt;
use crate::storage::io::DmaWriter;
use crate::storage::StoreError;

/// Bytes of builder output gathered before a DMA write.
const WRITE_CHUNK_BYTES: usize = 256 * 1024;

pub struct TableWriter {
    builder: TableBuilder,
    out: DmaWriter,
}

impl TableWriter {
    pub async fn create(
        path: &Path,
        block_bytes: usize,
        bloom_bits_per_key: usize,
    ) -> Result<TableWriter, StoreError> {
        Ok(TableWriter {
            builder: TableBuilder::new(block_bytes, bloom_bits_per_key),
            out: DmaWriter::create(path, WRITE_CHUNK_BYTES).await?,
        })
    }

    /// Adds the next entry (keys strictly increasing).
    pub async fn add(
        &mut self,
        key: &[u8],
        entry: EntryRef<'_>,
        expires_at_ms: Option<u64>,
    ) -> Result<(), StoreError> {
        self.builder
            .add(key, entry, expires_at_ms)
            .map_err(|e| corrupt(self.out.path(), format!("building table: {e}")))?;
        if self.builder.output_len() >= WRITE_CHUNK_BYTES {
            let bytes = self.builder.take_output();
            self.out.append(&bytes).await?;
        }
        Ok(())
    }

    pub fn entries(&self) -> u64 {
        self.builder.entries()
    }

    /// Seals and syncs the file. Returns its props and length.
    pub async fn finish(self) -> Result<(TableProps, u64), StoreError> {
        let TableWriter { builder, mut out } = self;
        let path = out.path().to_path_buf();
        let (tail, props, total) = builder.finish();
        out.append(&tail).await?;
        let len = out.finish().await?;
        if len != total {
            return Err(corrupt(
                &path,
                format!("wrote {len} bytes, builder expected {total}"),
            ));
        }
        Ok((props, len))
    }

    /// Drops a half-written table.
    pub async fn abandon(self) {
        self.out.abandon().await;
    }
}
