//! Deletes: delete batches cut by the deleter and their results, and the janitor's TTL sweeps,
//! whose expired keys join the same delete queue.

use super::transitions::ExpiredBy;
use super::ShardCore;
use crate::key::{due_bucket_bound, EventKey, Key};
use crate::log::Command;
use crate::message::Value;
use crate::pipeline::deleter::DeleteBatch;
use crate::pipeline::inflight::CopyState;
use crate::pipeline::janitor::SweepPage;

impl DeleteBatch {
    /// The command that deletes this batch's keys (and the records of their copies, if any).
    pub fn command(&self) -> Command {
        if self.dropped.is_empty() {
            return Command::Delete {
                keys: self.keys.clone(),
            };
        }
        Command::Copies {
            records: Vec::new(),
            deleted: self.keys.clone(),
            dropped: self.dropped.clone(),
        }
    }
}

impl ShardCore {
    // ---- deleter -------------------------------------------------------------------------

    /// Takes a due delete batch if fewer than `deleteBatchesInFlight` are out; call again until
    /// `None` to fill every slot.
    pub fn take_delete_batch(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        let now_ms = self.tick(now_ms);
        let batch = self.deleter.take_batch(now_ms)?;
        Some(self.with_records(batch))
    }

    /// Adds the copy records of the batch's messages, deleted with them.
    fn with_records(&self, mut batch: DeleteBatch) -> DeleteBatch {
        batch.dropped = self.records_of(&batch.keys);
        batch
    }

    /// When the next delete batch is due, if keys wait and a batch slot is free.
    pub fn next_delete_ms(&self) -> Option<u64> {
        self.deleter.next_flush_ms()
    }

    /// Whether the last pass found the delete backlog at its bound (dispatch is paused).
    pub fn dispatch_paused(&self) -> bool {
        self.paused
    }

    /// Takes a delete batch at once, due or not (shutdown).
    pub fn take_delete_batch_now(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        let now_ms = self.tick(now_ms);
        let batch = self.deleter.take_batch_now(now_ms)?;
        Some(self.with_records(batch))
    }

    /// Whether deletes wait or one is being written.
    pub fn deletes_busy(&self) -> bool {
        self.deleter.is_busy()
    }

    /// The batch is applied: in-flight entries of its keys are removed. Returns `true` when
    /// dispatch was paused on the delete backlog and may resume now (the shell kicks its
    /// dispatcher; `wake` is set for a shell that polls `next_pass_ms`).
    pub fn on_delete_applied(&mut self, batch: &DeleteBatch) -> bool {
        self.deleter.on_applied(batch);
        let bound = due_bucket_bound(self.now_ms, self.delivery.time_bucket_ms);
        for key in &batch.keys {
            self.waiters.deleted(key);
            self.copies.take_restored(key);
            self.stock.on_deleted(key, bound);
            if let Some(entry) = self.inflight.remove(key) {
                self.stock.on_retired(key);
                if entry.deleting {
                    self.deleting_entries -= 1;
                }
                for copy in &entry.copies {
                    if let CopyState::Held { consumer, .. } = copy.state() {
                        if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                            c.held.remove(key);
                        }
                    }
                }
            }
        }
        self.waiters.shrink();
        let resumed = self.paused && !self.deleter.is_over_backlog();
        if resumed {
            self.wake = true;
        }
        resumed
    }

    pub fn on_delete_failed(&mut self, batch: DeleteBatch) {
        self.deleter.on_failed(batch);
    }

    // ---- janitor -------------------------------------------------------------------------

    pub fn begin_sweep(&mut self, now_ms: u64) -> Option<SweepPage> {
        let now_ms = self.tick(now_ms);
        let page = self.janitor.begin(now_ms);
        if page.is_some() {
            self.stock.begin_census();
        }
        page
    }

    /// Counts a sweep page into the stock's census (event keys whose value names their topic).
    fn census_page(&mut self, rows: &[(Key, Value)], now_ms: u64) {
        let bound = due_bucket_bound(now_ms, self.delivery.time_bucket_ms);
        for (raw, value) in rows {
            let Ok(key) = EventKey::parse(raw) else {
                continue;
            };
            if let Ok(message) = value.message() {
                self.stock.census_row(&key, message.topic.as_str(), bound);
            }
            self.stock.census_through(key);
        }
    }

    /// Reads one sweep page, routes expired messages to the deleter, returns the next page.
    pub fn on_sweep_page(&mut self, now_ms: u64, rows: &[(Key, Value)]) -> Option<SweepPage> {
        let now_ms = self.tick(now_ms);
        self.census_page(rows, now_ms);
        let (expired, next) = self.janitor.on_page(rows, now_ms);
        for key in expired {
            self.expire(key, ExpiredBy::Janitor);
        }
        if next.is_none() {
            self.stock.end_census();
        }
        next
    }

    /// A sweep could not read the store; the next one starts after a full interval.
    pub fn abort_sweep(&mut self, now_ms: u64) {
        let now_ms = self.tick(now_ms);
        self.janitor.abort(now_ms);
        self.stock.abort_census();
    }
}
