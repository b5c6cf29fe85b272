//! The node-to-node transport of one shard: on the shard's own glommio executor, one TCP
//! connection per peer node carrying this shard's Raft messages (its Raft group's), so that no
//! shard's Raft traffic crosses to another core. Every shard of a node runs one.
//!
//! It owns the sockets, the per-peer outbound queues and the handshake; it never interprets a
//! Raft message (that is the Raft driver's, which hands messages to [`Transport::send`] and gets
//! the peers' through the `inbound` callback) and it never waits on a caller: `send` only queues,
//! and a writer task per connection drains the queue (STYLE 14). The codec and the handshake
//! rules are pure, in [`super::wire`].
//!
//! **Who dials.** Of each pair of nodes, shard k of the node with the lower id dials the other
//! node, for shard k; the connection then carries both directions of group k. That makes one
//! full-duplex connection per pair and shard without a tie-break race. The accepting side still
//! takes a connection from any member: the newest connection of a peer replaces the one before
//! (a peer that restarted dials again before the old socket's death is noticed).
//!
//! **One Raft port.** A node listens on one address (`cluster.raftListen`), on its first shard
//! ([`Transport::listen`]). A dialer writes an 8-byte plaintext preamble first (magic and shard
//! index, [`super::wire::encode_preamble`]), before TLS; the listening shard reads it within
//! [`HANDSHAKE_TIMEOUT`] and keeps the connection if it names itself, or hands the socket (a
//! duplicated descriptor, [`Accepted`]) to the named shard's core through the caller's
//! [`Handoff`] (a bounded channel: when it is full the socket is closed and counted,
//! `handoffs_shed`, and the dialer retries); that core's transport runs TLS, the handshake and
//! the loops ([`Transport::adopt`]). A preamble naming a shard the node does not run is a
//! refusal (`shardMismatch`, logged and kept), and the `Hello` repeats the shard so that a
//! connection handed to the wrong shard is refused too. Glommio's `TcpStream` does not read
//! ahead, so the socket handed over starts at the peer's first TLS or `Hello` byte.
//!
//! **TLS.** With `[cluster.tls]` every connection runs over rustls ([`crate::security::node`]):
//! the accepting side requires a client certificate signed by `caFile`, the dialing side verifies
//! the server's against `caFile` and the identity of the node it dialed. A failed TLS handshake
//! (wrong CA, no certificate, another member's certificate, a peer without TLS) is a refusal with
//! the local-only reason `tls`, logged and kept like the others; the TLS handshake and the `Hello`
//! exchange together must finish within [`HANDSHAKE_TIMEOUT`], so a peer that connects and says
//! nothing holds its slot no longer than that.
//!
//! **Handshake.** Each side sends its `Hello`, reads the other's, runs
//! [`check_hello`] on it (with TLS, the accepting side also checks that the peer's certificate
//! names the node its `Hello` claims: `certificateMismatch`) and sends its verdict; both
//! verdicts must say accepted. A refusal is
//! logged once per peer and reason (repeats go to debug until the connection works or the reason
//! changes), counted, kept in [`Transport::recent_refusals`], and the connection closed. The dialer
//! retries with exponential backoff (50 ms doubling to 2 s, with jitter from a generator seeded by
//! the two node ids, so a run replays), so fixing a node's configuration and restarting it is
//! enough.
//!
//! **Batching.** `send` queues and wakes the connection's writer; the writer runs after the
//! current task yields and drains the whole queue into as few frames as `cluster.maxFrameBytes`
//! allows, so everything the shard queued for a peer in one tick (its heartbeats and appends)
//! goes as one frame and one `write`. A core runs one shard, so this is all of the core's
//! messages to that peer; different shards' messages travel on different connections. A frame is assembled in one reused buffer and written whole,
//! which is what a `BufWriter` would give, without its second copy. Reads go through a
//! `BufReader`, so small frames cost one `read` for several.
//!
//! **Bounds.** Per peer, at most `cluster.outboundQueueMessages` queued messages; a message sent
//! while the queue is full, or while the peer is not connected, is dropped and counted (Raft
//! retransmits; queueing for a dead peer would only deliver stale messages later). An incoming
//! frame announcing more than `cluster.maxFrameBytes` closes the connection before its body is
//! read. A message of another shard than the connection's is dropped and counted
//! (`dropped_inbound`). A connection with no bytes in either direction for 10 × the election
//! timeout is closed; a writer with nothing to send sends an empty frame each election timeout
//! so that an idle but healthy pair is not mistaken for a stalled one. Unauthenticated
//! connections (still in their preamble or handshake) are bounded per shard too.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_lite::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use glommio::net::{TcpListener, TcpStream};
use raft::eraftpb::Message;
use rustls::pki_types::CertificateDer;

use super::wire::{
    check_hello, decode_frame, decode_preamble, encode_frame, encode_preamble, frame_bytes,
    message_bytes_estimate, segment_table_bytes, HandshakeRefusal, Hello, HelloReply,
    RefusalReason, WireError, FRAME_PREFIX_BYTES, PREAMBLE_BYTES,
};
use crate::config::ClusterConfig;
use crate::security::node::{describe_tls_failure, NodeTls};
use crate::security::stream::{self, Stream};

/// First delay before redialing a peer.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest delay between two dials of a peer.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A connection silent this many election timeouts is closed.
const IDLE_ELECTION_TIMEOUTS: u32 = 10;
/// Connections accepted and still in their handshake, at most (more are closed at once).
const HANDSHAKES_IN_PROGRESS_MAX: usize = 16;
/// The TLS handshake and the `Hello` exchange of a new connection must end within this; on a
/// LAN they take milliseconds, across a WAN a few round trips.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Refusals kept for [`Transport::recent_refusals`].
const RECENT_REFUSALS_MAX: usize = 16;
/// Read buffer of a connection.
const READ_BUFFER_BYTES: usize = 64 << 10;
/// Frame bytes that are not messages (segment table, root struct, list header), kept free when a
/// writer packs messages into a frame by their estimates.
const FRAME_ENVELOPE_BYTES: usize = 64;

