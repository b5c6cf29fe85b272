//! One shard's shell: the glommio tasks that drive its [`ShardCore`] and store, and the routing
//! of requests, deliveries and credits between shards.
//!
//! Tasks of a shard (all on its pinned core, sharing one `Rc<Shard>`):
//! - the dispatch loop (default queue): runs passes, routes deliveries to sinks, then sleeps until
//!   the core's next wake-up or a kick (publish, subscribe, ACK, credit);
//! - the deleter loop (default queue, beside dispatch: a starved deleter lets ACKed messages pile
//!   up): writes delete batches, up to `deleteBatchesInFlight` at once, one task each;
//! - the janitor loop (background queue, lower shares): sweeps for expired messages without
//!   starving dispatch;
//! - the metrics loop (background queue): once a second, copies the core's counters and the
//!   shard's histograms into its metrics slot (`crate::metrics`), the only lock a shard takes;
//! - one receive loop per peer shard, handling its [`ShardMsg`]s;
//! - accept loops and one RPC system per connection (`super::connection`).
//!
//! Flow control: a consumer's deliveries go to a *sink* on the shard of its connection. The hub
//! gives a consumer no more than its window (`queueSize`) of copies queued or sent in `deliver`
//! calls that have not returned; the sink returns the window ([`ShardMsg::Credit`]) as each call
//! returns. A slow or stuck client therefore fills its window and the dispatcher skips it at once
//! for the other members of its group, as PRODUCT.md §1 asks; nothing in between is unbounded.
//!
//! Shutdown ([`Shard::shut_down`], after the accept loops are dropped): refuse new publishes and
//! stop the dispatch, deleter and janitor loops, wait for publishes in progress, close every sink,
//! flush all waiting deletes, wait for the loops to return, close the store.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ahash::AHashMap;
use futures_channel::oneshot;
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::channels::shared_channel::ConnectedSender;

use super::mesh::{LeaderHint, Refused, Reply, Request, SettleOp, ShardMsg, SinkAddr, Subscribed};
use super::shutdown::ShutdownFlag;
use crate::cluster::driver::ReplicatedStore;
use crate::cluster::view::ClusterView;
use crate::config::DeliveryConfig;
use crate::ids::{NodeId, ShardId};
use crate::key::EventKey;
use crate::metrics::{MetricsSlots, Problem, ShardRecorder, ShardSnapshot, SNAPSHOT_INTERVAL};
use crate::ops::ratelimit::{RateLimit, LOG_INTERVAL_MS};
use crate::pipeline::copies::Committed;
use crate::pipeline::{drive, ConsumerError, ConsumerId, Delivery, Settled, ShardCore, TagResult};
use crate::rpc::refusal::{Code, RefusalCounts};
use crate::storage::{ShardStore, StoreError};

/// Wall-clock milliseconds; the core clamps them so shard time never goes back.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Deliveries waiting on a connection's shard for its client's `deliver` stream.
pub struct Sink {
    pub queue: RefCell<VecDeque<Delivery>>,
    notify: LocalSender<()>,
    pub closed: Cell<bool>,
    /// The `deliver` calls of the connection this sink feeds.
    receipts: Rc<super::receipts::Receipts>,
}

impl Sink {
    pub fn push(&self, deliveries: Vec<Delivery>) {
        self.queue.borrow_mut().extend(deliveries);
        let _ = self.notify.try_send(());
    }

    pub fn close(&self) {
        self.closed.set(true);
        let _ = self.notify.try_send(());
    }
}

/// Counts one task in progress (a publish, a loop) for as long as it lives, so one whose task is
/// dropped mid-write (its client went away) does not keep a shutdown waiting.
struct InProgress<'a>(&'a Cell<usize>);

