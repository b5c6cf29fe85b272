//! Deletes: delete batches cut by the deleter and their results, and the janitor's TTL sweeps,
//! whose expired keys join the same delete queue.

use super::ShardCore;
use crate::key::Key;
use crate::log::Command;
use crate::message::Value;
use crate::pipeline::deleter::DeleteBatch;
use crate::pipeline::inflight::CopyState;
use crate::pipeline::janitor::SweepPage;

impl DeleteBatch {
    /// The command that deletes this batch's keys.
    pub fn command(&self) -> Command {
        Command::Delete {
            keys: self.keys.clone(),
        }
    }
}

impl ShardCore {
    // ---- deleter -------------------------------------------------------------------------

    /// Takes a due delete batch if fewer than `deleteBatchesInFlight` are out; call again until
    /// `None` to fill every slot.
    pub fn take_delete_batch(&mut self, now_ms: u64) -> Option<DeleteBatch> {
        let now_ms = self.tick(now_ms);
        self.deleter.take_batch(now_ms)
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
        self.deleter.take_batch_now(now_ms)
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
        for key in &batch.keys {
            if let Some(entry) = self.inflight.remove(key) {
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
        self.janitor.begin(now_ms)
    }

    /// Reads one sweep page, routes expired messages to the deleter, returns the next page.
    pub fn on_sweep_page(&mut self, now_ms: u64, rows: &[(Key, Value)]) -> Option<SweepPage> {
        let now_ms = self.tick(now_ms);
        let (expired, next) = self.janitor.on_page(rows, now_ms);
        for key in expired {
            if self.deleter.contains(&key) {
                continue;
            }
            self.counters.expired_janitor_total += 1;
            self.expire(key);
        }
        next
    }

    /// A sweep could not read the store; the next one starts after a full interval.
    pub fn abort_sweep(&mut self, now_ms: u64) {
        let now_ms = self.tick(now_ms);
        self.janitor.abort(now_ms);
    }
}
