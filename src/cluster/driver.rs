//! [`ReplicatedStore`]: a shard's durable state in a cluster, the glommio shell around a
//! [`Replica`] — the Raft log (the shard's WAL) in front of the LSM [`Engine`], behind
//! [`crate::storage::Store`]. The Raft log is a [`Log`]: commits take the standalone store's
//! path ([`CommitPath`]: admission, room under the log-size cap, propose, wait), and the driver
//! applies committed entries through `CommitPath::apply`.
//!
//! ```text
//!  commit(cmd) ──propose──▶ Replica ──Ready──▶ driver loop ──▶ WAL (records; one fdatasync per
//!     ▲                       ▲                  │   │          group commit, never two)
//!     │                 step(peer msg)           │   └──▶ outbox ──▶ transport (peers)
//!     └── waiter(index) ◀── Engine::apply ◀──────┘ committed entries, in order, on every replica
//! ```
//!
//! The driver loop (one task, on the shard's core) wakes on a kick (a proposal, a message from
//! a peer), on the Raft tick, or when the WAL's fdatasync moves past a record the replica waits
//! for; it turns each Ready into work: messages out, the record into the WAL, committed entries
//! into the engine (after `Engine::admit`, the engine's bound on frozen memtables), and resolves
//! the proposals they answer. A proposal resolves once its entry is committed by a quorum and
//! applied here; an entry of another term at its index, or the loss of leadership, fails it
//! (its outcome is then unknown: the client retries, at-least-once).
//!
//! Failure: the driver never ends while the shard serves. If the log or the engine fails
//! (an I/O error, a full disk: the Raft log cannot refuse an entry the group committed, so
//! unlike the standalone store it cannot heal by refusing writes), or the reclaimer finds the
//! engine failed, the replica is marked failed at once ([`Leadership::fail`]: it serves and
//! hands out nothing from that instant), waiting proposals fail, and the shard's role watcher
//! stops the node with the reason (`pinq serve` exits non-zero; the peers elect another leader).
//!
//! Reclaim: after each engine flush, the log is compacted to what the tables hold, but never
//! past what the slowest follower has unless it is further behind than `logRetainEntries`; a
//! checkpoint record (compaction point and hard state) is made durable before the WAL segments
//! it supersedes are removed.
//! Writers waiting for room under the cap look again after each compaction. A follower keeps
//! the same bound: while its log is at the cap with a flush on its way, [`ReplicatedStore::step`]
//! leaves a leader's entries unanswered (counted as `log_full`) and the leader resends them.
//!
//! Open: the engine loads its tables (its manifest's `applied_index` is a Raft index), the WAL's
//! records rebuild the [`RaftLog`], and Raft itself hands back the committed entries past the
//! tables for the engine to apply again.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use futures_channel::oneshot;
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use raft::eraftpb::{Entry, Message};

use super::raft_log::RaftLog;
use super::record::RaftRecord;
use super::replica::{
    carries_command, is_conf_change, quiet_logger, RecordSink, Replica, ReplicaConfig,
    ReplicaStatus, Role,
};
use crate::key::Key;
use crate::log::{recovery, Command, Log, Wal};
use crate::metrics::{RaftDrops, RaftFigures, RaftRecorder, BATCH_BUCKETS, LATENCY_BUCKETS_S};
use crate::ops::ratelimit::monotonic_ms;
use crate::storage::engine::{Engine, LsmEnv, LsmStats, Opened};
use crate::storage::io as dio;
use crate::storage::{CommitPath, Logged, LsmOptions, StoreError, Sync};

/// Bytes of proposals between `commit` and their apply, per shard: a full budget makes
/// proposers wait (the leader's side of the bound; followers are bounded by Raft's in-flight
/// window).
pub const PROPOSAL_BYTES_MAX: u64 = 8 << 20;
mod membership;
mod snapshot;

pub use membership::MembershipNews;

