//! `Client::change_membership`: the `changeMembership` admin call, one step of a membership
//! change in one shard (`pinq cluster add-node` and `remove-node` drive the steps).

use super::{Client, ClientError, Pending};
use crate::rpc;
use crate::rpc::pinq_capnp::MembershipAction;

/// A shard's voters and learners, as its leader answered after a step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardMembers {
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
}

/// The node a step is about: its id, and for `addLearner` its Raft and client addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTarget {
    pub node_id: u64,
    pub raft_address: String,
    pub client_address: String,
}

impl Client {
    /// One step of a membership change of `shard` (see the schema's `changeMembership`). A
    /// node that does not lead the shard answers [`ClientError::NotLeader`].
    pub fn change_membership(
        &self,
        shard: u32,
        action: MembershipAction,
        target: &StepTarget,
    ) -> Pending<ShardMembers> {
        let mut request = self.conn.broker.change_membership_request();
        {
            let mut p = request.get();
            p.set_shard_id(shard);
            p.set_action(action);
            p.set_node_id(target.node_id);
            p.set_raft_address(target.raft_address.as_str());
            p.set_client_address(target.client_address.as_str());
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
            Ok(ShardMembers {
                voters: rpc::cluster::read_ids(reply.get_voters()).map_err(bad)?,
                learners: rpc::cluster::read_ids(reply.get_learners()).map_err(bad)?,
            })
        })
    }
}
