//! The driver's part of snapshots (`crate::cluster::snapshot` holds the formats and the pull's
//! bookkeeping): the leader builds the snapshot file once and serves its chunks; a follower
//! pulls the stream into a staging engine, steps the offer into its raft core once the stream
//! is whole, and installs it with one atomic switch, so that a crash at any point leaves the
//! old state or the new one.
//!
//! **Files.** `<shard>/snapshot-out/<index>-<term>.snap` on a leader (one at a time, removed
//! when a newer one replaces it and at start). On a follower, a staging engine in
//! `<shard>/snapshot-in/<leader>-<index>-<term>-<hash>/`: the pull applies each chunk's
//! commands to it as the chunk arrives (bounded by its small memtables: the pull's memory does
//! not grow with the snapshot), and once the stream's size, command count and hash match the
//! offer, it flushes and closes (its manifest durable) before the offer is stepped.
//!
//! **Install.** Before the shard's engine is touched, `snapshot-in/INSTALLING` is written
//! (atomically: a temporary file, fdatasync, rename, directory sync) naming the staging
//! engine, the snapshot's index, term and membership. Then the engine adopts the staging
//! engine's tables ([`crate::storage::engine::Engine::adopt`]: hard links and one manifest
//! commit carrying the snapshot's index, the switch), the checkpoint (and the Ready's other
//! records) are made durable, and only then is the marker removed. A crash before the marker
//! leaves the old state; a crash after it leaves a marker, and the next start finishes the
//! install before the replica does anything else: the raft log gets the checkpoint if it lacks
//! it, and the engine adopts the staged tables unless its manifest already carries the
//! snapshot's index (the switch happened). Only the adopt changes the engine, and it is one
//! atomic manifest change, so the engine never holds a mix of the two states.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use raft::eraftpb::{ConfState, Message, MessageType, Snapshot};
use xxhash_rust::xxh3::Xxh3;

use super::{snapshot_page, ReplicatedStore, SNAPSHOT_PAGE_KEYS};
use crate::cluster::raft_log::RaftLog;
use crate::cluster::record::RaftRecord;
use crate::cluster::snapshot::{
    classify, encode_chunk, push_command, Chunk, ChunkRequest, CommandReader, Descriptor, Fetch,
    InstallPoint, SnapshotId, Taken, Traffic,
};
use crate::key::Key;
use crate::log::wal::Payload;
use crate::ops::ratelimit::monotonic_ms;
use crate::storage::engine::{Engine, LsmEnv};
use crate::storage::io::{self as dio, DmaWriter};
use crate::storage::signal::Signal;
use crate::storage::{corrupt, LsmOptions, StoreError};

/// How long after a failed snapshot build the next one may start.
const RETRY_AFTER: Duration = Duration::from_secs(10);
/// Largest chunk (smaller when `cluster.maxFrameBytes` is small).
const CHUNK_BYTES_MAX: usize = 1 << 20;
/// A staging engine's memtable, at most (it has one more frozen): the bound on what a pull
/// holds in memory besides its queued chunks.
const STAGING_MEMTABLE_BYTES: usize = 32 << 20;
/// Messages of a page grouped into one `Store` command, by bytes.
const COMMAND_BYTES: usize = 1 << 20;
/// Requests a leader queues per follower (one more is dropped: the follower asks again).
const QUEUED_REQUESTS_MAX: usize = crate::cluster::snapshot::WINDOW_CHUNKS as usize;
/// Chunks a follower queues between its transport and its writer.
const QUEUE_CHUNKS: usize = 2 * crate::cluster::snapshot::WINDOW_CHUNKS as usize;
/// How often a pulling follower looks at its progress.
const PULL_TICK: Duration = Duration::from_millis(100);
const OUT_DIR: &str = "snapshot-out";
const IN_DIR: &str = "snapshot-in";
const MARKER: &str = "INSTALLING";
const MARKER_TMP: &str = "INSTALLING.tmp";
/// See [`stop_here_if_asked`].
const FAULT_INSTALL_STOP_ENV: &str = "PINQ_FAULT_INSTALL_STOP";

