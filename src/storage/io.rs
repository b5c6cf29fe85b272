//! The only place the storage engine touches glommio files: DMA open/read/write helpers, the
//! polled-I/O probe fix, and directory sync.
//!
//! Why DMA (O_DIRECT through io_uring): the WAL's group commit must control exactly when bytes
//! reach the device, and a shard must never stall on the page cache's writeback. The price is
//! alignment: every write here is a multiple of [`WRITE_ALIGN`] at an aligned offset, padded with
//! zeros, and files are truncated to their logical length when sealed.
//!
//! Two glommio traps are handled here (see `notes/dependencies.md`): the first DMA file an
//! executor opens on a disk decides whether reads go to the polling ring, and if that file is
//! new and empty the probe "succeeds" and every later read fails with EOPNOTSUPP — so
//! [`probe_disk`] opens an existing non-empty marker file first; and `DmaFile::create` opens
//! write-only, so [`open_rw`] is used instead.
//!
//! Every operation here asks the [`seam`] first what the disk does with it: nothing installed
//! (the server) means straight through to glommio; a test installs a simulated disk
//! ([`sim::FaultDisk`]) that fails or tears a seeded few. Nothing else in the engine or the
//! standalone log may touch a file, so every fault a test injects reaches them through here.
//!
//! Called by the WAL, table, manifest and recovery shells. Must never be used from a pure codec.

pub mod seam;
pub mod sim;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use glommio::io::{DmaBuffer, DmaFile, OpenOptions, ReadResult};

use self::seam::{Op, Outcome};
use super::{corrupt, io_error, MARKER_FILE};
use crate::storage::StoreError;

/// Alignment and padding unit of every DMA write: the device's physical block size here, so a
/// write never shares a physical block with bytes written (and acknowledged) earlier.
pub const WRITE_ALIGN: usize = 4096;

/// Bytes of the marker file; must be at least the device's logical block size for the probe.
const MARKER_BYTES: usize = 4096;

/// Rounds up to the next multiple of [`WRITE_ALIGN`].
pub fn align_up(n: usize) -> usize {
    n.div_ceil(WRITE_ALIGN) * WRITE_ALIGN
}

fn gerr(path: &Path, e: glommio::GlommioError<()>) -> StoreError {
    io_error(path, e.into())
}

/// Asks the installed disk about `op`: an error when it fails it. A torn outcome is a failure
/// for every operation but a write (see [`write_padded`]).
#[inline]
fn admit(op: Op<'_>) -> Result<(), StoreError> {
    match seam::decide(op) {
        Outcome::Proceed => Ok(()),
        Outcome::Fail(e) | Outcome::Torn { error: e, .. } => Err(io_error(op.path(), e)),
    }
}

/// Makes DMA reads work on this disk for the current executor (glommio issue #605).
///
/// Creates the marker file with std I/O if it is missing, then opens it with `DmaFile::open`
/// before any new DMA file is created, so glommio's polled-I/O probe reads real bytes and
/// correctly concludes the device cannot be polled. Call once per executor per data directory,
/// before anything else. The marker also tells a pinq data directory from an unrelated one.
pub async fn probe_disk(dir: &Path) -> Result<(), StoreError> {
    let marker = dir.join(MARKER_FILE);
    let needs_marker = match std::fs::metadata(&marker) {
        Ok(meta) => meta.len() < MARKER_BYTES as u64,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(io_error(&marker, e)),
    };
    admit(Op::Open {
        path: &marker,
        create: needs_marker,
    })?;
    if needs_marker {
        let mut body = b"pinq storage directory, format 1\n".to_vec();
        body.resize(MARKER_BYTES, b'\n');
        let mut file = std::fs::File::create(&marker).map_err(|e| io_error(&marker, e))?;
        file.write_all(&body).map_err(|e| io_error(&marker, e))?;
        file.sync_all().map_err(|e| io_error(&marker, e))?;
        sync_dir_blocking(dir)?;
    }
    let file = DmaFile::open(&marker).await.map_err(|e| gerr(&marker, e))?;
    file.close().await.map_err(|e| gerr(&marker, e))?;
    Ok(())
}

