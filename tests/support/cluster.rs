//! Test support: a Raft cluster of real `pinq serve` processes on 127.0.0.1.
//!
//! [`Cluster::new`] plans every member (its node id, client, Raft and metrics ports, data
//! directory) without starting anything; [`Cluster::start`] also starts them all. A member is
//! stopped by its process id only ([`Cluster::kill9`], [`Cluster::signal`]) and restarted with
//! the same arguments and data directory ([`Cluster::start_node`]). Dropping the cluster kills
//! every member it still runs. Status queries go straight to one node with a time limit, so a
//! paused (SIGSTOPped) node, whose kernel still accepts connections, cannot hang a test.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pinq::client::{Client, ClientOptions};
use pinq::rpc::cluster::ClusterStatus;

use super::{on_executor, Server};

/// Ports handed out by [`free_port`] in this test process: the kernel may give a port back
/// to `bind(0)` once its probe listener is dropped, and the broker's shared client port is
/// bound with `SO_REUSEPORT`, so two members given one port would both start and share it.
static PORTS_TAKEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Tries to find a free run of ports this many times before failing.
const FREE_PORT_TRIES_MAX: usize = 100;

/// A port nobody on 127.0.0.1 listens on now, with the `following` ports after it free too
/// (a member's shard ports default to its client port + 1, + 2, …), none of them handed out
/// by this process before.
pub fn free_port(following: u16) -> u16 {
    let mut taken = PORTS_TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    'probe: for _ in 0..FREE_PORT_TRIES_MAX {
        let probe = TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
        let port = probe.local_addr().expect("probe address").port();
        let Some(last) = port.checked_add(following) else {
            continue;
        };
        if (port..=last).any(|p| taken.contains(&p)) {
            continue;
        }
        for next in port + 1..=last {
            if TcpListener::bind(("127.0.0.1", next)).is_err() {
                continue 'probe;
            }
        }
        taken.extend(port..=last);
        return port;
    }
    panic!(
        "no {} free port(s) in a row on 127.0.0.1 after {FREE_PORT_TRIES_MAX} tries",
        following + 1
    );
}

/// One planned member: what it is started with, every time.
#[derive(Clone, Debug)]
pub struct Member {
    pub id: u64,
    /// Its client address (`--listen`); the shard port is the next one.
    pub client: SocketAddr,
    pub raft: SocketAddr,
    pub metrics: SocketAddr,
    pub data_dir: PathBuf,
    /// `--cpus`: members are spread over CPUs 0 and 1 (one shard each).
    pub cpus: String,
}

/// The members of one cluster and the processes running them.
pub struct Cluster {
    members: Vec<Member>,
    /// `servers[i]` runs `members[i]`, when running.
    servers: Vec<Option<Server>>,
    env: Vec<(String, String)>,
    tmp: tempfile::TempDir,
}

impl Cluster {
    /// Plans `size` members with ids 1..=size; starts none. `env` is given to every member.
    pub fn new(size: u64, env: &[(&str, &str)]) -> Cluster {
        let tmp = tempfile::tempdir().expect("temp dir");
        let members = (1..=size)
            .map(|id| Member {
                id,
                client: SocketAddr::from(([127, 0, 0, 1], free_port(1))),
                raft: SocketAddr::from(([127, 0, 0, 1], free_port(0))),
                metrics: SocketAddr::from(([127, 0, 0, 1], free_port(0))),
                data_dir: tmp.path().join(format!("node{id}")),
                cpus: ((id - 1) % 2).to_string(),
            })
            .collect::<Vec<_>>();
        Cluster {
            servers: members.iter().map(|_| None).collect(),
            members,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            tmp,
        }
    }

    /// Plans `size` members and starts them all (concurrently).
    pub fn start(size: u64, env: &[(&str, &str)]) -> Cluster {
        let mut cluster = Cluster::new(size, env);
        let ids = cluster.ids();
        let args = ids.iter().map(|&id| cluster.args(id, &[])).collect();
        cluster.start_nodes(&ids, args);
        cluster
    }

