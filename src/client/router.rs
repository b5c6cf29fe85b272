//! [`Router`]: a client that sends each shard's requests to that shard's leader, and follows
//! the leader across a failover.
//!
//! Against a standalone broker it is one connection. Against a cluster it starts from any node
//! (the seed; or the first of several that answers), learns every member's client address
//! from the handshake of every node it reaches (and `clusterStatus`) and each shard's leader
//! (`topology`), and keeps one connection per node it talks to. So a seed that dies right
//! after its handshake still leaves the other members to try. A request that meets a follower
//! (`NotLeader`) goes to the leader named in the answer; one that meets a dead or paused node
//! (the connection fails or drops, or no answer within `request_timeout`) is tried on the
//! other members until one answers as the leader, for at most `patience`; a node that failed is
//! tried after the others for `suspect_for`. Retrying a publish whose answer was lost may store
//! it twice: at-least-once.

use std::cell::RefCell;
use std::future::Future;
use std::time::{Duration, Instant};

use ahash::AHashMap;

use super::{Client, ClientError, ClientOptions, Subscription};
use crate::config::AckLevel;
use crate::key::{EventKey, TopicHash};
use crate::rpc::PublishMessage;

/// How long a [`Router`] keeps trying, and how long one try may take.
#[derive(Clone, Debug)]
pub struct RouterOptions {
    pub client: ClientOptions,
    /// Longest a request keeps being retried across nodes before its error is returned.
    pub patience: Duration,
    /// Longest one try may wait for its answer (a paused node answers nothing).
    pub request_timeout: Duration,
    /// Longest the questions that teach the router the cluster (`clusterStatus`, `topology`)
    /// may wait on one node: a node that does not answer them is skipped, not waited for.
    pub learn_timeout: Duration,
    /// How long a node whose connection failed, or that did not answer in time, is tried only
    /// after every other member (it is dead, paused, or cut off).
    pub suspect_for: Duration,
}

impl Default for RouterOptions {
    fn default() -> RouterOptions {
        RouterOptions {
            client: ClientOptions {
                connect_timeout: Duration::from_secs(2),
                ..ClientOptions::default()
            },
            patience: Duration::from_secs(20),
            request_timeout: Duration::from_secs(5),
            learn_timeout: Duration::from_secs(1),
            suspect_for: Duration::from_secs(2),
        }
    }
}

/// See the module docs.
pub struct Router {
    options: RouterOptions,
    /// Client addresses of the members: the seeds first, then those learned.
    members: RefCell<Vec<String>>,
    /// Members that failed lately, by the time until which they are tried last.
    suspects: RefCell<AHashMap<String, Instant>>,
    conns: RefCell<AHashMap<String, Client>>,
    /// The leader's client address by shard, as last learned.
    leaders: RefCell<AHashMap<u32, String>>,
    shard_count: u32,
}

impl Router {
    /// Connects to `seeds` (one address of any node of a cluster, or several separated by
    /// commas, or a standalone broker), trying each in turn until one answers, and learns the
    /// cluster's members (from the handshake, and `clusterStatus`) and leaders (`topology`).
    pub async fn connect(seeds: &str, options: RouterOptions) -> Result<Router, ClientError> {
        let seeds: Vec<String> = seeds
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let mut last_error = None;
        for seed in &seeds {
            match Client::connect_with(seed, &options.client).await {
                Ok(client) => return Ok(Router::start(seed, seeds.clone(), client, options).await),
                Err(e) => {
                    tracing::debug!(%seed, "seed unreachable: {e}");
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| ClientError::Disconnected("no seed address".to_owned())))
    }

    async fn start(
        seed: &str,
        seeds: Vec<String>,
        client: Client,
        options: RouterOptions,
    ) -> Router {
        let router = Router {
            shard_count: client.server().shard_count.max(1),
            options,
            members: RefCell::new(seeds),
            suspects: RefCell::new(AHashMap::new()),
            conns: RefCell::new(AHashMap::new()),
            leaders: RefCell::new(AHashMap::new()),
        };
        router.add_members(client.members());
        router.learn(&client).await;
        router.conns.borrow_mut().insert(seed.to_owned(), client);
        router
    }

    /// Whether the seed is a cluster member with peers (a standalone broker has none): only
    /// then is there another node to fail over to.
    pub fn is_cluster(&self) -> bool {
        self.members.borrow().len() > 1
    }

    /// The members' client addresses known now (the seeds first).
    pub fn members(&self) -> Vec<String> {
        self.members.borrow().clone()
    }

    /// The shard that owns `topic`.
    pub fn shard_of(&self, topic: &str) -> u32 {
        TopicHash::of(topic).shard(self.shard_count as usize) as u32
    }

    fn add_members<'a>(&self, addresses: impl IntoIterator<Item = &'a String>) {
        let mut members = self.members.borrow_mut();
        for address in addresses {
            if !address.is_empty() && !members.contains(address) {
                members.push(address.clone());
            }
        }
    }

