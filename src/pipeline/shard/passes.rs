//! Dispatch passes: `plan_pass` (timers, retry lists, retired groups, the scans to run),
//! `on_scan` (rows in, copies out) and when to wake next.

use super::transitions::ExpiredBy;
use super::{Release, ShardCore};
use crate::key::{due_bucket_bound, topic_end, EventKey, Key};
use crate::message::CheckedValue;
use crate::message::Value;
use crate::pipeline::dispatcher::ScanRequest;
use crate::pipeline::hub::RecipientId;
use crate::pipeline::inflight::{CopyState, Entry};
use crate::pipeline::memory::give_back;

impl ShardCore {
    /// Starts a dispatch pass: releases timed-out leases and ended NACK delays, serves retry
    /// lists, forgets groups past their retention, and returns the scans to run. While the delete
    /// backlog is at its bound the pass does none of that and returns no scans (module docs).
    pub fn plan_pass(&mut self, now_ms: u64) -> Vec<ScanRequest> {
        let now_ms = self.tick(now_ms);
        self.wake = false;
        self.productive = false;

        if self.deleter.is_over_backlog() {
            if !self.paused {
                self.paused = true;
                self.counters.delete_backlog_pauses_total += 1;
            }
            return Vec::new();
        }
        self.paused = false;

        while let Some(timer) = self.inflight.pop_due_timer(now_ms) {
            match self.inflight.state(&timer.key, timer.recipient) {
                Some(CopyState::Held { consumer, .. }) => {
                    if let Some(c) = self.hub.consumers.get_mut(&consumer) {
                        c.held.remove(&timer.key);
                    }
                    self.inflight
                        .set_avoid(timer.key, timer.recipient, Some(consumer));
                    self.counters.redeliveries_timeout_total += 1;
                    self.release(timer.key, timer.recipient, Release::Timeout, 0);
                }
                Some(CopyState::Delayed { .. }) => self.on_delay_ended(timer.key, timer.recipient),
                _ => {}
            }
        }

        self.forget_retired_groups(now_ms);

        let recipients: Vec<RecipientId> = self.hub.servable().collect();
        for recipient in recipients {
            self.serve_pending(recipient, now_ms);
            self.hub.note_pending(recipient);
        }

        let bound_bucket = due_bucket_bound(now_ms, self.delivery.time_bucket_ms);
        let poll_ms = self.delivery.dispatch_poll_interval_ms;
        let mut requests = Vec::new();
        for (name, topic) in self.topics.iter_mut() {
            let Some(members) = self.hub.topics.get(name) else {
                continue;
            };
            if members.live_consumers == 0 {
                continue;
            }
            let bound = self
                .unapplied
                .lowest_due(topic.hash)
                .map_or(bound_bucket, |low| low.min(bound_bucket));
            let polled = now_ms >= topic.last_scan_ms.saturating_add(poll_ms);
            if !topic.wants_scan(bound) && !polled {
                continue;
            }
            let recipients = self.hub.recipients_of(name);
            let room = recipients
                .iter()
                .map(|r| self.hub.room(*r))
                .max()
                .unwrap_or(0);
            let pending: usize = recipients
                .iter()
                .filter_map(|r| self.hub.recipients.get(r))
                .map(|r| r.pending.len())
                .sum();
            // Each message read may park one copy per recipient in the retry lists, so a scan
            // reads at most (free room / recipients) messages, but at least one while there is any
            // room: with more recipients than the bound the quotient is 0, and the topic would
            // never be read again. The lists may so overshoot the bound by `recipients - 1`.
            let budget = match self.delivery.retry_len_max.saturating_sub(pending) {
                0 => 0,
                free => (free / recipients.len().max(1)).max(1),
            };
            let limit = self.delivery.scan_batch_len_max.min(room).min(budget);
            topic.blocked = limit == 0;
            if topic.blocked {
                continue;
            }
            let start = topic.scan_start();
            let end = EventKey::new(topic.hash, bound, 0).to_key();
            topic.last_scan_ms = now_ms;
            topic.noted_during_scan = None;
            if start >= end {
                // Only a publish still being written holds the bound this low. Nothing past the
                // cursor is due before the bound, so a next due bucket below it is stale.
                topic.more = false;
                topic.next_due_bucket = topic.next_due_bucket.map(|due| due.max(bound));
                continue;
            }
            requests.push(ScanRequest {
                topic: name.clone(),
                start,
                end,
                limit,
                seek_end: topic_end(topic.hash),
            });
        }
        requests
    }

    /// Forgets the groups without consumers for `groupRetention`: O(groups due).
    pub(super) fn forget_retired_groups(&mut self, now_ms: u64) {
        let retention_ms = self.delivery.group_retention_ms;
        for recipient in self.hub.take_retired(now_ms, retention_ms) {
            self.forget_group_id(recipient);
        }
    }