/// What [`Transport::peers`] reports of one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    pub id: u64,
    pub raft_addr: SocketAddr,
    /// The client address the peer gave in its last accepted handshake.
    pub client_addr: Option<String>,
    /// Whether a connection to it is established (handshake accepted both ways).
    pub reachable: bool,
}

/// The transport's counters since [`Transport::start`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportCounters {
    pub frames_sent: u64,
    pub messages_sent: u64,
    pub bytes_sent: u64,
    pub frames_received: u64,
    pub messages_received: u64,
    pub bytes_received: u64,
    /// Messages dropped by `send` because the peer's queue was full.
    pub dropped_queue_full: u64,
    /// Messages dropped by `send` because the peer was not connected (or not a member).
    pub dropped_not_connected: u64,
    /// Messages dropped by a writer because alone they exceed `cluster.maxFrameBytes`.
    pub dropped_oversize: u64,
    /// Messages received for a shard this node does not run, or not from the connected peer.
    pub dropped_inbound: u64,
    /// Handshakes refused, by this node or by the peer.
    pub handshake_refusals: u64,
    /// Incoming frames over `cluster.maxFrameBytes` (each closed its connection).
    pub frames_too_large: u64,
    /// Incoming frames that did not decode (each closed its connection).
    pub decode_errors: u64,
    /// Connections closed because nothing arrived for 10 election timeouts, or because their
    /// handshake did not end within [`HANDSHAKE_TIMEOUT`].
    pub stalled_connections: u64,
    /// Connections established (both handshakes accepted).
    pub connections_established: u64,
    /// Connections established to a peer that had been connected before.
    pub reconnects: u64,
    /// Accepted connections closed at once because too many handshakes were in progress.
    pub handshakes_shed: u64,
    /// Listening shard only: accepted connections for another shard closed because that
    /// shard's core could not take them (its channel full, or it is not running).
    pub handoffs_shed: u64,
    /// Listening shard only: accepted connections handed to another shard's core.
    pub handoffs: u64,
}

impl TransportCounters {
    /// Every message the transport dropped, for any reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_queue_full
            + self.dropped_not_connected
            + self.dropped_oversize
            + self.dropped_inbound
    }
}

/// A handshake refusal, as [`Transport::recent_refusals`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusalEvent {
    /// The peer's node id, when its `Hello` was read.
    pub peer: Option<u64>,
    /// The peer's socket address on this connection.
    pub peer_addr: SocketAddr,
    /// `true` when this node refused the peer, `false` when the peer refused this node.
    pub by_us: bool,
    pub refusal: HandshakeRefusal,
}

/// Where a transport runs: shard `index` of the `count` a node runs. Every shard runs its own
/// transport, for its own Raft group only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlace {
    pub index: u32,
    pub count: u32,
}

/// A peer connection the listening shard accepted and read the preamble of, on its way to the
/// core of the shard the preamble named. Owning the descriptor, it closes the socket if dropped
/// on the way (a full channel, a stopped shard).
#[derive(Debug)]
pub struct Accepted {
    pub fd: OwnedFd,
    pub peer_addr: SocketAddr,
}

/// How the listening shard hands an accepted connection to shard `index`'s core; `false` when
/// that core cannot take it now (the connection is then closed, counted; its dialer retries).
pub type Handoff = Rc<dyn Fn(u32, Accepted) -> bool>;

/// Why the transport could not start.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot listen for peers on {addr} (cluster.raftListen): {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("node {node_id} is not in cluster.peers")]
    NotAMember { node_id: u64 },
}

/// The running transport; see the module docs. Lives on the executor that started it.
pub struct Transport {
    inner: Rc<Inner>,
}

struct Inner {
    node_id: u64,
    place: ShardPlace,
    /// This node's `Hello`; its members follow [`Transport::set_peers`].
    hello: RefCell<Hello>,
    queue_len_max: usize,
    max_frame_bytes: usize,
    idle_timeout: Duration,
    keepalive: Duration,
    /// `[cluster.tls]`; `None`: plain TCP.
    tls: Option<Arc<NodeTls>>,
    inbound: Rc<dyn Fn(u64, Message)>,
    peers: RefCell<BTreeMap<u64, Peer>>,
    counters: Cell<TransportCounters>,
    refusals: RefCell<VecDeque<RefusalEvent>>,
    /// Refusals already logged at warn, by peer id, side and reason, with their text: repeats go
    /// to debug until the peer connects or the text changes.
    logged_refusals: RefCell<BTreeMap<(u64, bool, RefusalReason), String>>,
    handshakes_in_progress: Cell<usize>,
    next_connection: Cell<u64>,
    next_task: Cell<u64>,
    tasks: RefCell<BTreeMap<u64, glommio::task::JoinHandle<()>>>,
    stopped: Cell<bool>,
}

struct Peer {
    raft_addr: SocketAddr,
    client_addr: Option<String>,
    queue: VecDeque<(u32, Message)>,
    /// The established connection, if any.
    connection: Option<Connection>,
    ever_connected: bool,
}

impl Peer {
    fn new(raft_addr: SocketAddr) -> Peer {
        Peer {
            raft_addr,
            client_addr: None,
            queue: VecDeque::new(),
            connection: None,
            ever_connected: false,
        }
    }
}

struct Connection {
    id: u64,
    /// Wakes the writer: messages queued, or the connection is to close.
    wake: Rc<Signal>,
    /// Set when a newer connection replaced this one, or on stop.
    closing: Rc<Cell<bool>>,
}

