//! The Rust client library: connect to a pinq broker over Cap'n Proto RPC, publish in batches,
//! subscribe, and ack, nack or touch what was delivered.
//!
//! Everything here runs on a glommio executor (`LocalExecutor::run` or one of the broker's own
//! shards) or on a tokio runtime, inside a `tokio::task::LocalSet` ([`runtime`] picks by where
//! it is called; `examples/tokio_client.rs`): a [`Client`] owns one TCP connection whose RPC
//! system is a task of the executor it was created on, and neither it nor anything derived from
//! it may leave that thread (capnp-rpc is built on `Rc`). Open one client per core when several
//! cores talk to the broker.
//!
//! Requests are sent when the method is called, not when its [`Pending`] reply is first polled:
//! calling [`Client::publish`] several times before awaiting keeps several batches in flight on
//! the one connection, which is how a producer reaches the broker's throughput (one round trip
//! per batch is the limit otherwise). [`Publisher`] does that bookkeeping for a fixed window.
//!
//! Deliveries arrive as `Consumer.deliver` calls from the broker. A [`Subscription`] puts them
//! in a bounded local queue and does not return from `deliver` until the whole batch fits, so a
//! consumer that stops reading stops the broker from sending (its deliveries then go to other
//! consumers of the group, or wait). [`Subscription::ack`] sends one call per batch of tags;
//! an [`AckGroup`] collects the ACKs of a short window into one call.
//!
//! Dropping the last handle of a connection (the [`Client`] and every [`Subscription`] made from
//! it) closes the connection at once; replies not awaited by then are abandoned, and the broker
//! redelivers whatever the consumers held. [`Client::close`] closes gracefully.
//!
//! Errors are a [`ClientError`]; nothing here panics on a bad reply or a lost connection. The
//! client speaks protocol 2, in which the broker answers a refused publish, ack, nack or touch
//! with a typed [`Refusal`] (code, index of the offending message) in the results:
//! [`ClientError::Rejected`]. Against a broker that speaks only protocol 1 it falls back to 1,
//! and reads the same refusals from the exceptions' text ([`ClientError::refusal`]).

mod ack_group;
mod membership;
mod policy;
mod publisher;
mod router;
pub mod runtime;
mod subscription;

#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use capnp::message::ReaderOptions;
use capnp_rpc::rpc_twoparty_capnp::Side;
use capnp_rpc::{twoparty, RpcSystem};
use futures_lite::io::{BufReader, BufWriter};

use self::runtime::Tcp;

pub use self::ack_group::{AckGroup, ACK_GROUP_TAGS_MAX};
pub use self::membership::{ShardMembers, StepTarget};
pub use self::policy::GroupPolicy;
pub use self::publisher::Publisher;
pub use self::router::{Router, RouterOptions};
pub use self::subscription::Subscription;
pub use crate::config::AckLevel;
pub use crate::key::EventKey;
use crate::key::TopicHash;
pub use crate::message::Header;
pub use crate::rpc::refusal::{Code as RefusalCode, Refusal};
pub use crate::rpc::{
    Delivery, GroupStats, PublishMessage, ShardInfo, ShardStats, Stats, TagResult, WireError,
};

use crate::rpc::pinq_capnp::broker;
use crate::rpc::{self, ANY_SHARD, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN};
use crate::security::client::ClientTls;

/// Errors of the client library.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("could not resolve broker address {addr}: {source}")]
    Resolve {
        addr: String,
        source: std::io::Error,
    },
    #[error("could not connect to the broker at {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "the broker speaks protocol version {server} and this client version {client}: \
         use a client built for the broker's version"
    )]
    VersionMismatch { server: u32, client: u32 },
    /// The broker refused the request (a Cap'n Proto `failed` exception); the text says why.
    #[error("the broker refused the request: {0}")]
    Refused(String),
    /// The broker refused the request with a typed refusal in its results (protocol 2): a code,
    /// the index of the offending message, and whether a retry may succeed. Nothing was done.
    #[error("the broker refused the request: {0}")]
    Rejected(Refusal),
    /// The broker is overloaded (an `overloaded` exception): try again later.
    #[error("the broker is overloaded, try again later: {0}")]
    Overloaded(String),
    /// The connection, or the object on the broker behind a capability, is gone.
    #[error("connection to the broker lost: {0}")]
    Disconnected(String),
    #[error("the broker does not implement this call (older broker?): {0}")]
    Unimplemented(String),
    /// The request cannot be encoded (for example a delay beyond `i64::MAX` ms).
    #[error("invalid request: {0}")]
    InvalidRequest(WireError),
    /// The broker's reply does not follow the protocol.
    #[error("malformed reply from the broker: {0}")]
    BadReply(WireError),
    /// The broker ended the subscription on a live connection: its shard changed leader (in a
    /// cluster: subscribe again, [`Router`] finds the new leader) or the broker is shutting down.
    #[error("the broker ended the subscription to {topic} (leader change or shutdown)")]
    SubscriptionEnded { topic: String },
    /// In a cluster: the node does not lead the shard the request needs; nothing was done.
    /// [`Router`] follows it to the leader.
    #[error("node does not lead shard {} (leader: {})", .0.shard_id, if .0.leader_address.is_empty() { "none known yet".to_string() } else { format!("node {} at {}", .0.leader_node_id, .0.leader_address) })]
    NotLeader(crate::rpc::cluster::NotLeader),
}