/// Opens (creating if needed) a file for DMA reads and writes. Never `DmaFile::create`: it opens
/// write-only and reads then fail with EBADF.
pub async fn open_rw(path: &Path, truncate: bool) -> Result<DmaFile, StoreError> {
    open_rw_flags(path, truncate, 0).await
}

/// [`open_rw`] with `O_DSYNC`: every write is on stable storage when it completes (the kernel
/// flushes the device cache, or writes with FUA, as part of the write), so a commit is one
/// submission to the ring instead of a write and then an fdatasync. Sizes a write extends are
/// covered too (`O_DSYNC` syncs the metadata needed to read the data back).
///
/// Measured by `benches/commit.rs`, not used by the WAL: the same device latency per commit and
/// less executor CPU, but scenario A on the LSM (max rate, durable) was 6–21 % slower in four
/// interleaved pairs of runs (perf/results/README.md).
pub async fn open_rw_dsync(path: &Path, truncate: bool) -> Result<DmaFile, StoreError> {
    open_rw_flags(path, truncate, libc::O_DSYNC).await
}

async fn open_rw_flags(path: &Path, truncate: bool, flags: i32) -> Result<DmaFile, StoreError> {
    admit(Op::Open { path, create: true })?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .custom_flags(flags)
        .dma_open(path)
        .await
        .map_err(|e| gerr(path, e))
}

/// Opens an existing file for DMA reads.
pub async fn open_read(path: &Path) -> Result<DmaFile, StoreError> {
    admit(Op::Open {
        path,
        create: false,
    })?;
    OpenOptions::new()
        .read(true)
        .dma_open(path)
        .await
        .map_err(|e| gerr(path, e))
}

/// Reads exactly `len` bytes at `pos`; a short read means the file is shorter than its own
/// metadata says, which is corruption.
pub async fn read_exact_at(
    file: &DmaFile,
    path: &Path,
    pos: u64,
    len: usize,
) -> Result<ReadResult, StoreError> {
    admit(Op::Read { path, pos, len })?;
    let read = file.read_at(pos, len).await.map_err(|e| gerr(path, e))?;
    if read.len() != len {
        return Err(corrupt(
            path,
            format!("short read: {} of {len} bytes at offset {pos}", read.len()),
        ));
    }
    Ok(read)
}

/// Size of an open file.
pub async fn file_size(file: &DmaFile, path: &Path) -> Result<u64, StoreError> {
    admit(Op::Size { path })?;
    file.file_size().await.map_err(|e| gerr(path, e))
}

/// Writes `bytes` at the aligned offset `pos`, zero-padded to [`WRITE_ALIGN`]. Returns the padded
/// length written.
pub async fn write_padded(
    file: &DmaFile,
    path: &Path,
    pos: u64,
    bytes: &[u8],
) -> Result<usize, StoreError> {
    debug_assert_eq!(pos % WRITE_ALIGN as u64, 0, "unaligned DMA write position");
    let padded = align_up(bytes.len().max(1));
    let mut buf: DmaBuffer = file.alloc_dma_buffer(padded);
    let dst = buf.as_bytes_mut();
    dst[..bytes.len()].copy_from_slice(bytes);
    dst[bytes.len()..].fill(0);
    match seam::decide(Op::Write {
        path,
        pos,
        len: padded,
    }) {
        Outcome::Proceed => {}
        Outcome::Fail(e) => return Err(io_error(path, e)),
        Outcome::Torn { bytes, error } => {
            tear(file, path, pos, buf, bytes).await?;
            return Err(io_error(path, error));
        }
    }
    let written = file.write_at(buf, pos).await.map_err(|e| gerr(path, e))?;
    if written != padded {
        return Err(io_error(
            path,
            std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("short write: {written} of {padded} bytes at offset {pos}"),
            ),
        ));
    }
    Ok(padded)
}