impl Transport {
    /// Starts shard `place`'s transport: one dialer per peer with a higher id (see "Who
    /// dials"); connections from peers with lower ids arrive through [`Transport::adopt`] (or,
    /// on the listening shard, its own accept loop: [`Transport::listen`]). Must run on the
    /// shard's glommio executor; every task it starts stays there. `inbound` is called with
    /// (from node, message) for each message of this shard received, in order per peer. `tls`
    /// is `[cluster.tls]` as read at start-up (`None`: plain TCP).
    pub fn start(
        config: &ClusterConfig,
        place: ShardPlace,
        tls: Option<Arc<NodeTls>>,
        inbound: Rc<dyn Fn(u64, Message)>,
    ) -> Result<Rc<Transport>, TransportError> {
        if !config.peers.contains_key(&config.node_id) {
            return Err(TransportError::NotAMember {
                node_id: config.node_id,
            });
        }
        let election_timeout = config.election_timeout().max(Duration::from_millis(1));
        let peers = config
            .peers
            .iter()
            .filter(|(id, _)| **id != config.node_id)
            .map(|(id, addr)| (*id, Peer::new(*addr)))
            .collect();
        let inner = Rc::new(Inner {
            node_id: config.node_id,
            place,
            hello: RefCell::new(Hello::new(config, place.count, place.index)),
            queue_len_max: config.outbound_queue_messages,
            max_frame_bytes: config.max_frame_bytes,
            idle_timeout: election_timeout.saturating_mul(IDLE_ELECTION_TIMEOUTS),
            keepalive: election_timeout,
            tls,
            inbound,
            peers: RefCell::new(peers),
            counters: Cell::new(TransportCounters::default()),
            refusals: RefCell::new(VecDeque::new()),
            logged_refusals: RefCell::new(BTreeMap::new()),
            handshakes_in_progress: Cell::new(0),
            next_connection: Cell::new(0),
            next_task: Cell::new(0),
            tasks: RefCell::new(BTreeMap::new()),
            stopped: Cell::new(false),
        });
        let dialed: Vec<u64> = inner
            .peers
            .borrow()
            .keys()
            .copied()
            .filter(|id| *id > config.node_id)
            .collect();
        for id in dialed {
            spawn(&inner, dial_loop(inner.clone(), id));
        }
        Ok(Rc::new(Transport { inner }))
    }

    /// The node's one Raft port: binds `cluster.raftListen` and accepts every shard's
    /// connections on this shard's core, reading each one's preamble; a connection for this
    /// shard stays here, one for another shard goes to `handoff`. Returns the address bound
    /// (with the port the OS chose if it was 0).
    pub fn listen(
        &self,
        raft_listen: SocketAddr,
        handoff: Handoff,
    ) -> Result<SocketAddr, TransportError> {
        let bind_error = |source| TransportError::Bind {
            addr: raft_listen,
            source,
        };
        let listener = bind_exclusive(raft_listen).map_err(bind_error)?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| bind_error(source.into()))?;
        let inner = &self.inner;
        spawn(inner, accept_loop(inner.clone(), listener, handoff));
        tracing::info!(
            node = inner.node_id,
            shard = inner.place.index,
            listen = %local_addr,
            peers = inner.peers.borrow().len(),
            "cluster transport listening"
        );
        Ok(local_addr)
    }

    /// Serves a connection the listening shard accepted for this shard (its preamble named
    /// it). Closed at once when too many handshakes are in progress here.
    pub fn adopt(&self, accepted: Accepted) {
        let inner = &self.inner;
        if inner.stopped.get() || inner.handshakes_in_progress.get() >= HANDSHAKES_IN_PROGRESS_MAX {
            inner.count(|c| c.handshakes_shed += 1);
            return;
        }
        // SAFETY: `accepted.fd` is a connected TCP socket we own (into_raw_fd released it),
        // which is what glommio's `from_raw_fd` requires; the stream takes over closing it.
        let stream = unsafe { TcpStream::from_raw_fd(accepted.fd.into_raw_fd()) };
        let connection = serve_connection(inner.clone(), stream, None);
        spawn(inner, async move {
            connection.await;
        });
    }

    /// Queues `msg` (of this transport's shard) for node `to`; never waits. Dropped (and
    /// counted) when that peer's queue is full, or when it is not connected.
    pub fn send(&self, to: u64, msg: Message) {
        let inner = &self.inner;
        let mut peers = inner.peers.borrow_mut();
        let Some(peer) = peers.get_mut(&to) else {
            inner.count(|c| c.dropped_not_connected += 1);
            return;
        };
        let Some(connection) = &peer.connection else {
            inner.count(|c| c.dropped_not_connected += 1);
            return;
        };
        if peer.queue.len() >= inner.queue_len_max {
            inner.count(|c| c.dropped_queue_full += 1);
            return;
        }
        peer.queue.push_back((inner.place.index, msg));
        connection.wake.notify();
    }

    /// Every peer (this node excluded), by id.
    pub fn peers(&self) -> Vec<PeerStatus> {
        self.inner
            .peers
            .borrow()
            .iter()
            .map(|(id, peer)| PeerStatus {
                id: *id,
                raft_addr: peer.raft_addr,
                client_addr: peer.client_addr.clone(),
                reachable: peer.connection.is_some(),
            })
            .collect()
    }

    /// The members changed (`pinq cluster add-node`/`remove-node`): from now on the peers are
    /// `wanted` (this node left out). A new peer gets a dialer if its id is higher (see "Who
    /// dials"); a peer gone has its connection closed and its dialer ends. The `Hello` this
    /// node sends lists the new members.
    pub fn set_peers(&self, wanted: &BTreeMap<u64, SocketAddr>) {
        let inner = &self.inner;
        let mut dial = Vec::new();
        {
            let mut peers = inner.peers.borrow_mut();
            peers.retain(|id, peer| {
                let keep = wanted.contains_key(id) && *id != inner.node_id;
                if !keep {
                    peer.queue.clear();
                    if let Some(connection) = peer.connection.take() {
                        connection.closing.set(true);
                        connection.wake.notify();
                    }
                }
                keep
            });
            for (&id, &addr) in wanted.iter().filter(|(id, _)| **id != inner.node_id) {
                match peers.get_mut(&id) {
                    Some(peer) => peer.raft_addr = addr,
                    None => {
                        peers.insert(id, Peer::new(addr));
                        if id > inner.node_id {
                            dial.push((id, addr));
                        }
                    }
                }
            }
        }
        {
            let mut hello = inner.hello.borrow_mut();
            let own = hello.raft_addr;
            hello.members = wanted.clone();
            hello.members.insert(inner.node_id, own);
        }
        for (id, addr) in dial {
            tracing::info!(node = inner.node_id, shard = inner.place.index, peer = id, %addr, "new cluster member: dialing it");
            spawn(inner, dial_loop(inner.clone(), id));
        }
    }

    /// The counters so far.
    pub fn counters(&self) -> TransportCounters {
        self.inner.counters.get()
    }

    /// The latest handshake refusals (at most 16), oldest first.
    pub fn recent_refusals(&self) -> Vec<RefusalEvent> {
        self.inner.refusals.borrow().iter().cloned().collect()
    }

    /// Stops every task: the listener, the dialers and every connection close when the executor
    /// next runs them (the sockets are closed by then). Queued messages are dropped.
    pub fn stop(&self) {
        let inner = &self.inner;
        if inner.stopped.replace(true) {
            return;
        }
        let tasks = std::mem::take(&mut *inner.tasks.borrow_mut());
        for task in tasks.values() {
            task.cancel();
        }
        let mut peers = inner.peers.borrow_mut();
        for peer in peers.values_mut() {
            peer.queue.clear();
            if let Some(connection) = peer.connection.take() {
                connection.closing.set(true);
                connection.wake.notify();
            }
        }
        tracing::info!(
            node = inner.node_id,
            shard = inner.place.index,
            "cluster transport stopped"
        );
    }
}