impl ClientError {
    /// Classifies an error of an RPC call by its Cap'n Proto exception type.
    fn from_rpc(e: capnp::Error) -> ClientError {
        match e.kind {
            capnp::ErrorKind::Failed => ClientError::Refused(e.extra),
            capnp::ErrorKind::Overloaded => ClientError::Overloaded(e.extra),
            capnp::ErrorKind::Disconnected => ClientError::Disconnected(e.extra),
            capnp::ErrorKind::Unimplemented => ClientError::Unimplemented(e.extra),
            _ => ClientError::BadReply(WireError::Capnp(e)),
        }
    }

    /// The typed refusal code of a refused or overloaded request (a configured bound, a full
    /// disk, a bad message), when the broker gave one: from the results' field, or from the
    /// start of an exception's text.
    pub fn refusal(&self) -> Option<RefusalCode> {
        match self {
            ClientError::Rejected(refusal) => Some(refusal.code),
            ClientError::Refused(text) | ClientError::Overloaded(text) => {
                crate::rpc::refusal::code_of(text)
            }
            _ => None,
        }
    }

    /// The index of the message a typed refusal names (`None`: the call as a whole, or no
    /// typed refusal).
    pub fn refused_index(&self) -> Option<u32> {
        match self {
            ClientError::Rejected(refusal) => refusal.index,
            _ => None,
        }
    }

    /// The refusal a reply's `refusal` field carries, as the error to return.
    fn rejected(
        present: bool,
        reader: rpc::pinq_capnp::refusal::Reader<'_>,
    ) -> Result<(), ClientError> {
        match Refusal::read(present, reader).map_err(ClientError::BadReply)? {
            Some(refusal) => Err(ClientError::Rejected(refusal)),
            None => Ok(()),
        }
    }

    fn bad_reply(e: impl Into<WireError>) -> ClientError {
        ClientError::BadReply(e.into())
    }
}

/// A reply not yet received. The request is already on its way: awaiting only waits for the
/// answer, and dropping this abandons the answer (the request may still take effect).
#[must_use = "the request is sent; await the reply to learn whether it succeeded"]
pub struct Pending<T> {
    reply: Pin<Box<dyn Future<Output = Result<T, ClientError>>>>,
}

impl<T: 'static> Pending<T> {
    fn new(reply: impl Future<Output = Result<T, ClientError>> + 'static) -> Pending<T> {
        Pending {
            reply: Box::pin(reply),
        }
    }

    /// A reply on `conn`, which stays open until the reply is in: a caller may drop its last
    /// [`Client`] handle right after sending (the connection would close under the request).
    fn on(
        conn: &Rc<Connection>,
        reply: impl Future<Output = Result<T, ClientError>> + 'static,
    ) -> Pending<T> {
        let keep = Rc::clone(conn);
        Pending::new(async move {
            let result = reply.await;
            drop(keep);
            result
        })
    }

    fn failed(e: ClientError) -> Pending<T> {
        Pending::new(std::future::ready(Err(e)))
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, ClientError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.reply.as_mut().poll(cx)
    }
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pending")
    }
}

/// What the broker said in the version handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerInfo {
    pub protocol_version: u32,
    pub shard_count: u32,
    /// The shard whose own port this connection reached; `None` on the shared client port.
    pub shard_id: Option<u32>,
}