    /// Learns the members' addresses and the shards' leaders from `client`'s node, waiting at
    /// most `learn_timeout` for each answer: a node that dies or pauses right after its
    /// handshake teaches nothing, and the members its handshake named remain to be tried.
    async fn learn(&self, client: &Client) {
        let limit = self.options.learn_timeout;
        if let Some(Ok(status)) = super::runtime::within(limit, client.cluster_status()).await {
            let addresses: Vec<String> =
                status.nodes.into_iter().map(|n| n.client_address).collect();
            self.add_members(&addresses);
        }
        if let Some(Ok(shards)) = super::runtime::within(limit, client.topology()).await {
            let mut leaders = self.leaders.borrow_mut();
            for shard in shards {
                if !shard.leader_address.is_empty() {
                    leaders.insert(shard.shard_id, shard.leader_address);
                }
            }
        }
    }

    async fn client_at(&self, addr: &str) -> Result<Client, ClientError> {
        if let Some(client) = self.conns.borrow().get(addr) {
            return Ok(client.clone());
        }
        let client = Client::connect_with(addr, &self.options.client).await?;
        // Every node reached names the members it knows in its handshake.
        self.add_members(client.members());
        self.conns
            .borrow_mut()
            .insert(addr.to_owned(), client.clone());
        Ok(client)
    }

    /// Where to send a request for `shard` on try number `attempt`: its leader when known,
    /// otherwise the members in turn, those that failed lately last.
    fn address_for(&self, shard: u32, attempt: usize) -> String {
        if let Some(addr) = self.leaders.borrow().get(&shard) {
            return addr.clone();
        }
        let mut suspects = self.suspects.borrow_mut();
        let now = Instant::now();
        suspects.retain(|_, until| *until > now);
        pick_member(
            &self.members.borrow(),
            |m| suspects.contains_key(m),
            attempt,
        )
    }

    /// `addr` failed: tried last for `suspect_for`, and its connection dropped.
    fn suspect(&self, addr: &str) {
        self.conns.borrow_mut().remove(addr);
        self.suspects
            .borrow_mut()
            .insert(addr.to_owned(), Instant::now() + self.options.suspect_for);
    }

    /// A connection to the node that leads `shard` (as far as is known now).
    pub async fn client_for(&self, shard: u32) -> Result<Client, ClientError> {
        self.retry(shard, |client| async move { Ok(client) }).await
    }

    /// Publishes a batch to its shard's leader (all messages of a batch must belong to one
    /// shard's topics when the shards have different leaders).
    pub async fn publish(
        &self,
        messages: &[PublishMessage],
        ack: AckLevel,
    ) -> Result<Vec<EventKey>, ClientError> {
        let Some(first) = messages.first() else {
            return Ok(Vec::new());
        };
        let shard = self.shard_of(&first.topic);
        self.retry(shard, |client| client.publish(messages, ack))
            .await
    }

    /// Subscribes on the leader of the topic's shard. When the subscription ends (its leader
    /// changed), subscribe again.
    pub async fn subscribe(
        &self,
        topic: &str,
        group: &str,
        queue_size: u32,
    ) -> Result<Subscription, ClientError> {
        let shard = self.shard_of(topic);
        self.retry(shard, |client| async move {
            client.subscribe(topic, group, queue_size).await
        })
        .await
    }

    /// [`Client::subscribe_at_most`] on the leader of the topic's shard.
    pub async fn subscribe_at_most(
        &self,
        topic: &str,
        group: &str,
        at_most: u64,
    ) -> Result<Subscription, ClientError> {
        let shard = self.shard_of(topic);
        self.retry(shard, |client| async move {
            client.subscribe_at_most(topic, group, at_most).await
        })
        .await
    }

