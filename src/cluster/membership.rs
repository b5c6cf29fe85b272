//! Membership changes at run time, as a pure core: what `pinq cluster add-node` and
//! `remove-node` ask of one shard's Raft group ([`Action`]), the configuration change that
//! does it given the membership in force ([`plan`]), why one is refused ([`MembershipError`]),
//! and the node addresses a change carries to every member ([`MemberAddr`], in the entry's
//! context).
//!
//! A node joins in two steps per shard, the way raft's learners are meant to be used: it is
//! added as a learner (it receives the log, or a snapshot, and votes in nothing), and once it
//! has caught up it is promoted to voter. Removal is one step. Each change is one
//! `ConfChangeV2` through raft's joint consensus (raft takes a single change directly and
//! leaves a joint configuration by itself), proposed only while no other change is in
//! progress. Steps that are already done answer at once, so an interrupted `add-node` or
//! `remove-node` can simply be run again.

use std::net::SocketAddr;

use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2, ConfState};

/// One step of a membership change in one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Add the node as a learner: it receives the log but votes in nothing.
    AddLearner,
    /// Make a learner a voter.
    Promote,
    /// Remove the node (voter or learner).
    Remove,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::AddLearner => "addLearner",
            Action::Promote => "promote",
            Action::Remove => "remove",
        }
    }
}

/// A node's addresses, carried in the context of the change that adds it so that every
/// member learns where to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberAddr {
    pub id: u64,
    pub raft: SocketAddr,
    /// Where clients reach it (`host:port`).
    pub client: String,
}

impl MemberAddr {
    /// `pinq-member id raft client`: text, so a log dump shows it.
    pub fn encode(&self) -> Vec<u8> {
        format!("pinq-member {} {} {}", self.id, self.raft, self.client).into_bytes()
    }

    /// The addresses a change's context carries (`None` for a context without them: removals,
    /// raft's own leave-joint change).
    pub fn decode(context: &[u8]) -> Option<MemberAddr> {
        let text = std::str::from_utf8(context).ok()?;
        let mut parts = text.split(' ');
        if parts.next()? != "pinq-member" {
            return None;
        }
        let id = parts.next()?.parse().ok()?;
        let raft = parts.next()?.parse().ok()?;
        let client = parts.next()?.to_string();
        parts
            .next()
            .is_none()
            .then_some(MemberAddr { id, raft, client })
    }
}

/// Why a membership change was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("not the leader of this shard (leader: {})", leader.map_or("none yet".to_string(), |l| format!("node {l}")))]
    NotLeader { leader: Option<u64> },
    #[error("another membership change is in progress in shard {shard}: wait for it to finish, then run the command again")]
    InProgress { shard: usize },
    #[error(
        "node {node} is the last voter of shard {shard}: a group cannot remove its last voter"
    )]
    LastVoter { node: u64, shard: usize },
    #[error(
        "node {node} is not a learner of shard {shard}: add it first (`pinq cluster add-node`)"
    )]
    NotALearner { node: u64, shard: usize },
    #[error("leadership changed before the membership change committed in shard {shard}: run the command again")]
    Lost { shard: usize },
    #[error("{0}")]
    Failed(String),
}

/// What one shard must do for `action` on `node`, given the membership in force.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Already as asked: nothing to propose.
    Done,
    Change(ConfChangeV2),
}

/// The change that performs `action` on `node` in a group whose membership is `conf`
/// (`shard` names the group in errors).
pub fn plan(
    action: Action,
    node: u64,
    conf: &ConfState,
    shard: usize,
) -> Result<Plan, MembershipError> {
    if !conf.voters_outgoing.is_empty() {
        return Err(MembershipError::InProgress { shard });
    }
    let voter = conf.voters.contains(&node);
    let learner = conf.learners.contains(&node);
    let kind = match action {
        Action::AddLearner if voter || learner => return Ok(Plan::Done),
        Action::AddLearner => ConfChangeType::AddLearnerNode,
        Action::Promote if voter => return Ok(Plan::Done),
        Action::Promote if !learner => {
            return Err(MembershipError::NotALearner { node, shard });
        }
        Action::Promote => ConfChangeType::AddNode,
        Action::Remove if !voter && !learner => return Ok(Plan::Done),
        Action::Remove if voter && conf.voters.len() == 1 => {
            return Err(MembershipError::LastVoter { node, shard });
        }
        Action::Remove => ConfChangeType::RemoveNode,
    };
    let mut single = ConfChangeSingle {
        node_id: node,
        ..ConfChangeSingle::default()
    };
    single.set_change_type(kind);
    let mut change = ConfChangeV2::default();
    change.mut_changes().push(single);
    Ok(Plan::Change(change))
}

