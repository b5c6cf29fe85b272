//! [`DeadLetterLinks`]: the way a dead letter reaches its topic's leader on another node.
//!
//! A shard publishes a dead letter to the shard that owns the dead-letter topic on its own node
//! (`Shard::send_dead_letter`). In a cluster that shard may be a follower here: it answers
//! `NotLeader` with the leader's client address, and the dead letter is then published there
//! over the client protocol, `durable`, as any client's publish would be. The publish carries
//! the dead letter's producer id and sequence, so one sent again after a lost answer is stored
//! once. A failure is returned to the caller, which leaves the copy parked until its guard runs
//! out and it is dead-lettered again (`pipeline::shard::dead_letter`): nothing is retried here.
//!
//! The links are one connection per leader address, made on first use and dropped on any
//! error; addresses come from the cluster view, so there are at most as many as members
//! (and never more than [`LINKS_MAX`]). Each try is bounded by [`FORWARD_TIMEOUT`], so a paused
//! or cut-off leader holds a dead letter's task no longer than that. The connection presents
//! no token and no TLS: a cluster whose client ports require them cannot forward (the failure
//! is logged and the dead letter waits until this node leads its topic's shard).

use std::cell::RefCell;
use std::time::Duration;

use ahash::AHashMap;

use crate::client::{Client, ClientError, ClientOptions};
use crate::config::AckLevel;
use crate::rpc::PublishMessage;

/// Longest one forward (connect, handshake and durable publish) may take.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// Most connections kept (one per leader address; a cluster has few members).
pub const LINKS_MAX: usize = 64;

/// See the module docs.
#[derive(Default)]
pub struct DeadLetterLinks {
    conns: RefCell<AHashMap<String, Client>>,
}

impl DeadLetterLinks {
    /// Publishes `message` durably on the node whose client address is `leader`.
    pub async fn publish(&self, leader: &str, message: &PublishMessage) -> Result<(), ClientError> {
        let attempt = async {
            let client = self.client_at(leader).await?;
            client
                .publish(std::slice::from_ref(message), AckLevel::Durable)
                .await
        };
        let result = futures_lite::future::or(attempt, async {
            glommio::timer::sleep(FORWARD_TIMEOUT).await;
            Err(ClientError::Disconnected(format!(
                "no answer from {leader} within {FORWARD_TIMEOUT:?}"
            )))
        })
        .await;
        if result.is_err() {
            self.conns.borrow_mut().remove(leader);
        }
        result.map(|_| ())
    }

    async fn client_at(&self, addr: &str) -> Result<Client, ClientError> {
        if let Some(client) = self.conns.borrow().get(addr) {
            return Ok(client.clone());
        }
        let options = ClientOptions {
            connect_timeout: FORWARD_TIMEOUT,
            ..ClientOptions::default()
        };
        let client = Client::connect_with(addr, &options).await?;
        let mut conns = self.conns.borrow_mut();
        if conns.len() >= LINKS_MAX {
            conns.clear();
        }
        conns.insert(addr.to_owned(), client.clone());
        Ok(client)
    }
}
