//! Placeholder for the node-to-node transport (being written on the `cluster-net` branch).

use std::net::SocketAddr;
use std::rc::Rc;

use crate::config::ClusterConfig;

pub struct PeerStatus {
    pub id: u64,
    pub raft_addr: SocketAddr,
    pub client_addr: Option<String>,
    pub reachable: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("transport: {0}")]
pub struct TransportError(String);

pub struct Transport;

impl Transport {
    pub fn start(
        _config: &ClusterConfig,
        _shard_count: u32,
        _inbound: Rc<dyn Fn(u64, u32, raft::eraftpb::Message)>,
    ) -> Result<Rc<Transport>, TransportError> {
        Err(TransportError("not built yet".into()))
    }

    pub fn send(&self, _to: u64, _shard: u32, _msg: raft::eraftpb::Message) {}

    pub fn peers(&self) -> Vec<PeerStatus> {
        Vec::new()
    }
}
