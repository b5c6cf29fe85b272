//! [`FaultDisk`]: a simulated disk for tests that lets most operations through to the real files
//! and fails a seeded random few: read errors, write errors, torn writes, ENOSPC and fsync
//! failures (TigerBeetle's testing storage, on real files).
//!
//! Every choice comes from one seeded generator, in the order the executor issues operations.
//! One executor is single-threaded, so a seed replays the same faults as long as the store issues
//! the same operations in the same order; background tasks racing io_uring completions can
//! reorder them, so a failing seed replays closely, not always exactly — which is why every
//! injected fault is also recorded ([`FaultDisk::injected`]) for the failure message.
//!
//! Never installed by the server: only tests (and tools) call [`super::seam::install`].

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::PathBuf;

use super::seam::{Disk, Op, Outcome, SECTOR_BYTES};

/// How often each fault strikes, in faults per million operations of its kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// A read fails with EIO.
    pub read_error: u32,
    /// A write fails with EIO; nothing reached the file.
    pub write_error: u32,
    /// A write reaches the file only in part (whole sectors), then fails with EIO.
    pub torn_write: u32,
    /// A write, or the creation of a file, fails with ENOSPC; nothing reached the file.
    pub no_space: u32,
    /// An fdatasync, directory fsync, rename, remove or truncate fails with EIO.
    pub sync_error: u32,
}

impl FaultRates {
    /// No faults at all.
    pub const NONE: FaultRates = FaultRates {
        read_error: 0,
        write_error: 0,
        torn_write: 0,
        no_space: 0,
        sync_error: 0,
    };

    /// Every kind at `per_million`.
    pub fn all(per_million: u32) -> FaultRates {
        FaultRates {
            read_error: per_million,
            write_error: per_million,
            torn_write: per_million,
            no_space: per_million,
            sync_error: per_million,
        }
    }
}

/// How many faults of each kind were injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub read_errors: u64,
    pub write_errors: u64,
    pub torn_writes: u64,
    pub no_space: u64,
    pub sync_errors: u64,
    /// Operations decided (faulted or not).
    pub operations: u64,
}

impl FaultCounts {
    /// All faults injected.
    pub fn total(&self) -> u64 {
        self.read_errors + self.write_errors + self.torn_writes + self.no_space + self.sync_errors
    }
}

/// Recorded faults kept for a failure message.
const INJECTED_KEPT_MAX: usize = 64;

/// A seeded fault-injecting disk. Install it with [`super::seam::install`].
pub struct FaultDisk {
    rng: Cell<u64>,
    rates: Cell<FaultRates>,
    counts: Cell<FaultCounts>,
    injected: RefCell<VecDeque<String>>,
    /// Prefix of the line printed to stderr for each fault, when set.
    echo: RefCell<Option<String>>,
}

impl FaultDisk {
    /// A disk whose choices follow `seed`, injecting at `rates`.
    pub fn new(seed: u64, rates: FaultRates) -> FaultDisk {
        FaultDisk {
            rng: Cell::new(seed),
            rates: Cell::new(rates),
            counts: Cell::new(FaultCounts::default()),
            injected: RefCell::new(VecDeque::new()),
            echo: RefCell::new(None),
        }
    }

    /// Changes the rates from now on ([`FaultRates::NONE`]: a healthy disk).
    pub fn set_rates(&self, rates: FaultRates) {
        self.rates.set(rates);
    }

    /// Prints each fault to stderr as it strikes, after `prefix` (a test's output then shows
    /// the faults that led to its failure).
    pub fn echo(&self, prefix: &str) {
        *self.echo.borrow_mut() = Some(prefix.to_string());
    }

    /// Faults injected so far.
    pub fn counts(&self) -> FaultCounts {
        self.counts.get()
    }

    /// The most recent injected faults, oldest first (operation, file, what happened).
    pub fn injected(&self) -> Vec<String> {
        self.injected.borrow().iter().cloned().collect()
    }