    pub(super) fn serve_pending(&mut self, recipient: RecipientId, now_ms: u64) {
        loop {
            let Some(key) = self
                .hub
                .recipients
                .get(&recipient)
                .and_then(|r| r.pending.front().copied())
            else {
                return;
            };
            let status = match self.inflight.entries.get(&key) {
                Some(entry) if !entry.deleting => {
                    match entry
                        .copies
                        .iter()
                        .find(|c| c.recipient == recipient)
                        .map(|c| c.state())
                    {
                        Some(CopyState::Pending) if entry.is_expired(now_ms) => {
                            PendingStatus::Expired
                        }
                        Some(CopyState::Pending) => PendingStatus::Ready,
                        _ => PendingStatus::Stale,
                    }
                }
                _ => PendingStatus::Stale,
            };
            match status {
                PendingStatus::Stale => {}
                PendingStatus::Expired => self.expire(key, ExpiredBy::Dispatcher),
                PendingStatus::Ready => {
                    if !self.offer(key, recipient) {
                        return;
                    }
                }
            }
            if let Some(r) = self.hub.recipients.get_mut(&recipient) {
                r.pending.pop_front();
                give_back(&mut r.pending);
            }
        }
    }

    /// Feeds the rows a [`ScanRequest`] returned, and the first key at or past its bound (the
    /// seek) when the scan came back short.
    pub fn on_scan(
        &mut self,
        now_ms: u64,
        request: &ScanRequest,
        rows: &[(Key, Value)],
        next_key: Option<&[u8]>,
    ) {
        let now_ms = self.tick(now_ms);
        let topic_name = request.topic.as_ref();
        let recipients = self.hub.recipients_of(topic_name);
        if recipients.is_empty() || !self.topics.contains_key(topic_name) {
            return;
        }
        for (raw, value) in rows {
            let Ok(key) = EventKey::parse(raw) else {
                continue;
            };
            if let Some(topic) = self.topics.get_mut(topic_name) {
                topic.cursor = Some(key);
            }
            if self.inflight.entries.contains_key(&key) {
                continue;
            }
            // The one check of this value in the pipeline: it is a `CheckedValue` from here to
            // the consumer (in-flight entry, drain, delivery latency, the deliver call).
            let Ok(value) = CheckedValue::check(value.clone()) else {
                self.counters.unreadable_values_total += 1;
                continue;
            };
            let message = value.message();
            if message.topic.as_str() != topic_name {
                continue; // another topic with the same hash
            }
            if message.is_expired(now_ms) {
                self.expire(key, ExpiredBy::Dispatcher);
                continue;
            }
            let (copies, records) = self.restored_copies_of(key, &recipients);
            self.inflight.entries.insert(
                key,
                Entry {
                    expires_at_ms: message.expires_at_ms(),
                    value: Some(value),
                    copies,
                    deleting: false,
                    records,
                },
            );
            self.stock.on_dispatched(&key);
            self.complete_if_done(key);
            for recipient in &recipients {
                if self.inflight.state(&key, *recipient) != Some(CopyState::Pending) {
                    continue; // ACKed before a restart (its group's record says so)
                }
                if !self.offer(key, *recipient) {
                    if let Some(r) = self.hub.recipients.get_mut(recipient) {
                        r.pending.push_back(key);
                        self.hub.note_pending(*recipient);
                    }
                }
            }
        }
        let Some(topic) = self.topics.get_mut(topic_name) else {
            return;
        };
        if rows.len() >= request.limit {
            topic.more = true;
            self.productive = true;
        } else {
            topic.more = false;
            let seen = next_key
                .and_then(|k| EventKey::parse(k).ok())
                .filter(|k| k.topic_hash() == topic.hash)
                .map(|k| k.due_bucket());
            topic.next_due_bucket = match (seen, topic.noted_during_scan) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
    }

    /// Whether the last pass did something, so the next one should run at once.
    pub fn productive(&self) -> bool {
        self.productive
    }

    /// When the shell should run the next pass (or flush, or sweep): at most a poll interval away.
    pub fn next_wake_ms(&self) -> u64 {
        let mut at = self.next_pass_ms();
        for candidate in [self.deleter.next_flush_ms(), self.janitor.next_sweep_ms()]
            .into_iter()
            .flatten()
        {
            at = at.min(candidate);
        }
        at.max(self.now_ms)
    }

    /// When the next dispatch pass is due, ignoring the deleter and the janitor (a shell that
    /// runs those in their own tasks sleeps its dispatch loop until this).
    pub fn next_pass_ms(&self) -> u64 {
        let now_ms = self.now_ms;
        if self.wake || self.productive {
            return now_ms;
        }
        let bucket_ms = self.delivery.time_bucket_ms.max(1);
        let mut at = now_ms.saturating_add(self.delivery.dispatch_poll_interval_ms);
        if self.paused {
            // Nothing is due until deletes catch up, and the delete that brings the backlog under
            // its bound sets `wake`: waking for due timers or buckets now would only spin.
            return at;
        }
        for (name, topic) in &self.topics {
            let served = self
                .hub
                .topics
                .get(name)
                .is_some_and(|m| m.live_consumers > 0);
            if let (true, false, Some(due)) = (served, topic.blocked, topic.next_due_bucket) {
                // A pass cannot read at or past a publish still being written, and that write
                // wakes the dispatcher when it lands (`on_publish_applied`): waking for it now
                // would only spin on empty passes.
                if self
                    .unapplied
                    .lowest_due(topic.hash)
                    .is_some_and(|low| due >= low)
                {
                    continue;
                }
                // Bucket `due` is scanned once (now + 1) / bucket_ms > due.
                at = at.min(
                    due.saturating_add(1)
                        .saturating_mul(bucket_ms)
                        .saturating_sub(1),
                );
            }
        }
        if let Some(candidate) = self.inflight.next_timer_ms() {
            at = at.min(candidate);
        }
        at.max(now_ms)
    }
}

enum PendingStatus {
    Ready,
    Expired,
    Stale,
}