/// Keys read per page while building or installing a snapshot (a page's values are in memory
/// at once: at most this many messages).
const SNAPSHOT_PAGE_KEYS: usize = 256;
/// Raft messages queued for the transport before new ones are dropped (Raft retries).
pub const OUTBOX_MESSAGES_MAX: usize = 4096;

/// Settings of one shard's replica, from `[cluster]`.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub replica: ReplicaConfig,
    pub tick: Duration,
    /// Entries kept past the slowest follower before it is left to a snapshot.
    pub log_retain_entries: u64,
    /// The largest command one entry may carry (it must fit in one transport frame).
    pub entry_bytes_max: usize,
}

/// Where a proposal waits for its entry.
struct Waiter {
    term: u64,
    /// Bytes of `proposal_room` the proposal holds until it is answered.
    units: u64,
    done: oneshot::Sender<Result<u64, StoreError>>,
}

type Answer = oneshot::Receiver<Result<u64, StoreError>>;

/// The WAL as the replica's record sink; remembers which Raft index each record reaches.
struct WalSink<'a> {
    wal: &'a Wal,
    index: &'a RefCell<VecDeque<(u64, u64)>>,
    recorder: &'a RefCell<RaftRecorder>,
}

impl RecordSink for WalSink<'_> {
    type Error = StoreError;

    fn append(&mut self, record: &RaftRecord) -> Result<u64, StoreError> {
        let seq = self.wal.append(record)?;
        if let RaftRecord::Entries { entries, .. } = record {
            self.recorder
                .borrow_mut()
                .append_batch_entries
                .record(entries.len() as u64);
        }
        self.index
            .borrow_mut()
            .push_back((seq, record.last_index()));
        Ok(seq)
    }
}

/// A shard's replicated store. See the module docs.
pub struct ReplicatedStore {
    /// The engine, the WAL under the Raft log, and the log-size cap (`storage.walMaxBytes`).
    path: CommitPath,
    replica: RefCell<Replica>,
    config: DriverConfig,
    waiters: RefCell<BTreeMap<u64, Waiter>>,
    /// The other end of each waiter, taken by `Log::wait_durable` right after the proposal, with
    /// the time it was proposed.
    answers: RefCell<BTreeMap<u64, (Answer, std::time::Instant)>>,
    /// (WAL sequence number, highest Raft index in that record), oldest first.
    record_index: RefCell<VecDeque<(u64, u64)>>,
    kick_tx: LocalSender<()>,
    kick_rx: RefCell<Option<LocalReceiver<()>>>,
    outbox: LocalSender<Vec<Message>>,
    /// The shard's view of this replica's role; the shard watches `role_changed`.
    role: Cell<(Role, bool)>,
    role_changed: crate::storage::signal::Signal,
    proposal_room: glommio::sync::Semaphore,
    closed: Cell<bool>,
    /// Raft messages dropped on their way to and from the transport, by where.
    drops: Cell<RaftDrops>,
    leader_changes: Cell<u64>,
    recorder: RefCell<RaftRecorder>,
    /// Snapshot files built, served, pulled and installed (`snapshot.rs`).
    snapshots: snapshot::Snapshots,
    /// Membership changes applied here, for the node's address book and `cluster status`.
    membership: membership::News,
    /// The driver stopped on this error (the shard watches `role_changed` and stops the node).
    failure: RefCell<Option<StoreError>>,
}