impl Inner {
    fn count(&self, change: impl FnOnce(&mut TransportCounters)) {
        let mut counters = self.counters.get();
        change(&mut counters);
        self.counters.set(counters);
    }

    fn record_refusal(&self, event: RefusalEvent) {
        self.count(|c| c.handshake_refusals += 1);
        let key = (event.peer.unwrap_or(0), event.by_us, event.refusal.reason);
        let first = self
            .logged_refusals
            .borrow_mut()
            .insert(key, event.refusal.detail.clone())
            .is_none_or(|before| before != event.refusal.detail);
        let peer = event.peer.map_or("?".to_owned(), |id| id.to_string());
        if first {
            if event.by_us {
                tracing::warn!(node = self.node_id, shard = self.place.index, peer, addr = %event.peer_addr, "refused a peer at the handshake: {}", event.refusal);
            } else {
                tracing::warn!(node = self.node_id, shard = self.place.index, peer, addr = %event.peer_addr, "refused by a peer at the handshake: {}", event.refusal);
            }
        } else {
            tracing::debug!(
                node = self.node_id,
                shard = self.place.index,
                peer,
                by_us = event.by_us,
                "handshake refused again: {}",
                event.refusal
            );
        }
        let mut refusals = self.refusals.borrow_mut();
        if refusals.len() == RECENT_REFUSALS_MAX {
            refusals.pop_front();
        }
        refusals.push_back(event);
    }

    /// Makes `connection` the peer's live one, replacing (and closing) any older one.
    fn register(&self, peer_id: u64, client_addr: String, connection: Connection) {
        let mut peers = self.peers.borrow_mut();
        let Some(peer) = peers.get_mut(&peer_id) else {
            return;
        };
        if let Some(old) = peer.connection.replace(connection) {
            old.closing.set(true);
            old.wake.notify();
        }
        // Messages queued for the old connection are stale by now; Raft resends what matters.
        peer.queue.clear();
        peer.client_addr = Some(client_addr);
        let reconnect = peer.ever_connected;
        peer.ever_connected = true;
        self.logged_refusals
            .borrow_mut()
            .retain(|(id, _, _), _| *id != peer_id);
        drop(peers);
        self.count(|c| {
            c.connections_established += 1;
            if reconnect {
                c.reconnects += 1;
            }
        });
    }

    fn unregister(&self, peer_id: u64, connection_id: u64) {
        let mut peers = self.peers.borrow_mut();
        if let Some(peer) = peers.get_mut(&peer_id) {
            if peer.connection.as_ref().map(|c| c.id) == Some(connection_id) {
                peer.connection = None;
                peer.queue.clear();
            }
        }
    }
}

/// Spawns `future` on the current executor, registered so that [`Transport::stop`] can cancel it.
fn spawn(inner: &Rc<Inner>, future: impl Future<Output = ()> + 'static) {
    if inner.stopped.get() {
        return;
    }
    let id = inner.next_task.get();
    inner.next_task.set(id + 1);
    let weak = Rc::downgrade(inner);
    let handle = glommio::spawn_local(async move {
        future.await;
        if let Some(inner) = weak.upgrade() {
            inner.tasks.borrow_mut().remove(&id);
        }
    })
    .detach();
    inner.tasks.borrow_mut().insert(id, handle);
}