/// A torn write, for a simulated disk: only the first `keep` bytes of `new` (whole sectors)
/// replace what the file holds at `pos`; the rest of the range keeps its old bytes (zeros past
/// the end of the file).
async fn tear(
    file: &DmaFile,
    path: &Path,
    pos: u64,
    mut new: DmaBuffer,
    keep: usize,
) -> Result<(), StoreError> {
    let len = new.len();
    let keep = keep.min(len);
    let old = file.read_at(pos, len).await.map_err(|e| gerr(path, e))?;
    let dst = new.as_bytes_mut();
    dst[keep..].fill(0);
    let old_end = old.len().min(len);
    if keep < old_end {
        dst[keep..old_end].copy_from_slice(&old[keep..old_end]);
    }
    file.write_at(new, pos).await.map_err(|e| gerr(path, e))?;
    Ok(())
}

/// Writes `len` zero bytes at the aligned offset `pos` (`len` a multiple of [`WRITE_ALIGN`]),
/// reusing one zeroed DMA buffer.
pub async fn write_zeros(
    file: &DmaFile,
    path: &Path,
    pos: u64,
    len: u64,
) -> Result<(), StoreError> {
    const ZERO_CHUNK: u64 = 1 << 20;
    debug_assert_eq!(pos % WRITE_ALIGN as u64, 0, "unaligned DMA write position");
    debug_assert_eq!(len % WRITE_ALIGN as u64, 0, "unaligned DMA write length");
    let chunk = len.min(ZERO_CHUNK) as usize;
    let mut buf: DmaBuffer = file.alloc_dma_buffer(chunk);
    buf.as_bytes_mut().fill(0);
    let buf = std::rc::Rc::new(buf);
    let mut at = pos;
    while at < pos + len {
        let this = (pos + len - at).min(chunk as u64) as usize;
        // A torn zero fill is a shorter one: the disk fails it whole.
        admit(Op::Write {
            path,
            pos: at,
            len: this,
        })?;
        let written = if this == chunk {
            file.write_rc_at(std::rc::Rc::clone(&buf), at).await
        } else {
            let mut tail: DmaBuffer = file.alloc_dma_buffer(this);
            tail.as_bytes_mut().fill(0);
            file.write_at(tail, at).await
        }
        .map_err(|e| gerr(path, e))?;
        if written != this {
            return Err(io_error(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    format!("short write: {written} of {this} zero bytes at offset {at}"),
                ),
            ));
        }
        at += this as u64;
    }
    Ok(())
}

/// fdatasync of one file.
pub async fn fdatasync(file: &DmaFile, path: &Path) -> Result<(), StoreError> {
    admit(Op::Sync { path })?;
    file.fdatasync().await.map_err(|e| gerr(path, e))
}

/// Closes a file, reporting errors with its path.
pub async fn close(file: DmaFile, path: &Path) -> Result<(), StoreError> {
    file.close().await.map_err(|e| gerr(path, e))
}

/// fsyncs a directory so that creations, renames and removals in it are durable.
pub async fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    admit(Op::SyncDir { dir })?;
    let handle = glommio::io::Directory::open(dir)
        .await
        .map_err(|e| gerr(dir, e))?;
    handle.sync().await.map_err(|e| gerr(dir, e))?;
    handle.close().await.map_err(|e| gerr(dir, e))
}

/// Blocking directory fsync, for recovery before the shard serves.
pub fn sync_dir_blocking(dir: &Path) -> Result<(), StoreError> {
    admit(Op::SyncDir { dir })?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(dir, e))
}

/// Renames a file (not durable until the directory is synced).
pub async fn rename(from: &Path, to: &Path) -> Result<(), StoreError> {
    admit(Op::Rename { from, to })?;
    glommio::io::rename(from, to)
        .await
        .map_err(|e| gerr(from, e))
}

/// Removes a file; a file already gone is not an error.
pub async fn remove(path: &Path) -> Result<(), StoreError> {
    admit(Op::Remove { path })?;
    match glommio::io::remove(path).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let e: std::io::Error = e.into();
            if e.kind() == std::io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(io_error(path, e))
            }
        }
    }
}

/// Reads a whole file with std I/O (recovery, before the shard serves). The error is the plain
/// `io::Error`, so a caller can tell a missing file from a failed read.
pub fn read_blocking(path: &Path) -> std::io::Result<Vec<u8>> {
    let bytes = std::fs::read(path)?;
    match seam::decide(Op::Read {
        path,
        pos: 0,
        len: bytes.len(),
    }) {
        Outcome::Proceed => Ok(bytes),
        Outcome::Fail(e) | Outcome::Torn { error: e, .. } => Err(e),
    }
}

