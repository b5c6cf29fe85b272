//! One client connection: the Cap'n Proto `Broker` and `Subscription` capabilities, served on
//! the shard that accepted the connection.
//!
//! Requests for topics owned by another shard cross to it ([`Shard::call`]); deliveries for this
//! connection's subscriptions arrive in local sinks and are streamed to the client with
//! `Consumer.deliver`, whose flow control paces them. Bad input becomes a `failed` exception that
//! names the problem; garbage bytes end the connection. Neither affects other connections.
//!
//! What a connection may hold is bounded here with the pieces of `limits.rs`: its bytes pass a
//! [`FrameGate`] (frame size, and what an unfinished frame may make the server allocate), a
//! [`Watchdog`] closes it when idle or when a frame stalls, every call takes a place among
//! `server.maxCallsInFlight`, every subscription one among `server.maxSubscriptionsPerConnection`,
//! and a publish takes its bytes from this shard's `publish.maxBytesInFlight` budget. A connection
//! beyond `server.maxConnections` is served by [`refuse`] instead.
//!
//! With `[server.tls]` the TLS handshake comes first, within `server.frameTimeout`
//! (`crate::security::stream`); a failed handshake closes the connection. `hello` must be the
//! first call: every other call before it is refused (`helloRequired`), and with tokens
//! configured `hello` authenticates the connection, whose token every later call is checked
//! against (`crate::security::auth`).
//!
//! `hello` also fixes the protocol version the connection speaks. A refusal of `publish`, `ack`,
//! `nack` or `touch` is a [`Refusal`]: on protocol 2 it is written into the call's results
//! (`refusal`) and the call returns normally; on protocol 1 it becomes the exception it always
//! was ([`Refusal::into_capnp`], same kind, same text). What is not a refusal of the request (a
//! malformed message, a failure behind it) stays an exception in both.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;

use capnp::capability::Rc as CapRc;
use capnp_rpc::rpc_twoparty_capnp::Side;
use capnp_rpc::{twoparty, RpcSystem};
use futures_lite::io::{BufReader, BufWriter};
use glommio::channels::local_channel::LocalReceiver;
use glommio::net::TcpStream;

use super::limits::send::{self as send_limits, SendGate, SendPermit};
use super::limits::{
    self, Admission, BytePermit, CallSlot, ConnectionSlot, ConnectionUse, EdgeLimits, FrameGate,
    Observation, ReadProgress, SubscriptionSlot, Verdict, Watchdog,
};
use super::mesh::{LeaderHint, Refused, Request, SettleOp, SinkAddr};
use super::receipts::{self, Awaiting, Receipts};
use super::shard::{now_ms, Shard, Sink};
use super::Topology;
use crate::batch::{PublishError, ShardPart, ValidatedBatch};
use crate::cluster::view::ClusterView;
use crate::config::AckLevel;
use crate::ids::{NodeId, ShardId};
use crate::key::{EventKey, TopicHash};
use crate::pipeline::{self, ConsumerId, TagResult};
use crate::rpc::pinq_capnp::{broker, consumer, subscription, TagResult as WireTagResult};
use crate::rpc::refusal::{code_of, Code, Refusal};
use crate::rpc::{self, OutgoingDelivery, PublishLimits, SettleTags, WireError};
use crate::security::auth::{Access, Action, AuthReason, Denied};
use crate::security::stream::{self, Stream};

/// Deliveries per `deliver` call.
const DELIVER_BATCH_MAX: usize = 256;

/// Serves one accepted connection until it closes, the watchdog closes it, or a frame breaks
/// the gate's limits. `_slot` holds its place among `server.maxConnections`.
pub async fn serve(
    shard: Rc<Shard>,
    topology: Topology,
    edge: Rc<EdgeLimits>,
    _slot: ConnectionSlot,
    stream: TcpStream,
    own_port: bool,
) {
    let _ = stream.set_nodelay(true);
    let peer = peer_of(&stream);
    // The socket outlives every use of `fd` below: the stream owns it until `serve` returns.
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let handshake_deadline = std::time::Duration::from_millis(edge.client.frame_timeout_ms);
    let stream =
        match stream::accept(topology.security.tls.as_ref(), stream, handshake_deadline).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(shard = %shard.id, peer, "TLS handshake failed, closed: {e}");
                return;
            }
        };
    let progress = Rc::new(ReadProgress::default());
    let conn = ConnectionUse::new(edge.client);
    let (reader, writer) = futures_lite::io::split(stream);
    let network = twoparty::VatNetwork::new(
        FrameGate::new(
            BufReader::new(reader),
            edge.frame_bytes_max,
            progress.clone(),
        )
        .admitted(Admission::new(conn.clone(), edge.clone())),
        BufWriter::new(writer),
        Side::Server,
        edge.reader_options,
    );
    let send = SendGate::new(edge.client.send_buffer_bytes_max, edge.send.clone());
    let receipts = Rc::new(Receipts::default());
    let broker: broker::Client = capnp_rpc::new_client(BrokerImpl {
        shard: shard.clone(),
        topology,
        own_port,
        conn: conn.clone(),
        receipts: receipts.clone(),
        edge: edge.clone(),
        send: send.clone(),
        access: RefCell::new(None),
    });
    let rpc = RpcSystem::new(Box::new(network), Some(broker.client));
    let disconnector = rpc.get_disconnector();
    let ended = futures_lite::future::or(
        async {
            match rpc.await {
                Ok(()) => None,
                Err(e) => Some(format!("{e}")),
            }
        },
        async { Some(watch(&progress, &conn, &send, &edge, (&receipts, fd)).await) },
    )
    .await;
    // The RPC system is dropped: end the tasks that wait on this connection's `deliver` calls
    // (they hold its state, and with it its subscriptions and their copies) and their streams.
    send.close();
    // Breaks every call still waiting on this connection and releases every capability it
    // exported, at the first poll: a watchdog's verdict drops the RPC system unfinished, and a
    // subscription whose `deliver` call can never be answered stayed alive with its copies. Safe
    // only now that the RPC system (and its message loop) is gone.
    let _ = futures_lite::future::poll_once(disconnector).await;
    if let Some(why) = ended {
        tracing::debug!(shard = %shard.id, peer, "connection closed: {why}");
    }
    release_memory(&edge, &send, &progress);
}

