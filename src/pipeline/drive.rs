//! Async steps that carry a [`ShardCore`]'s requests to a [`Store`] and feed back the results.
//!
//! These are the only places the pipeline meets storage. Each step borrows the core for short,
//! synchronous stretches and never across an await, so the publish path, the dispatch loop and
//! the deleter of one shard can run as separate tasks over one `RefCell<ShardCore>`.

use std::cell::RefCell;

use super::copies::CopyBatch;
use super::dedup::Originals;
use super::deleter::DeleteBatch;
use super::shard::{ShardCore, StoreBatch};
use crate::batch::ValidatedBatch;
use crate::config::AckLevel;
use crate::key::EventKey;
use crate::log::copies::{copy_key_range, CopyId, CopyRecord};
use crate::log::sequences::{sequence_key_range, SequenceEntry};
use crate::log::Command;
use crate::storage::{Store, StoreError, Sync};

/// Why a publish failed. A batch reaches the core validated (see [`crate::batch`]): only the
/// store can fail it here, or the batch whose message a duplicate's answer names.
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    #[error("storage failed: {0}")]
    Store(#[from] StoreError),
    /// A message was answered with the tag of an earlier publish of its (producer id, sequence)
    /// that was still being stored, and that publish failed (or this shard stopped leading).
    #[error("the first publish of a (producerId, sequence) in this batch was not stored (publish the batch again)")]
    OriginalNotStored,
}

/// Loads the shard's event-id high-water mark (applied from the log) into the core (call once
/// at start, after the store was opened).
pub fn recover<S: Store>(core: &RefCell<ShardCore>, store: &S) {
    core.borrow_mut()
        .recover_event_ids(store.event_id_high_water());
}

/// Reads every sequence entry of idempotent publish back from the store, page by page (call
/// at start and when a replica starts to lead, before it serves). Unreadable entries are
/// skipped and counted in the result: they can only make a republish be stored again.
pub async fn read_sequences<S: Store>(
    store: &S,
) -> Result<(Vec<SequenceEntry>, usize), StoreError> {
    const PAGE_KEYS: usize = 4096;
    let (mut start, end) = sequence_key_range();
    let mut entries = Vec::new();
    let mut unreadable = 0;
    loop {
        let rows = store.scan(&start, Some(&end), PAGE_KEYS).await?;
        for (_, value) in &rows {
            match SequenceEntry::from_value(value.as_bytes()) {
                Ok(entry) => entries.push(entry),
                Err(_) => unreadable += 1,
            }
        }
        match rows.last() {
            Some((last, _)) if rows.len() == PAGE_KEYS => {
                start = last.clone();
                start.push(0);
            }
            _ => return Ok((entries, unreadable)),
        }
    }
}

/// Keys, stores and announces one validated publish batch; returns the delivery tags once the
/// batch has reached the store at its ack level.
pub async fn publish<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
    batch: ValidatedBatch,
) -> Result<Vec<EventKey>, PublishFailure> {
    publish_accepting(core, store, now_ms, batch, |_| {}, || true).await
}

/// [`publish`], calling `accepted` with the tags as soon as the store has accepted the batch
/// at a `leader` or `none` ack level (in a cluster: appended on the leader, before a quorum
/// has it), so the shell can answer the client then. The core learns of the batch only once it
/// is applied, as for every publish. `current` says whether `core` is still the core that
/// prepared the batch (a cluster shard replaces its core when its leadership changes; the old
/// core's batch is then not reported to the new one).
pub async fn publish_accepting<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
    batch: ValidatedBatch,
    accepted: impl FnOnce(Vec<EventKey>),
    current: impl Fn() -> bool,
) -> Result<Vec<EventKey>, PublishFailure> {
    let ack = batch.ack();
    let batch = core.borrow_mut().prepare_publish(now_ms, batch);
    if batch.writes_nothing() {
        // Every message is a duplicate: nothing to store, the answers are the originals' tags.
        if current() {
            core.borrow_mut().on_publish_applied(&batch);
        }
        wait_for_originals(core, &batch, &current).await?;
        return Ok(batch.tags());
    }
    let sync = if ack == AckLevel::Durable {
        Sync::Durable
    } else {
        Sync::Buffered
    };
    // An answer that names a pending original waits for it, whatever the ack level.
    let early = (sync == Sync::Buffered && batch.waits.is_empty()).then(|| batch.tags());
    let on_accepted = move || {
        if let Some(tags) = early {
            accepted(tags);
        }
    };
    match store
        .commit_accepting(&batch.command(), sync, on_accepted)
        .await
    {
        Ok(_) => {
            if current() {
                core.borrow_mut().on_publish_applied(&batch);
            }
            wait_for_originals(core, &batch, &current).await?;
            Ok(batch.tags())
        }
        Err(error) => {
            if current() {
                core.borrow_mut().on_publish_failed(&batch);
            }
            Err(error.into())
        }
    }
}