/// Binds without `SO_REUSEPORT` (which glommio's own `bind` sets), so that a second process on
/// the same Raft port fails to start instead of silently sharing the port's connections.
fn bind_exclusive(addr: SocketAddr) -> io::Result<TcpListener> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let fd = listener.into_raw_fd();
    // SAFETY: `fd` is a bound, listening TCP socket that we own (into_raw_fd released it), which
    // is what glommio's `from_raw_fd` requires; it takes over closing it.
    Ok(unsafe { TcpListener::from_raw_fd(fd) })
}

async fn accept_loop(inner: Rc<Inner>, listener: TcpListener, handoff: Handoff) {
    loop {
        let stream = match listener.accept().await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(
                    node = inner.node_id,
                    shard = inner.place.index,
                    "accepting a peer connection: {e}"
                );
                glommio::timer::sleep(BACKOFF_MIN).await;
                continue;
            }
        };
        if inner.handshakes_in_progress.get() >= HANDSHAKES_IN_PROGRESS_MAX {
            inner.count(|c| c.handshakes_shed += 1);
            drop(stream);
            continue;
        }
        let routing = route_accepted(inner.clone(), stream, handoff.clone());
        spawn(&inner, routing);
    }
}

/// Reads an accepted connection's preamble (within [`HANDSHAKE_TIMEOUT`], counted among the
/// handshakes in progress) and serves the connection here or hands it to its shard's core.
async fn route_accepted(inner: Rc<Inner>, mut stream: TcpStream, handoff: Handoff) {
    let peer_addr = stream
        .peer_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    // A silent client is closed as stalled, as after the preamble (`serve_connection`).
    let _ = stream.set_read_timeout(Some(inner.idle_timeout));
    inner
        .handshakes_in_progress
        .set(inner.handshakes_in_progress.get() + 1);
    let shard = read_preamble(&mut stream).await;
    inner
        .handshakes_in_progress
        .set(inner.handshakes_in_progress.get().saturating_sub(1));
    let shard = match shard {
        Ok(shard) => shard,
        Err(end) => {
            note_end(&inner, None, peer_addr, &end);
            return;
        }
    };
    if shard == inner.place.index {
        serve_connection(inner, stream, None).await;
        return;
    }
    if shard >= inner.place.count {
        inner.record_refusal(RefusalEvent {
            peer: None,
            peer_addr,
            by_us: true,
            refusal: HandshakeRefusal {
                reason: RefusalReason::ShardMismatch,
                detail: format!(
                    "the connection's preamble names shard {shard}, node {} runs {} shards",
                    inner.node_id, inner.place.count
                ),
            },
        });
        return;
    }
    // The stream read exactly the preamble (glommio's TcpStream does not read ahead), so the
    // socket goes on at the peer's first TLS or Hello byte. The duplicate travels; this
    // descriptor closes with `stream`.
    // SAFETY: `stream` is open for the whole borrow.
    let fd = match unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) }.try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            inner.count(|c| c.handoffs_shed += 1);
            tracing::warn!(node = inner.node_id, to_shard = shard, addr = %peer_addr, "cannot hand a peer connection to its shard: {e}");
            return;
        }
    };
    drop(stream);
    if handoff(shard, Accepted { fd, peer_addr }) {
        inner.count(|c| c.handoffs += 1);
    } else {
        inner.count(|c| c.handoffs_shed += 1);
        tracing::debug!(node = inner.node_id, to_shard = shard, addr = %peer_addr, "shard {shard} cannot take a peer connection now: closed (its dialer retries)");
    }
}

/// The shard index an accepted connection's preamble names, within [`HANDSHAKE_TIMEOUT`].
async fn read_preamble(stream: &mut TcpStream) -> Result<u32, ConnectionEnd> {
    let work = async {
        let mut bytes = [0u8; PREAMBLE_BYTES];
        let first = stream.read(&mut bytes).await?;
        if first == 0 {
            return Err(ConnectionEnd::Eof);
        }
        stream.read_exact(&mut bytes[first..]).await?;
        Ok(decode_preamble(bytes)?)
    };
    let deadline = async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
        Err(ConnectionEnd::HandshakeTimeout)
    };
    futures_lite::future::or(work, deadline).await
}