/// Connection settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// How long a TCP connect may take before it fails.
    pub connect_timeout: Duration,
    /// Size of the read and of the write buffer of the connection. capnp-rpc flushes after every
    /// message; the buffers turn a message's several small writes into one system call.
    pub io_buffer_bytes: usize,
    /// Largest message accepted from the broker, in bytes (a bound on memory, not a protocol
    /// limit): delivery batches must fit in it.
    pub receive_message_bytes_max: usize,
    /// TLS (`--tls-ca`, …) and the token presented in `hello`; default: plain TCP, no token.
    pub security: crate::security::client::ClientSecurity,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            io_buffer_bytes: 64 * 1024,
            receive_message_bytes_max: 256 * 1024 * 1024,
            security: Default::default(),
        }
    }
}

/// A graceful close of a connection, not yet started.
type Closing = Pin<Box<dyn Future<Output = Result<(), capnp::Error>>>>;

/// One connection: the broker capability and the RPC task that serves it.
struct Connection {
    broker: broker::Client,
    server: ServerInfo,
    /// The cluster's members' client addresses from the handshake (empty: standalone).
    members: Vec<String>,
    options: ClientOptions,
    /// The host name this connection's TLS certificate was checked against.
    tls_name: String,
    /// Closes the connection gracefully when awaited (capnp-rpc's `Disconnector`, which it does
    /// not export by name).
    disconnector: RefCell<Option<Closing>>,
    /// Dropping the task (with the last handle) cancels it, which closes the socket.
    _rpc_task: runtime::Task<Result<(), capnp::Error>>,
}