/// Waits until every pending original a batch answered with is stored; fails when one was
/// not (its batch failed, or the core was replaced: this shard stopped leading).
async fn wait_for_originals(
    core: &RefCell<ShardCore>,
    batch: &StoreBatch,
    current: &impl Fn() -> bool,
) -> Result<(), PublishFailure> {
    if batch.waits.is_empty() {
        return Ok(());
    }
    let signal = core.borrow().settled_signal();
    loop {
        if !current() {
            return Err(PublishFailure::OriginalNotStored);
        }
        match core.borrow().originals(batch) {
            Originals::Stored => return Ok(()),
            Originals::Lost => return Err(PublishFailure::OriginalNotStored),
            Originals::Waiting => {}
        }
        // No await between the check and this wait: a settle cannot slip between them.
        signal.wait().await;
    }
}

/// Runs one dispatch pass and writes the copy records waiting before and after it (one task
/// does everything here; the shell writes records from its deleter loop instead). Returns
/// whether the next pass should run at once: the pass was productive, or it let copies go
/// whose records are now written (they are servable in the next pass).
pub async fn dispatch_pass<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
) -> Result<bool, StoreError> {
    write_copy_records(core, store).await?;
    let productive = dispatch_pass_if(core, store, now_ms, || true).await?;
    let waiting = core.borrow().copies_waiting();
    write_copy_records(core, store).await?;
    Ok(productive || waiting)
}

/// Writes every copy-record batch waiting, one at a time.
pub async fn write_copy_records<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
) -> Result<(), StoreError> {
    loop {
        let now_ms = core.borrow().now_ms();
        let Some(batch) = core.borrow_mut().take_copy_batch(now_ms) else {
            return Ok(());
        };
        write_copy_batch_if(core, store, batch, || true).await?;
    }
}

/// [`dispatch_pass`] that stops, without handing its reads to `core`, once `current()` says
/// the core was replaced while it read (see [`publish_accepting`]): a scan planned from the old
/// core's cursors would move the new core's past messages it never saw.
pub async fn dispatch_pass_if<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
    current: impl Fn() -> bool,
) -> Result<bool, StoreError> {
    let requests = core.borrow_mut().plan_pass(now_ms);
    for request in &requests {
        let rows = store
            .scan(&request.start, Some(&request.end), request.limit)
            .await?;
        let next = if rows.len() < request.limit {
            store
                .first_key(&request.end, Some(&request.seek_end))
                .await?
        } else {
            None
        };
        if !current() {
            return Ok(false);
        }
        core.borrow_mut()
            .on_scan(now_ms, request, &rows, next.as_deref());
    }
    Ok(core.borrow().productive())
}

/// What one applied delete batch did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeleteApplied {
    /// Keys the batch deleted.
    pub keys: usize,
    /// The batch brought the delete backlog under its bound while dispatch was paused on it: the
    /// shell must wake its dispatcher.
    pub dispatch_resumed: bool,
}

/// Flushes every due delete batch, one at a time (each write awaited before the next is cut).
/// Deletes are durable: an applied delete survives a crash, so an ACKed message is not
/// redelivered after a restart. Returns whether a batch went out. The shell writes batches
/// concurrently instead ([`take_delete_batches`], [`write_delete_batch`]).
pub async fn flush_deletes<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
) -> Result<bool, StoreError> {
    Ok(flush_delete_batch(core, store, now_ms, false)
        .await?
        .is_some())
}