/// Dials `peer` for as long as the transport runs and the peer is a member: connect,
/// handshake, carry traffic until the connection ends, then dial again after a backoff (reset
/// once a connection was established). The address is looked up at each dial (a member's
/// address may be corrected by a membership change).
async fn dial_loop(inner: Rc<Inner>, peer: u64) {
    let mut backoff = BACKOFF_MIN;
    let mut jitter = Jitter::new(inner.node_id, peer);
    let mut unreachable_logged = false;
    loop {
        let Some(addr) = inner.peers.borrow().get(&peer).map(|p| p.raft_addr) else {
            tracing::info!(
                node = inner.node_id,
                shard = inner.place.index,
                peer,
                "no longer a cluster member: not dialing it any more"
            );
            return;
        };
        match TcpStream::connect_timeout(addr, inner.idle_timeout.max(BACKOFF_MIN)).await {
            Ok(stream) => {
                unreachable_logged = false;
                if serve_connection(inner.clone(), stream, Some(peer)).await {
                    backoff = BACKOFF_MIN;
                }
            }
            Err(e) => {
                if !unreachable_logged {
                    tracing::info!(node = inner.node_id, shard = inner.place.index, peer, %addr, "cannot reach peer (retrying with backoff): {e}");
                    unreachable_logged = true;
                }
            }
        }
        if inner.stopped.get() {
            return;
        }
        glommio::timer::sleep(jitter.spread(backoff)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnectionEnd {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("handshake refused")]
    Refused,
    #[error("no handshake within {HANDSHAKE_TIMEOUT:?}")]
    HandshakeTimeout,
    #[error("peer closed the connection")]
    Eof,
    #[error("replaced by a newer connection, or stopping")]
    Closing,
}

/// Runs one connection, dialed (`dialed` = the peer we meant to reach) or accepted, from the
/// handshake to its end. Returns whether the handshake was accepted both ways.
async fn serve_connection(inner: Rc<Inner>, stream: TcpStream, dialed: Option<u64>) -> bool {
    let peer_addr = stream
        .peer_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let _ = stream.set_nodelay(true);
    // Glommio enforces these on every read and write: a silent or stuck peer ends the connection.
    let _ = stream.set_read_timeout(Some(inner.idle_timeout));
    let _ = stream.set_write_timeout(Some(inner.idle_timeout));

    let accepted_side = dialed.is_none();
    if accepted_side {
        inner
            .handshakes_in_progress
            .set(inner.handshakes_in_progress.get() + 1);
    }
    let established = establish(&inner, stream, dialed, peer_addr).await;
    if accepted_side {
        inner
            .handshakes_in_progress
            .set(inner.handshakes_in_progress.get().saturating_sub(1));
    }
    let Established {
        theirs,
        mut reader,
        mut writer,
        mut buffer,
    } = match established {
        Ok(established) => established,
        Err(e) => {
            note_end(&inner, None, peer_addr, &e);
            return false;
        }
    };
    let peer = theirs.node_id;
    let id = inner.next_connection.get();
    inner.next_connection.set(id + 1);
    let wake = Rc::new(Signal::default());
    let closing = Rc::new(Cell::new(false));
    inner.register(
        peer,
        theirs.client_addr.clone(),
        Connection {
            id,
            wake: wake.clone(),
            closing: closing.clone(),
        },
    );
    tracing::info!(node = inner.node_id, shard = inner.place.index, peer, addr = %peer_addr, client = theirs.client_addr, "connected to peer");

    let reading = read_loop(&inner, peer, &mut reader, &mut buffer);
    let writing = write_loop(&inner, peer, &mut writer, &wake, &closing);
    let end = futures_lite::future::or(reading, writing).await;
    inner.unregister(peer, id);
    note_end(&inner, Some(peer), peer_addr, &end);
    true
}

fn note_end(inner: &Inner, peer: Option<u64>, addr: SocketAddr, end: &ConnectionEnd) {
    match end {
        ConnectionEnd::Refused | ConnectionEnd::Closing => {}
        ConnectionEnd::HandshakeTimeout => {
            inner.count(|c| c.stalled_connections += 1);
            tracing::info!(node = inner.node_id, shard = inner.place.index, ?peer, %addr, "closing a peer connection: {end}");
        }
        ConnectionEnd::Io(e) if e.kind() == io::ErrorKind::TimedOut => {
            inner.count(|c| c.stalled_connections += 1);
            tracing::warn!(node = inner.node_id, shard = inner.place.index, ?peer, %addr, "closing a stalled peer connection: nothing for {:?}", inner.idle_timeout);
        }
        ConnectionEnd::Wire(WireError::FrameTooLarge { .. }) => {
            inner.count(|c| c.frames_too_large += 1);
            tracing::warn!(node = inner.node_id, shard = inner.place.index, ?peer, %addr, "closing a peer connection: {end}");
        }
        ConnectionEnd::Wire(_) => {
            inner.count(|c| c.decode_errors += 1);
            tracing::warn!(node = inner.node_id, shard = inner.place.index, ?peer, %addr, "closing a peer connection: {end}");
        }
        ConnectionEnd::Io(_) | ConnectionEnd::Eof => {
            if peer.is_some() {
                tracing::info!(node = inner.node_id, shard = inner.place.index, ?peer, %addr, "peer connection closed: {end}");
            } else {
                tracing::debug!(node = inner.node_id, shard = inner.place.index, %addr, "peer connection closed during the handshake: {end}");
            }
        }
    }
}

/// A connection past its handshake: the peer's `Hello` and the stream's halves.
struct Established {
    theirs: Hello,
    reader: BufReader<futures_lite::io::ReadHalf<Stream>>,
    writer: futures_lite::io::WriteHalf<Stream>,
    buffer: FrameBuffer,
}

/// The TLS handshake (with `[cluster.tls]`) and the `Hello` exchange, within
/// [`HANDSHAKE_TIMEOUT`]. A TLS failure, here or surfacing as the peer's alert on the first
/// read, is recorded as a refusal with the reason `tls`.
async fn establish(
    inner: &Inner,
    stream: TcpStream,
    dialed: Option<u64>,
    peer_addr: SocketAddr,
) -> Result<Established, ConnectionEnd> {
    let work = async {
        let mut stream = stream;
        if dialed.is_some() {
            stream
                .write_all(&encode_preamble(inner.place.index))
                .await?;
        }
        let stream = secure(inner, stream, dialed).await?;
        let peer_cert = stream.peer_certificate();
        let (reader, mut writer) = futures_lite::io::split(stream);
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
        let mut buffer = FrameBuffer::default();
        let theirs = handshake(
            inner,
            (&mut reader, &mut writer),
            &mut buffer,
            dialed,
            peer_addr,
            peer_cert.as_ref(),
        )
        .await?;
        Ok(Established {
            theirs,
            reader,
            writer,
            buffer,
        })
    };
    let deadline = async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
        Err(ConnectionEnd::HandshakeTimeout)
    };
    let tls_refused = |by_us: bool, detail: String| {
        inner.record_refusal(RefusalEvent {
            peer: dialed,
            peer_addr,
            by_us,
            refusal: HandshakeRefusal {
                reason: RefusalReason::Tls,
                detail,
            },
        });
        ConnectionEnd::Refused
    };
    futures_lite::future::or(work, deadline)
        .await
        .map_err(|end| match end {
            ConnectionEnd::Io(e) => match describe_tls_failure(&e) {
                Some((by_us, detail)) => tls_refused(by_us, detail),
                None => ConnectionEnd::Io(e),
            },
            ConnectionEnd::Wire(e @ WireError::TlsRecord) => tls_refused(true, e.to_string()),
            other => other,
        })
}

/// The TLS handshake: the server's side on an accepted connection, the client's (checking the
/// identity of `dialed`) on a dialed one; plain TCP without `[cluster.tls]`.
async fn secure(
    inner: &Inner,
    stream: TcpStream,
    dialed: Option<u64>,
) -> Result<Stream, ConnectionEnd> {
    let Some(tls) = &inner.tls else {
        return Ok(Stream::Plain(stream));
    };
    // The outer deadline of `establish` is the bound; this one only has to be no shorter.
    let stream = match dialed {
        None => stream::accept(Some(tls.acceptor()), stream, HANDSHAKE_TIMEOUT).await?,
        Some(peer) => {
            let Some(dialer) = tls.dialer(peer) else {
                return Err(ConnectionEnd::Io(io::Error::other(format!(
                    "node {peer} is not in cluster.peers"
                ))));
            };
            stream::connect(Some(dialer), stream).await?
        }
    };
    Ok(stream)
}

/// This node's verdict on the peer's `Hello` (and, with TLS on the accepting side, on its
/// certificate).
fn verdict(
    inner: &Inner,
    theirs: &Hello,
    dialed: Option<u64>,
    peer_addr: SocketAddr,
    peer_cert: Option<&CertificateDer<'_>>,
) -> Result<(), HandshakeRefusal> {
    check_hello(&inner.hello.borrow(), theirs)?;
    match (dialed, &inner.tls) {
        (Some(expected), _) if expected != theirs.node_id => Err(HandshakeRefusal {
            reason: RefusalReason::UnknownNode,
            detail: format!(
                "dialed node {expected} at {peer_addr}, node {} answered",
                theirs.node_id
            ),
        }),
        // The dialing side checked the certificate's identity in its TLS verifier.
        (Some(_), _) | (None, None) => Ok(()),
        (None, Some(tls)) => {
            tls.check_peer(theirs.node_id, peer_cert)
                .map_err(|e| HandshakeRefusal {
                    reason: RefusalReason::CertificateMismatch,
                    detail: e.to_string(),
                })
        }
    }
}

/// Both `Hello`s and both verdicts; returns the peer's `Hello` when both sides accepted.
async fn handshake<R, W>(
    inner: &Inner,
    (reader, writer): (&mut R, &mut W),
    buffer: &mut FrameBuffer,
    dialed: Option<u64>,
    peer_addr: SocketAddr,
    peer_cert: Option<&CertificateDer<'_>>,
) -> Result<Hello, ConnectionEnd>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut out = Vec::new();
    inner.hello.borrow().encode(&mut out)?;
    writer.write_all(&out).await?;
    writer.flush().await?;

    let len = read_frame(reader, buffer, inner.max_frame_bytes).await?;
    let theirs = Hello::decode(buffer.bytes(len), inner.max_frame_bytes)?;
    let verdict = verdict(inner, &theirs, dialed, peer_addr, peer_cert);
    let reply = match &verdict {
        Ok(()) => HelloReply::Accepted,
        Err(refusal) => HelloReply::Refused(refusal.clone()),
    };
    out.clear();
    reply.encode(&mut out)?;
    writer.write_all(&out).await?;
    writer.flush().await?;
    if let Err(refusal) = verdict {
        inner.record_refusal(RefusalEvent {
            peer: Some(theirs.node_id),
            peer_addr,
            by_us: true,
            refusal,
        });
        return Err(ConnectionEnd::Refused);
    }

    let len = read_frame(reader, buffer, inner.max_frame_bytes).await?;
    match HelloReply::decode(buffer.bytes(len), inner.max_frame_bytes)? {
        HelloReply::Accepted => Ok(theirs),
        HelloReply::Refused(refusal) => {
            inner.record_refusal(RefusalEvent {
                peer: Some(theirs.node_id),
                peer_addr,
                by_us: false,
                refusal,
            });
            Err(ConnectionEnd::Refused)
        }
    }
}