impl ReplicatedStore {
    /// Opens (or creates) the shard's replicated store in `dir`; Raft messages for peers go to
    /// `outbox`. Must run on the shard's executor; call [`ReplicatedStore::start`] next.
    pub async fn open(
        dir: &Path,
        options: LsmOptions,
        config: DriverConfig,
        outbox: LocalSender<Vec<Message>>,
    ) -> Result<ReplicatedStore, StoreError> {
        let segment_bytes_max = options.wal_segment_bytes_max;
        let preallocate_bytes = options.wal_preallocate_bytes;
        let wal_bytes_max = options.wal_bytes_max;
        // Accepting a truncated log here drops entries this replica acknowledged to its
        // leader: only an operator's explicit flag does it (README "WAL recovery").
        let policy = recovery::RecoveryPolicy {
            accept_truncation: options.recover_truncated_wal,
        };
        let Opened {
            engine,
            mut applied_index,
            orphans,
        } = Engine::open_with(dir, options, LsmEnv::default()).await?;
        let mut raft_log = RaftLog::new(config.replica.voters.clone());
        let mut record_index = VecDeque::new();
        let mut log = recovery::recover_records(engine.dir(), 0, policy, |seq, payload| {
            let record = RaftRecord::decode(payload).map_err(|e| {
                format!(
                    "{e} (a data directory a standalone broker wrote must first be converted: \
                     `pinq cluster convert --data-dir <dataDir>`)"
                )
            })?;
            raft_log.apply_record(&record)?;
            record_index.push_back((seq, record.last_index()));
            Ok(())
        })
        .await?;
        // Tables past index 0 and not one record: a standalone directory whose log the tables
        // cover whole (a replica that ever ran keeps at least its last record). Raft would
        // start from index 0 under a state machine that is not empty.
        if record_index.is_empty() && applied_index > 0 {
            return Err(StoreError::NotClustered {
                dir: engine.dir().display().to_string(),
                applied_index,
            });
        }
        engine.remove_orphans(&orphans)?;
        log.finish(engine.dir())?;
        engine.note_log_recovery(&log.report);
        let wal = Rc::new(Wal::new(
            engine.dir(),
            log.next_index,
            log.live_segments,
            segment_bytes_max,
            preallocate_bytes,
        ));
        let genesis = membership::first_conf_record(&raft_log, &config.replica, engine.dir());
        let snapshots = snapshot::Snapshots::default();
        ReplicatedStore::clear_outgoing(engine.dir());
        let interrupted = snapshot::read_marker(engine.dir())?;
        let mut resumed = None;
        if let Some(interrupted) = &interrupted {
            resumed = snapshot::resume_log(&mut raft_log, interrupted)
                .map_err(|e| crate::storage::corrupt(engine.dir(), e))?;
            applied_index = interrupted.index();
        }
        *snapshots.interrupted.borrow_mut() = interrupted;
        let replica = Replica::new(&config.replica, raft_log, applied_index, &quiet_logger())
            .map_err(|e| raft_error(engine.dir(), e))?;
        if let Some(record) = genesis {
            let seq = wal.append(&record)?;
            record_index.push_back((seq, 0));
        }
        if let Some(record) = resumed {
            let seq = wal.append(&record)?;
            record_index.push_back((seq, record.last_index()));
            snapshots.note_resumed_seq(seq);
        }
        let (kick_tx, kick_rx) = local_channel::new_bounded(1);
        let role = (replica.role(), false);
        Ok(ReplicatedStore {
            path: CommitPath::new(Rc::new(engine), wal, wal_bytes_max),
            replica: RefCell::new(replica),
            config,
            waiters: RefCell::new(BTreeMap::new()),
            answers: RefCell::new(BTreeMap::new()),
            record_index: RefCell::new(record_index),
            kick_tx,
            kick_rx: RefCell::new(Some(kick_rx)),
            outbox,
            role: Cell::new(role),
            role_changed: Default::default(),
            proposal_room: glommio::sync::Semaphore::new(PROPOSAL_BYTES_MAX),
            closed: Cell::new(false),
            drops: Cell::new(RaftDrops::default()),
            leader_changes: Cell::new(0),
            recorder: RefCell::new(RaftRecorder::default()),
            snapshots,
            membership: membership::News::default(),
            failure: RefCell::new(None),
        })
    }