/// Removes a file with std I/O (recovery); a file already gone is not an error.
pub fn remove_blocking(path: &Path) -> Result<(), StoreError> {
    admit(Op::Remove { path })?;
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(path, e)),
    }
}

/// Cuts a file to `len` bytes and syncs it, with std I/O (recovery cutting a torn tail).
pub fn truncate_blocking(path: &Path, len: u64) -> Result<(), StoreError> {
    admit(Op::Truncate { path, len })?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_error(path, e))?;
    file.set_len(len).map_err(|e| io_error(path, e))?;
    file.sync_all().map_err(|e| io_error(path, e))
}

/// Writes `bytes` at `pos` of an existing file and syncs it, with std I/O (recovery rewriting a
/// WAL segment's header before it cuts the segment).
pub fn write_at_blocking(path: &Path, pos: u64, bytes: &[u8]) -> Result<(), StoreError> {
    use std::os::unix::fs::FileExt as _;
    admit(Op::Write {
        path,
        pos,
        len: bytes.len(),
    })?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_error(path, e))?;
    file.write_all_at(bytes, pos)
        .map_err(|e| io_error(path, e))?;
    file.sync_data().map_err(|e| io_error(path, e))
}

/// Renames a file with std I/O (recovery); durable once the directory is synced.
pub fn rename_blocking(from: &Path, to: &Path) -> Result<(), StoreError> {
    admit(Op::Rename { from, to })?;
    std::fs::rename(from, to).map_err(|e| io_error(from, e))
}

/// Streams bytes into a new file with aligned DMA writes of `chunk_bytes`, then seals it:
/// pads the last chunk, truncates to the logical length, fdatasyncs and closes.
pub struct DmaWriter {
    file: DmaFile,
    path: PathBuf,
    chunk: Vec<u8>,
    chunk_bytes: usize,
    /// File offset where `chunk` starts (always aligned).
    chunk_pos: u64,
}

impl DmaWriter {
    /// Creates (truncating) `path`. `chunk_bytes` is rounded up to [`WRITE_ALIGN`].
    pub async fn create(path: &Path, chunk_bytes: usize) -> Result<DmaWriter, StoreError> {
        let file = open_rw(path, true).await?;
        let chunk_bytes = align_up(chunk_bytes.max(WRITE_ALIGN));
        Ok(DmaWriter {
            file,
            path: path.to_path_buf(),
            chunk: Vec::with_capacity(chunk_bytes),
            chunk_bytes,
            chunk_pos: 0,
        })
    }

    /// Logical bytes appended so far.
    pub fn len(&self) -> u64 {
        self.chunk_pos + self.chunk.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends bytes, writing out every full chunk.
    pub async fn append(&mut self, mut bytes: &[u8]) -> Result<(), StoreError> {
        while !bytes.is_empty() {
            let room = self.chunk_bytes - self.chunk.len();
            let take = room.min(bytes.len());
            self.chunk.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.chunk.len() == self.chunk_bytes {
                let written =
                    write_padded(&self.file, &self.path, self.chunk_pos, &self.chunk).await?;
                self.chunk_pos += written as u64;
                self.chunk.clear();
            }
        }
        Ok(())
    }

    /// Writes the tail, truncates to the logical length, fdatasyncs and closes. Returns the
    /// file's length. The file is durable, but its directory entry is not until the directory
    /// is synced (the manifest commit does that).
    pub async fn finish(mut self) -> Result<u64, StoreError> {
        let len = self.len();
        if !self.chunk.is_empty() {
            write_padded(&self.file, &self.path, self.chunk_pos, &self.chunk).await?;
            self.chunk.clear();
        }
        admit(Op::Truncate {
            path: &self.path,
            len,
        })?;
        self.file
            .truncate(len)
            .await
            .map_err(|e| gerr(&self.path, e))?;
        fdatasync(&self.file, &self.path).await?;
        close(self.file, &self.path).await?;
        Ok(len)
    }

    /// Abandons the file: closes and removes it.
    pub async fn abandon(self) {
        let _ = self.file.close().await;
        let _ = remove(&self.path).await;
    }
}