/// After a connection that had many bytes unanswered closed (its RPC system, queued calls and
/// subscriptions are dropped by now), gives the freed heap back to the OS: glibc keeps freed
/// memory in the shard thread's arena, so without it the broker's RSS stayed at its peak after
/// the client was gone.
fn release_memory(edge: &EdgeLimits, send: &SendGate, progress: &ReadProgress) {
    let held = send.high_water().max(progress.largest_frame.get());
    if held >= limits::TRIM_AFTER_BYTES {
        edge.memory.trims.set(edge.memory.trims.get() + 1);
        limits::trim_heap();
    }
}

fn peer_of(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Observes the connection every tick until the watchdog says to close it, or a `deliver` call
/// went unanswered for `server.deliverTimeout`; returns why. A connection closed with `deliver`
/// calls unanswered is reset (its socket `fd`: see [`receipts`]), so what was still on its way
/// to the client is discarded, never delivered after its copies went to another consumer.
async fn watch(
    progress: &ReadProgress,
    conn: &ConnectionUse,
    send: &SendGate,
    edge: &EdgeLimits,
    (receipts, fd): (&Receipts, i32),
) -> String {
    let why = watchdog(progress, conn, send, edge, receipts).await;
    if !receipts.is_empty() {
        if let Err(e) = receipts::reset(fd) {
            tracing::warn!("a stuck connection could not be set to reset: {e}");
        }
    }
    why
}

/// The watchdog's loop: [`watch`] without the reset.
async fn watchdog(
    progress: &ReadProgress,
    conn: &ConnectionUse,
    send: &SendGate,
    edge: &EdgeLimits,
    receipts: &Receipts,
) -> String {
    let limits = conn.limits();
    let tick = Watchdog::tick(limits);
    let mut dog = Watchdog::new(limits, now_ms());
    loop {
        futures_lite::future::or(glommio::timer::sleep(tick), receipts.revoked()).await;
        if receipts.revoked_with_calls_out() {
            return "reset: the shard that sent its unanswered deliveries stopped serving them \
                    (its lease ended, or it lost its leadership)"
                .into();
        }
        if receipts.overdue(now_ms(), limits.deliver_timeout_ms) {
            return format!(
                "reset: a deliver call was not answered within server.deliverTimeout ({} ms)",
                limits.deliver_timeout_ms
            );
        }
        conn.release_unclaimed_frame(now_ms());
        let verdict = dog.observe(Observation {
            now_ms: now_ms(),
            bytes: progress.bytes.get(),
            frames: progress.frames.get(),
            frame_open: progress.frame_open.get(),
            busy: conn.busy(),
            send_blocked_since_ms: send.blocked_since_ms(),
        });
        match verdict {
            Verdict::Keep => continue,
            Verdict::Idle => {
                return format!(
                    "idle for server.idleTimeout ({} ms): no call, no subscription, no byte",
                    limits.idle_timeout_ms
                )
            }
            Verdict::StalledFrame => {
                return format!(
                    "a frame was not complete within server.frameTimeout ({} ms)",
                    limits.frame_timeout_ms
                )
            }
            Verdict::SendStalled => {
                edge.memory
                    .send_stall_closes
                    .set(edge.memory.send_stall_closes.get() + 1);
                return format!(
                    "{} bytes of deliveries unanswered and none returned within server.sendStallTimeout ({} ms): the client does not read its socket",
                    send.in_use(),
                    limits.send_stall_timeout_ms
                );
            }
        }
    }
}

/// Answers a connection beyond `server.maxConnections`: every call gets `tooManyConnections`,
/// and the connection closes after the first answer or [`limits::REFUSED_CONNECTION_LINGER`],
/// whichever comes first. Counted once per connection. When this shard is already answering
/// [`limits::REFUSING_CONNECTIONS_MAX`] of them, the connection is closed at once.
pub fn refuse(
    shard: Rc<Shard>,
    edge: Rc<EdgeLimits>,
    tls: Option<futures_rustls::TlsAcceptor>,
    stream: TcpStream,
) {
    shard.refused(Code::TooManyConnections);
    if edge.refusing.get() >= limits::REFUSING_CONNECTIONS_MAX {
        return;
    }
    edge.refusing.set(edge.refusing.get() + 1);
    glommio::spawn_local(async move {
        let detail = format!(
            "this node serves {} connections, the limit server.maxConnections ({}); try again later",
            edge.connections.open(),
            edge.connections.max()
        );
        let (answered, first_answer) = futures_channel::oneshot::channel();
        let stream: Stream =
            match stream::accept(tls.as_ref(), stream, limits::REFUSED_CONNECTION_LINGER).await {
                Ok(stream) => stream,
                Err(_) => {
                    edge.refusing.set(edge.refusing.get().saturating_sub(1));
                    return;
                }
            };
        let (reader, writer) = futures_lite::io::split(stream);
        let network = twoparty::VatNetwork::new(
            // A refused connection needs nothing larger than a small call.
            FrameGate::new(
                BufReader::new(reader),
                limits::DIRECT_FRAME_BYTES_MAX,
                Rc::new(ReadProgress::default()),
            ),
            BufWriter::new(writer),
            Side::Server,
            limits::reader_options_for_frames(limits::DIRECT_FRAME_BYTES_MAX),
        );
        let broker: broker::Client = capnp_rpc::new_client(Refuser {
            detail,
            answered: RefCell::new(Some(answered)),
        });
        let rpc = RpcSystem::new(Box::new(network), Some(broker.client));
        let closing = async {
            // Let the answer reach the socket before the connection is dropped.
            if first_answer.await.is_ok() {
                glommio::timer::sleep(ANSWER_FLUSH).await;
            }
        };
        futures_lite::future::or(
            async {
                let _ = rpc.await;
            },
            futures_lite::future::or(
                closing,
                glommio::timer::sleep(limits::REFUSED_CONNECTION_LINGER),
            ),
        )
        .await;
        edge.refusing.set(edge.refusing.get().saturating_sub(1));
    })
    .detach();
}

/// How long a refused connection stays open after its answer, for the answer to be written.
const ANSWER_FLUSH: std::time::Duration = std::time::Duration::from_millis(50);

/// The bootstrap `Broker` of a connection beyond `server.maxConnections`.
struct Refuser {
    detail: String,
    answered: RefCell<Option<futures_channel::oneshot::Sender<()>>>,
}

impl Refuser {
    fn answer(&self) -> std::future::Ready<Result<(), capnp::Error>> {
        if let Some(answered) = self.answered.borrow_mut().take() {
            let _ = answered.send(());
        }
        std::future::ready(Err(Code::TooManyConnections.error(&self.detail)))
    }
}

impl broker::Server for Refuser {
    fn hello(
        self: CapRc<Self>,
        _: broker::HelloParams,
        _: broker::HelloResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn publish(
        self: CapRc<Self>,
        _: broker::PublishParams,
        _: broker::PublishResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn subscribe(
        self: CapRc<Self>,
        _: broker::SubscribeParams,
        _: broker::SubscribeResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn topology(
        self: CapRc<Self>,
        _: broker::TopologyParams,
        _: broker::TopologyResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn stats(
        self: CapRc<Self>,
        _: broker::StatsParams,
        _: broker::StatsResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn forget_group(
        self: CapRc<Self>,
        _: broker::ForgetGroupParams,
        _: broker::ForgetGroupResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn cluster_status(
        self: CapRc<Self>,
        _: broker::ClusterStatusParams,
        _: broker::ClusterStatusResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn set_group_policy(
        self: CapRc<Self>,
        _: broker::SetGroupPolicyParams,
        _: broker::SetGroupPolicyResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
    fn change_membership(
        self: CapRc<Self>,
        _: broker::ChangeMembershipParams,
        _: broker::ChangeMembershipResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.answer()
    }
}

struct BrokerImpl {
    shard: Rc<Shard>,
    topology: Topology,
    own_port: bool,
    conn: Rc<ConnectionUse>,
    /// The connection's unanswered `deliver` calls.
    receipts: Rc<Receipts>,
    edge: Rc<EdgeLimits>,
    /// Bytes of this connection's `deliver` calls unanswered.
    send: Rc<SendGate>,
    /// What the connection may do; `None` until a successful `hello`.
    access: RefCell<Option<Access>>,
}

/// A place among the connection's `server.maxCallsInFlight`, or the refusal (counted).
fn call_slot(shard: &Shard, conn: &Rc<ConnectionUse>) -> Result<CallSlot, Refusal> {
    conn.try_call().ok_or_else(|| {
        shard.refused(Code::TooManyCalls);
        Code::TooManyCalls.refusal(format!(
            "this connection has {} calls unanswered, the limit server.maxCallsInFlight",
            conn.limits().calls_in_flight_max
        ))
    })
}

/// [`call_slot`] for the calls that refuse with exceptions.
fn enter_call(shard: &Shard, conn: &Rc<ConnectionUse>) -> Result<CallSlot, capnp::Error> {
    call_slot(shard, conn).map_err(Refusal::into_capnp)
}

/// Why a call with a `refusal` field did not succeed: a refusal of the request, or a failure
/// that is not one (a malformed message, a shard gone), which stays an exception.
enum CallError {
    Refused(Refusal),
    Failed(capnp::Error),
}

impl From<Refusal> for CallError {
    fn from(refusal: Refusal) -> CallError {
        CallError::Refused(refusal)
    }
}

impl From<capnp::Error> for CallError {
    fn from(e: capnp::Error) -> CallError {
        CallError::Failed(e)
    }
}

impl From<WireError> for CallError {
    fn from(e: WireError) -> CallError {
        match e.refusal() {
            Ok(refusal) => CallError::Refused(refusal),
            Err(e) => CallError::Failed(e),
        }
    }
}

/// Answers a call that did not succeed: on protocol 2 a refusal is written by `write` into the
/// results and the call returns normally; on protocol 1 it is the exception it always was.
fn answer_refused(
    conn: &ConnectionUse,
    e: CallError,
    write: impl FnOnce(&Refusal),
) -> Result<(), capnp::Error> {
    match e {
        CallError::Refused(refusal)
            if conn.protocol_version() >= rpc::REFUSAL_IN_RESULTS_VERSION =>
        {
            write(&refusal);
            Ok(())
        }
        CallError::Refused(refusal) => Err(refusal.into_capnp()),
        CallError::Failed(e) => Err(e),
    }
}

impl BrokerImpl {
    fn enter_call(&self) -> Result<CallSlot, capnp::Error> {
        enter_call(&self.shard, &self.conn)
    }

    /// Whether the connection may make a call needing `action` (`None`: any call after a
    /// successful `hello`); the refusal is counted and names what was refused.
    fn admit(&self, action: Option<Action<'_>>) -> Result<(), capnp::Error> {
        self.admits(action).map_err(Refusal::into_capnp)
    }

    /// [`BrokerImpl::admit`] with the refusal typed, for the calls with a `refusal` field.
    fn admits(&self, action: Option<Action<'_>>) -> Result<(), Refusal> {
        let access = self.access.borrow();
        let Some(access) = access.as_ref() else {
            self.shard
                .auth_refused(Code::HelloRequired, AuthReason::HelloRequired);
            return Err(Code::HelloRequired
                .refusal("call Broker.hello first (with the token, if the broker asks for one)"));
        };
        match action {
            Some(action) => access
                .check(action)
                .map_err(|denied| self.denied(Code::Forbidden, denied)),
            None => Ok(()),
        }
    }

    fn denied(&self, code: Code, denied: Denied) -> Refusal {
        self.shard.auth_refused(code, denied.reason);
        code.refusal(denied.detail)
    }

    /// Takes a publish's bytes from this shard's budget, waiting up to [`limits::PUBLISH_ROOM_WAIT`] for room.
    ///
    /// The budget is the shard's that accepted the connection, not the owning shard's: the
    /// request's memory (the read frame and the archives made from it) is allocated here and
    /// held here until the reply, and one local budget lets a multi-shard batch take its bytes
    /// at once, with no cross-core round trip and no partial reservation across shards.
    ///
    /// `frame` is the bytes the gate took for a large frame before reading it: they count
    /// toward the publish's, and only the rest is waited for. A small frame's publish waits with
    /// its frame in memory, so at most [`limits::PUBLISHES_WAITING_MAX`] of them wait per shard.
    async fn room_for(&self, bytes: usize, frame: Option<BytePermit>) -> Result<Room, Refusal> {
        let own = frame.as_ref().map_or(0, BytePermit::bytes);
        if own >= bytes {
            return Ok(Room(frame, None));
        }
        let budget = &self.edge.budget;
        let waiting = &self.edge.publishes_waiting;
        if frame.is_none() && waiting.get() >= limits::PUBLISHES_WAITING_MAX {
            return Err(self.no_room(bytes, 0));
        }
        waiting.set(waiting.get() + 1);
        let more = budget
            .acquire_beside(bytes - own, own, limits::PUBLISH_ROOM_WAIT)
            .await;
        waiting.set(waiting.get().saturating_sub(1));
        match more {
            Some(more) => Ok(Room(frame, Some(more))),
            None => Err(self.no_room(bytes, limits::PUBLISH_ROOM_WAIT.as_millis())),
        }
    }

    /// The refusal of a publish that found no room for `bytes` after `waited_ms` (counted).
    fn no_room(&self, bytes: usize, waited_ms: u128) -> Refusal {
        let budget = &self.edge.budget;
        self.shard.refused(Code::PublishBytesInFlight);
        Code::PublishBytesInFlight.refusal(format!(
            "shard {} holds {} bytes of publishes in flight, the limit publish.maxBytesInFlight ({}), with {} publishes waiting; waited {waited_ms} ms for room for {bytes} bytes",
            self.shard.id,
            budget.in_use(),
            budget.max(),
            self.edge.publishes_waiting.get(),
        ))
    }
}

/// A publish's bytes in its shard's budget: the frame's, taken before it was read, and the rest.
struct Room(
    #[allow(dead_code)] Option<BytePermit>,
    #[allow(dead_code)] Option<BytePermit>,
);

/// A request for shard `owner` that this node does not serve, as the client is told.
impl BrokerImpl {
    fn not_led_here(&self, owner: ShardId) -> Option<LeaderHint> {
        let view = self.shard.cluster.as_ref()?;
        let (serving, leader, term) = view.shard_role(owner.get())?;
        if serving {
            return None;
        }
        Some(LeaderHint {
            shard: owner,
            term,
            leader: NodeId::from_wire(leader),
            client: view.client_address(leader),
        })
    }
}

pub(super) fn write_not_leader(
    builder: crate::rpc::pinq_capnp::not_leader::Builder<'_>,
    hint: &LeaderHint,
) {
    rpc::cluster::write_not_leader(
        builder,
        &rpc::cluster::NotLeader {
            shard_id: hint.shard.to_wire(),
            term: hint.term,
            leader_node_id: NodeId::to_wire(hint.leader),
            leader_address: hint.client.clone().unwrap_or_default(),
        },
    );
}

fn sorted(ids: &[u64]) -> Vec<u64> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids
}

/// This node's view of the cluster, for `Broker.clusterStatus`.
fn cluster_status(view: &ClusterView) -> rpc::cluster::ClusterStatus {
    let nodes = view
        .nodes()
        .into_iter()
        .map(|n| rpc::cluster::NodeStatus {
            id: n.id,
            raft_address: n.raft,
            client_address: n.client.unwrap_or_default(),
            reachable: n.reachable,
            role: view.role_of(n.id).unwrap_or_default().to_string(),
        })
        .collect();
    let shards = (0u32..)
        .zip(view.shards())
        .map(|(shard_id, s)| rpc::cluster::ShardReplica {
            shard_id,
            leader_node_id: s.status.leader_id,
            term: s.status.term,
            commit_index: s.status.commit,
            applied_index: s.status.applied,
            followers: s
                .status
                .followers
                .iter()
                .map(|f| rpc::cluster::FollowerProgress {
                    node_id: f.id,
                    match_index: f.matched,
                })
                .collect(),
            voters: sorted(&s.conf.voters),
            learners: sorted(&s.conf.learners),
            voters_outgoing: sorted(&s.conf.voters_outgoing),
        })
        .collect();
    rpc::cluster::ClusterStatus {
        node_id: view.node_id(),
        nodes,
        shards,
    }
}

/// A refusal as the client gets it: `overloaded` when its text carries a code the client may
/// retry later (a shard's `diskFull` travels as text through the mesh), `failed` otherwise.
fn failed(message: impl Into<String>) -> capnp::Error {
    let message = message.into();
    match crate::rpc::refusal::code_of(&message) {
        Some(code) if code.retry_later() => capnp::Error::overloaded(message),
        _ => capnp::Error::failed(message),
    }
}

/// The bytes a call's params take, to find the large frame that carried them.
fn params_bytes(size: capnp::Result<capnp::MessageSize>) -> capnp::Result<usize> {
    Ok(usize::try_from(size?.word_count)
        .unwrap_or(usize::MAX)
        .saturating_mul(8))
}

fn wire(e: WireError) -> capnp::Error {
    e.into_capnp()
}

/// A refused batch: a wire error keeps its own text (it names the field and index).
fn publish_refused(e: PublishError) -> CallError {
    match e {
        PublishError::Invalid(e) => e.into(),
        e @ PublishError::AckLevelTooWeak { .. } => {
            Refusal::new(Code::AckLevelTooLow, format!("publish: {e}")).into()
        }
        // The archive could not be made: a failure of the broker, not of the request.
        e @ PublishError::Encode { .. } => CallError::Failed(failed(format!("publish: {e}"))),
    }
}

/// A shard's refusal of its part of a batch (`diskFull` crosses the mesh as text that starts
/// with the code): typed when it has a code and no shard stored its part, otherwise the
/// exception it always was (a batch partly stored is not refused).
fn shard_refused(text: String, nothing_stored: bool) -> CallError {
    match code_of(&text) {
        Some(code) if nothing_stored => Refusal::new(code, text).into(),
        _ => CallError::Failed(failed(text)),
    }
}

/// A shard's refusal of a settle call: the consumer is gone there (its subscription ended on a
/// leader change, or the broker let it go) or the text carries a code; else an exception.
fn settle_refused(e: Refused) -> CallError {
    let text = e.to_string();
    match e {
        Refused::NotLeader(_) | Refused::ConsumerGone => {
            Refusal::new(Code::SubscriptionClosed, text).into()
        }
        // A settle changes nothing when it is refused: typed whenever the text has a code.
        Refused::Failed(_) => shard_refused(text, true),
    }
}

/// The level of an ACK or NACK (unset: `durable`); `none` waits for nothing, as `leader`.
fn settle_level(
    level: Result<crate::rpc::pinq_capnp::AckLevel, capnp::NotInSchema>,
) -> Result<AckLevel, CallError> {
    level.map(AckLevel::from).map_err(|e| {
        let text = format!("level: {e} (this broker knows durable, leader and none)");
        Refusal::new(Code::InvalidAckLevel, text).into()
    })
}

fn to_wire(result: TagResult) -> WireTagResult {
    match result {
        TagResult::Ok => WireTagResult::Ok,
        TagResult::UnknownTag => WireTagResult::UnknownTag,
        TagResult::NotHolder => WireTagResult::NotHolder,
        TagResult::AlreadyAcked => WireTagResult::AlreadyAcked,
        TagResult::Malformed => WireTagResult::Malformed,
    }
}

impl BrokerImpl {
    /// `Broker.publish` up to its answer: the tags or `notLeader` written, or why not.
    async fn publish_batch(
        &self,
        params: broker::PublishParams,
        results: &mut broker::PublishResults,
    ) -> Result<(), CallError> {
        let _call = call_slot(&self.shard, &self.conn)?;
        self.admits(None)?;
        let (parts, len, bytes, frame) = {
            let params = params.get()?;
            let frame = self.conn.claim_frame(params_bytes(params.total_size())?);
            let ack = rpc::read_ack_level(params.get_ack_level())?;
            let limits = PublishLimits::from(&self.topology.publish);
            let messages = rpc::read_publish_batch(params.get_messages()?, &limits)?;
            for (index, message) in (0u32..).zip(&messages) {
                self.admits(Some(Action::Publish {
                    topic: message.topic,
                }))
                .map_err(|refusal| refusal.at(Some(index)))?;
            }
            let parts =
                ValidatedBatch::split(&messages, ack, &self.topology.publish, self.shard.count)
                    .map_err(publish_refused)?;
            let bytes = messages.iter().fold(0usize, |sum, m| {
                sum.saturating_add(limits::publish_charge_bytes(m.counted_bytes()))
            });
            (parts, messages.len(), bytes, frame)
        };
        // The archives in `parts` are all the call needs now: free the request's frame (as
        // large as the batch) before waiting for room and for the store.
        drop(params);
        if let Some(hint) = parts
            .iter()
            .find_map(|p| self.not_led_here(ShardId::new(p.shard)))
        {
            write_not_leader(results.get().init_not_leader(), &hint);
            return Ok(());
        }
        let _room = self.room_for(bytes, frame).await?;
        match self.store(parts, len).await? {
            Stored::Tags(tags) => {
                rpc::write_tags(results.get().init_tags(tags.len() as u32), &tags)
            }
            Stored::NotLeader(hint) => write_not_leader(results.get().init_not_leader(), &hint),
        }
        Ok(())
    }

    /// Sends each part of a batch to its owning shard at once and waits for all of them.
    async fn store(&self, parts: Vec<ShardPart>, len: usize) -> Result<Stored, CallError> {
        let calls: Vec<_> = parts
            .into_iter()
            .map(|part| {
                let ShardPart {
                    shard: owner,
                    places,
                    batch,
                } = part;
                let shard = self.shard.clone();
                let owner = ShardId::new(owner);
                let call = glommio::spawn_local(async move {
                    shard
                        .call(owner, |reply| Request::Publish { batch, reply })
                        .await
                });
                (places, call)
            })
            .collect();
        let mut tags = vec![EventKey::new(TopicHash(0), 0, 0); len];
        let mut stored = 0usize;
        let mut refusal = None;
        for (places, call) in calls {
            match call.await {
                Ok(shard_tags) => {
                    stored += 1;
                    for (place, tag) in places.into_iter().zip(shard_tags) {
                        tags[place as usize] = tag;
                    }
                }
                Err(e) => {
                    refusal.get_or_insert(e);
                }
            }
        }
        match refusal {
            None => Ok(Stored::Tags(tags)),
            // Nothing of the batch was stored: the client may go to the leader.
            Some(Refused::NotLeader(hint)) if stored == 0 => Ok(Stored::NotLeader(hint)),
            Some(e) => Err(shard_refused(format!("publish: {e}"), stored == 0)),
        }
    }
}

/// What the owning shards did with a batch.
enum Stored {
    Tags(Vec<EventKey>),
    NotLeader(LeaderHint),
}

impl broker::Server for BrokerImpl {
    async fn hello(
        self: CapRc<Self>,
        params: broker::HelloParams,
        mut results: broker::HelloResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        let params = params.get()?;
        let client_version = params.get_client_version();
        if !(rpc::PROTOCOL_VERSION_MIN..=rpc::PROTOCOL_VERSION).contains(&client_version) {
            self.shard.refused(Code::UnsupportedVersion);
            return Err(Code::UnsupportedVersion.error(format!(
                "hello: this broker speaks protocol versions {} to {}, not clientVersion {client_version}",
                rpc::PROTOCOL_VERSION_MIN,
                rpc::PROTOCOL_VERSION
            )));
        }
        let token = if params.has_token() {
            params.get_token()?
        } else {
            &[]
        };
        // A failed hello leaves the connection unauthenticated, whatever an earlier one gave.
        let access = self.topology.security.tokens.authenticate(token);
        *self.access.borrow_mut() = access.as_ref().ok().cloned();
        let access =
            access.map_err(|denied| self.denied(Code::Unauthenticated, denied).into_capnp())?;
        // The connection answers in the client's version from now on (its subscriptions too).
        self.conn.set_protocol_version(client_version);
        if let Some(name) = access.name() {
            tracing::debug!(
                shard = %self.shard.id,
                token = name,
                "connection authenticated"
            );
        }
        let mut reply = results.get();
        reply.set_server_version(client_version);
        reply.set_shard_count(self.shard.count as u32);
        reply.set_shard_id(if self.own_port {
            self.shard.id.to_wire()
        } else {
            rpc::ANY_SHARD
        });
        if let Some(view) = &self.shard.cluster {
            // The whole cluster in the handshake: a client whose seed dies right after this
            // answer still knows where else to go (`client::Router`).
            let members: Vec<String> = view.nodes().into_iter().filter_map(|n| n.client).collect();
            let mut list = reply.init_members(members.len() as u32);
            for (i, member) in (0u32..).zip(&members) {
                list.set(i, member.as_str());
            }
        }
        Ok(())
    }

    async fn publish(
        self: CapRc<Self>,
        params: broker::PublishParams,
        mut results: broker::PublishResults,
    ) -> Result<(), capnp::Error> {
        let started = std::time::Instant::now();
        match self.publish_batch(params, &mut results).await {
            Ok(()) => {
                self.shard.record_step(|r| &mut r.publish_call, started);
                Ok(())
            }
            Err(e) => answer_refused(&self.conn, e, |refusal| {
                refusal.write(results.get().init_refusal())
            }),
        }
    }

    async fn subscribe(
        self: CapRc<Self>,
        params: broker::SubscribeParams,
        mut results: broker::SubscribeResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        self.admit(None)?;
        let slot = self.conn.try_subscribe().ok_or_else(|| {
            self.shard.refused(Code::TooManySubscriptions);
            Code::TooManySubscriptions.error(format!(
                "this connection has {} subscriptions open, the limit server.maxSubscriptionsPerConnection",
                self.conn.limits().subscriptions_max
            ))
        })?;
        let (topic, group, consumer_cap, queue_size) = subscribe_params(&params)?;
        self.admit(Some(Action::Consume { topic: &topic }))?;
        let owner = self.shard.owner_of(&topic);
        let (sink_id, sink, notify) = self.shard.open_sink(self.receipts.clone());
        let uuid = uuid::Uuid::new_v4();
        let sink_addr = SinkAddr {
            shard: self.shard.id,
            sink: sink_id,
        };
        let subscribed = match self
            .shard
            .call(owner, |reply| Request::Subscribe {
                topic,
                group,
                uuid,
                sink: sink_addr,
                queue_size,
                reply,
            })
            .await
        {
            Ok(subscribed) => subscribed,
            Err(Refused::NotLeader(hint)) => {
                self.shard.close_sink(sink_id);
                write_not_leader(results.get().init_not_leader(), &hint);
                return Ok(());
            }
            Err(e) => {
                self.shard.close_sink(sink_id);
                return Err(failed(rpc::refusal::code_first(
                    "subscribe",
                    &e.to_string(),
                )));
            }
        };
        let consumer = subscribed.consumer;
        let stream = DeliverStream {
            shard: self.shard.clone(),
            owner,
            consumer,
            sink: sink.clone(),
            receipts: self.receipts.clone(),
            send: self.send.clone(),
            edge: self.edge.clone(),
        };
        glommio::spawn_local(stream.forward(notify, consumer_cap)).detach();
        let handle = SubscriptionImpl {
            shard: self.shard.clone(),
            conn: self.conn.clone(),
            owner,
            consumer,
            sink_id,
            sink,
            closed: Cell::new(false),
            slot: RefCell::new(Some(slot)),
        };
        let mut reply = results.get();
        reply.set_subscription(capnp_rpc::new_client(handle));
        reply.set_consumer_id(uuid.as_bytes());
        reply.set_queue_size(u32::try_from(subscribed.queue_size).unwrap_or(u32::MAX));
        reply.set_max_unacked(u32::try_from(subscribed.max_unacked).unwrap_or(u32::MAX));
        Ok(())
    }

    fn topology(
        self: CapRc<Self>,
        _: broker::TopologyParams,
        mut results: broker::TopologyResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        let _call = match self
            .enter_call()
            .and_then(|call| self.admit(None).map(|()| call))
        {
            Ok(call) => call,
            Err(e) => return std::future::ready(Err(e)),
        };
        let mut shards = self.topology.shards();
        if let Some(view) = &self.shard.cluster {
            for (info, replica) in shards.iter_mut().zip(view.shards()) {
                let leader = replica.status.leader_id;
                info.leader_node_id = leader;
                info.term = replica.status.term;
                info.leader_address = view.client_address(leader).unwrap_or_default();
            }
        }
        rpc::write_topology(results.get().init_shards(shards.len() as u32), &shards);
        std::future::ready(Ok(()))
    }

    fn cluster_status(
        self: CapRc<Self>,
        _: broker::ClusterStatusParams,
        mut results: broker::ClusterStatusResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        let _call = match self
            .enter_call()
            .and_then(|call| self.admit(None).map(|()| call))
        {
            Ok(call) => call,
            Err(e) => return std::future::ready(Err(e)),
        };
        let status = match &self.shard.cluster {
            Some(view) => cluster_status(view),
            None => rpc::cluster::ClusterStatus::default(),
        };
        rpc::cluster::write_cluster_status(results.get().init_status(), &status);
        std::future::ready(Ok(()))
    }

    async fn stats(
        self: CapRc<Self>,
        _: broker::StatsParams,
        mut results: broker::StatsResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        self.admit(Some(Action::Admin { what: "stats" }))?;
        let mut stats = rpc::Stats::default();
        for owner in ShardId::all(self.shard.count) {
            let s = self
                .shard
                .call(owner, |reply| Request::Stats { reply })
                .await
                .map_err(|e| failed(e.to_string()))?;
            rpc::stats::add_shard(&mut stats, owner, s);
        }
        if self.conn.protocol_version() < rpc::BACKLOG_SPLIT_VERSION {
            rpc::stats::as_protocol_1(&mut stats);
        }
        rpc::write_stats(results.get().init_stats(), &stats).map_err(wire)
    }

    async fn forget_group(
        self: CapRc<Self>,
        params: broker::ForgetGroupParams,
        _: broker::ForgetGroupResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        self.admit(Some(Action::Admin {
            what: "forgetGroup",
        }))?;
        let (topic, group) = {
            let params = params.get()?;
            let topic = params
                .get_topic()?
                .to_str()
                .map_err(|_| failed("forgetGroup: topic is not UTF-8"))?
                .to_owned();
            let group = params
                .get_group()?
                .to_str()
                .map_err(|_| failed("forgetGroup: group is not UTF-8"))?
                .to_owned();
            (topic, group)
        };
        crate::key::validate_topic(&topic)
            .map_err(|e| failed(format!("forgetGroup: topic: {e}")))?;
        let owner = self.shard.owner_of(&topic);
        self.shard
            .call(owner, |reply| Request::ForgetGroup {
                topic,
                group,
                reply,
            })
            .await
            .map_err(|e| failed(format!("forgetGroup: {e}")))
    }

    async fn set_group_policy(
        self: CapRc<Self>,
        params: broker::SetGroupPolicyParams,
        results: broker::SetGroupPolicyResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        self.admit(Some(Action::Admin {
            what: "setGroupPolicy",
        }))?;
        super::policy_call::set_group_policy(&self.shard, params, results, failed).await
    }

    async fn change_membership(
        self: CapRc<Self>,
        params: broker::ChangeMembershipParams,
        results: broker::ChangeMembershipResults,
    ) -> Result<(), capnp::Error> {
        let _call = self.enter_call()?;
        self.admit(Some(Action::Admin {
            what: "changeMembership",
        }))?;
        super::membership::change_membership(&self.shard, params, results, failed).await
    }
}

/// A `subscribe` call's topic, group, consumer and `queueSize`, checked (UTF-8, a valid topic, a
/// group within the length limit).
fn subscribe_params(
    params: &broker::SubscribeParams,
) -> Result<(String, String, consumer::Client, usize), capnp::Error> {
    let params = params.get()?;
    let topic = params
        .get_topic()?
        .to_str()
        .map_err(|_| Code::NotUtf8.error("subscribe: topic is not UTF-8"))?
        .to_owned();
    let group = params
        .get_group()?
        .to_str()
        .map_err(|_| Code::NotUtf8.error("subscribe: group is not UTF-8"))?
        .to_owned();
    crate::key::validate_topic(&topic)
        .map_err(|e| Code::InvalidTopic.error(format!("subscribe: topic: {e}")))?;
    if group.len() > crate::key::TOPIC_LEN_MAX {
        return Err(Code::InvalidRequest.error(format!(
            "subscribe: group is {} bytes, the limit is 255",
            group.len()
        )));
    }
    Ok((
        topic,
        group,
        params.get_consumer()?,
        params.get_queue_size() as usize,
    ))
}

/// One subscription's way to its client: the sink the owner fills, and where the window goes
/// back to.
#[derive(Clone)]
struct DeliverStream {
    shard: Rc<Shard>,
    owner: ShardId,
    consumer: ConsumerId,
    sink: Rc<Sink>,
    receipts: Rc<Receipts>,
    /// The connection's send budgets: a call is sent only when its bytes fit.
    send: Rc<SendGate>,
    edge: Rc<EdgeLimits>,
}

impl DeliverStream {
    /// Sends the sink's deliveries to the client's `Consumer` in batches, without waiting for
    /// earlier calls: the owner never puts more in the sink than the consumer's window allows,
    /// and each batch's share of the window goes back when its call returns. A batch goes only
    /// when its bytes fit the connection's send budgets (`limits::send`); until then the copies
    /// wait in the sink.
    async fn forward(self, notify: LocalReceiver<()>, consumer: consumer::Client) {
        loop {
            if self.sink.closed.get() || self.send.is_closed() {
                return;
            }
            let Some(first) = self.first_charge() else {
                if notify.recv().await.is_none() {
                    return;
                }
                continue;
            };
            if !self.send.fits(first, true) && !self.wait_for_room(first, &notify).await {
                return;
            }
            let (batch, permit) = self.next_batch();
            if batch.is_empty() {
                continue;
            }
            let mut request = consumer.deliver_request();
            {
                let outgoing: Vec<OutgoingDelivery<'_, crate::message::ArchivedStoredMessage>> =
                    batch
                        .iter()
                        .map(|d| OutgoingDelivery {
                            tag: d.key,
                            message: d.value.message(),
                            attempt: d.attempt,
                        })
                        .collect();
                let list = request.get().init_deliveries(outgoing.len() as u32);
                rpc::write_deliveries(list, &outgoing);
            }
            let keys: Vec<EventKey> = batch.iter().map(|d| d.key).collect();
            let call = request.send().promise;
            let sent = (now_ms(), std::time::Instant::now());
            let awaiting = self.receipts.sent(sent.0);
            drop(batch);
            let held = (permit, awaiting, sent.1);
            glommio::spawn_local(self.clone().returned(keys, call, held)).detach();
        }
    }

    /// What the oldest delivery in the sink would take from the send budgets.
    fn first_charge(&self) -> Option<usize> {
        let queue = self.sink.queue.borrow();
        queue
            .front()
            .map(|d| send_limits::delivery_charge_bytes(d.value.as_bytes().len()))
    }

    /// Waits until a delivery of `first` bytes fits, or the sink is told something (closed, or
    /// more deliveries); `false` when the sink is gone.
    async fn wait_for_room(&self, first: usize, notify: &LocalReceiver<()>) -> bool {
        let memory = &self.edge.memory;
        memory.sends_waited.set(memory.sends_waited.get() + 1);
        let room = futures_lite::future::poll_fn(|cx| self.send.poll_room(cx, first, now_ms()));
        futures_lite::future::or(
            async {
                room.await;
                true
            },
            async { notify.recv().await.is_some() },
        )
        .await
            && !self.send.is_closed()
    }

    /// Up to [`DELIVER_BATCH_MAX`] deliveries from the sink, oldest first, as many as fit the
    /// send budgets, with their bytes taken.
    fn next_batch(&self) -> (Vec<pipeline::Delivery>, SendPermit) {
        let mut queue = self.sink.queue.borrow_mut();
        let charge =
            |d: &pipeline::Delivery| send_limits::delivery_charge_bytes(d.value.as_bytes().len());
        let n = send_limits::batch_len(&self.send, queue.iter().map(charge), DELIVER_BATCH_MAX);
        let batch: Vec<pipeline::Delivery> = queue.drain(..n).collect();
        let bytes = batch.iter().map(charge).sum();
        (batch, self.send.take(bytes))
    }

    /// Waits for one `deliver` call to return, then gives its bytes and its deliveries'
    /// window back, and starts their leases (the consumer confirmed it has them). A call that
    /// fails ends the stream (a disconnect of this consumer).
    async fn returned<T>(
        self,
        keys: Vec<EventKey>,
        call: impl Future<Output = Result<T, capnp::Error>>,
        (permit, awaiting, sent): (SendPermit, Awaiting, std::time::Instant),
    ) {
        let closed = futures_lite::future::poll_fn(|cx| self.send.poll_closed(cx));
        let answer = futures_lite::future::or(async { Some(call.await) }, async {
            closed.await;
            None
        })
        .await;
        drop((permit, awaiting));
        let Some(answer) = answer else {
            // The connection was closed under the call: its answer will never come.
            self.sink.close();
            return;
        };
        if let Err(e) = answer {
            tracing::debug!("deliver failed, closing the subscription's stream: {e}");
            self.sink.close();
            return;
        }
        self.shard.record_step(|r| &mut r.deliver_round_trip, sent);
        self.shard
            .return_credit(self.owner, self.consumer, keys)
            .await;
    }
}

struct SubscriptionImpl {
    shard: Rc<Shard>,
    conn: Rc<ConnectionUse>,
    owner: ShardId,
    consumer: ConsumerId,
    sink_id: u64,
    sink: Rc<Sink>,
    closed: Cell<bool>,
    /// Its place among the connection's subscriptions, given back when it closes.
    slot: RefCell<Option<SubscriptionSlot>>,
}

impl SubscriptionImpl {
    async fn settle(
        &self,
        op: SettleOp,
        tags: capnp::data_list::Reader<'_>,
        params_bytes: usize,
    ) -> Result<Vec<TagResult>, CallError> {
        let started = std::time::Instant::now();
        // A large frame's bytes, held until the call returns.
        let _frame = self.conn.claim_frame(params_bytes);
        let _call = call_slot(&self.shard, &self.conn)?;
        if self.closed.get() {
            // The text protocol 1 always had, with no code in it.
            return Err(Refusal::new(Code::SubscriptionClosed, "subscription is closed").into());
        }
        let mut tags = SettleTags::read(tags)?;
        if tags.keys.is_empty() {
            return Ok(tags.answers(&[], TagResult::Malformed));
        }
        let consumer = self.consumer;
        let keys = std::mem::take(&mut tags.keys);
        let settled = self
            .shard
            .call(self.owner, |reply| Request::Settle {
                consumer,
                op,
                tags: keys,
                reply,
            })
            .await
            .map_err(settle_refused)?;
        let results = tags.answers(&settled, TagResult::Malformed);
        self.shard.record_step(|r| &mut r.settle_call, started);
        Ok(results)
    }

    fn close_now(&self) {
        if self.closed.replace(true) {
            return;
        }
        self.slot.borrow_mut().take();
        self.shard.close_sink(self.sink_id);
        self.sink.close();
        let shard = self.shard.clone();
        let (owner, consumer) = (self.owner, self.consumer);
        glommio::spawn_local(
            async move { shard.tell(owner, Request::Unsubscribe { consumer }).await },
        )
        .detach();
    }
}

impl Drop for SubscriptionImpl {
    fn drop(&mut self) {
        // Dropping the capability (or losing the connection) is a disconnect.
        self.close_now();
    }
}

fn write_results(list: capnp::enum_list::Builder<'_, WireTagResult>, results: &[TagResult]) {
    let wire_results: Vec<WireTagResult> = results.iter().map(|r| to_wire(*r)).collect();
    rpc::write_tag_results(list, &wire_results);
}

/// Answers a settle call (each its own capnp results type, all with `results` and `refusal`).
macro_rules! answer_settle {
    ($conn:expr, $outcome:expr, $results:expr) => {
        match $outcome {
            Ok(outcome) => {
                write_results($results.get().init_results(outcome.len() as u32), &outcome);
                Ok(())
            }
            Err(e) => answer_refused($conn, e, |refusal| {
                refusal.write($results.get().init_refusal())
            }),
        }
    };
}

impl subscription::Server for SubscriptionImpl {
    async fn ack(
        self: CapRc<Self>,
        params: subscription::AckParams,
        mut results: subscription::AckResults,
    ) -> Result<(), capnp::Error> {
        let params = params.get()?;
        let size = params_bytes(params.total_size())?;
        let outcome = match settle_level(params.get_level()) {
            Ok(level) => {
                self.settle(SettleOp::Ack { level }, params.get_tags()?, size)
                    .await
            }
            Err(e) => Err(e),
        };
        answer_settle!(&self.conn, outcome, results)
    }

    async fn nack(
        self: CapRc<Self>,
        params: subscription::NackParams,
        mut results: subscription::NackResults,
    ) -> Result<(), capnp::Error> {
        let params = params.get()?;
        let size = params_bytes(params.total_size())?;
        let delay_ms = params.get_delay_ms();
        let outcome = match settle_level(params.get_level()) {
            Ok(level) => {
                let op = SettleOp::Nack { delay_ms, level };
                self.settle(op, params.get_tags()?, size).await
            }
            Err(e) => Err(e),
        };
        answer_settle!(&self.conn, outcome, results)
    }

    async fn touch(
        self: CapRc<Self>,
        params: subscription::TouchParams,
        mut results: subscription::TouchResults,
    ) -> Result<(), capnp::Error> {
        let params = params.get()?;
        let size = params_bytes(params.total_size())?;
        let outcome = self.settle(SettleOp::Touch, params.get_tags()?, size).await;
        answer_settle!(&self.conn, outcome, results)
    }

    fn close(
        self: CapRc<Self>,
        _: subscription::CloseParams,
        _: subscription::CloseResults,
    ) -> impl Future<Output = Result<(), capnp::Error>> + 'static {
        self.close_now();
        std::future::ready(Ok(()))
    }
}