impl<'a> InProgress<'a> {
    fn enter(count: &'a Cell<usize>) -> InProgress<'a> {
        count.set(count.get() + 1);
        InProgress(count)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// The owner's view of where a consumer's deliveries go.
struct Route {
    sink: SinkAddr,
    /// A task is moving this consumer's deliveries to its sink (at most one per consumer).
    pumping: bool,
}

/// A notifier that coalesces kicks: at most one wake-up waits.
pub struct Kick {
    tx: LocalSender<()>,
}

impl Kick {
    pub fn new() -> (Kick, LocalReceiver<()>) {
        let (tx, rx) = local_channel::new_bounded(1);
        (Kick { tx }, rx)
    }

    pub fn kick(&self) {
        let _ = self.tx.try_send(());
    }
}

pub struct Shard {
    pub id: ShardId,
    pub count: usize,
    pub core: RefCell<ShardCore>,
    pub store: ShardStore,
    pub delivery: DeliveryConfig,
    peers: Vec<Option<ConnectedSender<ShardMsg>>>,
    sinks: RefCell<AHashMap<u64, Rc<Sink>>>,
    next_sink: Cell<u64>,
    routes: RefCell<AHashMap<ConsumerId, Route>>,
    /// The role loop saw this leader hold its lease since it last revoked (`revoke_after_lease`).
    lease_seen: Cell<bool>,
    /// Consumers whose queued copies a pump could not hand out (no lease): the dispatch loop
    /// pumps them once the shard may hand out again. At most one entry per consumer.
    held_back: RefCell<ahash::AHashSet<ConsumerId>>,
    dispatcher: Kick,
    deleter: Kick,
    /// Latency and size histograms; only this shard records, the metrics loop snapshots them.
    pub recorder: RefCell<ShardRecorder>,
    /// A shutdown has begun: new publishes are refused.
    draining: Cell<bool>,
    /// Publish batches between their start on this shard and their store acknowledgement.
    publishing: Cell<usize>,
    /// Dispatch, deleter and janitor loops still running: the store is closed only once they
    /// have returned, so no scan or write overlaps the close.
    loops_running: Cell<usize>,
    /// The process-wide shutdown: a store that failed for good stops the whole broker.
    shutdown: ShutdownFlag,
    /// Clustered: what this node knows of the cluster (`None` standalone).
    pub cluster: Option<ClusterView>,
    /// This shard serves (accepts publishes and consumers, dispatches): always standalone; in a
    /// cluster only while its replica leads and has caught up.
    serving: Cell<bool>,
    /// Bumped each time the pipeline core is replaced (a change of leadership): work started
    /// under an older core does not report back to the new one.
    core_epoch: Cell<u64>,
    /// Clustered: this shard's transport to its peers (every shard runs its own, for its own
    /// Raft group; shard 0's also listens on the node's Raft port).
    pub transport: RefCell<Option<Rc<crate::cluster::transport::Transport>>>,
    /// Client requests refused by this shard, by code.
    refusals: Cell<RefusalCounts>,
    /// The client limits its connections share, for the metrics (set when it starts accepting).
    edge: RefCell<Option<Rc<super::limits::EdgeLimits>>>,
    /// Subscription closes another shard could not take (it had stopped).
    closes_lost: Cell<u64>,
    auth_refusals: Cell<crate::security::auth::AuthRefusalCounts>,
    /// Rate limits of the loops' repeated store-error lines, by site.
    error_logs: RefCell<AHashMap<&'static str, RateLimit>>,
    /// The publish limits a dead letter is checked against (as a client's publish is).
    publish: crate::config::PublishConfig,
    /// Clustered: connections to the nodes that lead dead-letter topics' shards.
    dead_letter_links: super::dead_letter_forward::DeadLetterLinks,
}

impl Shard {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: ShardId,
        count: usize,
        core: ShardCore,
        store: ShardStore,
        delivery: DeliveryConfig,
        peers: Vec<Option<ConnectedSender<ShardMsg>>>,
        dispatcher: Kick,
        deleter: Kick,
        shutdown: ShutdownFlag,
    ) -> Shard {
        Shard {
            id,
            count,
            core: RefCell::new(core),
            store,
            delivery,
            peers,
            sinks: RefCell::new(AHashMap::new()),
            next_sink: Cell::new(1),
            routes: RefCell::new(AHashMap::new()),
            lease_seen: Cell::new(false),
            held_back: RefCell::new(Default::default()),
            dispatcher,
            deleter,
            recorder: RefCell::new(ShardRecorder::default()),
            draining: Cell::new(false),
            publishing: Cell::new(0),
            loops_running: Cell::new(0),
            shutdown,
            cluster: None,
            serving: Cell::new(true),
            core_epoch: Cell::new(0),
            transport: RefCell::new(None),
            refusals: Cell::new(RefusalCounts::default()),
            edge: RefCell::new(None),
            closes_lost: Cell::new(0),
            auth_refusals: Cell::new(Default::default()),
            error_logs: RefCell::new(AHashMap::new()),
            publish: crate::config::PublishConfig::default(),
            dead_letter_links: Default::default(),
        }
    }

    /// The `[publish]` limits dead letters are checked against.
    pub fn with_publish(mut self, publish: crate::config::PublishConfig) -> Shard {
        self.publish = publish;
        self
    }

    /// Makes this shard a member of a cluster: it serves only while its replica leads.
    pub fn with_cluster(mut self, view: ClusterView) -> Shard {
        self.cluster = Some(view);
        self.serving.set(false);
        self
    }

    /// The replicated store, in a cluster.
    pub fn replicated(&self) -> Option<&Rc<ReplicatedStore>> {
        match &self.store {
            ShardStore::Replicated(r) => Some(r),
            _ => None,
        }
    }

    pub fn is_serving(&self) -> bool {
        self.serving.get()
    }

    /// Refuses a request this shard cannot serve: in a cluster, unless it leads.
    fn check_serving(&self) -> Result<(), Refused> {
        // The store's own state too: a replica that just stepped down accepts nothing, even
        // before the role watcher has caught up (a subscription accepted then would outlive
        // the pipeline reset that ends the others).
        if self.serving.get() && self.replicated().is_none_or(|r| r.role().1) {
            return Ok(());
        }
        Err(Refused::NotLeader(self.leader_hint()))
    }

    /// Who leads this shard, as far as this node knows.
    pub fn leader_hint(&self) -> LeaderHint {
        let (role, _) = self.replicated().map(|r| r.role()).unwrap_or_default();
        let leader = NodeId::from_wire(role.leader_id);
        let client = match (&self.cluster, leader) {
            (Some(view), Some(id)) => view.client_address(id.get()),
            _ => None,
        };
        LeaderHint {
            shard: self.id,
            term: role.term,
            leader,
            client,
        }
    }

    /// A store error on `what`. A fatal one (the log or the engine refuses every later write)
    /// stops the broker: logged once, `/healthz` turns 503, and `pinq serve` exits with the
    /// reason, instead of a shard that retries and warns forever beside healthy ones.
    ///
    /// A non-fatal one the loop retries (a full disk) is logged at most once per
    /// [`LOG_INTERVAL_MS`] per site, with the count of lines suppressed meanwhile.
    fn on_store_error(&self, what: &'static str, error: &StoreError) {
        if !error.is_fatal() {
            if !error.is_disk_full() {
                tracing::debug!(shard = %self.id, "{what}: {error}");
                return;
            }
            if let Some(suppressed) = self.admit_log(what) {
                tracing::warn!(
                    shard = %self.id,
                    suppressed,
                    "{what} refused, retried: {error}"
                );
            }
            return;
        }
        let reason = format!("shard {}: storage failed during {what}: {error}", self.id);
        if self.shutdown.fail(reason) {
            tracing::error!(
                shard = %self.id,
                "{what}: storage failed for good, stopping the broker: {error}"
            );
        }
    }

    /// Logs a repeated failure of `what` at most once per [`LOG_INTERVAL_MS`].
    fn log_limited(&self, what: &'static str, detail: std::fmt::Arguments<'_>) {
        if let Some(suppressed) = self.admit_log(what) {
            tracing::warn!(
                shard = %self.id,
                suppressed,
                "{what} not stored, retried: {detail}"
            );
        }
    }

    /// Whether a line about `what` may be logged now: `Some(lines suppressed since the last)`
    /// at most once per [`LOG_INTERVAL_MS`] per site.
    fn admit_log(&self, what: &'static str) -> Option<u64> {
        self.error_logs
            .borrow_mut()
            .entry(what)
            .or_insert(RateLimit::new(LOG_INTERVAL_MS))
            .admit(now_ms())
    }

    /// A failed publish as the client sees it: a replica that lost its leadership (or never
    /// had it) says who leads now.
    fn publish_refusal(&self, failure: drive::PublishFailure) -> Refused {
        match failure {
            drive::PublishFailure::Store(StoreError::NotLeader { .. }) => {
                Refused::NotLeader(self.leader_hint())
            }
            // The text starts with the code, so `refusal::code_of` (and the client's
            // `refusal()`) read it as `diskFull`; the connection sends it as `overloaded`.
            drive::PublishFailure::Store(e) if e.is_disk_full() => {
                self.refused(Code::DiskFull);
                Refused::Failed(format!(
                    "{}: {e} (free space on the disk of server.dataDir)",
                    Code::DiskFull.name()
                ))
            }
            other => Refused::Failed(other.to_string()),
        }
    }

    /// The shard of this node that owns `topic`.
    pub fn owner_of(&self, topic: &str) -> ShardId {
        ShardId::new(crate::key::TopicHash::of(topic).shard(self.count))
    }

    /// Sends a message to another shard, waiting while its channel is full.
    async fn send_to(&self, shard: ShardId, msg: ShardMsg) -> Result<(), String> {
        let peer = self
            .peers
            .get(shard.get())
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("no channel to shard {shard}"))?;
        peer.send(msg)
            .await
            .map_err(|_| format!("shard {shard} is not accepting messages"))
    }

    /// Runs a request on the shard that owns it and waits for the reply.
    pub async fn call<T>(
        self: &Rc<Self>,
        owner: ShardId,
        make: impl FnOnce(Reply<T>) -> Request,
    ) -> Result<T, Refused> {
        let (tx, rx) = oneshot::channel();
        let request = make(tx);
        if owner == self.id {
            // In a task of its own, as a peer's request is: a caller that goes away (its client
            // disconnected) must not cancel a publish between its keys being assigned and its
            // commit being noted, which would stall the topic's dispatch for good.
            let shard = self.clone();
            glommio::spawn_local(async move { shard.handle(request).await }).detach();
        } else {
            self.send_to(owner, ShardMsg::Request(request)).await?;
        }
        rx.await
            .map_err(|_| Refused::Failed(format!("shard {owner} dropped the request")))?
    }

    /// Sends a request that needs no reply.
    pub async fn tell(self: &Rc<Self>, owner: ShardId, request: Request) {
        if owner == self.id {
            self.handle(request).await;
        } else if let Err(e) = self.send_to(owner, ShardMsg::Request(request)).await {
            tracing::warn!(shard = %self.id, "{e}");
        }
    }

    /// Handles a request on its owning shard.
    pub async fn handle(self: &Rc<Self>, request: Request) {
        let request = match self.refuse_if_not_serving(request) {
            Some(request) => request,
            None => return,
        };
        match request {
            Request::Publish { batch, reply } => self.publish(batch, reply).await,
            Request::Subscribe {
                topic,
                group,
                uuid,
                sink,
                queue_size,
                reply,
            } => {
                let result = self.subscribe(&topic, &group, uuid, queue_size);
                if let Ok(subscribed) = result {
                    let route = Route {
                        sink,
                        pumping: false,
                    };
                    self.routes.borrow_mut().insert(subscribed.consumer, route);
                }
                self.dispatcher.kick();
                let _ = reply.send(result.map_err(|e| self.consumer_refusal(e)));
            }
            Request::Unsubscribe { consumer } => self.unsubscribe(consumer),
            Request::Settle {
                consumer,
                op,
                tags,
                reply,
            } => {
                let result = self.settle(consumer, op, &tags).await;
                let _ = reply.send(result);
            }
            Request::Stats { reply } => {
                let _ = reply.send(Ok(self.core.borrow().stats()));
            }
            Request::ForgetGroup {
                topic,
                group,
                reply,
            } => {
                let result = self
                    .core
                    .borrow_mut()
                    .forget_group(now_ms(), &topic, &group);
                self.deleter.kick();
                let _ = reply.send(result.map_err(|e| Refused::Failed(e.to_string())));
            }
            Request::SetGroupPolicy {
                topic,
                group,
                policy,
                reply,
            } => self.set_group_policy(&topic, &group, policy, reply).await,
            Request::ChangeMembership { step, reply } => {
                super::membership::run_step(self, step, reply).await;
            }
        }
    }

    /// This node was removed from its cluster: it says so, leaves the mark a restart refuses
    /// (`super::membership::REMOVED_FILE`), and stops serving (`pinq serve` exits 0).
    pub fn retire(&self, reason: String) {
        tracing::warn!(shard = %self.id, "{reason}: stopping");
        let data_dir = self
            .replicated()
            .and_then(|r| r.shard_dir().parent().map(std::path::Path::to_path_buf));
        if let Some(dir) = data_dir {
            let mark = dir.join(super::membership::REMOVED_FILE);
            if let Err(e) = std::fs::write(&mark, format!("{reason}\n")) {
                tracing::warn!("cannot leave {}: {e}", mark.display());
            }
        }
        self.shutdown.request();
    }

    /// Stores a publish batch and answers it: at `leader` in a cluster once the leader appended
    /// it, before its commit; otherwise once the store resolved.
    async fn publish(
        self: &Rc<Self>,
        batch: crate::pipeline::ValidatedBatch,
        reply: Reply<Vec<EventKey>>,
    ) {
        if self.draining.get() {
            let _ = reply.send(Err(Refused::Failed(format!(
                "shard {} is shutting down: nothing was stored, publish again once the broker is back",
                self.id
            ))));
            return;
        }
        let in_progress = InProgress::enter(&self.publishing);
        let started = Instant::now();
        let reply = RefCell::new(Some(reply));
        let epoch = self.core_epoch.get();
        let result = drive::publish_accepting(
            &self.core,
            &self.store,
            now_ms(),
            batch,
            |tags| {
                if let Some(reply) = reply.borrow_mut().take() {
                    let _ = reply.send(Ok(tags));
                }
            },
            || self.core_epoch.get() == epoch,
        )
        .await;
        let reply = reply.into_inner();
        drop(in_progress);
        if let Err(drive::PublishFailure::Store(e)) = &result {
            self.on_store_error("a publish", e);
        }
        if result.is_ok() {
            let us = started.elapsed().as_micros() as u64;
            self.recorder.borrow_mut().publish_latency.record(us);
        }
        self.dispatcher.kick();
        if let Some(reply) = reply {
            let _ = reply.send(result.map_err(|e| self.publish_refusal(e)));
        }
    }

    /// A consumer left: its copies are released, and dead letters its leaving caused go out.
    fn unsubscribe(self: &Rc<Self>, consumer: ConsumerId) {
        self.routes.borrow_mut().remove(&consumer);
        if let Err(e) = self.core.borrow_mut().unsubscribe(now_ms(), consumer) {
            tracing::debug!(shard = %self.id, "unsubscribe: {e}");
        }
        self.send_dead_letters();
        self.dispatcher.kick();
        self.deleter.kick();
    }

    /// Sets (or reads) a group's policy and answers with it; a limit or a store failure is
    /// refused (counted, logged).
    async fn set_group_policy(
        self: &Rc<Self>,
        topic: &str,
        group: &str,
        policy: crate::pipeline::policy::PolicyOverride,
        reply: Reply<crate::pipeline::policy::Policy>,
    ) {
        let result = drive::set_group_policy(&self.core, &self.store, topic, group, policy).await;
        self.dispatcher.kick();
        let _ = reply.send(result.map_err(|e| match e {
            drive::PolicyFailure::Limit(limit) => {
                self.refused(Code::TooManyGroups);
                Refused::Failed(Code::TooManyGroups.error(limit).extra)
            }
            drive::PolicyFailure::Store(e) => {
                self.on_store_error("a group policy write", &e);
                Refused::Failed(format!("storage failed: {e}"))
            }
        }));
    }

    /// ACKs, NACKs or touches `tags` of `consumer`; at `durable` answers once what the call
    /// changed is committed (its deletes, or its copies' records), or refuses it as
    /// `ConsumerGone` when the core that took it was replaced first (the shard stopped leading:
    /// the subscription has ended, and its copies may be delivered again).
    async fn settle(
        self: &Rc<Self>,
        consumer: ConsumerId,
        op: SettleOp,
        tags: &[EventKey],
    ) -> Result<Vec<TagResult>, Refused> {
        let now = now_ms();
        let result = {
            let mut core = self.core.borrow_mut();
            match op {
                SettleOp::Ack { level } => core.ack_at(now, consumer, tags, level),
                SettleOp::Nack { delay_ms, level } => {
                    core.nack_at(now, consumer, tags, delay_ms, level)
                }
                SettleOp::Touch => core.touch(now, consumer, tags).map(|results| Settled {
                    results,
                    commit: None,
                }),
            }
        };
        self.send_dead_letters();
        self.dispatcher.kick();
        self.deleter.kick();
        let settled = result.map_err(|e| match e {
            ConsumerError::UnknownConsumer => Refused::ConsumerGone,
            other => Refused::Failed(other.to_string()),
        })?;
        if let Some(commit) = settled.commit {
            if commit.wait().await == Committed::Lost {
                return Err(Refused::ConsumerGone);
            }
        }
        Ok(settled.results)
    }

    /// Publishes the core's queued dead letters, each in a task of its own, durably to its
    /// topic's owning shard (this one or another, over the mesh); the copy is ACKed for its group
    /// only once its dead letter is stored (`pipeline::shard::dead_letter`). In a cluster whose
    /// dead-letter shard another node leads, it is published on that node
    /// (`dead_letter_forward`). A failed publish is retried when the copy's guard
    /// (`inFlightTimeout`) runs out.
    fn send_dead_letters(self: &Rc<Self>) {
        if !self.may_dispatch() {
            // Handing a copy to the dead-letter topic is a hand-out: not without the lease.
            return;
        }
        let letters = self.core.borrow_mut().take_dead_letters();
        for letter in letters {
            let shard = self.clone();
            glommio::spawn_local(async move { shard.send_dead_letter(letter).await }).detach();
        }
    }

    async fn send_dead_letter(self: Rc<Self>, letter: crate::pipeline::DeadLetter) {
        let message = letter.message(self.publish.message_bytes_max);
        let batch = match crate::batch::ValidatedBatch::from_messages(
            std::slice::from_ref(&message),
            crate::config::AckLevel::Durable,
            &self.publish,
        ) {
            Ok(batch) => batch,
            Err(e) => {
                // Too large with the added headers: kept parked, tried again after the guard.
                self.log_limited("a dead letter", format_args!("{e}"));
                return;
            }
        };
        let owner = self.owner_of(&message.topic);
        let epoch = self.core_epoch.get();
        if !self.may_dispatch() {
            // Lost the lease since it was taken: parked, tried again after the guard.
            return;
        }
        let stored = match self
            .call(owner, |reply| Request::Publish { batch, reply })
            .await
        {
            // Another node leads the dead-letter topic's shard: publish it there.
            Err(Refused::NotLeader(LeaderHint {
                client: Some(leader),
                ..
            })) => self
                .dead_letter_links
                .publish(&leader, &message)
                .await
                .map_err(|e| Refused::Failed(format!("forwarded to {leader}: {e}"))),
            other => other.map(drop),
        };
        match stored {
            Ok(()) if self.core_epoch.get() == epoch => {
                self.core
                    .borrow_mut()
                    .on_dead_lettered(now_ms(), letter.key, letter.recipient);
                self.deleter.kick();
            }
            Ok(()) => {}
            Err(e) => self.log_limited("a dead letter", format_args!("{e}")),
        }
    }

    /// The refusal of a consumer call. A bound's refusal (groups, consumers per group) is
    /// counted, and its text starts with its code, which the connection passes on in its
    /// exception ("subscribe: tooManyGroups: ..."), so the client reads the code from it.
    fn consumer_refusal(&self, e: ConsumerError) -> Refused {
        let code = match &e {
            ConsumerError::Limit(limit) if limit.is_groups() => Code::TooManyGroups,
            ConsumerError::Limit(_) => Code::TooManyConsumers,
            _ => return Refused::Failed(e.to_string()),
        };
        self.refused(code);
        Refused::Failed(code.error(e).extra)
    }

    /// Answers a request that needs a serving shard with `NotLeader` when this one does not
    /// serve; returns the request otherwise.
    fn refuse_if_not_serving(&self, request: Request) -> Option<Request> {
        let Err(refused) = self.check_serving() else {
            return Some(request);
        };
        match request {
            Request::Publish { reply, .. } => drop(reply.send(Err(refused))),
            Request::Subscribe { reply, .. } => drop(reply.send(Err(refused))),
            Request::Settle { reply, .. } => drop(reply.send(Err(refused))),
            Request::ForgetGroup { reply, .. } => drop(reply.send(Err(refused))),
            Request::SetGroupPolicy { reply, .. } => drop(reply.send(Err(refused))),
            Request::Unsubscribe { .. } => {}
            // The raft core decides whether a membership step may be taken here.
            other @ (Request::Stats { .. } | Request::ChangeMembership { .. }) => {
                return Some(other)
            }
        }
        None
    }

    /// Handles a message from another shard.
    pub async fn on_message(self: &Rc<Self>, msg: ShardMsg) {
        match msg {
            ShardMsg::Request(request) => {
                let shard = self.clone();
                glommio::spawn_local(async move { shard.handle(request).await }).detach();
            }
            ShardMsg::Deliver { sink, deliveries } => self.deliver_local(sink, deliveries),
            ShardMsg::Credit { consumer, keys } => self.add_credit(consumer, &keys),
            ShardMsg::CloseSink { sink } => self.revoke_sink(sink),
            ShardMsg::RevokeReceipts { sink } => self.revoke_receipts(sink),
            ShardMsg::RaftConnection(accepted) => self.adopt_raft_connection(accepted),
        }
    }

    // ---- cluster -------------------------------------------------------------------------

    /// The listening shard: hands a peer's connection to shard `to`'s core. Never waits: `false`
    /// (the connection closed as `accepted` drops) when that shard's channel is full or gone.
    pub fn hand_raft_connection(
        &self,
        to: ShardId,
        accepted: crate::cluster::transport::Accepted,
    ) -> bool {
        match self.peers.get(to.get()) {
            Some(Some(peer)) => peer.try_send(ShardMsg::RaftConnection(accepted)).is_ok(),
            _ => false,
        }
    }

    /// A peer's connection for this shard, from the listening shard: to this shard's transport
    /// (closed when there is none yet: the peer's dialer retries).
    fn adopt_raft_connection(&self, accepted: crate::cluster::transport::Accepted) {
        match self.transport.borrow().as_ref() {
            Some(transport) => transport.adopt(accepted),
            None => tracing::debug!(
                shard = %self.id,
                addr = %accepted.peer_addr,
                "a peer connection arrived before this shard's transport started: closed"
            ),
        }
    }

    /// Carries this replica's outgoing Raft messages to this shard's transport (same core: it
    /// only queues them per peer, never waits).
    pub async fn raft_out_loop(self: Rc<Self>, outbox: LocalReceiver<Vec<raft::eraftpb::Message>>) {
        while let Some(messages) = outbox.recv().await {
            if let Some(transport) = self.transport.borrow().as_ref() {
                for message in messages {
                    transport.send(message.to, message);
                }
            }
        }
    }

    /// Follows the replica's role: a replica that starts serving gets a fresh pipeline (its
    /// event ids from the applied log, an empty in-flight table: what was in flight under the
    /// old leader is delivered again, at-least-once); one that stops serving drops its
    /// pipeline and ends its consumers' streams, so their clients subscribe on the new leader.
    /// A stopped driver stops the node (see [`Shard::on_driver_stopped`]).
    pub async fn role_loop(self: Rc<Self>) {
        let Some(store) = self.replicated().cloned() else {
            return;
        };
        loop {
            if let Some(error) = store.failure() {
                self.on_driver_stopped(&error);
                return;
            }
            let (role, serving) = store.role();
            if let Some(view) = &self.cluster {
                view.set_shard(self.id.get(), store.status());
            }
            if serving != self.serving.get() {
                if !serving {
                    // Accept and hand out nothing from now on, not only once the reset is done.
                    self.serving.set(false);
                }
                self.reset_pipeline().await;
                if serving {
                    if let Err(e) = drive::recover_policies(&self.core, &self.store).await {
                        self.on_store_error("loading group policies", &e);
                    }
                }
                self.serving.set(serving);
                tracing::info!(
                    shard = %self.id,
                    term = role.term,
                    leader = role.leader_id,
                    serving,
                    "shard {} this node",
                    if serving {
                        "is now served by"
                    } else {
                        "is no longer served by"
                    }
                );
                self.dispatcher.kick();
                self.deleter.kick();
            }
            if self.draining.get() {
                return;
            }
            if store.role() != (role, serving) || store.failure().is_some() {
                continue; // changed during the reset: its notification is already spent
            }
            let wait = until_lease_end(&store);
            futures_lite::future::or(store.role_changed(), glommio::timer::sleep(wait)).await;
            self.revoke_after_lease(&store);
        }
    }

    /// A serving leader whose lease ended hands out nothing more (`may_hand_out`); what it sent
    /// and was not answered is revoked now (its connections reset, `revoke_sink`), not at the
    /// step-down, which comes later: a newer leader may be elected from half an election timeout
    /// after the lease ends, and a cut that healed in between would let an old call through
    /// after the new leader's copy was ACKed.
    /// Revokes once per lapse: without its lease the leader hands out nothing new, so what
    /// was out when the lease ended is all there is to revoke.
    fn revoke_after_lease(self: &Rc<Self>, store: &ReplicatedStore) {
        if self.serving.get() && store.may_hand_out() {
            self.lease_seen.set(true);
            return;
        }
        if !self.serving.get() || !self.lease_seen.replace(false) {
            return;
        }
        let sinks: Vec<SinkAddr> = self.routes.borrow().values().map(|r| r.sink).collect();
        for sink in sinks {
            if sink.shard == self.id {
                self.revoke_receipts(sink.sink);
            } else {
                let shard = self.clone();
                glommio::spawn_local(async move {
                    let revoke = ShardMsg::RevokeReceipts { sink: sink.sink };
                    if let Err(e) = shard.send_to(sink.shard, revoke).await {
                        tracing::warn!(shard = %shard.id, "a revoke was lost: {e}");
                    }
                })
                .detach();
            }
        }
    }

    /// The replica's driver stopped for good: the shard serves nothing from this instant (its
    /// streams end) and the node stops with the reason: one failure rule, never a shard
    /// serving with a dead driver (the standalone store heals a full disk instead; a Raft log
    /// cannot refuse what its group committed).
    fn on_driver_stopped(self: &Rc<Self>, error: &StoreError) {
        self.serving.set(false);
        self.end_streams();
        let reason = format!("shard {}: the raft driver stopped: {error}", self.id);
        if self.shutdown.fail(reason) {
            tracing::error!(
                shard = %self.id,
                "the raft driver stopped, stopping the node: {error}"
            );
        }
    }

    /// Runs a long-lived task of this shard. Should it ever return while the broker is not
    /// shutting down, the shard stops serving and the node stops with a logged reason (a panic
    /// stops it too: `super::shutdown::stop_node_on_panic`).
    pub async fn supervised(self: Rc<Self>, what: &'static str, task: impl Future<Output = ()>) {
        task.await;
        if self.draining.get() || self.shutdown.is_requested() {
            return;
        }
        self.serving.set(false);
        self.end_streams();
        let reason = format!("shard {}: {what} ended unexpectedly", self.id);
        if self.shutdown.fail(reason.clone()) {
            tracing::error!(shard = %self.id, "{reason}; stopping the node");
        }
    }

    /// Ends every consumer's stream this shard serves (their clients subscribe again, on the
    /// shard's leader), and revokes the deliveries still unanswered (see `revoke_sink`).
    fn end_streams(self: &Rc<Self>) {
        let routes: Vec<Route> = self.routes.borrow_mut().drain().map(|(_, r)| r).collect();
        for route in routes {
            if route.sink.shard == self.id {
                self.revoke_sink(route.sink.sink);
            } else {
                self.spawn_close_sink(route.sink);
            }
        }
    }

    /// Ends a subscription's stream on another shard. The close waits for room in the channel
    /// (in a task of its own, so no caller waits): it never vanishes; one the receiving shard
    /// can no longer take (it stopped) is counted.
    fn spawn_close_sink(self: &Rc<Self>, sink: SinkAddr) {
        let shard = self.clone();
        glommio::spawn_local(async move {
            let close = ShardMsg::CloseSink { sink: sink.sink };
            if let Err(e) = shard.send_to(sink.shard, close).await {
                shard.closes_lost.set(shard.closes_lost.get() + 1);
                tracing::warn!(shard = %shard.id, "a subscription's close was lost: {e}");
            }
        })
        .detach();
    }

    /// A fresh pipeline core over the store's applied state; every consumer's stream ends.
    async fn reset_pipeline(self: &Rc<Self>) {
        self.end_streams();
        let limits = self.core.borrow().dedup_limits();
        let mut core = ShardCore::new(self.delivery.clone(), now_ms()).with_dedup_limits(limits);
        core.recover_event_ids(crate::storage::Store::event_id_high_water(&self.store));
        self.core_epoch.set(self.core_epoch.get() + 1);
        *self.core.borrow_mut() = core;
        self.load_sequences().await;
        self.load_copies().await;
    }

    /// Loads the stored copy records into the current core (at start, and each time the core
    /// is replaced, before the shard serves), and drops those whose message is gone.
    pub async fn load_copies(&self) {
        let epoch = self.core_epoch.get();
        let found = match drive::read_copy_records(&self.store).await {
            Ok(found) => found,
            Err(e) => return self.on_store_error("reading the copy records", &e),
        };
        if found.unreadable > 0 {
            tracing::warn!(
                shard = %self.id,
                unreadable = found.unreadable,
                "unreadable copy records skipped (their copies count deliveries from 1 again)"
            );
        }
        if self.core_epoch.get() == epoch {
            self.core.borrow_mut().restore_copies(found.live);
        }
        if let Err(e) = drive::drop_copy_records(&self.store, found.orphans).await {
            tracing::debug!(
                shard = %self.id,
                "copy records of deleted messages not dropped yet: {e}"
            );
        }
    }

    /// Loads the stored (producer, sequence) pairs of idempotent publish into the current core
    /// (at start, and each time the core is replaced, before the shard serves).
    pub async fn load_sequences(&self) {
        let epoch = self.core_epoch.get();
        match drive::read_sequences(&self.store).await {
            Ok((entries, unreadable)) => {
                if unreadable > 0 {
                    tracing::warn!(
                        shard = %self.id,
                        unreadable,
                        "unreadable idempotent-publish entries skipped (a republish of their messages is stored again)"
                    );
                }
                if self.core_epoch.get() == epoch {
                    self.core.borrow_mut().recover_sequences(now_ms(), &entries);
                }
            }
            Err(e) => self.on_store_error("reading the idempotent-publish entries", &e),
        }
    }

    /// Waits while this shard does not serve (a follower's loops idle).
    async fn wait_until_serving(&self) {
        while !self.serving.get() && !self.draining.get() {
            glommio::timer::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether this shard may hand out copies now: it serves and, in a cluster, its replica
    /// serves and holds its lease (`ReplicatedStore::may_hand_out`, `crate::cluster::leadership`).
    fn may_dispatch(&self) -> bool {
        self.serving.get() && self.replicated().is_none_or(|r| r.may_hand_out())
    }

    // ---- sinks (connection side) ---------------------------------------------------------

    /// A sink for a subscription of the connection whose `deliver` calls are `receipts`.
    pub fn open_sink(
        &self,
        receipts: Rc<super::receipts::Receipts>,
    ) -> (u64, Rc<Sink>, LocalReceiver<()>) {
        let id = self.next_sink.get();
        self.next_sink.set(id + 1);
        let (notify, rx) = local_channel::new_bounded(1);
        let sink = Rc::new(Sink {
            queue: RefCell::new(VecDeque::new()),
            notify,
            closed: Cell::new(false),
            receipts,
        });
        self.sinks.borrow_mut().insert(id, sink.clone());
        (id, sink, rx)
    }

    pub fn close_sink(&self, id: u64) {
        if let Some(sink) = self.sinks.borrow_mut().remove(&id) {
            sink.close();
        }
    }

    /// Revokes the unanswered `deliver` calls of the connection behind sink `id` (it is reset
    /// if it has any; `super::receipts`).
    pub fn revoke_receipts(&self, id: u64) {
        if let Some(sink) = self.sinks.borrow().get(&id) {
            sink.receipts.revoke();
        }
    }

    /// Ends a stream whose owner stopped serving it (it lost its leadership): besides the
    /// close, the deliveries it sent that are still unanswered are revoked, and their
    /// connection is reset (`super::receipts`).
    pub fn revoke_sink(&self, id: u64) {
        if let Some(sink) = self.sinks.borrow_mut().remove(&id) {
            sink.receipts.revoke();
            sink.close();
        }
    }

    fn deliver_local(&self, sink: u64, deliveries: Vec<Delivery>) {
        // A sink closed meanwhile drops the batch: its consumer is being unsubscribed, which
        // releases the copies on the owner.
        if let Some(sink) = self.sinks.borrow().get(&sink) {
            sink.push(deliveries);
        }
    }

    /// The client returned the deliveries `keys` of `consumer`: give its window back on the
    /// owner, where their leases start.
    pub async fn return_credit(
        self: &Rc<Self>,
        owner: ShardId,
        consumer: ConsumerId,
        keys: Vec<EventKey>,
    ) {
        if owner == self.id {
            self.add_credit(consumer, &keys);
        } else if let Err(e) = self
            .send_to(owner, ShardMsg::Credit { consumer, keys })
            .await
        {
            tracing::warn!(shard = %self.id, "{e}");
        }
    }

    // ---- routing deliveries (owner side) -------------------------------------------------

    /// Registers a consumer with the core; answers with the bounds in force for it.
    fn subscribe(
        &self,
        topic: &str,
        group: &str,
        uuid: uuid::Uuid,
        queue_size: usize,
    ) -> Result<Subscribed, ConsumerError> {
        let mut core = self.core.borrow_mut();
        let consumer = core.subscribe_window(now_ms(), topic, group, uuid, queue_size)?;
        let (queue_size, max_unacked) = core.consumer_bounds(queue_size);
        Ok(Subscribed {
            consumer,
            queue_size,
            max_unacked,
        })
    }

    /// Gives a consumer's window back and moves what it now allows in a task of its own, never
    /// in the caller: a mesh receive loop that awaited a send to a full channel could deadlock
    /// with the shard on the other end doing the same. At most one such task runs per consumer.
    fn add_credit(self: &Rc<Self>, consumer: ConsumerId, keys: &[EventKey]) {
        if self.core.borrow_mut().returned(now_ms(), consumer, keys) {
            // It was full: the dispatcher may have copies waiting for room.
            self.dispatcher.kick();
        }
        {
            let mut routes = self.routes.borrow_mut();
            let Some(route) = routes.get_mut(&consumer) else {
                return;
            };
            if route.pumping {
                return;
            }
            route.pumping = true;
        }
        let shard = self.clone();
        glommio::spawn_local(async move {
            while shard.pump(consumer).await {}
            if let Some(route) = shard.routes.borrow_mut().get_mut(&consumer) {
                route.pumping = false;
            }
        })
        .detach();
    }

    /// Moves a consumer's queued deliveries to its sink (the hub queues no more than its window
    /// allows); returns whether it moved any.
    async fn pump(self: &Rc<Self>, consumer: ConsumerId) -> bool {
        let Some(sink) = self.routes.borrow().get(&consumer).map(|route| route.sink) else {
            return false;
        };
        if !self.may_dispatch() {
            // Asked at the moment of hand-out: without the lease the copies wait in the queue.
            self.held_back.borrow_mut().insert(consumer);
            return false;
        }
        let now = now_ms();
        let deliveries = self.core.borrow_mut().drain(now, consumer, usize::MAX);
        if deliveries.is_empty() {
            return false;
        }
        self.record_delivery_latency(now, &deliveries);
        if sink.shard == self.id {
            self.deliver_local(sink.sink, deliveries);
        } else if let Err(e) = self
            .send_to(
                sink.shard,
                ShardMsg::Deliver {
                    sink: sink.sink,
                    deliveries,
                },
            )
            .await
        {
            tracing::warn!(shard = %self.id, "{e}");
        }
        true
    }

    /// Records the time since `started` (µs) in one of the wire-step histograms of
    /// [`ShardRecorder`] (`publish_call`, `deliver_round_trip`, `settle_call`).
    pub fn record_step(
        &self,
        histogram: impl FnOnce(&mut ShardRecorder) -> &mut crate::metrics::Recorded,
        started: Instant,
    ) {
        let us = started.elapsed().as_micros() as u64;
        histogram(&mut self.recorder.borrow_mut()).record(us);
    }

    /// Due time → hand-off, for first deliveries only (a redelivery's lateness is the lease or
    /// the NACK delay, not the broker's).
    fn record_delivery_latency(&self, now_ms: u64, deliveries: &[Delivery]) {
        let mut recorder = self.recorder.borrow_mut();
        for delivery in deliveries.iter().filter(|d| d.attempt == 1) {
            let message = delivery.value.message();
            let due_ms = message.enqueued_at_ms().saturating_add(message.delay_ms());
            recorder
                .delivery_latency
                .record(now_ms.saturating_sub(due_ms).saturating_mul(1000));
        }
    }

    // ---- loops ---------------------------------------------------------------------------

    /// The dispatch loop: passes, routing, then sleep until the next wake-up or a kick.
    pub async fn dispatch_loop(self: Rc<Self>, kicks: LocalReceiver<()>) {
        let _running = InProgress::enter(&self.loops_running);
        while !self.draining.get() {
            if !self.serving.get() {
                self.wait_until_serving().await;
                continue;
            }
            if !self.may_dispatch() {
                // A leader that has not heard from a quorum lately hands nothing out.
                glommio::timer::sleep(Duration::from_millis(5)).await;
                continue;
            }
            let now = now_ms();
            let started = Instant::now();
            let epoch = self.core_epoch.get();
            let current = || self.core_epoch.get() == epoch;
            let productive =
                match drive::dispatch_pass_if(&self.core, &self.store, now, current).await {
                    Ok(productive) => productive,
                    Err(e) => {
                        self.on_store_error("a dispatch pass", &e);
                        false
                    }
                };
            self.send_dead_letters();
            if self.core.borrow().copies_waiting() {
                // Copies the pass let go wait for their records: the deleter loop writes them.
                self.deleter.kick();
            }
            let mut ready = self.core.borrow_mut().take_ready();
            ready.extend(self.held_back.borrow_mut().drain());
            for consumer in ready {
                self.pump(consumer).await;
            }
            let us = started.elapsed().as_micros() as u64;
            self.recorder.borrow_mut().dispatch_pass.record(us);
            if productive {
                glommio::yield_if_needed().await;
                continue;
            }
            let wake_at = self.core.borrow().next_pass_ms();
            let now = now_ms();
            if wake_at <= now {
                // Due again already: let the shard's other tasks run first.
                futures_lite::future::yield_now().await;
            } else {
                let sleep = glommio::timer::sleep(Duration::from_millis(wake_at - now));
                futures_lite::future::or(
                    async {
                        sleep.await;
                    },
                    async {
                        let _ = kicks.recv().await;
                    },
                )
                .await;
            }
        }
    }

    /// The deleter loop: cuts delete batches on the interval, or at once when one is full, and
    /// keeps up to `deleteBatchesInFlight` of them being written at once (each in its own task,
    /// so the WAL's group commit covers several per fdatasync). A finished write kicks this loop
    /// (a slot is free) and, when it lifted the delete-backlog pause, the dispatcher.
    pub async fn deleter_loop(self: Rc<Self>, kicks: LocalReceiver<()>) {
        let _running = InProgress::enter(&self.loops_running);
        let interval_ms = self.delivery.delete_batch_interval_ms;
        while !self.draining.get() {
            if !self.serving.get() {
                self.wait_until_serving().await;
                continue;
            }
            let now = now_ms();
            let batches = drive::take_delete_batches(&self.core, now, false, usize::MAX);
            for batch in batches {
                self.spawn_delete_write(batch).detach();
            }
            for write in self.write_copy_batches() {
                write.detach();
            }
            // Wake when the next batch is due, or on a kick (new keys, a write finished).
            let sleep_ms = match self.core.borrow().next_delete_ms() {
                Some(at) => at.saturating_sub(now).clamp(1, interval_ms),
                None => interval_ms,
            };
            let sleep = glommio::timer::sleep(Duration::from_millis(sleep_ms));
            futures_lite::future::or(
                async {
                    sleep.await;
                },
                async {
                    let _ = kicks.recv().await;
                },
            )
            .await;
        }
    }

    /// Writes one delete batch in a task of its own; resolves to whether it was applied. The
    /// task counts as a running loop, so the store is not closed under it.
    fn spawn_delete_write(
        self: &Rc<Self>,
        batch: crate::pipeline::DeleteBatch,
    ) -> glommio::Task<bool> {
        let shard = self.clone();
        glommio::spawn_local(async move {
            let _writing = InProgress::enter(&shard.loops_running);
            let epoch = shard.core_epoch.get();
            let current = || shard.core_epoch.get() == epoch;
            match drive::write_delete_batch_if(&shard.core, &shard.store, batch, current).await {
                Ok(applied) => {
                    shard
                        .recorder
                        .borrow_mut()
                        .delete_batch_size
                        .record(applied.keys as u64);
                    if applied.dispatch_resumed {
                        shard.dispatcher.kick();
                    }
                    // A batch slot is free: the next batch may be due at once.
                    shard.deleter.kick();
                    true
                }
                Err(e) => {
                    // No kick: the keys are back in the queue, retried on the next wake-up (a
                    // fatal error stops the broker instead).
                    shard.on_store_error("a delete write", &e);
                    false
                }
            }
        })
    }

    /// Starts a write of every copy-record batch the core has ready (each in a task of its
    /// own, counted as a running loop). A write that lands wakes the dispatcher (copies held
    /// back for their record may go out) and this loop (a slot is free).
    fn write_copy_batches(self: &Rc<Self>) -> Vec<glommio::Task<bool>> {
        let mut writes = Vec::new();
        loop {
            let Some(batch) = self.core.borrow_mut().take_copy_batch(now_ms()) else {
                return writes;
            };
            let shard = self.clone();
            writes.push(glommio::spawn_local(async move {
                let _writing = InProgress::enter(&shard.loops_running);
                let epoch = shard.core_epoch.get();
                let current = || shard.core_epoch.get() == epoch;
                match drive::write_copy_batch_if(&shard.core, &shard.store, batch, current).await {
                    Ok(_) => {
                        shard.dispatcher.kick();
                        shard.deleter.kick();
                        true
                    }
                    Err(e) => {
                        shard.on_store_error("a copy-record write", &e);
                        false
                    }
                }
            }));
        }
    }

    /// Writes every waiting copy record before `deadline` (shutdown); stops early on a failed
    /// store or a full disk (their copies may then be numbered as before, never lower).
    async fn flush_copy_records(self: &Rc<Self>, deadline: Instant) {
        while self.core.borrow().copies_busy() && Instant::now() < deadline {
            let writes = self.write_copy_batches();
            if writes.is_empty() {
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
            let mut failed = false;
            for write in writes {
                failed |= !write.await;
            }
            if failed {
                if self.shutdown.failure().is_some() || self.store.health().disk_full.is_some() {
                    return;
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// The janitor loop: a full sweep every `ttlSweepInterval`, yielding between pages.
    pub async fn janitor_loop(self: Rc<Self>) {
        let _running = InProgress::enter(&self.loops_running);
        loop {
            let sleep_ms = self.delivery.ttl_sweep_interval_ms.min(1_000);
            glommio::timer::sleep(Duration::from_millis(sleep_ms)).await;
            if self.draining.get() {
                return;
            }
            if !self.serving.get() {
                continue;
            }
            let swept = drive::sweep(&self.core, &self.store, now_ms(), || {
                glommio::yield_if_needed()
            })
            .await;
            match swept {
                Ok(true) => self.deleter.kick(),
                Ok(false) => {}
                Err(e) => self.on_store_error("a janitor sweep", &e),
            }
        }
    }

    /// The metrics loop: publishes this shard's snapshot into its slot once a second.
    pub async fn metrics_loop(self: Rc<Self>, slots: MetricsSlots) {
        loop {
            self.publish_snapshot(&slots);
            glommio::timer::sleep(SNAPSHOT_INTERVAL).await;
        }
    }

    /// Copies the counters and histograms into this shard's metrics slot.
    pub fn publish_snapshot(&self, slots: &MetricsSlots) {
        let health = self.store.health();
        let mut stats = self.core.borrow().stats();
        // Values the store skipped in unreadable blocks never reach the pipeline's check.
        stats.counters.unreadable_values_total += health.unreadable_values;
        let groups = std::mem::take(&mut stats.groups);
        stats.groups = crate::metrics::groups::bounded(groups, self.delivery.group_metrics_max);
        stats.topics.clear(); // not exported: their cardinality is the store's
        let snapshot = ShardSnapshot {
            stats,
            histograms: self.recorder.borrow().snapshot(),
            storage: self.store.storage_figures(),
            raft: self.raft_figures(),
            problems: self.problems(health),
            refusals: self.refusals.get(),
            auth_refusals: self.auth_refusals.get(),
            client_memory: self.client_memory(),
        };
        slots.publish(self.id.get(), snapshot);
    }

    /// The client limits its accept loops and connections share (the metrics read them).
    pub fn set_edge(&self, edge: Rc<super::limits::EdgeLimits>) {
        *self.edge.borrow_mut() = Some(edge);
    }

    /// What the byte bounds on this shard's client connections hold, for its snapshot.
    fn client_memory(&self) -> crate::metrics::memory::ClientMemoryFigures {
        let edge = self.edge.borrow();
        let Some(edge) = edge.as_ref() else {
            return Default::default();
        };
        let m = &edge.memory;
        crate::metrics::memory::ClientMemoryFigures {
            send_buffer_bytes: edge.send.in_use() as u64,
            send_buffer_bytes_max: edge.send.max() as u64,
            sends_waited_total: m.sends_waited.get(),
            send_stall_closes_total: m.send_stall_closes.get(),
            publish_bytes_in_flight: edge.budget.in_use() as u64,
            frames_waited_total: m.frames_waited.get(),
            heap_trims_total: m.trims.get(),
        }
    }

    /// The replica's figures, with the drops and connections of this shard's transport and the
    /// lost closes.
    fn raft_figures(&self) -> Option<crate::metrics::RaftFigures> {
        let mut figures = self.replicated()?.raft_figures();
        figures.closes_lost = self.closes_lost.get();
        if let Some(transport) = self.transport.borrow().as_ref() {
            let c = transport.counters();
            figures.drops.transport_queue_full = c.dropped_queue_full;
            figures.drops.peer_not_connected = c.dropped_not_connected;
            figures.drops.oversize = c.dropped_oversize;
            figures.drops.inbound = c.dropped_inbound;
            figures.connections_established = c.connections_established;
            figures.handshake_refusals = c.handshake_refusals;
            figures.connections_shed = c.handshakes_shed + c.handoffs_shed;
            figures.peers_connected =
                transport.peers().iter().filter(|p| p.reachable).count() as u64;
        }
        Some(figures)
    }

    /// What keeps this shard from being healthy, for `/healthz` (empty while healthy).
    fn problems(&self, health: crate::storage::StoreHealth) -> Vec<Problem> {
        let mut problems = Vec::new();
        if let Some(what) = health.disk_full {
            problems.push(Problem::DiskFull(what));
        }
        if health.unreadable_blocks > 0 {
            problems.push(Problem::UnreadableBlocks(health.unreadable_blocks));
        }
        if let Some(what) = health.wal_tail_dropped {
            problems.push(Problem::WalTailDropped(what));
        }
        if self.serving.get() && !self.may_dispatch() {
            problems.push(Problem::Fenced(
                "leads its shard but has not heard from a quorum within the lease: delivers nothing".into(),
            ));
        }
        problems
    }

    /// Counts a refused client request (`pinq_refusals_total{code}`).
    pub fn refused(&self, code: Code) {
        let mut counts = self.refusals.get();
        counts.add(code);
        self.refusals.set(counts);
    }

    /// Counts a refusal of the permission model, by code (`pinq_refusals_total{code}`) and by
    /// reason (`pinq_auth_refusals_total{reason}`).
    pub fn auth_refused(&self, code: Code, reason: crate::security::auth::AuthReason) {
        self.refused(code);
        let mut counts = self.auth_refusals.get();
        counts.add(reason);
        self.auth_refusals.set(counts);
    }

    /// Graceful shutdown of this shard, once its listeners are closed: refuses new publishes,
    /// waits for those in progress, closes every subscription's sink (their streams end; the
    /// copies they held are redelivered after the restart, as nothing ACKed them), writes every
    /// waiting delete and closes the store. Waits at most `deadline` for publishes and deletes.
    pub async fn shut_down(self: &Rc<Self>, deadline: Instant) {
        self.draining.set(true);
        // Wake the loops so they see the flag and return (the janitor within its sleep, ≤ 1 s).
        self.dispatcher.kick();
        self.deleter.kick();
        while self.publishing.get() > 0 && Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        if self.publishing.get() > 0 {
            tracing::warn!(
                shard = %self.id,
                publishing = self.publishing.get(),
                "publishes still waiting for the store at the shutdown deadline"
            );
        }
        let sinks: Vec<u64> = self.sinks.borrow().keys().copied().collect();
        for sink in sinks {
            self.close_sink(sink);
        }
        // Copy records first (a record written after its message's delete would be an orphan).
        self.flush_copy_records(deadline).await;
        while self.core.borrow().deletes_busy() && Instant::now() < deadline {
            let batches = drive::take_delete_batches(&self.core, now_ms(), true, usize::MAX);
            if batches.is_empty() {
                // Every slot is taken by writes the deleter loop started: wait for them.
                glommio::timer::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let writes: Vec<glommio::Task<bool>> = batches
                .into_iter()
                .map(|batch| self.spawn_delete_write(batch))
                .collect();
            let mut failed = false;
            for write in writes {
                failed |= !write.await;
            }
            if failed {
                // A failed store refuses every retry: stop now (the warning below says what is
                // left). Otherwise retry, without a warning per attempt.
                if self.shutdown.failure().is_some() {
                    break;
                }
                if self.store.health().disk_full.is_some() {
                    // Deletes wait for space that may not come before the deadline: their
                    // messages are delivered again after the restart (the warning below).
                    break;
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
        if self.core.borrow().deletes_busy() {
            tracing::warn!(shard = %self.id, "deletes still waiting at the shutdown deadline: their messages may be delivered again after a restart");
        }
        if let Some(store) = self.replicated() {
            // Every delete is written: let a follower take over now, not after an election
            // timeout (the loops below may take a second to return).
            store.hand_over(Duration::from_secs(1)).await;
        }
        while self.loops_running.get() > 0 && Instant::now() < deadline {
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        if let Err(e) = self.store.close().await {
            tracing::error!(shard = %self.id, "closing the store failed: {e}");
        }
        tracing::debug!(shard = %self.id, "shard stopped");
    }

    /// Dispatch work needs to look again (used by the connection layer after it changes state).
    pub fn kick_dispatcher(&self) {
        self.dispatcher.kick();
    }
}

/// How long the role loop may sleep: until just after this leader's lease ends (so the loop
/// looks at it then, [`Shard::revoke_after_lease`]); a serving leader without a lease looks
/// again every [`LEASELESS_CHECK`]; at most 1 s.
fn until_lease_end(store: &ReplicatedStore) -> Duration {
    let now = crate::ops::ratelimit::monotonic_ms();
    match store.lease_until_ms() {
        Some(until) if until > now => {
            Duration::from_millis(until - now + 1).min(Duration::from_secs(1))
        }
        _ if store.role().1 => LEASELESS_CHECK,
        _ => Duration::from_secs(1),
    }
}

/// How often the role loop looks at a serving leader that holds no lease (just elected, or cut
/// off): its deliveries are revoked within this of the lease's end.
const LEASELESS_CHECK: Duration = Duration::from_millis(20);