/// Reads frames and hands their messages to `inbound` until the connection ends.
async fn read_loop<R: AsyncRead + Unpin>(
    inner: &Inner,
    peer: u64,
    reader: &mut R,
    buffer: &mut FrameBuffer,
) -> ConnectionEnd {
    loop {
        let len = match read_frame(reader, buffer, inner.max_frame_bytes).await {
            Ok(len) => len,
            Err(end) => return end,
        };
        let mut dropped = 0u64;
        let decoded = decode_frame(
            buffer.bytes(len),
            inner.max_frame_bytes,
            |shard, message| {
                if shard != inner.place.index || message.from != peer || message.to != inner.node_id
                {
                    dropped += 1;
                } else {
                    (inner.inbound)(peer, message);
                }
            },
        );
        let count = match decoded {
            Ok(count) => count as u64,
            Err(e) => return e.into(),
        };
        inner.count(|c| {
            c.frames_received += 1;
            c.messages_received += count - dropped;
            c.dropped_inbound += dropped;
            c.bytes_received += len as u64;
        });
        // A peer sending without pause must not starve the shard this executor also runs.
        glommio::yield_if_needed().await;
    }
}

/// Drains the peer's queue into frames until the connection ends or is replaced.
async fn write_loop<W: AsyncWrite + Unpin>(
    inner: &Inner,
    peer: u64,
    writer: &mut W,
    wake: &Signal,
    closing: &Cell<bool>,
) -> ConnectionEnd {
    let mut batch: Vec<(u32, Message)> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let frame_budget = inner.max_frame_bytes.saturating_sub(FRAME_ENVELOPE_BYTES);
    loop {
        if closing.get() {
            return ConnectionEnd::Closing;
        }
        let empty = inner
            .peers
            .borrow()
            .get(&peer)
            .is_none_or(|p| p.queue.is_empty());
        if empty {
            let woken = futures_lite::future::or(
                async {
                    wake.wait().await;
                    true
                },
                async {
                    glommio::timer::sleep(inner.keepalive).await;
                    false
                },
            )
            .await;
            if closing.get() {
                return ConnectionEnd::Closing;
            }
            if !woken {
                // Keepalive: an empty frame.
                out.clear();
                if let Err(e) = encode_frame(&[], &mut out) {
                    return e.into();
                }
                if let Err(e) = write_all(writer, &out).await {
                    return e;
                }
                inner.count(|c| {
                    c.frames_sent += 1;
                    c.bytes_sent += out.len() as u64;
                });
                continue;
            }
        }
        // Take everything queued; frames are cut below by size.
        if let Some(p) = inner.peers.borrow_mut().get_mut(&peer) {
            batch.extend(p.queue.drain(..));
        }
        let mut start = 0;
        while start < batch.len() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < batch.len() {
                let size = message_bytes_estimate(&batch[end].1);
                if size > frame_budget {
                    break;
                }
                if bytes + size > frame_budget {
                    break;
                }
                bytes += size;
                end += 1;
            }
            if end == start {
                // This message alone is larger than a frame: it can never be sent.
                inner.count(|c| c.dropped_oversize += 1);
                tracing::warn!(
                    node = inner.node_id,
                    shard = inner.place.index,
                    peer,
                    shard = batch[start].0,
                    bytes = message_bytes_estimate(&batch[start].1),
                    "dropping a Raft message larger than cluster.maxFrameBytes ({})",
                    inner.max_frame_bytes
                );
                start += 1;
                continue;
            }
            out.clear();
            if let Err(e) = encode_frame(&batch[start..end], &mut out) {
                return e.into();
            }
            debug_assert!(
                out.len() <= inner.max_frame_bytes,
                "the estimate is an upper bound"
            );
            if let Err(e) = write_all(writer, &out).await {
                return e;
            }
            let messages = (end - start) as u64;
            inner.count(|c| {
                c.frames_sent += 1;
                c.messages_sent += messages;
                c.bytes_sent += out.len() as u64;
            });
            start = end;
        }
        batch.clear();
        if out.capacity() > 2 * READ_BUFFER_BYTES {
            // A frame that carried a snapshot or a large entry must not pin its memory.
            out = Vec::new();
        }
    }
}

