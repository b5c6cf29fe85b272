//! Messages between shards, carried over bounded single-producer channels (one per ordered pair
//! of shards, glommio shared channels). A full channel makes the sender wait: nothing is
//! unbounded. Replies to requests travel on a oneshot carried in the request.

use futures_channel::oneshot;

use crate::config::AckLevel;
use crate::ids::{NodeId, ShardId};
use crate::key::EventKey;
use crate::pipeline::{ConsumerId, Delivery, ShardStats, TagResult, ValidatedBatch};

/// Where a subscription's deliveries go: a sink on the shard that owns the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkAddr {
    pub shard: ShardId,
    pub sink: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleOp {
    /// At `durable` the reply waits for the commit (`pipeline::shard::records`).
    Ack {
        level: AckLevel,
    },
    Nack {
        delay_ms: u64,
        level: AckLevel,
    },
    Touch,
}

pub type Reply<T> = oneshot::Sender<Result<T, Refused>>;

/// A subscription the owner registered, with the bounds in force for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Subscribed {
    pub consumer: ConsumerId,
    /// The effective `queueSize`: deliveries queued or sent and not yet returned.
    pub queue_size: usize,
    /// `delivery.maxUnackedPerConsumer`.
    pub max_unacked: usize,
}

/// In a cluster: who leads a shard this node does not serve, for a client to go there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaderHint {
    pub shard: ShardId,
    pub term: u64,
    /// The leader's node id, when one is known.
    pub leader: Option<NodeId>,
    /// The leader's client address (`host:port`), when known.
    pub client: Option<String>,
}

/// Why a shard refused a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Clustered: this node does not lead the shard; nothing was done.
    #[error("shard {} is led by {}", .0.shard, match (&.0.leader, &.0.client) {
        (Some(id), Some(addr)) => format!("node {id} at {addr}"),
        (Some(id), None) => format!("node {id} (address not known yet)"),
        _ => "no node yet (an election is under way)".to_string(),
    })]
    NotLeader(LeaderHint),
    /// The consumer is not registered here (any more): its subscription ended.
    #[error("unknown consumer")]
    ConsumerGone,
    #[error("{0}")]
    Failed(String),
}

impl From<String> for Refused {
    fn from(text: String) -> Refused {
        Refused::Failed(text)
    }
}

/// Work for the shard that owns a topic.
pub enum Request {
    /// Messages the edge validated and archived; the owning shard only keys and stamps them.
    Publish {
        batch: ValidatedBatch,
        reply: Reply<Vec<EventKey>>,
    },
    Subscribe {
        topic: String,
        group: String,
        uuid: uuid::Uuid,
        sink: SinkAddr,
        /// The `queueSize` the client asked for (0: the default).
        queue_size: usize,
        reply: Reply<Subscribed>,
    },
    Unsubscribe {
        consumer: ConsumerId,
    },
    Settle {
        consumer: ConsumerId,
        op: SettleOp,
        tags: Vec<EventKey>,
        reply: Reply<Vec<TagResult>>,
    },
    Stats {
        reply: Reply<ShardStats>,
    },
    ForgetGroup {
        topic: String,
        group: String,
        reply: Reply<()>,
    },
    /// One step of a membership change of this shard (`super::membership`).
    ChangeMembership {
        step: super::membership::Step,
        reply: Reply<super::membership::Members>,
    },
    /// Sets a group's redelivery policy overrides; answers the policy in force.
    SetGroupPolicy {
        topic: String,
        group: String,
        policy: crate::pipeline::policy::PolicyOverride,
        reply: Reply<crate::pipeline::policy::Policy>,
    },
}

/// Everything that crosses between two shards.
pub enum ShardMsg {
    Request(Request),
    /// Deliveries for a sink on the receiving shard.
    Deliver {
        sink: u64,
        deliveries: Vec<Delivery>,
    },
    /// The client returned these deliveries of this consumer (a `deliver` call returned): the
    /// owner may send as many more, and their leases start.
    Credit {
        consumer: ConsumerId,
        keys: Vec<crate::key::EventKey>,
    },
    /// The owner stopped serving the consumer behind this sink (it lost leadership): end the
    /// subscription's stream so the client subscribes again, on the new leader, and revoke
    /// the deliveries still unanswered (`Shard::revoke_sink`).
    CloseSink {
        sink: u64,
    },
    /// The owner's lease ended: revoke the unanswered `deliver` calls of the connection behind
    /// this sink (`Shard::revoke_after_lease`).
    RevokeReceipts {
        sink: u64,
    },
    /// A peer node's Raft connection for the receiving shard, accepted on the node's Raft port
    /// by the shard that listens there (shard 0) after its preamble named the receiving shard;
    /// the receiving shard's transport runs TLS, the handshake and the traffic.
    RaftConnection(crate::cluster::transport::Accepted),
}