    /// A scratch directory that lives as long as the cluster (for a member started with
    /// another data directory than its own).
    pub fn scratch_dir(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn ids(&self) -> Vec<u64> {
        self.members.iter().map(|m| m.id).collect()
    }

    pub fn member(&self, id: u64) -> &Member {
        &self.members[self.index(id)]
    }

    /// `--peers`: every member's Raft address.
    pub fn peers_arg(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}={}", m.id, m.raft))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The `pinq serve` arguments of member `id`, with the value of each flag in `overrides`
    /// (e.g. `("--cpus", "0,1")`) replaced; a flag not among the defaults is added.
    pub fn args(&self, id: u64, overrides: &[(&str, &str)]) -> Vec<String> {
        let m = self.member(id);
        let mut args: Vec<(String, String)> = [
            ("--cpus", m.cpus.clone()),
            ("--node-id", id.to_string()),
            ("--raft-listen", m.raft.to_string()),
            ("--peers", self.peers_arg()),
            ("--listen", m.client.to_string()),
            ("--metrics-listen", m.metrics.to_string()),
            ("--data-dir", m.data_dir.display().to_string()),
        ]
        .into_iter()
        .map(|(flag, value)| (flag.to_owned(), value))
        .collect();
        for (flag, value) in overrides {
            match args.iter_mut().find(|(f, _)| f == flag) {
                Some(entry) => entry.1 = value.to_string(),
                None => args.push((flag.to_string(), value.to_string())),
            }
        }
        args.into_iter().flat_map(|(f, v)| [f, v]).collect()
    }

    /// `--peers` naming only members `ids` (a cluster whose other planned members join later).
    pub fn peers_of(&self, ids: &[u64]) -> String {
        ids.iter()
            .map(|&id| format!("{id}={}", self.member(id).raft))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The `pinq serve` arguments of member `id` joining a running cluster through the member
    /// at `join` (`--join` instead of `--peers`).
    pub fn join_args(&self, id: u64, join: &str) -> Vec<String> {
        let mut args = self.args(id, &[]);
        if let Some(at) = args.iter().position(|a| a == "--peers") {
            args.drain(at..at + 2);
        }
        args.extend(["--join".to_string(), join.to_string()]);
        args
    }

    /// Starts (or restarts, on the same data directory) member `id` with its usual arguments.
    pub fn start_node(&mut self, id: u64) {
        let args = self.args(id, &[]);
        self.start_nodes(&[id], vec![args]);
    }

    /// Starts member `id` with `extra` added to the cluster's environment (fault injection).
    pub fn start_node_env(&mut self, id: u64, extra: &[(&str, &str)]) {
        let saved = self.env.clone();
        self.env
            .extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self.start_node(id);
        self.env = saved;
    }

    /// Starts members `ids`, member `ids[i]` with `args[i]` (from [`Cluster::args`], whose
    /// `--data-dir` may point elsewhere than the member's own), at once:
    /// each waits for its listening line, and they need not wait for one another.
    pub fn start_nodes(&mut self, ids: &[u64], args: Vec<Vec<String>>) {
        assert_eq!(ids.len(), args.len(), "one argument list per member");
        for &id in ids {
            assert!(
                self.servers[self.index(id)].is_none(),
                "node {id} is already running"
            );
        }
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let started: Vec<Server> = std::thread::scope(|scope| {
            let handles: Vec<_> = ids
                .iter()
                .zip(args)
                .map(|(&id, args)| {
                    let data_dir = args
                        .iter()
                        .position(|a| a == "--data-dir")
                        .and_then(|i| args.get(i + 1))
                        .map(PathBuf::from)
                        .unwrap_or_else(|| self.member(id).data_dir.clone());
                    let env = &env;
                    scope.spawn(move || {
                        let args: Vec<OsString> = args.into_iter().map(OsString::from).collect();
                        Server::start_exact(&data_dir, &args, env)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a member failed to start"))
                .collect()
        });
        for (&id, server) in ids.iter().zip(started) {
            let i = self.index(id);
            self.servers[i] = Some(server);
        }
    }

    /// The running process of member `id`.
    pub fn server(&self, id: u64) -> &Server {
        self.servers[self.index(id)]
            .as_ref()
            .unwrap_or_else(|| panic!("node {id} is not running"))
    }

    pub fn server_mut(&mut self, id: u64) -> &mut Server {
        let i = self.index(id);
        self.servers[i]
            .as_mut()
            .unwrap_or_else(|| panic!("node {id} is not running"))
    }

    /// Members whose process runs (a SIGSTOPped one included).
    pub fn running(&self) -> Vec<u64> {
        self.members
            .iter()
            .zip(&self.servers)
            .filter(|(_, s)| s.is_some())
            .map(|(m, _)| m.id)
            .collect()
    }

    /// `127.0.0.1:PORT` of member `id`'s client port, as the CLI's `--server` takes it.
    pub fn addr(&self, id: u64) -> String {
        self.member(id).client.to_string()
    }

    /// SIGKILLs member `id` and reaps it; it can be started again with [`Cluster::start_node`].
    pub fn kill9(&mut self, id: u64) {
        let i = self.index(id);
        if let Some(mut server) = self.servers[i].take() {
            server.kill9();
        }
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`) to member `id`'s process, by its pid.
    pub fn signal(&self, id: u64, signal: &str) {
        let pid = self.server(id).pid();
        assert_ne!(pid, 0, "node {id} has no process");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill(1)");
        assert!(status.success(), "kill -{signal} {pid} failed: {status}");
    }

    /// Member `id`'s own view (`Broker.clusterStatus`), or `None` if it does not answer
    /// within `timeout`.
    pub fn status(&self, id: u64, timeout: Duration) -> Option<ClusterStatus> {
        status_of(self.addr(id), timeout)
    }

    /// The members among `among` that say they lead `shard` now, each asked with a 1 s limit.
    pub fn claimed_leaders(&self, shard: u32, among: &[u64]) -> Vec<u64> {
        among
            .iter()
            .copied()
            .filter(|&id| {
                self.status(id, Duration::from_secs(1)).is_some_and(|s| {
                    s.shards
                        .iter()
                        .any(|r| r.shard_id == shard && r.leader_node_id == id)
                })
            })
            .collect()
    }

    /// Waits until exactly one member of `among` says it leads `shard` and returns it; panics
    /// after `timeout`.
    pub fn wait_for_leader(&self, shard: u32, among: &[u64], timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            let leaders = self.claimed_leaders(shard, among);
            if let [leader] = leaders[..] {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "no single leader of shard {shard} among nodes {among:?} within {timeout:?} \
                 (claimed: {leaders:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn index(&self, id: u64) -> usize {
        self.members
            .iter()
            .position(|m| m.id == id)
            .unwrap_or_else(|| panic!("no member with id {id}"))
    }
}

/// `Broker.clusterStatus` of the node at `addr`, or `None` if it does not answer (connect
/// included) within `timeout`.
pub fn status_of(addr: String, timeout: Duration) -> Option<ClusterStatus> {
    on_executor(move || async move {
        let ask = async {
            let options = ClientOptions {
                connect_timeout: timeout,
                ..ClientOptions::default()
            };
            let client = Client::connect_with(addr.as_str(), &options).await.ok()?;
            client.cluster_status().await.ok()
        };
        futures_lite::future::or(ask, async {
            glommio::timer::sleep(timeout).await;
            None
        })
        .await
    })
}