async fn write_all<W: AsyncWrite + Unpin>(
    writer: &mut W,
    bytes: &[u8],
) -> Result<(), ConnectionEnd> {
    writer.write_all(bytes).await?;
    writer.flush().await?;
    Ok(())
}

/// Reads one whole frame into `buffer`, checking its size from the segment table before reading
/// the body. Returns its length in bytes.
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    buffer: &mut FrameBuffer,
    max_frame_bytes: usize,
) -> Result<usize, ConnectionEnd> {
    let mut prefix = [0u8; FRAME_PREFIX_BYTES];
    let first = reader.read(&mut prefix).await?;
    if first == 0 {
        return Err(ConnectionEnd::Eof);
    }
    reader.read_exact(&mut prefix[first..]).await?;
    let table_len = segment_table_bytes(prefix)?;
    let table = buffer.bytes_mut(table_len);
    table[..FRAME_PREFIX_BYTES].copy_from_slice(&prefix);
    reader.read_exact(&mut table[FRAME_PREFIX_BYTES..]).await?;
    let total = frame_bytes(&table[..table_len], max_frame_bytes)?;
    let frame = buffer.bytes_mut(total);
    reader.read_exact(&mut frame[table_len..]).await?;
    Ok(total)
}

/// A word-aligned, reused read buffer (the Cap'n Proto reader needs 8-byte alignment).
#[derive(Default)]
struct FrameBuffer {
    words: Vec<capnp::Word>,
}

impl FrameBuffer {
    /// The first `len` bytes, growing the buffer (keeping its contents) if needed.
    fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words
                .resize(words, capnp::word(0, 0, 0, 0, 0, 0, 0, 0));
        }
        &mut capnp::Word::words_to_bytes_mut(&mut self.words)[..len]
    }

    fn bytes(&mut self, len: usize) -> &[u8] {
        self.bytes_mut(len)
    }
}

/// Wakes one waiting task; a notification with nobody waiting is kept for the next wait.
#[derive(Default)]
struct Signal {
    notified: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Signal {
    fn notify(&self) {
        self.notified.set(true);
        if let Some(waker) = self.waker.borrow_mut().take() {
            waker.wake();
        }
    }

    fn wait(&self) -> impl Future<Output = ()> + '_ {
        SignalWait { signal: self }
    }
}

struct SignalWait<'a> {
    signal: &'a Signal,
}

impl Future for SignalWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.signal.notified.replace(false) {
            return Poll::Ready(());
        }
        *self.signal.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Backoff jitter from a xorshift generator seeded by the two node ids: dialers of different
/// pairs spread out, and a run replays.
struct Jitter(u64);

impl Jitter {
    fn new(node: u64, peer: u64) -> Jitter {
        Jitter((node.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ peer.rotate_left(32)) | 1)
    }

    /// A delay in `[backoff / 2, backoff]`.
    fn spread(&mut self, backoff: Duration) -> Duration {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        let half = backoff / 2;
        let range = u64::try_from(half.as_micros()).unwrap_or(u64::MAX).max(1);
        half + Duration::from_micros(x % range)
    }
}

#[cfg(test)]
mod tests;
