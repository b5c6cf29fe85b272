//! pinq: a thread-per-core message broker for delayed and immediate delivery with per-message
//! acknowledgement.
//!
//! Layout (one folder per subsystem; pure cores apart from the glommio shells that drive them):
//! - [`key`]: the 24-byte event key and the key space;
//! - [`message`]: the stored message (rkyv) and the shared [`message::Value`];
//! - [`config`]: every setting, its default, loading and validation;
//! - [`store`]: the storage interface and the in-memory engine;
//! - [`pipeline`]: the delivery pipeline as pure state machines (dispatcher, hub, in-flight
//!   table, deleter, janitor) driven by explicit time.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod config;
pub mod key;
pub mod message;
pub mod pipeline;
pub mod store;