    /// Sets (or, with an empty `change`, reads) a group's policy on the leader of the topic's
    /// shard. Retrying is safe: the same overrides applied twice leave the same policy.
    pub async fn set_group_policy(
        &self,
        topic: &str,
        group: &str,
        change: &crate::pipeline::policy::PolicyOverride,
    ) -> Result<super::GroupPolicy, ClientError> {
        let shard = self.shard_of(topic);
        self.retry(shard, |client| {
            client.set_group_policy(topic, group, change)
        })
        .await
    }

    /// Runs `call` against `shard`'s leader, following `NotLeader` answers and skipping dead
    /// or paused nodes, for at most `patience`.
    async fn retry<T, F, Fut>(&self, shard: u32, call: F) -> Result<T, ClientError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = Instant::now() + self.options.patience;
        let mut attempt = 0usize;
        loop {
            let addr = self.address_for(shard, attempt);
            attempt += 1;
            let error = match self.try_once(&addr, &call).await {
                Ok(value) => return Ok(value),
                Err(ClientError::NotLeader(hint)) => {
                    let mut leaders = self.leaders.borrow_mut();
                    if hint.leader_address.is_empty() || hint.leader_address == addr {
                        leaders.remove(&shard);
                    } else {
                        leaders.insert(shard, hint.leader_address.clone());
                    }
                    ClientError::NotLeader(hint)
                }
                Err(e) if is_transient(&e) => {
                    self.suspect(&addr);
                    self.leaders.borrow_mut().remove(&shard);
                    e
                }
                Err(e) => return Err(e),
            };
            tracing::debug!(shard, %addr, attempt, "retrying: {error}");
            if Instant::now() >= deadline {
                return Err(error);
            }
            // A named leader is tried at once; otherwise give the election a moment.
            if !self.leaders.borrow().contains_key(&shard) {
                super::runtime::sleep(backoff(attempt)).await;
            }
        }
    }

    async fn try_once<T, F, Fut>(&self, addr: &str, call: &F) -> Result<T, ClientError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let timeout = self.options.request_timeout;
        let attempt = async {
            let client = self.client_at(addr).await?;
            call(client).await
        };
        super::runtime::within(timeout, attempt)
            .await
            .unwrap_or_else(|| {
                Err(ClientError::Disconnected(format!(
                    "no answer from {addr} within {timeout:?}"
                )))
            })
    }
}

/// The member to try on try number `attempt` when no leader is known: the members that are
/// not suspect in turn, or, when all are, all of them in turn. `members` is never empty (it
/// holds the seed).
fn pick_member(members: &[String], is_suspect: impl Fn(&String) -> bool, attempt: usize) -> String {
    let trusted: Vec<&String> = members.iter().filter(|m| !is_suspect(m)).collect();
    if trusted.is_empty() {
        members[attempt % members.len()].clone()
    } else {
        trusted[attempt % trusted.len()].clone()
    }
}

/// Errors another node (or a later try) may not have: the node is gone or paused, it is
/// overloaded, or leadership changed while the request waited.
fn is_transient(e: &ClientError) -> bool {
    match e {
        ClientError::Connect { .. } | ClientError::Disconnected(_) | ClientError::Overloaded(_) => {
            true
        }
        ClientError::Refused(text) => {
            text.contains("leadership changed") || text.contains("shutting down")
        }
        ClientError::Rejected(refusal) => refusal.retryable,
        _ => false,
    }
}

fn backoff(attempt: usize) -> Duration {
    Duration::from_millis((20u64 << attempt.min(4)).min(300))
}

#[cfg(test)]
mod tests {
    use super::pick_member;

    fn members() -> Vec<String> {
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn members_that_failed_lately_are_tried_last() {
        let members = members();
        let picked: Vec<String> = (0..4)
            .map(|i| pick_member(&members, |m| m == "a", i))
            .collect();
        assert_eq!(picked, ["b", "c", "b", "c"]);
    }

    #[test]
    fn when_every_member_failed_lately_all_are_tried_in_turn() {
        let members = members();
        let picked: Vec<String> = (0..4).map(|i| pick_member(&members, |_| true, i)).collect();
        assert_eq!(picked, ["a", "b", "c", "a"]);
    }
}