/// The role `node` has in `conf`, for `pinq cluster status`.
pub fn role_of(conf: &ConfState, node: u64) -> Option<&'static str> {
    if conf.voters.contains(&node) || conf.voters_outgoing.contains(&node) {
        Some("voter")
    } else if conf.learners.contains(&node) || conf.learners_next.contains(&node) {
        Some("learner")
    } else {
        None
    }
}

/// Every node `conf` names, in any role.
pub fn members_of(conf: &ConfState) -> impl Iterator<Item = u64> + '_ {
    conf.voters
        .iter()
        .chain(&conf.learners)
        .chain(&conf.voters_outgoing)
        .chain(&conf.learners_next)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(voters: &[u64], learners: &[u64]) -> ConfState {
        ConfState {
            voters: voters.to_vec(),
            learners: learners.to_vec(),
            ..ConfState::default()
        }
    }

    fn change_of(plan: Plan) -> (u64, ConfChangeType) {
        let Plan::Change(change) = plan else {
            panic!("expected a change, got {plan:?}");
        };
        assert_eq!(change.changes.len(), 1);
        (
            change.changes[0].node_id,
            change.changes[0].get_change_type(),
        )
    }

    #[test]
    fn a_node_joins_as_a_learner_then_becomes_a_voter() {
        let c = conf(&[1, 2, 3], &[]);
        assert_eq!(
            change_of(plan(Action::AddLearner, 4, &c, 0).unwrap()),
            (4, ConfChangeType::AddLearnerNode)
        );
        let c = conf(&[1, 2, 3], &[4]);
        assert_eq!(plan(Action::AddLearner, 4, &c, 0), Ok(Plan::Done));
        assert_eq!(
            change_of(plan(Action::Promote, 4, &c, 0).unwrap()),
            (4, ConfChangeType::AddNode)
        );
        let c = conf(&[1, 2, 3, 4], &[]);
        assert_eq!(plan(Action::Promote, 4, &c, 0), Ok(Plan::Done));
        assert_eq!(plan(Action::AddLearner, 4, &c, 0), Ok(Plan::Done));
    }

    #[test]
    fn refusals_name_the_node_and_the_shard() {
        let c = conf(&[1, 2, 3], &[]);
        assert_eq!(
            plan(Action::Promote, 4, &c, 2),
            Err(MembershipError::NotALearner { node: 4, shard: 2 })
        );
        assert_eq!(
            plan(Action::Remove, 1, &conf(&[1], &[]), 1),
            Err(MembershipError::LastVoter { node: 1, shard: 1 })
        );
        let joint = ConfState {
            voters: vec![1, 2, 4],
            voters_outgoing: vec![1, 2, 3],
            ..ConfState::default()
        };
        assert_eq!(
            plan(Action::Remove, 3, &joint, 0),
            Err(MembershipError::InProgress { shard: 0 })
        );
    }

    #[test]
    fn removal_takes_voters_and_learners_and_is_done_when_absent() {
        let c = conf(&[1, 2, 3], &[4]);
        assert_eq!(
            change_of(plan(Action::Remove, 3, &c, 0).unwrap()),
            (3, ConfChangeType::RemoveNode)
        );
        assert_eq!(
            change_of(plan(Action::Remove, 4, &c, 0).unwrap()),
            (4, ConfChangeType::RemoveNode)
        );
        assert_eq!(plan(Action::Remove, 9, &c, 0), Ok(Plan::Done));
        // A learner alone beside one voter may go; the voter may not.
        assert!(plan(Action::Remove, 4, &conf(&[1], &[4]), 0).is_ok());
    }

    #[test]
    fn member_addresses_round_trip_and_junk_is_none() {
        let m = MemberAddr {
            id: 4,
            raft: "127.0.0.1:7104".parse().unwrap(),
            client: "127.0.0.1:7404".into(),
        };
        assert_eq!(MemberAddr::decode(&m.encode()), Some(m));
        for junk in [
            &b""[..],
            b"pinq-member",
            b"pinq-member x 127.0.0.1:1 a",
            b"pinq-member 4 nope a",
            b"pinq-member 4 127.0.0.1:1 a extra",
            b"other 4 127.0.0.1:1 a",
            &[0xff, 0xfe],
        ] {
            assert_eq!(MemberAddr::decode(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn roles_read_from_either_half_of_a_joint_membership() {
        let joint = ConfState {
            voters: vec![1, 2, 4],
            voters_outgoing: vec![1, 2, 3],
            learners_next: vec![3],
            ..ConfState::default()
        };
        assert_eq!(role_of(&joint, 4), Some("voter"));
        assert_eq!(role_of(&joint, 3), Some("voter"));
        assert_eq!(role_of(&conf(&[1], &[5]), 5), Some("learner"));
        assert_eq!(role_of(&joint, 9), None);
        let mut all: Vec<u64> = members_of(&joint).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, [1, 2, 3, 4]);
    }
}