    /// Starts the WAL writer, the engine's tasks, the driver loop and the reclaimer.
    pub fn start(self: &Rc<Self>) -> Result<(), StoreError> {
        self.path.wal().start();
        self.path.engine().start()?;
        let Some(kicks) = self.kick_rx.borrow_mut().take() else {
            return Ok(());
        };
        glommio::spawn_local(Rc::clone(self).drive(kicks)).detach();
        glommio::spawn_local(Rc::clone(self).reclaim()).detach();
        Ok(())
    }

    fn kick(&self) {
        let _ = self.kick_tx.try_send(());
    }

    /// A Raft message from a peer's replica of this shard. Entries from a leader wait while
    /// the log is at its byte cap with a flush on its way (the bound the leader's own commits
    /// keep, `CommitPath::must_wait_for_room`): they are left unanswered, counted, and the
    /// leader sends them again.
    pub fn step(self: &Rc<Self>, message: Message) {
        if message.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot {
            self.snapshot_traffic(message);
            return;
        }
        if message.get_msg_type() == raft::eraftpb::MessageType::MsgAppend
            && !message.entries.is_empty()
            && self.path.must_wait_for_room()
        {
            self.count_drops(|d| d.log_full += 1);
            return;
        }
        if self.replica.borrow_mut().step(message).is_ok() {
            self.kick();
        }
    }

    /// Whether this replica may hand out a copy now: it serves, and a quorum answered one of
    /// its heartbeats sent within the lease (see `super::leadership`). Every path that hands
    /// a copy to a consumer or to a dead-letter topic asks this at the moment it does.
    pub fn may_hand_out(&self) -> bool {
        self.replica.borrow().may_hand_out(monotonic_ms())
    }

    /// Until when this leader's lease holds (monotonic ms; `None` when it holds none).
    pub fn lease_until_ms(&self) -> Option<u64> {
        self.replica.borrow().lease_until_ms()
    }

    /// This replica's role and whether it serves (leads and has caught up).
    pub fn role(&self) -> (Role, bool) {
        self.role.get()
    }

    /// Resolves at the next change of [`ReplicatedStore::role`].
    pub fn role_changed(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.role_changed.wait()
    }

    /// Why the driver stopped, if it did (a fatal storage error).
    pub fn failure(&self) -> Option<StoreError> {
        self.failure.borrow().as_ref().map(StoreError::clone_kind)
    }

    pub fn status(&self) -> ReplicaStatus {
        self.replica.borrow().status()
    }

    /// Counts Raft messages the shard dropped on their way to or from the transport.
    pub fn count_drops(&self, count: impl FnOnce(&mut RaftDrops)) {
        let mut drops = self.drops.get();
        count(&mut drops);
        self.drops.set(drops);
    }

    /// Stops the driver for good on `error`: from this instant the replica serves and hands
    /// out nothing, waiting proposals fail, and the shard's role watcher stops the node.
    fn stop(&self, error: StoreError) {
        if self.failure.borrow().is_some() {
            return;
        }
        tracing::error!(dir = %self.path.engine().dir().display(), "the raft driver stops: {error}");
        self.replica.borrow_mut().fail();
        self.fail_waiters(&error);
        *self.failure.borrow_mut() = Some(error);
        self.path.reclaimed().notify();
        self.note_role();
        self.role_changed.notify();
    }