/// Flushes one delete batch: a due one, or with `force` any waiting keys at once (shutdown).
/// Returns what the applied batch did, `None` when no batch went out.
pub async fn flush_delete_batch<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
    force: bool,
) -> Result<Option<DeleteApplied>, StoreError> {
    let Some(batch) = take_delete_batches(core, now_ms, force, 1).pop() else {
        return Ok(None);
    };
    write_delete_batch(core, store, batch).await.map(Some)
}

/// Cuts up to `batches_max` delete batches: the due ones, or with `force` any waiting keys at
/// once (shutdown). The core stops at `deleteBatchesInFlight` batches out; each batch taken must
/// be handed to [`write_delete_batch`], which settles it.
pub fn take_delete_batches(
    core: &RefCell<ShardCore>,
    now_ms: u64,
    force: bool,
    batches_max: usize,
) -> Vec<DeleteBatch> {
    let mut core = core.borrow_mut();
    std::iter::from_fn(|| {
        if force {
            core.take_delete_batch_now(now_ms)
        } else {
            core.take_delete_batch(now_ms)
        }
    })
    .take(batches_max)
    .collect()
}

/// Writes one delete batch durably and settles it in the core: applied, or back to the front of
/// the queue on failure. Several of these may be awaited at once (one per batch out).
pub async fn write_delete_batch<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    batch: DeleteBatch,
) -> Result<DeleteApplied, StoreError> {
    write_delete_batch_if(core, store, batch, || true).await
}

/// [`write_delete_batch`], settling the batch in `core` only while `current()` says it is still
/// the core that cut it (see [`publish_accepting`]).
pub async fn write_delete_batch_if<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    batch: DeleteBatch,
    current: impl Fn() -> bool,
) -> Result<DeleteApplied, StoreError> {
    let result = store.commit(&batch.command(), Sync::Durable).await;
    if !current() {
        return result.map(|_| DeleteApplied {
            keys: batch.keys.len(),
            dispatch_resumed: false,
        });
    }
    match result {
        Ok(_) => {
            let dispatch_resumed = core.borrow_mut().on_delete_applied(&batch);
            Ok(DeleteApplied {
                keys: batch.keys.len(),
                dispatch_resumed,
            })
        }
        Err(error) => {
            core.borrow_mut().on_delete_failed(batch);
            Err(error)
        }
    }
}

/// Writes one batch of copy records durably and settles it in `core` (while `current()` says
/// it is still the core that cut it): applied, or back to the front of the queue on failure.
pub async fn write_copy_batch_if<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    batch: CopyBatch,
    current: impl Fn() -> bool,
) -> Result<usize, StoreError> {
    let command = Command::Copies {
        records: batch.records.clone(),
        deleted: Vec::new(),
        dropped: Vec::new(),
    };
    let result = store.commit(&command, Sync::Durable).await;
    if !current() {
        return result.map(|_| batch.records.len());
    }
    match result {
        Ok(_) => {
            core.borrow_mut().on_copies_applied(&batch);
            Ok(batch.records.len())
        }
        Err(error) => {
            core.borrow_mut().on_copies_failed(batch);
            Err(error)
        }
    }
}

/// What [`read_copy_records`] found.
#[derive(Debug, Default)]
pub struct CopyRecords {
    /// Records of messages still stored.
    pub live: Vec<CopyRecord>,
    /// Records whose message is gone (a record written after its message's delete): to drop.
    pub orphans: Vec<CopyId>,
    /// Records that do not decode (skipped: their copies start their count again).
    pub unreadable: usize,
}

/// Reads every copy record back from the store, page by page (call at start and when a replica
/// starts to lead, before it serves), checking that each one's message is still stored.
pub async fn read_copy_records<S: Store>(store: &S) -> Result<CopyRecords, StoreError> {
    const PAGE_KEYS: usize = 4096;
    let (mut start, end) = copy_key_range();
    let mut found = CopyRecords::default();
    loop {
        let rows = store.scan(&start, Some(&end), PAGE_KEYS).await?;
        for (key, value) in &rows {
            match CopyRecord::from_row(key, value.as_bytes()) {
                Ok(record) if store.get(record.id.key.as_bytes()).await?.is_some() => {
                    found.live.push(record)
                }
                Ok(record) => found.orphans.push(record.id),
                Err(_) => found.unreadable += 1,
            }
        }
        match rows.last() {
            Some((last, _)) if rows.len() == PAGE_KEYS => {
                start = last.clone();
                start.push(0);
            }
            _ => return Ok(found),
        }
    }
}

