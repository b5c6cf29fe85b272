//! The driver's part of membership changes (`super::super::membership` is the pure core):
//! proposing a change on the leader and waiting for it to be applied, applying committed
//! changes on every replica (the raft core takes them, and the membership in force is made
//! durable as a [`RaftRecord::Conf`] before anything after it is applied), and the news of
//! each change for the node's address book and `pinq cluster status`.

use std::cell::RefCell;
use std::path::Path;

use futures_channel::oneshot;
use raft::eraftpb::{ConfState, Entry};

use super::{raft_error, ReplicatedStore, Waiter};
use crate::cluster::membership::{self, Action, MemberAddr, MembershipError, Plan};
use crate::cluster::raft_log::RaftLog;
use crate::cluster::record::RaftRecord;
use crate::cluster::replica::{ProposeError, ReplicaConfig};
use crate::storage::signal::Signal;
use crate::storage::StoreError;

/// What a shard's replica knows of its group's membership, for the node around it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MembershipNews {
    /// The membership in force here.
    pub conf: ConfState,
    /// Addresses carried by the changes applied here since the replica opened, of nodes that
    /// are still members.
    pub learned: Vec<MemberAddr>,
}

/// The news and the signal that it changed.
#[derive(Default)]
pub(super) struct News {
    news: RefCell<MembershipNews>,
    changed: Signal,
}

/// The membership record a log without one gets at its creation (index 0: the members it
/// starts with), so that a later start with another `cluster.peers` cannot change it; `None`
/// when the log has one (a difference from `cluster.peers` is logged: the stored membership
/// wins).
pub(super) fn first_conf_record(
    log: &RaftLog,
    config: &ReplicaConfig,
    dir: &Path,
) -> Option<RaftRecord> {
    if !log.has_conf_record() {
        return Some(RaftRecord::Conf {
            index: 0,
            conf_state: log.conf_state().clone(),
        });
    }
    let stored = log.conf_at(u64::MAX);
    let mut stored_ids: Vec<u64> = membership::members_of(&stored).collect();
    stored_ids.sort_unstable();
    stored_ids.dedup();
    if !config.voters.is_empty() && stored_ids != config.voters {
        tracing::info!(
            dir = %dir.display(),
            configured = ?config.voters,
            stored = ?stored_ids,
            "cluster.peers differs from the membership stored in the log: the stored one is in force (cluster.peers is only a new cluster's first membership)"
        );
    }
    None
}

impl ReplicatedStore {
    /// The membership in force here and the addresses learned from changes.
    pub fn membership(&self) -> MembershipNews {
        let mut news = self.membership.news.borrow().clone();
        news.conf = self.replica.borrow().conf_state().clone();
        news
    }

    /// Resolves at the next membership change applied here.
    pub fn membership_changed(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.membership.changed.wait()
    }

    /// The shard's directory (`<dataDir>/shard-N`).
    pub fn shard_dir(&self) -> &Path {
        self.path.engine().dir()
    }

    /// Leader only: hands the leadership to the most up-to-date voter (before this node is
    /// removed, so the group does not wait out an election).
    pub fn transfer_leadership(&self) {
        if let Some(to) = self.replica.borrow_mut().transfer_leadership() {
            tracing::info!(dir = %self.shard_dir().display(), to, "handing leadership over for a membership change");
        }
        self.kick();
    }

    /// Whether this replica holds no state yet (a node added at run time, before its first
    /// snapshot).
    pub fn awaiting_snapshot(&self) -> bool {
        self.replica.borrow().awaiting_snapshot()
    }

    /// Leader only: one step of a membership change in this shard (`shard` names it in
    /// errors). Answers once the change is committed and applied here, with the membership
    /// then in force; a step already done answers at once.
    pub async fn change_membership(
        &self,
        action: Action,
        member: &MemberAddr,
        shard: usize,
    ) -> Result<ConfState, MembershipError> {
        let conf = self.replica.borrow().conf_state().clone();
        let change = match membership::plan(action, member.id, &conf, shard)? {
            Plan::Done => return Ok(conf),
            Plan::Change(change) => change,
        };
        let context = match action {
            Action::AddLearner => member.encode(),
            Action::Promote | Action::Remove => Vec::new(),
        };
        self.proposal_room
            .acquire(1)
            .await
            .map_err(|_| MembershipError::Lost { shard })?;
        let proposed = self
            .replica
            .borrow_mut()
            .propose_conf_change(change, context);
        let (term, index) = proposed.map_err(|e| {
            self.proposal_room.signal(1);
            match e {
                ProposeError::NotLeader { leader } => MembershipError::NotLeader { leader },
                ProposeError::ChangeInProgress => MembershipError::InProgress { shard },
                ProposeError::Dropped => MembershipError::Lost { shard },
            }
        })?;
        let (done, answer) = oneshot::channel();
        let waiter = Waiter {
            term,
            units: 1,
            done,
        };
        self.waiters.borrow_mut().insert(index, waiter);
        self.kick();
        let applied = answer.await.map_err(|_| MembershipError::Lost { shard })?;
        applied.map_err(|_| MembershipError::Lost { shard })?;
        let now = self.replica.borrow().conf_state().clone();
        // The raft core turns a change it will not take into an empty entry at the same
        // index: then the membership is not as asked.
        match membership::plan(action, member.id, &now, shard) {
            Ok(Plan::Done) => Ok(now),
            _ => Err(MembershipError::Failed(format!(
                "shard {shard}: the raft core did not take the change ({} node {}); run the command again",
                action.name(),
                member.id
            ))),
        }
    }

    /// Applies a committed membership change: the raft core takes it, the membership in force
    /// from its index on is made durable, and the node hears of it.
    pub(super) async fn apply_conf_change(&self, entry: &Entry) -> Result<(), StoreError> {
        let dir = self.path.engine().dir();
        let conf_state = self
            .replica
            .borrow_mut()
            .apply_conf_change(entry)
            .map_err(|e| raft_error(dir, e))?;
        let record = RaftRecord::Conf {
            index: entry.index,
            conf_state: conf_state.clone(),
        };
        let seq = self.path.wal().append(&record)?;
        self.record_index.borrow_mut().push_back((seq, entry.index));
        // Before the engine may hold anything after this index (a restart takes the
        // membership in force at the engine's index from these records).
        self.path.wal().wait_durable(seq).await?;
        let learned = MemberAddr::decode(&entry.context);
        tracing::info!(
            dir = %dir.display(),
            index = entry.index,
            voters = ?conf_state.voters,
            learners = ?conf_state.learners,
            outgoing = ?conf_state.voters_outgoing,
            "membership change applied"
        );
        {
            let mut news = self.membership.news.borrow_mut();
            if let Some(member) = learned {
                news.learned.retain(|m| m.id != member.id);
                news.learned.push(member);
            }
            // Only members' addresses are kept: bounded by the group's size, not by every node
            // ever added.
            let member = |id: &u64| {
                [
                    &conf_state.voters,
                    &conf_state.learners,
                    &conf_state.voters_outgoing,
                    &conf_state.learners_next,
                ]
                .iter()
                .any(|ids| ids.contains(id))
            };
            news.learned.retain(|m| member(&m.id));
            news.conf = conf_state;
        }
        self.membership.changed.notify();
        Ok(())
    }

    /// A snapshot brought a membership: the node hears of it.
    pub(super) fn note_snapshot_membership(&self) {
        self.membership.news.borrow_mut().conf = self.replica.borrow().conf_state().clone();
        self.membership.changed.notify();
    }
}
