//! `Client::set_group_policy`: the `setGroupPolicy` admin call (a group's max deliveries,
//! dead-letter topic and redelivery backoff), and the policy it answers.

use super::{Client, ClientError, Pending};
use crate::pipeline::policy::{Backoff, PolicyOverride};
use crate::rpc;

/// The redelivery policy in force for a group, as the broker answered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPolicy {
    /// 0 = unlimited.
    pub max_deliveries: u32,
    /// The group's dead-letter topic (its template already applied to the topic).
    pub dead_letter_topic: String,
    /// `None`: a plain NACK or a lease timeout redelivers at once.
    pub backoff: Option<Backoff>,
}

impl Client {
    /// Sets the overrides `change` names for `topic`'s `group` (the rest stay as they are) and
    /// answers the policy now in force. An empty `change` only reads the policy. A dead-letter
    /// topic of `""` goes back to the broker's default; `backoff: Some(None)` switches backoff
    /// off for the group. Goes to the topic's shard; in a cluster a node that does not lead it
    /// answers [`ClientError::NotLeader`] ([`Router::set_group_policy`](super::Router) follows it).
    pub fn set_group_policy(
        &self,
        topic: &str,
        group: &str,
        change: &PolicyOverride,
    ) -> Pending<GroupPolicy> {
        let mut request = self.conn.broker.set_group_policy_request();
        {
            let mut p = request.get();
            p.set_topic(topic);
            p.set_group(group);
            if let Some(n) = change.max_deliveries {
                p.set_set_max_deliveries(true);
                p.set_max_deliveries(n);
            }
            if let Some(name) = &change.dead_letter_topic {
                p.set_set_dead_letter_topic(true);
                p.set_dead_letter_topic(name.as_str());
            }
            if let Some(backoff) = change.backoff {
                p.set_set_backoff(true);
                let (initial, max) = backoff.map_or((0, 0), |b| (b.initial_ms, b.max_ms));
                p.set_backoff_initial_ms(initial);
                p.set_backoff_max_ms(max);
            }
        }
        let reply = request.send().promise;
        Pending::on(&self.conn, async move {
            let reply = reply.await.map_err(ClientError::from_rpc)?;
            let bad = ClientError::bad_reply;
            let reply = reply.get().map_err(bad)?;
            if let Some(not_leader) =
                rpc::cluster::read_not_leader(reply.has_not_leader(), reply.get_not_leader())
                    .map_err(ClientError::BadReply)?
            {
                return Err(ClientError::NotLeader(not_leader));
            }
            let policy = reply.get_policy().map_err(bad)?;
            let (initial, max) = (policy.get_backoff_initial_ms(), policy.get_backoff_max_ms());
            Ok(GroupPolicy {
                max_deliveries: policy.get_max_deliveries(),
                dead_letter_topic: policy
                    .get_dead_letter_topic()
                    .map_err(bad)?
                    .to_string()
                    .map_err(|e| ClientError::Disconnected(e.to_string()))?,
                backoff: (initial > 0).then_some(Backoff {
                    initial_ms: initial,
                    max_ms: max,
                }),
            })
        })
    }
}