    /// SplitMix64: small, seedable, good enough to pick faults.
    fn next(&self) -> u64 {
        let mut z = self.rng.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.rng.set(z);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `per_million` / 1e6.
    fn strikes(&self, per_million: u32) -> bool {
        per_million > 0 && self.next() % 1_000_000 < u64::from(per_million)
    }

    fn record(&self, op: &Op<'_>, what: &str, count: impl FnOnce(&mut FaultCounts)) {
        let mut counts = self.counts.get();
        count(&mut counts);
        self.counts.set(counts);
        let mut injected = self.injected.borrow_mut();
        if injected.len() == INJECTED_KEPT_MAX {
            injected.pop_front();
        }
        let file: PathBuf = op.path().file_name().map(PathBuf::from).unwrap_or_default();
        let line = format!(
            "#{} {what} on {op:?} ({})",
            counts.operations,
            file.display()
        );
        if let Some(prefix) = self.echo.borrow().as_ref() {
            eprintln!("{prefix}: injected {line}");
        }
        injected.push_back(line);
    }

    fn fail(&self, op: &Op<'_>, errno: i32, count: impl FnOnce(&mut FaultCounts)) -> Outcome {
        let error = std::io::Error::from_raw_os_error(errno);
        self.record(op, &error.to_string(), count);
        Outcome::Fail(error)
    }
}

impl Disk for FaultDisk {
    fn decide(&self, op: Op<'_>) -> Outcome {
        let mut counts = self.counts.get();
        counts.operations += 1;
        self.counts.set(counts);
        let rates = self.rates.get();
        match op {
            Op::Read { .. } if self.strikes(rates.read_error) => {
                self.fail(&op, libc::EIO, |c| c.read_errors += 1)
            }
            Op::Open { create: true, .. } if self.strikes(rates.no_space) => {
                self.fail(&op, libc::ENOSPC, |c| c.no_space += 1)
            }
            Op::Open { .. } if self.strikes(rates.read_error) => {
                self.fail(&op, libc::EIO, |c| c.read_errors += 1)
            }
            Op::Write { .. } if self.strikes(rates.no_space) => {
                self.fail(&op, libc::ENOSPC, |c| c.no_space += 1)
            }
            Op::Write { .. } if self.strikes(rates.write_error) => {
                self.fail(&op, libc::EIO, |c| c.write_errors += 1)
            }
            Op::Write { len, .. } if len >= SECTOR_BYTES && self.strikes(rates.torn_write) => {
                let sectors = (len / SECTOR_BYTES) as u64;
                let bytes = (self.next() % sectors) as usize * SECTOR_BYTES;
                self.record(&op, &format!("torn after {bytes} bytes"), |c| {
                    c.torn_writes += 1
                });
                Outcome::Torn {
                    bytes,
                    error: std::io::Error::from_raw_os_error(libc::EIO),
                }
            }
            Op::Sync { .. }
            | Op::SyncDir { .. }
            | Op::Rename { .. }
            | Op::Remove { .. }
            | Op::Truncate { .. }
                if self.strikes(rates.sync_error) =>
            {
                self.fail(&op, libc::EIO, |c| c.sync_errors += 1)
            }
            _ => Outcome::Proceed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn write(path: &Path) -> Op<'_> {
        Op::Write {
            path,
            pos: 0,
            len: 8192,
        }
    }

    #[test]
    fn a_healthy_disk_lets_everything_through() {
        let disk = FaultDisk::new(7, FaultRates::NONE);
        let path = Path::new("x");
        for _ in 0..1000 {
            assert!(matches!(disk.decide(write(path)), Outcome::Proceed));
        }
        assert_eq!(disk.counts().total(), 0);
        assert_eq!(disk.counts().operations, 1000);
    }

    #[test]
    fn the_same_seed_injects_the_same_faults() {
        let run = |seed| {
            let disk = FaultDisk::new(seed, FaultRates::all(50_000));
            let path = Path::new("x");
            let outcomes: Vec<String> = (0..500)
                .map(|_| format!("{:?}", disk.decide(write(path))))
                .collect();
            (outcomes, disk.counts())
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn torn_writes_keep_whole_sectors_and_less_than_the_write() {
        let disk = FaultDisk::new(
            11,
            FaultRates {
                torn_write: 1_000_000,
                ..FaultRates::NONE
            },
        );
        let path = Path::new("x");
        for _ in 0..200 {
            match disk.decide(write(path)) {
                Outcome::Torn { bytes, .. } => {
                    assert_eq!(bytes % SECTOR_BYTES, 0);
                    assert!(bytes < 8192);
                }
                other => panic!("expected a torn write, got {other:?}"),
            }
        }
        assert_eq!(disk.counts().torn_writes, 200);
    }

    #[test]
    fn every_kind_of_fault_strikes_at_its_rate() {
        let disk = FaultDisk::new(5, FaultRates::all(100_000));
        let path = Path::new("x");
        for _ in 0..10_000 {
            let _ = disk.decide(Op::Read {
                path,
                pos: 0,
                len: 4096,
            });
            let _ = disk.decide(write(path));
            let _ = disk.decide(Op::Sync { path });
        }
        let c = disk.counts();
        assert!((800..1200).contains(&c.read_errors), "{c:?}");
        assert!((800..1200).contains(&c.sync_errors), "{c:?}");
        assert!(
            c.no_space > 500 && c.write_errors > 500 && c.torn_writes > 500,
            "{c:?}"
        );
        assert!(disk.injected().len() <= INJECTED_KEPT_MAX);
    }
}