/// A shard's snapshot state, both roles.
#[derive(Default)]
pub(super) struct Snapshots {
    /// Leader: the file offered now.
    outgoing: RefCell<Option<Outgoing>>,
    building: Cell<bool>,
    not_before: Cell<Option<Instant>>,
    /// Leader: per follower, the requests its one serving task has yet to answer (in order:
    /// the follower takes chunks in order only).
    serving: RefCell<BTreeMap<u64, VecDeque<ChunkRequest>>>,
    /// Follower: the pull in progress.
    incoming: RefCell<Option<Incoming>>,
    /// Follower: whole files whose offers were stepped, by snapshot.
    staged: RefCell<Vec<(SnapshotId, PathBuf)>>,
    /// An install started before the last stop and must be finished first.
    pub(super) interrupted: RefCell<Option<Interrupted>>,
    /// The snapshot an install is switching in: the reclaimer does not compact meanwhile,
    /// and a newer pull does not remove its staging engine.
    pub(super) installing: Cell<Option<SnapshotId>>,
    /// The checkpoint record written at open for an unfinished install.
    resumed_seq: Cell<u64>,
}

struct Outgoing {
    descriptor: Descriptor,
    path: PathBuf,
}

struct Incoming {
    fetch: Fetch,
    offer: Message,
    queue: Vec<Message>,
    arrived: Rc<Signal>,
}

/// What the marker of an unfinished install says.
pub(super) struct Interrupted {
    descriptor: Descriptor,
    conf: ConfState,
}

impl ReplicatedStore {
    fn chunk_bytes(&self) -> u32 {
        let fit = (self.config.entry_bytes_max / 2) / dio::WRITE_ALIGN * dio::WRITE_ALIGN;
        fit.clamp(dio::WRITE_ALIGN, CHUNK_BYTES_MAX) as u32
    }

    /// Raft asked for a snapshot to send: build one unless a build runs or failed lately.
    pub(super) fn snapshot_asked(self: &Rc<Self>) {
        let s = &self.snapshots;
        if s.building.get() || s.not_before.get().is_some_and(|t| Instant::now() < t) {
            return;
        }
        s.building.set(true);
        glommio::spawn_local(Rc::clone(self).build_snapshot()).detach();
    }

    /// Builds the snapshot file at the applied index and offers it to the raft core.
    async fn build_snapshot(self: Rc<Self>) {
        let result = self.snapshot_file().await;
        self.snapshots.building.set(false);
        match result {
            Ok(Some(snapshot)) => {
                self.replica.borrow_mut().offer_snapshot(snapshot);
                self.kick();
            }
            Ok(None) => {}
            Err(e) => {
                self.snapshots
                    .not_before
                    .set(Some(Instant::now() + RETRY_AFTER));
                tracing::warn!(dir = %self.dir().display(), "cannot build a snapshot for a follower (next try in {RETRY_AFTER:?}): {e}");
            }
        }
    }

    fn dir(&self) -> &Path {
        self.path.engine().dir()
    }

    async fn snapshot_file(&self) -> Result<Option<Snapshot>, StoreError> {
        let Some((index, term, conf_state)) = self.replica.borrow().snapshot_point() else {
            return Ok(None);
        };
        let started = Instant::now();
        let out_dir = self.dir().join(OUT_DIR);
        std::fs::create_dir_all(&out_dir).map_err(|e| crate::storage::io_error(&out_dir, e))?;
        let path = out_dir.join(format!("{index}-{term}.snap"));
        let tmp = path.with_extension("tmp");
        let (bytes, commands, hash) = self.write_state(&tmp).await?;
        dio::rename(&tmp, &path).await?;
        dio::sync_dir(&out_dir).await?;
        let descriptor = Descriptor {
            leader: self.config.replica.id,
            index,
            term,
            bytes,
            commands,
            chunk_bytes: self.chunk_bytes(),
            hash,
        };
        let old = self.snapshots.outgoing.replace(Some(Outgoing {
            descriptor,
            path: path.clone(),
        }));
        if let Some(old) = old.filter(|o| o.path != path) {
            let _ = dio::remove(&old.path).await;
        }
        tracing::info!(dir = %self.dir().display(), index, bytes, commands, took = ?started.elapsed(), "snapshot built for a follower behind the log");
        let mut snapshot = Snapshot {
            data: descriptor.encode().into(),
            ..Default::default()
        };
        let meta = snapshot.mut_metadata();
        meta.index = index;
        meta.term = term;
        meta.set_conf_state(conf_state);
        Ok(Some(snapshot))
    }

