//! The delivery pipeline as pure, I/O-free state machines, and the async steps that connect
//! them to a [`Store`].
//!
//! ```text
//!  store ──scan──▶ dispatcher ──▶ hub ──▶ consumer queues ──drain──▶ connections
//!                     ▲            │
//!   ack / nack ───────┴── in-flight table ──▶ deleter ──▶ delete batch ──▶ store
//!                                              ▲
//!   expired messages (janitor sweep) ──────────┘
//! ```
//!
//! [`ShardCore`] owns one shard's pipeline; its parts live in [`hub`], [`inflight`],
//! [`dispatcher`], [`deleter`], [`copies`] and [`janitor`]. None of them reads a clock, sleeps or does I/O.
//! The functions in [`drive`] carry a core's requests to a store; they borrow the core only
//! between awaits, so several tasks of one shard can share it in a `RefCell`.

pub mod copies;
pub mod dedup;
pub mod deleter;
pub mod dispatcher;
pub mod drive;
pub mod hub;
pub mod inflight;
pub mod janitor;
pub mod memory;
pub mod policy;
pub mod shard;
pub mod stock;

pub use crate::batch::{PublishError, ValidatedBatch};
pub use deleter::DeleteBatch;
pub use dispatcher::ScanRequest;
pub use hub::{ConsumerId, HubLimits, Limit, RecipientId};
pub use shard::{
    Capacities, ConsumerError, Counters, DeadLetter, Delivery, GroupFigures, Release, Settled,
    ShardCore, ShardStats, StoreBatch, TagResult, TopicFigures,
};

#[allow(unused_imports)]
use crate::storage::Store;

#[cfg(test)]
mod copies_tests;
#[cfg(test)]
mod limit_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