/// A connection to a pinq broker. Cheap to clone; all clones share the connection.
#[derive(Clone)]
pub struct Client {
    conn: Rc<Connection>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.conn.server)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to a broker (`"127.0.0.1:7400"`) with default options and does the version
    /// handshake. Must run on a glommio executor or in a tokio `LocalSet` ([`runtime`]).
    pub async fn connect(addr: impl ToSocketAddrs + fmt::Display) -> Result<Client, ClientError> {
        Client::connect_with(addr, &ClientOptions::default()).await
    }

    /// Connects with explicit options. Tries each address the name resolves to in turn.
    pub async fn connect_with(
        addr: impl ToSocketAddrs + fmt::Display,
        options: &ClientOptions,
    ) -> Result<Client, ClientError> {
        let name = addr.to_string();
        let candidates: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|source| ClientError::Resolve {
                addr: name.clone(),
                source,
            })?
            .collect();
        let mut last_error = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the name resolved to no address",
        );
        for candidate in candidates {
            match Tcp::connect(candidate, options.connect_timeout).await {
                Ok(stream) => return Client::over(stream, &name, options).await,
                Err(e) => last_error = e,
            }
        }
        Err(ClientError::Connect {
            addr: name,
            source: last_error,
        })
    }

    /// Runs the protocol over an established stream (through TLS when configured; `name` is
    /// the address asked for, whose host the broker's certificate must name) and does the
    /// handshake.
    async fn over(stream: Tcp, name: &str, options: &ClientOptions) -> Result<Client, ClientError> {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let tls = match &options.security.tls {
            None => None,
            Some(tls) => {
                let server_name = tls.name_for(name).map_err(|e| ClientError::Connect {
                    addr: peer.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
                })?;
                Some((&tls.config, server_name))
            }
        };
        let deadline = options.connect_timeout;
        let handshake = crate::security::stream::connect(tls, stream);
        let stream = runtime::within(deadline, handshake)
            .await
            .unwrap_or_else(|| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the TLS handshake took longer than {} ms",
                        deadline.as_millis()
                    ),
                ))
            })
            .map_err(|source| ClientError::Connect {
                addr: peer.clone(),
                source,
            })?;
        let (reader, writer) = futures_lite::io::split(stream);
        let buffer = options.io_buffer_bytes.max(4096);
        let mut reader_options = ReaderOptions::new();
        reader_options.traversal_limit_in_words(Some(options.receive_message_bytes_max / 8));
        let network = twoparty::VatNetwork::new(
            BufReader::with_capacity(buffer, reader),
            BufWriter::with_capacity(buffer, writer),
            Side::Client,
            reader_options,
        );
        let mut rpc_system = RpcSystem::new(Box::new(network), None);
        let broker: broker::Client = rpc_system.bootstrap(Side::Server);
        let disconnector = rpc_system.get_disconnector();
        let rpc_task = runtime::spawn_local(rpc_system);

        let (server, members) = match hello(&broker, PROTOCOL_VERSION, options).await {
            // A broker of protocol 1 only: speak 1, whose refusals are exceptions.
            Err(e) if e.refusal() == Some(RefusalCode::UnsupportedVersion) => {
                hello(&broker, PROTOCOL_VERSION_MIN, options).await?
            }
            other => other?,
        };
        Ok(Client {
            conn: Rc::new(Connection {
                broker,
                server,
                members,
                options: options.clone(),
                tls_name: match &options.security.tls {
                    Some(ClientTls {
                        server_name: Some(n),
                        ..
                    }) => n.clone(),
                    _ => crate::security::client::host_of(name).to_owned(),
                },
                disconnector: RefCell::new(Some(Box::pin(disconnector))),
                _rpc_task: rpc_task,
            }),
        })
    }

    /// What the broker answered in the handshake.
    pub fn server(&self) -> ServerInfo {
        self.conn.server
    }

    /// The client address of every cluster member, as the broker named them in the handshake
    /// (empty from a standalone broker or one older than this field).
    pub fn members(&self) -> &[String] {
        &self.conn.members
    }

    /// Opens another connection, straight to the port of the shard that owns `topic` (from
    /// [`Client::topology`]), so that this topic's requests are served on the owner's core with
    /// no hop between cores. Uses this client's options.
    pub async fn connect_to_owner(&self, topic: &str) -> Result<Client, ClientError> {
        let shards = self.topology().await?;
        if shards.is_empty() {
            return Err(ClientError::BadReply(WireError::WrongLength {
                field: rpc::Field::top("shards (count)"),
                len: 0,
                expected: 1,
            }));
        }
        let owner = TopicHash::of(topic).shard(shards.len());
        let Some(shard) = shards.iter().find(|s| s.shard_id as usize == owner) else {
            return Err(ClientError::Refused(format!(
                "topology lists {} shards but not shard {owner}, the owner of topic {topic:?}",
                shards.len()
            )));
        };
        let addr = if shard.host.contains(':') {
            format!("[{}]:{}", shard.host, shard.port)
        } else {
            format!("{}:{}", shard.host, shard.port)
        };
        // The owner's address is an IP from the topology: its certificate is checked against
        // the name this client first connected with.
        let mut options = self.conn.options.clone();
        if let Some(tls) = &mut options.security.tls {
            if tls.server_name.is_none() {
                tls.server_name = Some(self.conn.tls_name.clone());
            }
        }
        Client::connect_with(addr.as_str(), &options).await
    }

    /// The raw `Broker` capability, for calls this library does not wrap.
    pub fn broker(&self) -> &broker::Client {
        &self.conn.broker
    }

    /// Publishes one batch (atomic: all messages are written or none). The reply carries each
    /// message's delivery tag, in order, once the batch reached `ack`. The request is sent now;
    /// call again before awaiting to pipeline batches.
    pub fn publish(
        &self,
        messages: impl AsRef<[PublishMessage]>,
        ack: AckLevel,
    ) -> Pending<Vec<EventKey>> {
        let messages = messages.as_ref();
        let count = match u32::try_from(messages.len()) {
            Ok(count) => count,
            Err(_) => {
                return Pending::failed(ClientError::InvalidRequest(WireError::BatchTooLarge {
                    len: messages.len(),
                    max: u32::MAX as usize,
                }))
            }
        };
        let mut request = self.conn.broker.publish_request();
        {
            let mut params = request.get();
            params.set_ack_level(ack.into());
            if let Err(e) = rpc::write_publish_batch(params.init_messages(count), messages) {
                return Pending::failed(ClientError::InvalidRequest(e));
            }
        }
        let reply = request.send().promise;
        Pending::on(&self.conn, async move {
            let reply = reply.await.map_err(ClientError::from_rpc)?;
            let results = reply.get().map_err(ClientError::bad_reply)?;
            let refusal = results.get_refusal().map_err(ClientError::bad_reply)?;
            ClientError::rejected(results.has_refusal(), refusal)?;
            if let Some(not_leader) =
                rpc::cluster::read_not_leader(results.has_not_leader(), results.get_not_leader())
                    .map_err(ClientError::BadReply)?
            {
                return Err(ClientError::NotLeader(not_leader));
            }
            let tags = results.get_tags().map_err(ClientError::bad_reply)?;
            let tags = rpc::read_tags(tags).map_err(ClientError::BadReply)?;
            if tags.len() != count as usize {
                return Err(ClientError::BadReply(WireError::WrongLength {
                    field: rpc::Field::top("tags (count)"),
                    len: tags.len(),
                    expected: count as usize,
                }));
            }
            Ok(tags)
        })
    }

    /// Subscribes to `topic` as a member of `group` (empty: a universal consumer, which gets
    /// every message). `queue_size` bounds the deliveries queued for this consumer, on the
    /// broker and locally; 0 means the broker's default.
    pub async fn subscribe(
        &self,
        topic: &str,
        group: &str,
        queue_size: u32,
    ) -> Result<Subscription, ClientError> {
        Subscription::open(self.clone(), topic, group, queue_size, None).await
    }

    /// Subscribes a consumer that will take at most `at_most` deliveries (`pinq consume
    /// --count`): the broker is never given room to send it more, not even a copy it NACKed.
    /// Its queue size is `at_most` capped at the broker's default.
    pub async fn subscribe_at_most(
        &self,
        topic: &str,
        group: &str,
        at_most: u64,
    ) -> Result<Subscription, ClientError> {
        Subscription::open(self.clone(), topic, group, 0, Some(at_most)).await
    }

    /// The broker's shards and the port of each.
    pub fn topology(&self) -> Pending<Vec<ShardInfo>> {
        let reply = self.conn.broker.topology_request().send().promise;
        Pending::on(&self.conn, async move {
            let reply = reply.await.map_err(ClientError::from_rpc)?;
            let shards = reply
                .get()
                .and_then(|r| r.get_shards())
                .map_err(ClientError::bad_reply)?;
            rpc::read_topology(shards).map_err(ClientError::BadReply)
        })
    }

    /// The broker's counters.
    pub fn stats(&self) -> Pending<Stats> {
        let reply = self.conn.broker.stats_request().send().promise;
        Pending::on(&self.conn, async move {
            let reply = reply.await.map_err(ClientError::from_rpc)?;
            let stats = reply
                .get()
                .and_then(|r| r.get_stats())
                .map_err(ClientError::bad_reply)?;
            rpc::read_stats(stats).map_err(ClientError::BadReply)
        })
    }

    /// In a cluster: the answering node's view of every node and shard (standalone: node id 0).
    pub fn cluster_status(&self) -> Pending<rpc::cluster::ClusterStatus> {
        let reply = self.conn.broker.cluster_status_request().send().promise;
        Pending::on(&self.conn, async move {
            let reply = reply.await.map_err(ClientError::from_rpc)?;
            let status = reply
                .get()
                .and_then(|r| r.get_status())
                .map_err(ClientError::bad_reply)?;
            rpc::cluster::read_cluster_status(status).map_err(ClientError::BadReply)
        })
    }

    /// Admin: forgets a consumer group of a topic with its claims on messages.
    pub fn forget_group(&self, topic: &str, group: &str) -> Pending<()> {
        let mut request = self.conn.broker.forget_group_request();
        request.get().set_topic(topic);
        request.get().set_group(group);
        let reply = request.send().promise;
        Pending::on(&self.conn, async move {
            reply.await.map_err(ClientError::from_rpc)?;
            Ok(())
        })
    }

    /// Closes the connection gracefully: requests already sent are written out first. Other
    /// handles of this connection (clones, subscriptions) fail from then on.
    pub async fn close(self) -> Result<(), ClientError> {
        let disconnector = self.conn.disconnector.borrow_mut().take();
        match disconnector {
            Some(d) => d.await.map_err(ClientError::from_rpc),
            None => Ok(()),
        }
    }
}

