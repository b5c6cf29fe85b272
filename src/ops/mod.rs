//! Operating pinq on a host: `pinq doctor` and NUMA placement (`--numa auto`).
//!
//! Pure cores apart from the I/O, as everywhere in pinq:
//! - [`parse`]: the text of `/sys` and `/proc` files → values (pure, tested on fixtures);
//! - [`cert`]: the TLS certificate's expiry (pure);
//! - [`checks`]: facts → findings with what to change, the exit status, the report (pure);
//! - [`numa`]: choosing the CPUs of one node (pure) and reading the nodes;
//! - [`host`]: the only place that reads the host (files, `io_uring_setup`, an O_DIRECT probe);
//! - [`doctor`]: `pinq doctor` itself, gluing the above (and the data directory's table check);
//! - [`ratelimit`]: at most one line per interval for a log site that can repeat (used by the
//!   shard's loops and the storage engine).
//!
//! Nothing here runs on a shard: doctor is its own subcommand, and NUMA placement runs once before
//! the shards start.

pub mod cert;
pub mod checks;
pub mod doctor;
pub mod host;
pub mod numa;
pub mod parse;
pub mod ratelimit;