    /// The driver loop. See the module docs.
    async fn drive(self: Rc<Self>, kicks: LocalReceiver<()>) {
        if let Err(e) = self.finish_interrupted_install().await {
            self.stop(e);
            return;
        }
        let mut next_tick = std::time::Instant::now() + self.config.tick;
        while !self.closed.get() {
            // The log or the engine failed (a failed fdatasync is seen here even when no new
            // record would notice it): the node cannot go on with this shard. The shard's
            // role watcher sees this and stops the broker (no shard left wedged).
            let healthy = self
                .path
                .wal()
                .check()
                .and_then(|()| self.path.engine().check_writable());
            if let Err(e) = healthy {
                if !self.closed.get() {
                    self.stop(e);
                }
                return;
            }
            if let Err(e) = self.run_work().await {
                self.stop(e);
                return;
            }
            if self.replica.borrow().snapshot_wanted() {
                self.snapshot_asked();
            }
            let now = std::time::Instant::now();
            if now >= next_tick {
                self.replica.borrow_mut().tick();
                next_tick = now + self.config.tick;
                continue;
            }
            let pending = self.replica.borrow().oldest_unpersisted_seq();
            let wal = Rc::clone(self.path.wal());
            let durable = async move {
                match pending {
                    Some(seq) => {
                        let _ = wal.wait_durable(seq).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let sleep = glommio::timer::sleep(next_tick - now);
            futures_lite::future::or(
                futures_lite::future::or(
                    async {
                        sleep.await;
                    },
                    async {
                        let _ = kicks.recv().await;
                    },
                ),
                durable,
            )
            .await;
        }
    }

    /// Handles every Ready there is: messages out, records in, committed entries applied.
    async fn run_work(&self) -> Result<(), StoreError> {
        loop {
            let released = self
                .replica
                .borrow_mut()
                .durable(self.path.wal().synced_seq());
            self.send(released);
            let work = {
                let mut sink = WalSink {
                    wal: self.path.wal(),
                    index: &self.record_index,
                    recorder: &self.recorder,
                };
                self.replica.borrow_mut().next_work(&mut sink)?
            };
            let Some(work) = work else {
                self.note_role();
                return Ok(());
            };
            self.send(work.messages);
            if let Some(snapshot) = work.snapshot {
                self.install_snapshot(snapshot, work.deferred).await?;
            }
            if work.role.is_some_and(|r| !r.leader) {
                self.fail_waiters(&StoreError::LeadershipLost);
            }
            self.apply(work.committed).await?;
            self.note_role();
        }
    }

    /// Applies one command to the engine after its admission (the bound on frozen memtables);
    /// the log-size cap freezes the memtable as standalone does, and a freeze starts a new
    /// log segment.
    async fn apply_one(&self, index: u64, command: &Command) -> Result<(), StoreError> {
        let turn = self.path.engine().admit().await?;
        self.path.apply(index, command);
        drop(turn);
        Ok(())
    }

    fn send(&self, mut messages: Vec<Message>) {
        if messages.is_empty() {
            return;
        }
        // Heartbeats carry their send time: the lease counts from it (see `super::leadership`).
        self.replica
            .borrow_mut()
            .stamp(monotonic_ms(), &mut messages);
        let n = messages.len() as u64;
        let snapshots: Vec<u64> = messages
            .iter()
            .filter(|m| m.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot)
            .map(|m| m.to)
            .collect();
        if self.outbox.try_send(messages).is_err() {
            self.count_drops(|d| d.outbox_full += n);
        }
        for to in snapshots {
            // Sent or dropped, the leader probes the follower again: a lost snapshot makes it
            // reject, and the core asks for one again.
            self.replica.borrow_mut().snapshot_sent(to);
        }
    }

    /// Applies committed entries in order and resolves the proposals they answer.
    async fn apply(&self, entries: Vec<Entry>) -> Result<(), StoreError> {
        let Some(last) = entries.last().map(|e| e.index) else {
            return Ok(());
        };
        for entry in &entries {
            if is_conf_change(entry) {
                self.apply_conf_change(entry).await?;
            } else if carries_command(entry) {
                let command = Command::decode(&entry.data).map_err(|e| {
                    crate::storage::io_error(
                        self.path.engine().dir(),
                        std::io::Error::other(format!(
                            "committed raft entry {} does not hold a command: {e}",
                            entry.index
                        )),
                    )
                })?;
                self.apply_one(entry.index, &command).await?;
            }
            self.resolve(entry);
        }
        self.replica.borrow_mut().applied_to(last);
        Ok(())
    }

    fn resolve(&self, entry: &Entry) {
        let mut waiters = self.waiters.borrow_mut();
        // Waiters below this index whose entries were replaced never see theirs.
        while let Some((&index, _)) = waiters.first_key_value() {
            if index > entry.index {
                break;
            }
            if let Some((index, waiter)) = waiters.pop_first() {
                let result = if index == entry.index && waiter.term == entry.term {
                    Ok(index)
                } else {
                    Err(StoreError::LeadershipLost)
                };
                self.proposal_room.signal(waiter.units);
                let _ = waiter.done.send(result);
            }
        }
    }

    fn fail_waiters(&self, error: &StoreError) {
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        for (_, waiter) in waiters {
            self.proposal_room.signal(waiter.units);
            let _ = waiter.done.send(Err(error.clone_kind()));
        }
    }

    fn note_role(&self) {
        let replica = self.replica.borrow();
        let now = (replica.role(), replica.serving());
        drop(replica);
        if now != self.role.get() {
            if now.0.leader_id != self.role.get().0.leader_id && now.0.leader_id != 0 {
                self.leader_changes.set(self.leader_changes.get() + 1);
            }
            self.role.set(now);
            self.role_changed.notify();
        }
    }

    /// This replica's figures for `/metrics`.
    pub fn raft_figures(&self) -> RaftFigures {
        let status = self.status();
        let recorder = self.recorder.borrow();
        RaftFigures {
            term: status.term,
            serving: status.serving,
            commit: status.commit,
            applied: status.applied,
            leader_changes: self.leader_changes.get(),
            drops: self.drops.get(),
            closes_lost: 0, // the shard's figure (`Shard::raft_figures`)
            // The shard's transport's figures (`Shard::raft_figures`).
            peers_connected: 0,
            connections_established: 0,
            handshake_refusals: 0,
            connections_shed: 0,
            commit_latency: recorder.commit_latency.snapshot(LATENCY_BUCKETS_S),
            append_batch_entries: recorder.append_batch_entries.snapshot(BATCH_BUCKETS),
            follower_lag: status
                .followers
                .iter()
                .map(|f| (f.id, status.commit.saturating_sub(f.matched)))
                .collect(),
        }
    }

    /// Compacts the log after each engine flush. See the module docs.
    async fn reclaim(self: Rc<Self>) {
        while !self.closed.get() {
            self.path.engine().flushed().await;
            if self.closed.get() {
                break;
            }
            if let Err(e) = self.path.engine().check_writable() {
                // The engine failed for good: the driver must not outlive it.
                self.stop(e);
                break;
            }
            if self.snapshots.installing.get().is_some() {
                // The engine's flushed index is the snapshot's, not yet the log's.
                continue;
            }
            if let Err(e) = self.compact().await {
                tracing::warn!(dir = %self.path.engine().dir().display(), "raft log compaction: {e}");
            }
            // Writers and appends waiting for room in the log look again.
            self.path.reclaimed().notify();
        }
        self.path.reclaimed().notify();
    }

    async fn compact(&self) -> Result<(), StoreError> {
        let flushed = self.path.engine().flushed_index();
        let point = {
            let replica = self.replica.borrow();
            let applied = replica.applied();
            // Entries a lagging follower may still want are kept, within both bounds: at most
            // `logRetainEntries` of them and at most the WAL cap in bytes (past either, the
            // follower gets a snapshot).
            let floor = applied.saturating_sub(self.config.log_retain_entries).max(
                replica
                    .log()
                    .compact_point_for_bytes(self.path.wal_bytes_max() as usize),
            );
            let keep_for = replica.min_follower_match().unwrap_or(flushed);
            flushed.min(keep_for.max(floor))
        };
        let (base, _) = self.replica.borrow().log().base();
        if point <= base {
            return Ok(());
        }
        let (index, term) = self.replica.borrow_mut().compact_to(point).map_err(|e| {
            crate::storage::io_error(self.path.engine().dir(), std::io::Error::other(e))
        })?;
        let hard_state = self.replica.borrow().log().hard_state().clone();
        let conf = Some(self.replica.borrow().log().conf_at(index));
        let seq = self.path.wal().append(&RaftRecord::Checkpoint {
            index,
            term,
            hard_state,
            conf,
        })?;
        self.record_index.borrow_mut().push_back((seq, index));
        self.path.wal().wait_durable(seq).await?;
        // Every record before the last one reaching past `index` is superseded.
        let through = {
            let mut records = self.record_index.borrow_mut();
            let mut through = 0;
            while let Some(&(seq, reach)) = records.front() {
                if reach > index || records.len() == 1 {
                    break;
                }
                through = seq;
                records.pop_front();
            }
            through
        };
        for path in self.path.wal().release_through(through) {
            dio::remove(&path).await?;
        }
        Ok(())
    }

    /// Graceful shutdown of a leader: hands leadership to the most up-to-date follower and
    /// waits (at most `wait`) until it took over, so clients fail over without waiting for an
    /// election timeout. Nothing happens on a follower.
    pub async fn hand_over(&self, wait: Duration) {
        let Some(to) = self.replica.borrow_mut().transfer_leadership() else {
            return;
        };
        self.kick();
        let deadline = std::time::Instant::now() + wait;
        while self.replica.borrow().role().leader && std::time::Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let handed = !self.replica.borrow().role().leader;
        tracing::info!(dir = %self.path.engine().dir().display(), to, handed, "leadership handed over for the shutdown");
    }

    /// Graceful close: fails waiting proposals, flushes the memtable (if configured), syncs the
    /// log and stops the tasks.
    pub async fn close(&self) -> Result<(), StoreError> {
        self.closed.set(true);
        self.kick();
        self.fail_waiters(&StoreError::Closed);
        self.path.reclaimed().notify();
        let flush = self.path.engine().flush_on_close();
        let result = self.path.engine().begin_close(flush).await;
        if matches!(result, Err(StoreError::Closed)) {
            return result;
        }
        let wal_result = self.path.wal().shutdown().await;
        self.path.engine().finish_close().await;
        result.and(wal_result)
    }

    pub fn stats(&self) -> LsmStats {
        crate::storage::lsm::stats_of(self.path.engine(), self.path.wal())
    }

    /// The engine's health (its Raft log fails for good on a full disk, as before).
    pub fn health(&self) -> crate::storage::StoreHealth {
        self.path.engine().health()
    }
}

fn raft_error(dir: &Path, e: raft::Error) -> StoreError {
    crate::storage::io_error(dir, std::io::Error::other(format!("raft: {e}")))
}

impl Logged for ReplicatedStore {
    type Log = ReplicatedStore;

    fn path(&self) -> &CommitPath {
        &self.path
    }

    fn log(&self) -> &ReplicatedStore {
        self
    }
}

/// The shard's Raft log behind the `Log` seam: a proposal is taken into the leader's log, and
/// resolves once a quorum committed it and it is applied here (the driver applies committed
/// entries on every replica, through `CommitPath::apply`).
impl Log for ReplicatedStore {
    fn applies_at_append(&self) -> bool {
        false
    }

    /// Waits for room among the proposals in flight (`PROPOSAL_BYTES_MAX`), then hands the
    /// command to the raft core: its index once this leader appended it.
    async fn propose(&self, command: &Command) -> Result<u64, StoreError> {
        let data = command.to_bytes();
        if data.len() > self.config.entry_bytes_max {
            return Err(StoreError::TooLarge {
                bytes: data.len(),
                max: self.config.entry_bytes_max,
            });
        }
        let units = (data.len() as u64).clamp(1, PROPOSAL_BYTES_MAX);
        self.proposal_room
            .acquire(units)
            .await
            .map_err(|_| StoreError::Closed)?;
        let proposed = self.replica.borrow_mut().propose(data);
        let (term, index) = proposed.map_err(|e| {
            self.proposal_room.signal(units);
            match e {
                super::replica::ProposeError::NotLeader { leader } => {
                    StoreError::NotLeader { leader }
                }
                super::replica::ProposeError::Dropped
                | super::replica::ProposeError::ChangeInProgress => StoreError::LeadershipLost,
            }
        })?;
        let (done, answer) = oneshot::channel();
        let waiter = Waiter { term, units, done };
        self.waiters.borrow_mut().insert(index, waiter);
        let now = std::time::Instant::now();
        self.answers.borrow_mut().insert(index, (answer, now));
        self.kick();
        Ok(index)
    }

    fn wait_durable(
        &self,
        index: u64,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> {
        // Taken now, not at the first poll: nothing is left behind if the caller drops it.
        let answer = self.answers.borrow_mut().remove(&index);
        async move {
            let (answer, proposed) = answer.ok_or(StoreError::LeadershipLost)?;
            answer.await.map_err(|_| StoreError::LeadershipLost)??;
            let us = proposed.elapsed().as_micros() as u64;
            self.recorder.borrow_mut().commit_latency.record(us);
            Ok(())
        }
    }

    async fn settle_empty(&self, _sync: Sync) -> Result<u64, StoreError> {
        Ok(self.replica.borrow().applied())
    }
}

/// One page of a snapshot as the commands a follower applies: the page's messages (with its
/// idempotent-publish entries, so a follower that leads later answers republishes as this
/// leader does), then each group policy as its own command (it dead-letters and backs off the
/// same way), then the copy records (it neither redelivers a copy a group ACKed durably nor
/// counts deliveries from 1 again).
fn snapshot_page(
    rows: Vec<(Key, crate::message::Value)>,
    event_id_high_water: u64,
    command_bytes: usize,
) -> Vec<Command> {
    let remember: Vec<_> = rows
        .iter()
        .filter(|(k, _)| crate::log::sequences::is_sequence_key(k))
        .filter_map(|(_, v)| crate::log::sequences::SequenceEntry::from_value(v.as_bytes()).ok())
        .collect();
    let policies: Vec<Command> = rows
        .iter()
        .filter(|(k, _)| Command::is_policy_key(k))
        .filter_map(|(_, v)| Command::decode(v.as_bytes()).ok())
        .filter(|c| matches!(c, Command::GroupPolicy { .. }))
        .collect();
    let records: Vec<_> = rows
        .iter()
        .filter_map(|(k, v)| crate::log::copies::CopyRecord::from_row(k, v.as_bytes()).ok())
        .collect();
    let mut commands = store_commands(rows, event_id_high_water, command_bytes);
    if !remember.is_empty() {
        commands.push(Command::StoreSequenced {
            messages: Vec::new(),
            event_id_high_water,
            remember,
            forget: Vec::new(),
        });
    }
    commands.extend(policies);
    if !records.is_empty() {
        commands.push(Command::Copies {
            records,
            deleted: Vec::new(),
            dropped: Vec::new(),
        });
    }
    commands
}

/// A page's messages as `Store` commands of about `command_bytes` each (one message at least).
fn store_commands(
    rows: Vec<(Key, crate::message::Value)>,
    event_id_high_water: u64,
    command_bytes: usize,
) -> Vec<Command> {
    let mut commands = Vec::new();
    let mut messages = Vec::new();
    let mut bytes = 0;
    for (k, v) in rows {
        let Ok(key) = crate::key::EventKey::parse(&k) else {
            continue;
        };
        if bytes + v.len() > command_bytes && !messages.is_empty() {
            commands.push(Command::Store {
                messages: std::mem::take(&mut messages),
                event_id_high_water,
            });
            bytes = 0;
        }
        bytes += v.len() + k.len();
        messages.push((key, v));
    }
    if !messages.is_empty() {
        commands.push(Command::Store {
            messages,
            event_id_high_water,
        });
    }
    commands
}