/// The version handshake, asking for `version`; the broker must answer with it.
async fn hello(
    broker: &broker::Client,
    version: u32,
    options: &ClientOptions,
) -> Result<(ServerInfo, Vec<String>), ClientError> {
    let mut request = broker.hello_request();
    request.get().set_client_version(version);
    if let Some(token) = &options.security.token {
        request.get().set_token(token.secret());
    }
    let reply = request
        .send()
        .promise
        .await
        .map_err(ClientError::from_rpc)?;
    let hello = reply.get().map_err(ClientError::bad_reply)?;
    let server = ServerInfo {
        protocol_version: hello.get_server_version(),
        shard_count: hello.get_shard_count(),
        shard_id: Some(hello.get_shard_id()).filter(|&id| id != ANY_SHARD),
    };
    if server.protocol_version != version {
        return Err(ClientError::VersionMismatch {
            server: server.protocol_version,
            client: version,
        });
    }
    let mut members = Vec::new();
    if hello.has_members() {
        for (i, member) in (0u32..).zip(hello.get_members().map_err(ClientError::bad_reply)?) {
            let member = member.map_err(ClientError::bad_reply)?;
            let text = member.to_str().map_err(|_| {
                ClientError::BadReply(WireError::NotUtf8 {
                    field: rpc::Field::at("members", i, ""),
                })
            })?;
            members.push(text.to_owned());
        }
    }
    Ok((server, members))
}