    /// Writes the state machine's commands to `path`: (bytes, commands, xxh3).
    async fn write_state(&self, path: &Path) -> Result<(u64, u64, u64), StoreError> {
        let mut writer = DmaWriter::create(path, CHUNK_BYTES_MAX).await?;
        let mut hasher = Xxh3::new();
        let mut commands = 0u64;
        let mut buf = Vec::new();
        let mut start = Key::new();
        loop {
            let rows = self
                .path
                .engine()
                .scan(&start, None, SNAPSHOT_PAGE_KEYS)
                .await?;
            let full = rows.len() == SNAPSHOT_PAGE_KEYS;
            if let Some((last, _)) = rows.last() {
                start = last.clone();
                start.push(0);
            }
            let high_water = self.path.engine().event_id_high_water();
            for command in snapshot_page(rows, high_water, COMMAND_BYTES) {
                push_command(&mut buf, &command);
                commands += 1;
            }
            if !full {
                // The high-water mark as of the end of the scan, in its own command.
                push_command(
                    &mut buf,
                    &crate::log::Command::Store {
                        messages: Vec::new(),
                        event_id_high_water: high_water,
                    },
                );
                commands += 1;
            }
            hasher.update(&buf);
            if let Err(e) = writer.append(&buf).await {
                writer.abandon().await;
                return Err(e);
            }
            buf.clear();
            if !full {
                break;
            }
        }
        let bytes = writer.finish().await?;
        Ok((bytes, commands, hasher.digest()))
    }

    /// A `MsgSnapshot` from a peer: an offer, a chunk, or a request for chunks.
    pub(super) fn snapshot_traffic(self: &Rc<Self>, message: Message) {
        let traffic = classify(&message.get_snapshot().data[..]);
        match traffic {
            Ok(Traffic::Offer(d)) => self.offered(d, message),
            Ok(Traffic::Request(r)) => self.chunks_requested(message.from, r),
            Ok(Traffic::Chunk(c)) => {
                let id = c.id;
                self.chunk_arrived(id, message);
            }
            Err(e) => {
                self.count_drops(|d| d.snapshot_malformed += 1);
                tracing::debug!(dir = %self.dir().display(), from = message.from, "snapshot message refused: {e}");
            }
        }
    }

