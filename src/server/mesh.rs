//! Messages between shards, carried over bounded single-producer channels (one per ordered pair
//! of shards, glommio shared channels). A full channel makes the sender wait: nothing is
//! unbounded. Replies to requests travel on a oneshot carried in the request.

use futures_channel::oneshot;

use crate::key::EventKey;
use crate::pipeline::{ConsumerId, Delivery, ShardStats, TagResult, ValidatedBatch};

/// Where a subscription's deliveries go: a sink on the shard that owns the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkAddr {
    pub shard: usize,
    pub sink: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleOp {
    Ack,
    Nack { delay_ms: u64 },
    Touch,
}

pub type Reply<T> = oneshot::Sender<Result<T, String>>;

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
        credit: usize,
        reply: Reply<ConsumerId>,
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
}

/// Everything that crosses between two shards.
pub enum ShardMsg {
    Request(Request),
    /// Deliveries for a sink on the receiving shard.
    Deliver {
        sink: u64,
        deliveries: Vec<Delivery>,
    },
    /// A sink sent `n` deliveries to its client: the owner may send `n` more.
    Credit {
        consumer: ConsumerId,
        n: usize,
    },
}