/// Deletes copy records whose message is gone ([`read_copy_records`]' orphans).
pub async fn drop_copy_records<S: Store>(
    store: &S,
    dropped: Vec<CopyId>,
) -> Result<(), StoreError> {
    if dropped.is_empty() {
        return Ok(());
    }
    let command = Command::Copies {
        records: Vec::new(),
        deleted: Vec::new(),
        dropped,
    };
    store.commit(&command, Sync::Durable).await.map(|_| ())
}

/// Runs a whole janitor sweep if one is due, calling `between_pages` after each page (the shell
/// passes a yield so a long sweep never starves dispatch). Returns whether a sweep ran.
pub async fn sweep<S: Store, F, Fut>(
    core: &RefCell<ShardCore>,
    store: &S,
    now_ms: u64,
    mut between_pages: F,
) -> Result<bool, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(mut page) = core.borrow_mut().begin_sweep(now_ms) else {
        return Ok(false);
    };
    loop {
        let rows = match store.scan(&page.start, None, page.limit).await {
            Ok(rows) => rows,
            Err(error) => {
                core.borrow_mut().abort_sweep(now_ms);
                return Err(error);
            }
        };
        let next = core.borrow_mut().on_sweep_page(now_ms, &rows);
        match next {
            Some(next) => page = next,
            None => return Ok(true),
        }
        between_pages().await;
    }
}

/// Loads every group policy the log has applied into the core (call at start and whenever a
/// fresh core takes over, after [`recover`]). A record that does not decode is skipped and
/// reported: the policy command was checksummed when written, so that is damage, and the group
/// falls back to the `[delivery]` defaults rather than stopping the shard.
pub async fn recover_policies<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
) -> Result<usize, StoreError> {
    let (mut start, end) = crate::log::Command::policy_key_range();
    let page = 256;
    let mut loaded = 0;
    loop {
        let rows = store.scan(&start, Some(&end), page).await?;
        for (key, value) in &rows {
            match crate::log::Command::decode(value.as_bytes()) {
                Ok(crate::log::Command::GroupPolicy {
                    topic,
                    group,
                    policy,
                }) => match core.borrow_mut().set_policy(&topic, &group, policy) {
                    Ok(()) => loaded += 1,
                    Err(e) => tracing::warn!("group policy of {topic:?}/{group:?} not loaded: {e}"),
                },
                Ok(_) | Err(_) => tracing::warn!("unreadable group policy record {key:02x?}"),
            }
        }
        match rows.last() {
            Some((last, _)) if rows.len() == page => {
                start = last.clone();
                start.push(0);
            }
            _ => return Ok(loaded),
        }
    }
}

/// Writes a change of a group's policy durably, then applies it to the core (fields the change
/// leaves `None` keep their value). An empty change only reads. Refused (nothing written) past
/// the bound on policies per shard.
pub async fn set_group_policy<S: Store>(
    core: &RefCell<ShardCore>,
    store: &S,
    topic: &str,
    group: &str,
    policy: crate::pipeline::policy::PolicyOverride,
) -> Result<crate::pipeline::policy::Policy, PolicyFailure> {
    if policy == crate::pipeline::policy::PolicyOverride::default() {
        // Nothing to change: a read, and nothing is written.
        return Ok(core.borrow().policy(topic, group));
    }
    core.borrow().check_policy(topic, group)?;
    let command = crate::log::Command::GroupPolicy {
        topic: topic.to_owned(),
        group: group.to_owned(),
        policy: policy.clone(),
    };
    store.commit(&command, Sync::Durable).await?;
    let mut core = core.borrow_mut();
    core.set_policy(topic, group, policy)?;
    Ok(core.policy(topic, group))
}

/// Why a group policy was not set.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFailure {
    #[error("{0}")]
    Limit(#[from] super::Limit),
    #[error("storage failed: {0}")]
    Store(#[from] StoreError),
}