    /// Sends one message of the snapshot stream (not through `send`: only offers are what the
    /// raft core's snapshot accounting counts).
    fn send_stream(&self, to: u64, data: Vec<u8>) {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgSnapshot);
        message.to = to;
        message.from = self.config.replica.id;
        message.mut_snapshot().data = data.into();
        if self.outbox.try_send(vec![message]).is_err() {
            self.count_drops(|d| d.outbox_full += 1);
        }
    }

    fn chunks_requested(self: &Rc<Self>, from: u64, request: ChunkRequest) {
        let mut serving = self.snapshots.serving.borrow_mut();
        if let Some(queue) = serving.get_mut(&from) {
            if queue.len() >= QUEUED_REQUESTS_MAX {
                self.count_drops(|d| d.snapshot_busy += 1);
            } else {
                queue.push_back(request);
            }
            return;
        }
        serving.insert(from, VecDeque::from([request]));
        drop(serving);
        glommio::spawn_local(Rc::clone(self).serve(from)).detach();
    }

    /// Answers follower `to`'s requests in order until none is left.
    async fn serve(self: Rc<Self>, to: u64) {
        loop {
            let next = self
                .snapshots
                .serving
                .borrow_mut()
                .get_mut(&to)
                .and_then(VecDeque::pop_front);
            let Some(request) = next else {
                self.snapshots.serving.borrow_mut().remove(&to);
                return;
            };
            let target = self
                .snapshots
                .outgoing
                .borrow()
                .as_ref()
                .filter(|o| o.descriptor.id() == request.id)
                .map(|o| (o.descriptor, o.path.clone()));
            // An older snapshot's request is not answered: the follower gives it up and takes
            // the next offer.
            let Some((descriptor, path)) = target else {
                continue;
            };
            if let Err(e) = self.serve_chunks(to, descriptor, &path, request).await {
                tracing::warn!(dir = %self.dir().display(), to, "cannot send snapshot chunks: {e}");
            }
        }
    }

    async fn serve_chunks(
        &self,
        to: u64,
        d: Descriptor,
        path: &Path,
        request: ChunkRequest,
    ) -> Result<(), StoreError> {
        let window = crate::cluster::snapshot::WINDOW_CHUNKS;
        let end = (request.first + u64::from(request.count).min(window)).min(d.chunks());
        let file = dio::open_read(path).await?;
        for number in request.first..end {
            let (at, len) = d.chunk_range(number);
            let read = match dio::read_exact_at(&file, path, at, len).await {
                Ok(read) => read,
                Err(e) => {
                    let _ = dio::close(file, path).await;
                    return Err(e);
                }
            };
            self.send_stream(to, encode_chunk(&request.id, number, &read));
        }
        dio::close(file, path).await
    }

    /// An offer: pull its file unless this pull runs already, or step it if the file is here.
    fn offered(self: &Rc<Self>, d: Descriptor, offer: Message) {
        if self.staged_path(&d.id()).is_some() {
            self.step_offer(offer);
            return;
        }
        let mut incoming = self.snapshots.incoming.borrow_mut();
        if incoming.as_ref().is_some_and(|i| i.fetch.descriptor == d) {
            return;
        }
        let arrived = Rc::new(Signal::default());
        *incoming = Some(Incoming {
            fetch: Fetch::new(d, monotonic_ms()),
            offer,
            queue: Vec::new(),
            arrived: Rc::clone(&arrived),
        });
        drop(incoming);
        tracing::info!(dir = %self.dir().display(), leader = d.leader, index = d.index, bytes = d.bytes, "pulling a snapshot from the leader");
        glommio::spawn_local(Rc::clone(self).pull(d)).detach();
    }

    fn step_offer(&self, offer: Message) {
        if self.replica.borrow_mut().step(offer).is_ok() {
            self.kick();
        }
    }

    fn chunk_arrived(&self, id: SnapshotId, message: Message) {
        let mut incoming = self.snapshots.incoming.borrow_mut();
        let Some(i) = incoming.as_mut().filter(|i| i.fetch.descriptor.id() == id) else {
            return;
        };
        if i.queue.len() >= QUEUE_CHUNKS {
            self.count_drops(|d| d.snapshot_busy += 1);
            return;
        }
        i.queue.push(message);
        i.arrived.notify();
    }

    /// Pulls the file of offer `d`; when it is whole, steps the offer into the raft core.
    async fn pull(self: Rc<Self>, d: Descriptor) {
        let started = Instant::now();
        let result = self.pull_file(d).await;
        let offer = {
            let mut incoming = self.snapshots.incoming.borrow_mut();
            let mine = incoming.as_ref().is_some_and(|i| i.fetch.descriptor == d);
            if mine {
                incoming.take().map(|i| i.offer)
            } else {
                None
            }
        };
        match (result, offer) {
            (Ok(path), Some(offer)) => {
                tracing::info!(dir = %self.dir().display(), index = d.index, bytes = d.bytes, took = ?started.elapsed(), "snapshot pulled");
                self.stage(d.id(), path).await;
                self.step_offer(offer);
            }
            (Ok(path), None) => {
                let _ = dio::remove(&path).await;
            }
            (Err(e), _) => {
                tracing::warn!(dir = %self.dir().display(), index = d.index, "snapshot pull given up (the leader offers again): {e}");
            }
        }
    }

    /// Keeps a pulled staging engine for its install; any other that raft never took goes,
    /// but not the one an install is using: at most two are kept.
    async fn stage(&self, id: SnapshotId, path: PathBuf) {
        let installing = self.snapshots.installing.get();
        let old: Vec<_> = {
            let mut staged = self.snapshots.staged.borrow_mut();
            let (keep, old) = staged.drain(..).partition(|(s, _)| Some(*s) == installing);
            *staged = keep;
            staged.push((id, path));
            old
        };
        for (_, old) in old {
            remove_staged(&old).await;
        }
    }

    fn staged_path(&self, id: &SnapshotId) -> Option<PathBuf> {
        let staged = self.snapshots.staged.borrow();
        staged.iter().find(|(s, _)| s == id).map(|(_, p)| p.clone())
    }

    /// Pulls offer `d` into a staging engine of its own (`snapshot-in/<leader>-<index>-<term>-
    /// <hash>/`), applying each chunk's commands as it arrives; once the stream is whole and
    /// matches the offer's size, command count and hash, the staging engine flushes and closes.
    async fn pull_file(&self, d: Descriptor) -> Result<PathBuf, StoreError> {
        let dir = staged_dir(self.dir(), &d);
        remove_staged(&dir).await;
        std::fs::create_dir_all(&dir).map_err(|e| crate::storage::io_error(&dir, e))?;
        let live = self.path.engine();
        let env = LsmEnv {
            clock: None,
            background_queue: Some(live.background_queue()),
        };
        let staging = Engine::open_with(&dir, staging_options(live.options()), env)
            .await?
            .engine;
        let mut load = Load::new(&staging, self.config.entry_bytes_max);
        let loaded = match staging.start() {
            Ok(()) => self.pull_chunks(d, &mut load).await,
            Err(e) => Err(e),
        };
        let checked = loaded.and_then(|()| load.check(&d, &dir));
        let closed = staging.begin_close(checked.is_ok()).await;
        staging.finish_close().await;
        match checked.and(closed) {
            Ok(()) => Ok(dir),
            Err(e) => {
                remove_staged(&dir).await;
                Err(e)
            }
        }
    }

    async fn pull_chunks(&self, d: Descriptor, load: &mut Load<'_>) -> Result<(), StoreError> {
        let gone = || corrupt(self.dir(), "the snapshot pull was replaced or stopped");
        loop {
            let arrived = {
                let mut incoming = self.snapshots.incoming.borrow_mut();
                let i = incoming
                    .as_mut()
                    .filter(|i| i.fetch.descriptor == d && !self.closed.get())
                    .ok_or_else(gone)?;
                std::mem::take(&mut i.queue)
            };
            for message in arrived {
                self.load_chunk(d, &message, load).await?;
            }
            // No await from here to the wait: a chunk arriving after this look wakes it.
            let (requests, signal, complete, queued) = {
                let mut incoming = self.snapshots.incoming.borrow_mut();
                let i = incoming
                    .as_mut()
                    .filter(|i| i.fetch.descriptor == d)
                    .ok_or_else(gone)?;
                if let Err(e) = i.fetch.due(monotonic_ms()) {
                    incoming.take();
                    return Err(corrupt(self.dir(), e.to_string()));
                }
                let requests: Vec<ChunkRequest> =
                    std::iter::from_fn(|| i.fetch.request()).collect();
                let queued = !i.queue.is_empty();
                (requests, Rc::clone(&i.arrived), i.fetch.complete(), queued)
            };
            if complete {
                return Ok(());
            }
            for r in requests {
                self.send_stream(d.leader, r.encode());
            }
            if !queued {
                futures_lite::future::or(signal.wait(), async {
                    glommio::timer::sleep(PULL_TICK).await;
                })
                .await;
            }
        }
    }

    async fn load_chunk(
        &self,
        d: Descriptor,
        message: &Message,
        load: &mut Load<'_>,
    ) -> Result<(), StoreError> {
        let Ok(Traffic::Chunk(chunk)) = classify(&message.get_snapshot().data[..]) else {
            return Ok(());
        };
        if !self.take_chunk(d, &chunk) {
            return Ok(());
        }
        load.feed(chunk.bytes, self.dir()).await
    }

    fn take_chunk(&self, d: Descriptor, chunk: &Chunk<'_>) -> bool {
        let mut incoming = self.snapshots.incoming.borrow_mut();
        incoming
            .as_mut()
            .filter(|i| i.fetch.descriptor == d)
            .is_some_and(|i| i.fetch.take(chunk, monotonic_ms()) == Taken::Write)
    }

    /// A follower installs the leader's snapshot (see the module docs).
    pub(super) async fn install_snapshot(
        &self,
        snapshot: Snapshot,
        deferred: Vec<RaftRecord>,
    ) -> Result<(), StoreError> {
        let meta = snapshot.get_metadata();
        let index = meta.index;
        let Ok(Traffic::Offer(d)) = classify(&snapshot.data[..]) else {
            return Err(corrupt(
                self.dir(),
                format!("the snapshot at index {index} is not an offer"),
            ));
        };
        let path = self.staged_path(&d.id()).ok_or_else(|| {
            corrupt(
                self.dir(),
                format!("the snapshot at index {index} was not pulled"),
            )
        })?;
        self.snapshots.installing.set(Some(d.id()));
        write_marker(self.dir(), &d, meta.get_conf_state()).await?;
        stop_here_if_asked("marker");
        self.path.engine().adopt(&path, index).await?;
        stop_here_if_asked("adopt");
        let mut last = 0;
        for record in &deferred {
            last = self.path.wal().append(record)?;
            self.record_index
                .borrow_mut()
                .push_back((last, record.last_index()));
        }
        self.path.wal().wait_durable(last).await?;
        stop_here_if_asked("records");
        self.finish_install(d.id(), &path).await?;
        self.replica.borrow_mut().snapshot_written(index, last);
        self.note_snapshot_membership();
        tracing::info!(dir = %self.dir().display(), index, bytes = d.bytes, commands = d.commands, "installed a snapshot from the leader");
        Ok(())
    }

    /// The install is durable: the marker and the installed snapshot's staging engine go (a
    /// newer one pulled meanwhile waits for its own install).
    async fn finish_install(&self, installed: SnapshotId, path: &Path) -> Result<(), StoreError> {
        let dir = self.dir().join(IN_DIR);
        dio::remove(&dir.join(MARKER)).await?;
        dio::sync_dir(&dir).await?;
        self.snapshots
            .staged
            .borrow_mut()
            .retain(|(id, _)| *id != installed);
        remove_staged(path).await;
        self.snapshots.installing.set(None);
        Ok(())
    }

    /// After a restart: finishes the install a crash interrupted (see the module docs), before
    /// the driver does anything else.
    pub(super) async fn finish_interrupted_install(&self) -> Result<(), StoreError> {
        let Some(interrupted) = self.snapshots.interrupted.borrow_mut().take() else {
            return Ok(());
        };
        let d = interrupted.descriptor;
        tracing::info!(dir = %self.dir().display(), index = d.index, "finishing a snapshot install a stop interrupted");
        self.snapshots.installing.set(Some(d.id()));
        let path = staged_dir(self.dir(), &d);
        // The manifest's index says whether the switch was made before the stop.
        if self.path.engine().flushed_index() < d.index {
            self.path.engine().adopt(&path, d.index).await?;
        }
        self.path
            .wal()
            .wait_durable(self.snapshots.resumed_seq.get())
            .await?;
        self.finish_install(d.id(), &path).await?;
        self.note_snapshot_membership();
        Ok(())
    }

    /// Removes the leader's snapshot files left from before this start.
    pub(super) fn clear_outgoing(dir: &Path) {
        let _ = std::fs::remove_dir_all(dir.join(OUT_DIR));
    }
}

