//! The `Disk` seam: every file operation of the storage engine (and of the standalone command
//! log) asks the disk installed on its executor, before it touches the file, what the disk does
//! with it.
//!
//! The real disk is no disk at all: when nothing is installed (every server, every bench) the
//! check is one thread-local read and the operation goes straight to glommio — no allocation, no
//! dynamic dispatch. A test installs a [`Disk`] (for example [`super::sim::FaultDisk`]) on its
//! executor before it opens a store; from then on each operation first calls [`Disk::decide`],
//! which may let it through, fail it with an error (nothing reached the file), or, for a write,
//! tear it (a prefix of whole sectors reached the file, then the write fails). The disk cannot
//! change what a successful read returns: bytes that rot on the medium are the corruption tests'
//! business (they flip bytes in real files).
//!
//! Per executor (thread-local), because glommio runs one executor per thread: a disk installed
//! for one shard's test never fails another executor's I/O. Called only by `super` (io.rs).

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

/// One file operation, as the disk sees it before it happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op<'a> {
    /// Opening a file (`create`: it may be created).
    Open { path: &'a Path, create: bool },
    /// A read of `len` bytes at `pos`.
    Read {
        path: &'a Path,
        pos: u64,
        len: usize,
    },
    /// A write of `len` bytes (aligned, padded) at `pos`.
    Write {
        path: &'a Path,
        pos: u64,
        len: usize,
    },
    /// fdatasync of a file.
    Sync { path: &'a Path },
    /// Reading a file's size.
    Size { path: &'a Path },
    /// Truncating a file to `len`.
    Truncate { path: &'a Path, len: u64 },
    /// Renaming `from` to `to`.
    Rename { from: &'a Path, to: &'a Path },
    /// Removing a file.
    Remove { path: &'a Path },
    /// fsync of a directory.
    SyncDir { dir: &'a Path },
}

impl Op<'_> {
    /// The file the operation is about (for a rename, its source).
    pub fn path(&self) -> &Path {
        match *self {
            Op::Open { path, .. }
            | Op::Read { path, .. }
            | Op::Write { path, .. }
            | Op::Sync { path }
            | Op::Size { path }
            | Op::Truncate { path, .. }
            | Op::Remove { path } => path,
            Op::Rename { from, .. } => from,
            Op::SyncDir { dir } => dir,
        }
    }
}

/// What the disk does with an operation.
#[derive(Debug)]
pub enum Outcome {
    /// The operation runs on the real file.
    Proceed,
    /// The operation fails with this error; nothing reached the file.
    Fail(std::io::Error),
    /// A write whose first `bytes` (a multiple of [`SECTOR_BYTES`], less than the write) reach
    /// the file; the rest of the range keeps its old bytes, and the write fails with `error`.
    /// Operations other than writes treat it as `Fail(error)`.
    Torn { bytes: usize, error: std::io::Error },
}

/// The unit a torn write keeps whole: a device writes a sector all or nothing.
pub const SECTOR_BYTES: usize = 512;

/// A disk that decides what happens to each file operation of its executor.
pub trait Disk {
    /// Called before `op` runs.
    fn decide(&self, op: Op<'_>) -> Outcome;
}

thread_local! {
    static INSTALLED: RefCell<Option<Rc<dyn Disk>>> = const { RefCell::new(None) };
}

/// Installs `disk` for every later file operation on this thread (executor), replacing the one
/// installed before. Install it before the store opens.
pub fn install(disk: Rc<dyn Disk>) {
    INSTALLED.with(|d| *d.borrow_mut() = Some(disk));
}

/// Goes back to the real disk on this thread; returns the disk that was installed.
pub fn uninstall() -> Option<Rc<dyn Disk>> {
    INSTALLED.with(|d| d.borrow_mut().take())
}

/// What the installed disk does with `op` (`Proceed` when none is installed).
#[inline]
pub(crate) fn decide(op: Op<'_>) -> Outcome {
    // Clone the Rc out so the disk may itself install or uninstall without a borrow conflict.
    let disk = INSTALLED.with(|d| d.borrow().as_ref().map(Rc::clone));
    match disk {
        None => Outcome::Proceed,
        Some(disk) => disk.decide(op),
    }
}