/// Fault injection for the kill test of an install (`tests/server_cluster.rs`):
/// `PINQ_FAULT_INSTALL_STOP=marker|adopt|records` makes the process kill itself with SIGKILL
/// right after that step of a follower's install, as a kill -9 landing there would. Never set
/// in production.
fn stop_here_if_asked(step: &str) {
    if std::env::var(FAULT_INSTALL_STOP_ENV).is_ok_and(|asked| asked == step) {
        tracing::warn!("{FAULT_INSTALL_STOP_ENV}={step}: this node kills itself mid-install");
        // SAFETY: kill(2) on this process's own id; it has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Removes a staging engine's directory, each file through the ring (its tables may be large;
/// after an install they are links the shard's engine still holds).
async fn remove_staged(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    for file in files {
        let _ = dio::remove(&file).await;
    }
    let _ = std::fs::remove_dir(dir);
}

fn staged_dir(dir: &Path, d: &Descriptor) -> PathBuf {
    dir.join(IN_DIR).join(format!(
        "{}-{}-{}-{:016x}",
        d.leader, d.index, d.term, d.hash
    ))
}

/// The staging engine's settings: the shard's, with smaller memtables (the pull's memory
/// bound) and no compaction (the shard's engine compacts the tables it adopts, as it would
/// its own flushes).
fn staging_options(live: &LsmOptions) -> LsmOptions {
    let mut options = live.clone();
    options.memtable_bytes_max = options.memtable_bytes_max.min(STAGING_MEMTABLE_BYTES);
    options.frozen_memtables_max = 1;
    options.compaction.tables_max = usize::MAX;
    options.compaction.merge_width_min = usize::MAX;
    options.compaction.dead_bytes_min = u64::MAX;
    options.flush_on_close = true;
    options
}

/// A pull's load into its staging engine: the stream's hash and size, and its commands.
struct Load<'a> {
    engine: &'a Engine,
    reader: CommandReader,
    hasher: Xxh3,
    bytes: u64,
    /// Commands applied: each goes in under the next sequence number (the staging engine has
    /// no log; its manifest's index is replaced by the snapshot's when adopted).
    applied: u64,
}

impl<'a> Load<'a> {
    fn new(engine: &'a Engine, entry_bytes_max: usize) -> Load<'a> {
        Load {
            engine,
            reader: CommandReader::new(entry_bytes_max.max(COMMAND_BYTES * 2)),
            hasher: Xxh3::new(),
            bytes: 0,
            applied: 0,
        }
    }

    async fn feed(&mut self, bytes: &[u8], dir: &Path) -> Result<(), StoreError> {
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        let commands = self
            .reader
            .feed(bytes)
            .map_err(|e| corrupt(dir, e.to_string()))?;
        for command in &commands {
            let turn = self.engine.admit().await?;
            self.applied += 1;
            self.engine.apply(self.applied, command);
            drop(turn);
        }
        Ok(())
    }

    /// The whole stream arrived: it must be what the offer announced.
    fn check(&mut self, d: &Descriptor, dir: &Path) -> Result<(), StoreError> {
        if self.bytes != d.bytes || self.hasher.digest() != d.hash {
            return Err(corrupt(
                dir,
                "the pulled snapshot does not match its offer's hash",
            ));
        }
        self.reader
            .finish(d.commands)
            .map_err(|e| corrupt(dir, e.to_string()))
    }
}

/// Writes the install marker atomically.
async fn write_marker(dir: &Path, d: &Descriptor, conf: &ConfState) -> Result<(), StoreError> {
    let in_dir = dir.join(IN_DIR);
    let mut bytes = d.encode();
    let record = RaftRecord::Conf {
        index: d.index,
        conf_state: conf.clone(),
    };
    record.encode_into(&mut bytes);
    bytes.extend_from_slice(&crc32c::crc32c(&bytes).to_le_bytes());
    let tmp = in_dir.join(MARKER_TMP);
    let mut writer = DmaWriter::create(&tmp, bytes.len()).await?;
    writer.append(&bytes).await?;
    writer.finish().await?;
    dio::rename(&tmp, &in_dir.join(MARKER)).await?;
    dio::sync_dir(&in_dir).await
}

/// At open: the marker of an install a crash interrupted, if there is one. Its staged file
/// must be whole (it was made durable before the marker); anything else is corruption the
/// node cannot repair itself.
pub(super) fn read_marker(dir: &Path) -> Result<Option<Interrupted>, StoreError> {
    let path = dir.join(IN_DIR).join(MARKER);
    let bytes = match dio::read_blocking(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            remove_leftovers(dir);
            return Ok(None);
        }
        Err(e) => return Err(crate::storage::io_error(&path, e)),
    };
    let damaged = |what: &str| {
        corrupt(&path, format!("snapshot install marker {what}: move the shard's directory aside and let the node be re-seeded"))
    };
    let (body, crc) = bytes
        .split_last_chunk::<4>()
        .ok_or_else(|| damaged("truncated"))?;
    if crc32c::crc32c(body) != u32::from_le_bytes(*crc) || body.len() < 53 {
        return Err(damaged("fails its checksum"));
    }
    let Ok(Traffic::Offer(descriptor)) = classify(&body[..53]) else {
        return Err(damaged("names no snapshot"));
    };
    let Ok(RaftRecord::Conf { conf_state, .. }) = RaftRecord::decode(&body[53..]) else {
        return Err(damaged("holds no membership"));
    };
    // The staging engine was closed, its manifest durable, before the marker was written.
    let staged = staged_dir(dir, &descriptor);
    if !matches!(
        crate::storage::manifest::read_blocking(&staged),
        Ok(Some(_))
    ) {
        return Err(damaged(
            "names a staging engine that is missing or has no manifest",
        ));
    }
    Ok(Some(Interrupted {
        descriptor,
        conf: conf_state,
    }))
}

/// Staged files of pulls that never completed an install.
fn remove_leftovers(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir.join(IN_DIR));
}

/// At open, with an unfinished install: the raft log starts at the snapshot (see
/// [`crate::cluster::snapshot::resume_log`]).
pub(super) fn resume_log(
    log: &mut RaftLog,
    interrupted: &Interrupted,
) -> Result<Option<RaftRecord>, String> {
    let d = &interrupted.descriptor;
    let point = InstallPoint {
        index: d.index,
        term: d.term,
        conf: interrupted.conf.clone(),
    };
    crate::cluster::snapshot::resume_log(log, &point)
}

impl Snapshots {
    pub(super) fn note_resumed_seq(&self, seq: u64) {
        self.resumed_seq.set(seq);
    }
}

impl Interrupted {
    pub(super) fn index(&self) -> u64 {
        self.descriptor.index
    }
}
