//! The broker process: one glommio executor per configured CPU, each pinned to its CPU and
//! running one shard (`shard.rs`), connected to every other shard by bounded channels
//! (`mesh.rs`), accepting clients on the shared port (SO_REUSEPORT) and on its own port
//! (`connection.rs`).
//!
//! `run` owns start-up and nothing else: it resolves ports, builds the channels, starts the
//! executors, prints one line once every shard listens, and waits. A shard that cannot start
//! (port taken, storage unreadable) stops the whole process with an error: no half-up broker.
//! It also starts the metrics endpoint (`crate::metrics::http`, printed as a second line
//! `pinq metrics on ADDR`) and the signal handler (`shutdown.rs`); `run` returns `Ok` once every
//! shard has shut down gracefully.

pub mod connection;
pub mod dead_letter_forward;
pub mod exclusive;
pub mod limits;
pub mod membership;
pub mod mesh;
pub mod policy_call;
pub mod receipts;
pub mod shard;
pub mod shutdown;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::rc::Rc;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::Context;
use glommio::channels::shared_channel::{self, ConnectedReceiver, SharedReceiver, SharedSender};
use glommio::{LocalExecutorBuilder, Placement};

use self::limits::{Backoff, ConnectionCount, EdgeLimits};
use self::mesh::ShardMsg;
use self::shard::{now_ms, Kick, Shard};
use self::shutdown::ShutdownFlag;
use crate::cluster::driver::{DriverConfig, OUTBOX_MESSAGES_MAX};
use crate::cluster::replica::ReplicaConfig;
use crate::cluster::transport::{ShardPlace, Transport};
use crate::cluster::view::ClusterView;
use crate::config::{ClusterConfig, Config, PublishConfig, StorageEngine};
use crate::ids::ShardId;
use crate::metrics::http::MetricsEndpoint;
use crate::metrics::MetricsSlots;
use crate::pipeline::{drive, ShardCore};
use crate::rpc::ShardInfo;
use crate::storage::ShardStore;
use glommio::channels::local_channel::{self, LocalReceiver};

/// Messages a cross-shard channel holds before its sender waits.
pub const MESH_CHANNEL_LEN: usize = 1024;

/// What every connection may need to know about the whole broker.
#[derive(Clone)]
pub struct Topology {
    pub publish: PublishConfig,
    /// TLS and tokens, built once at start-up.
    pub security: crate::security::Security,
    shards: Arc<Mutex<Vec<ShardInfo>>>,
}

impl Topology {
    pub fn shards(&self) -> Vec<ShardInfo> {
        self.shards.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// What the operations side gives every shard: its metrics slot and the shutdown flag.
#[derive(Clone)]
struct Ops {
    slots: MetricsSlots,
    shutdown: ShutdownFlag,
}

/// Where a shard ended up listening.
struct Started {
    shard: ShardId,
    shared: SocketAddr,
    own: SocketAddr,
}

/// Runs the broker until SIGTERM or SIGINT, then shuts it down gracefully.
pub fn run(config: Config) -> anyhow::Result<()> {
    let cpus: Vec<usize> = config.server.cpus.cpus().to_vec();
    let count = cpus.len();
    anyhow::ensure!(count > 0, "server.cpus selects no CPU");
    limits::tune_allocator();
    check_engine(&config)?;
    membership::refuse_standalone_on_member_dir(&config)?;
    let _data_dir_lock = match config.storage.engine {
        StorageEngine::Memory => None,
        _ => Some(exclusive::lock_data_dir(&config.server.data_dir)?),
    };
    // Every TLS file is read and checked before anything listens: a bad one stops start-up.
    let security = crate::security::Security::from_config(&config)?;
    ensure_ports_free(&config)?;
    let listen = resolve_port(config.server.listen)?;
    let mut slots = MetricsSlots::new(count);
    if let Some(files) = &config.security.tls {
        let not_after_s = crate::security::tls::server_not_after_s(files)?;
        slots = slots.with_certificate(files.cert_file.display().to_string(), not_after_s);
    }
    let ops = Ops {
        slots,
        shutdown: ShutdownFlag::default(),
    };
    shutdown::install(ops.shutdown.clone())?;
    shutdown::stop_node_on_panic(ops.shutdown.clone());
    let serving = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let metrics = MetricsEndpoint::start(
        config.server.metrics_listen,
        ops.slots.clone(),
        serving.clone(),
        ops.shutdown.shared(),
    )?;
    let topology = Topology {
        publish: config.publish.clone(),
        security,
        shards: Arc::new(Mutex::new(Vec::new())),
    };
    let (started_tx, started_rx) = mpsc::channel::<Result<Started, String>>();
    let handles = spawn_shards(&config, &cpus, &topology, listen, &ops, started_tx)?;
    let shards = await_started(&started_rx, &topology, &cpus)?;
    let ports: Vec<String> = shards.iter().map(|s| s.own.port().to_string()).collect();
    println!(
        "pinq listening on {} with {count} shard(s) on CPUs {:?}; shard ports {}",
        shards[0].shared,
        cpus,
        ports.join(",")
    );
    serving.store(true, std::sync::atomic::Ordering::Relaxed);
    println!("pinq metrics on {}", metrics.addr);
    tracing::info!(listen = %shards[0].shared, metrics = %metrics.addr, shards = count, "pinq is serving");
    join_shards(handles, &ops, metrics)
}

/// Refuses configurations the engine cannot serve; warns about a store that keeps nothing.
fn check_engine(config: &Config) -> anyhow::Result<()> {
    if config.storage.engine == StorageEngine::Memory {
        anyhow::ensure!(
            config.cluster.is_none(),
            "a cluster node keeps its Raft log on disk: set storage.engine = \"lsm\" (or leave [cluster] out for a standalone broker)"
        );
        tracing::warn!("storage.engine = \"memory\": nothing survives a restart");
    }
    Ok(())
}

/// The members as this node first sees them (itself reachable, the others not yet; see
/// [`membership::initial_members`]).
fn cluster_view_of(config: &Config, count: usize) -> anyhow::Result<Option<ClusterView>> {
    let Some(c) = &config.cluster else {
        return Ok(None);
    };
    let nodes = membership::initial_members(c, &config.server.data_dir)?;
    Ok(Some(ClusterView::new(c.node_id, nodes, count)))
}

/// The sending ends of the mesh by shard and peer, and the receiving ends by shard.
type Mesh = (
    Vec<Vec<Option<SharedSender<ShardMsg>>>>,
    Vec<Vec<SharedReceiver<ShardMsg>>>,
);

/// One bounded channel per ordered pair of shards.
fn mesh_channels(count: usize) -> Mesh {
    let mut senders: Vec<Vec<Option<SharedSender<ShardMsg>>>> = (0..count)
        .map(|_| (0..count).map(|_| None).collect())
        .collect();
    let mut receivers: Vec<Vec<SharedReceiver<ShardMsg>>> =
        (0..count).map(|_| Vec::new()).collect();
    for (from, row) in senders.iter_mut().enumerate() {
        for (to, slot) in row.iter_mut().enumerate() {
            if from != to {
                let (tx, rx) = shared_channel::new_bounded(MESH_CHANNEL_LEN);
                *slot = Some(tx);
                receivers[to].push(rx);
            }
        }
    }
    (senders, receivers)
}

/// Starts one pinned executor per CPU, each running [`shard_main`].
fn spawn_shards(
    config: &Config,
    cpus: &[usize],
    topology: &Topology,
    listen: SocketAddr,
    ops: &Ops,
    started: mpsc::Sender<Result<Started, String>>,
) -> anyhow::Result<Vec<glommio::ExecutorJoinHandle<()>>> {
    let count = cpus.len();
    let cluster_view = cluster_view_of(config, count)?;
    let connections = ConnectionCount::new(config.server.client.connections_max);
    let (senders, receivers) = mesh_channels(count);
    let mut handles = Vec::with_capacity(count);
    for (index, (peer_senders, peer_receivers)) in senders.into_iter().zip(receivers).enumerate() {
        let (shard_id, cpu) = (ShardId::new(index), cpus[index]);
        let start = ShardStart {
            shard_id,
            count,
            config: config.clone(),
            topology: topology.clone(),
            listen,
            own_addr: config.server.shard_listen(index),
            started: started.clone(),
            ops: ops.clone(),
            cluster_view: cluster_view.clone(),
            connections: connections.clone(),
        };
        let mut builder = LocalExecutorBuilder::new(Placement::Fixed(cpu))
            .name(&format!("pinq-shard-{shard_id}"));
        if config.server.idle_poll_us > 0 {
            // `server.idlePoll`: poll this long for more work before sleeping (tuning.md).
            builder = builder
                .spin_before_park(std::time::Duration::from_micros(config.server.idle_poll_us));
        }
        let handle = builder
            .spawn(move || async move { shard_main(start, peer_senders, peer_receivers).await })
            .map_err(|e| {
                anyhow::anyhow!("starting the executor of shard {shard_id} on CPU {cpu}: {e}")
            })?;
        handles.push(handle);
    }
    Ok(handles)
}

/// Waits until every shard listens (or one fails to start), and publishes their ports.
fn await_started(
    started: &mpsc::Receiver<Result<Started, String>>,
    topology: &Topology,
    cpus: &[usize],
) -> anyhow::Result<Vec<Started>> {
    let mut shards = Vec::with_capacity(cpus.len());
    for _ in 0..cpus.len() {
        match started.recv() {
            Ok(Ok(started)) => shards.push(started),
            Ok(Err(e)) => anyhow::bail!(e),
            Err(_) => anyhow::bail!("a shard stopped during start-up"),
        }
    }
    shards.sort_by_key(|s| s.shard);
    if let Ok(mut list) = topology.shards.lock() {
        *list = shards
            .iter()
            .map(|s| ShardInfo {
                shard_id: s.shard.to_wire(),
                host: s.own.ip().to_string(),
                port: s.own.port(),
                cpu: cpus[s.shard.get()] as u32,
                ..ShardInfo::default()
            })
            .collect();
    }
    Ok(shards)
}

/// Joins every shard, even after one failed (the others drain and close their stores first),
/// and says how the broker stopped.
fn join_shards(
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
    ops: &Ops,
    metrics: MetricsEndpoint,
) -> anyhow::Result<()> {
    let mut lost = None;
    for (shard, handle) in handles.into_iter().enumerate() {
        if let Err(e) = handle.join() {
            lost.get_or_insert(format!("shard {shard} stopped abnormally: {e}"));
        }
    }
    metrics.stop();
    if let Some(reason) = ops.shutdown.failure().map(str::to_string).or(lost) {
        anyhow::bail!("{reason}; the broker stopped (every shard drained what it could)");
    }
    // Each shard stored a last snapshot after closing its store: report what it had stored.
    let published: u64 = ops
        .slots
        .read()
        .iter()
        .flatten()
        .map(|s| s.stats.counters.published_total)
        .sum();
    println!("pinq stopped: every shard drained and closed its store; {published} message(s) published since start");
    tracing::info!(published, "pinq stopped");
    Ok(())
}

/// Refuses to start beside another broker on the client port, a shard port or the Raft port.
fn ensure_ports_free(config: &Config) -> anyhow::Result<()> {
    exclusive::ensure_port_free(config.server.listen, "client port")?;
    for shard in 0..config.server.cpus.len() {
        exclusive::ensure_port_free(config.server.shard_listen(shard), "shard port")?;
    }
    if let Some(cluster) = &config.cluster {
        exclusive::ensure_port_free(cluster.raft_listen, "raft port")?;
    }
    Ok(())
}

/// Port 0 means "any free port": pick one here so that every shard binds the same one.
fn resolve_port(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    let probe = StdListener::bind(addr).with_context(|| format!("binding {addr}"))?;
    Ok(probe.local_addr()?)
}

/// What one shard's executor starts from.
struct ShardStart {
    shard_id: ShardId,
    count: usize,
    config: Config,
    topology: Topology,
    listen: SocketAddr,
    own_addr: SocketAddr,
    started: mpsc::Sender<Result<Started, String>>,
    ops: Ops,
    cluster_view: Option<ClusterView>,
    connections: ConnectionCount,
}

/// One shard, on its own executor: listens, connects the mesh, opens and recovers its store,
/// starts its loops, reports itself started, serves clients until shutdown, then drains.
async fn shard_main(
    start: ShardStart,
    peer_senders: Vec<Option<SharedSender<ShardMsg>>>,
    peer_receivers: Vec<SharedReceiver<ShardMsg>>,
) {
    let shard_id = start.shard_id;
    let fail = |e: String| {
        let _ = start.started.send(Err(format!("shard {shard_id}: {e}")));
    };
    let shared = match glommio::net::TcpListener::bind(start.listen) {
        Ok(l) => l,
        Err(e) => return fail(format!("cannot listen on {}: {e}", start.listen)),
    };
    let own = match glommio::net::TcpListener::bind(start.own_addr) {
        Ok(l) => l,
        Err(e) => return fail(format!("cannot listen on {}: {e}", start.own_addr)),
    };
    let (peers, inbound) = connect_mesh(peer_senders, peer_receivers, start.count).await;
    let (shard, kicks) = match open_shard(&start, peers).await {
        Ok(opened) => opened,
        Err(e) => return fail(e),
    };
    spawn_loops(&shard, kicks, inbound, &start.ops);

    // The first snapshot before the shard reports itself started: `/healthz` turns 200 as soon
    // as every shard listens, not a metrics interval later.
    shard.publish_snapshot(&start.ops.slots);
    let shared_addr = shared.local_addr().unwrap_or(start.listen);
    let own_bound = own.local_addr().unwrap_or(start.own_addr);
    let _ = start.started.send(Ok(Started {
        shard: shard_id,
        shared: shared_addr,
        own: own_bound,
    }));
    tracing::debug!(shard = %shard_id, %shared_addr, %own_bound, "shard listening");
    inject_panic_if_asked(shard_id);
    end_a_task_if_asked(&shard);
    serve_clients(&shard, &start, shared, own).await;
    shard
        .shut_down(std::time::Instant::now() + shutdown::DRAIN_MAX)
        .await;
    shard.publish_snapshot(&start.ops.slots);
}

/// This shard's ends of the mesh: a sender per peer shard (`None` for itself) and a receiver
/// from each.
async fn connect_mesh(
    peer_senders: Vec<Option<SharedSender<ShardMsg>>>,
    peer_receivers: Vec<SharedReceiver<ShardMsg>>,
    count: usize,
) -> (
    Vec<Option<glommio::channels::shared_channel::ConnectedSender<ShardMsg>>>,
    Vec<ConnectedReceiver<ShardMsg>>,
) {
    // Both ends of a channel wait for each other to connect: connect the receiving ends in
    // their own tasks first, or two shards would wait on each other forever.
    let receiving: Vec<_> = peer_receivers
        .into_iter()
        .map(|receiver| glommio::spawn_local(async move { receiver.connect().await }))
        .collect();
    let mut peers = Vec::with_capacity(count);
    for sender in peer_senders {
        peers.push(match sender {
            Some(s) => Some(s.connect().await),
            None => None,
        });
    }
    let mut inbound: Vec<ConnectedReceiver<ShardMsg>> = Vec::with_capacity(count);
    for task in receiving {
        inbound.push(task.await);
    }
    (peers, inbound)
}

/// The kicks of a shard's dispatcher and deleter loops.
type Kicks = (LocalReceiver<()>, LocalReceiver<()>);

/// Opens the shard's store and builds the shard over it: recovered state, sequences, copy
/// records and group policies loaded, its Raft replica started in a cluster.
async fn open_shard(
    start: &ShardStart,
    peers: Vec<Option<glommio::channels::shared_channel::ConnectedSender<ShardMsg>>>,
) -> Result<(Rc<Shard>, Kicks), String> {
    let config = &start.config;
    let (store, outbox) = open_store(config, start.shard_id)
        .await
        .map_err(|e| format!("cannot open storage: {e}"))?;
    let core = ShardCore::new(config.delivery.clone(), now_ms())
        .with_dedup_limits(crate::pipeline::dedup::DedupLimits::from(&config.publish));
    let (dispatcher, dispatcher_kicks) = Kick::new();
    let (deleter, deleter_kicks) = Kick::new();
    let mut shard = Shard::new(
        start.shard_id,
        start.count,
        core,
        store,
        config.delivery.clone(),
        peers,
        dispatcher,
        deleter,
        start.ops.shutdown.clone(),
    );
    shard = shard.with_publish(config.publish.clone());
    if let Some(view) = start.cluster_view.clone() {
        shard = shard.with_cluster(view);
    }
    let shard = Rc::new(shard);
    drive::recover(&shard.core, &shard.store);
    shard.load_sequences().await;
    shard.load_copies().await;
    drive::recover_policies(&shard.core, &shard.store)
        .await
        .map_err(|e| format!("cannot read group policies: {e}"))?;
    if let Some(outbox) = outbox {
        let node_tls = start.topology.security.node.clone();
        start_cluster(&shard, config, node_tls, outbox)?;
    }
    Ok((shard, (dispatcher_kicks, deleter_kicks)))
}

/// Starts the shard's long-lived loops. Every one is supervised: one that returns outside a
/// shutdown stops the node.
fn spawn_loops(
    shard: &Rc<Shard>,
    (dispatcher_kicks, deleter_kicks): Kicks,
    inbound: Vec<ConnectedReceiver<ShardMsg>>,
    ops: &Ops,
) {
    let background = glommio::executor().create_task_queue(
        glommio::Shares::Static(100),
        glommio::Latency::NotImportant,
        "pinq-background",
    );
    type Task = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;
    let supervised = |what: &'static str, task: Task| shard.clone().supervised(what, task);
    glommio::spawn_local(supervised(
        "the dispatch loop",
        Box::pin(shard.clone().dispatch_loop(dispatcher_kicks)),
    ))
    .detach();
    // Deletes run beside dispatch, not in the background queue: a deleter starved by the
    // foreground lets ACKed messages pile up until the backlog bound pauses dispatch.
    glommio::spawn_local(supervised(
        "the deleter loop",
        Box::pin(shard.clone().deleter_loop(deleter_kicks)),
    ))
    .detach();
    let janitor = supervised("the janitor loop", Box::pin(shard.clone().janitor_loop()));
    let _ = glommio::spawn_local_into(janitor, background).map(|t| t.detach());
    let metrics_loop = supervised(
        "the metrics loop",
        Box::pin(shard.clone().metrics_loop(ops.slots.clone())),
    );
    let _ = glommio::spawn_local_into(metrics_loop, background).map(|t| t.detach());
    for receiver in inbound {
        let receiving = {
            let shard = shard.clone();
            async move {
                while let Some(msg) = receiver.recv().await {
                    shard.on_message(msg).await;
                }
            }
        };
        glommio::spawn_local(supervised("a mesh receive loop", Box::pin(receiving))).detach();
    }
}

/// Accepts clients on the shared and the shard's own port until shutdown is requested. The
/// accept loops never end on their own: the shutdown flag ends them, and dropping them closes
/// both listeners before the shard drains.
async fn serve_clients(
    shard: &Rc<Shard>,
    start: &ShardStart,
    shared: glommio::net::TcpListener,
    own: glommio::net::TcpListener,
) {
    let config = &start.config;
    let edge = EdgeLimits::new(
        config.server.client,
        &config.publish,
        start.connections.clone(),
        shard.count,
    );
    shard.set_edge(edge.clone());
    let accepting = futures_lite::future::zip(
        accept_loop(
            shard.clone(),
            start.topology.clone(),
            edge.clone(),
            shared,
            false,
        ),
        accept_loop(shard.clone(), start.topology.clone(), edge, own, true),
    );
    futures_lite::future::or(
        async {
            accepting.await;
        },
        start.ops.shutdown.requested(),
    )
    .await;
}

/// Fault injection for the tests of what a panic does: `PINQ_FAULT_PANIC_SHARD=N` makes shard
/// `N` panic half a second after it starts serving. Never set in production.
fn inject_panic_if_asked(shard_id: ShardId) {
    let asked = std::env::var("PINQ_FAULT_PANIC_SHARD").ok();
    if asked.and_then(|v| v.parse::<usize>().ok()) != Some(shard_id.get()) {
        return;
    }
    tracing::warn!(
        shard = %shard_id,
        "PINQ_FAULT_PANIC_SHARD is set: this shard will panic"
    );
    glommio::spawn_local(async move {
        glommio::timer::sleep(std::time::Duration::from_millis(500)).await;
        panic!("fault injected by PINQ_FAULT_PANIC_SHARD={shard_id}");
    })
    .detach();
}

/// Fault injection for the test of the one failure rule: `PINQ_FAULT_END_TASK_SHARD=N` makes
/// shard `N` run a supervised task that returns half a second after the shard starts serving,
/// as a long-lived task that ended by mistake would. Never set in production.
fn end_a_task_if_asked(shard: &Rc<Shard>) {
    let asked = std::env::var("PINQ_FAULT_END_TASK_SHARD").ok();
    if asked.and_then(|v| v.parse::<usize>().ok()) != Some(shard.id.get()) {
        return;
    }
    tracing::warn!(
        shard = %shard.id,
        "PINQ_FAULT_END_TASK_SHARD is set: a task of this shard will end"
    );
    let ends = Box::pin(glommio::timer::sleep(std::time::Duration::from_millis(500)));
    let task = async move {
        ends.await;
    };
    glommio::spawn_local(shard.clone().supervised("an injected task", task)).detach();
}

/// Opens the shard's store: standalone, the engine `storage.engine` names; in a cluster, the
/// replicated store, with the channel its Raft messages for peers come out of.
async fn open_store(
    config: &Config,
    shard_id: ShardId,
) -> Result<
    (
        ShardStore,
        Option<LocalReceiver<Vec<raft::eraftpb::Message>>>,
    ),
    crate::storage::StoreError,
> {
    let data_dir = &config.server.data_dir;
    let Some(cluster) = &config.cluster else {
        return Ok((
            ShardStore::open(&config.storage, data_dir, shard_id.get()).await?,
            None,
        ));
    };
    let (tx, rx) = local_channel::new_bounded(OUTBOX_MESSAGES_MAX);
    let store = ShardStore::open_replicated(
        &config.storage,
        data_dir,
        shard_id.get(),
        driver_config(cluster),
        tx,
    )
    .await?;
    Ok((store, Some(rx)))
}

/// The replica settings `[cluster]` gives every shard.
fn driver_config(cluster: &ClusterConfig) -> DriverConfig {
    DriverConfig {
        replica: ReplicaConfig {
            id: cluster.node_id,
            // A joining node starts as nobody's member: its first state comes in a snapshot.
            voters: match cluster.join {
                Some(_) => Vec::new(),
                None => cluster.peers.keys().copied().collect(),
            },
            election_ticks: cluster.election_ticks,
            heartbeat_ticks: cluster.heartbeat_ticks,
            max_message_bytes: (cluster.entry_bytes_max() as u64).min(APPEND_MESSAGE_BYTES_MAX),
            max_inflight_messages: APPEND_MESSAGES_IN_FLIGHT,
            // Half the election timeout: see `crate::cluster::leadership` for why it holds.
            lease_ms: (cluster.election_timeout() / 2).as_millis() as u64,
        },
        tick: cluster.tick_interval,
        log_retain_entries: cluster.log_retain_entries,
        entry_bytes_max: cluster.entry_bytes_max(),
    }
}

/// Entries of one append message to a follower, in bytes (at least one entry is always sent).
const APPEND_MESSAGE_BYTES_MAX: u64 = 1 << 20;
/// Append messages in flight to one follower.
const APPEND_MESSAGES_IN_FLIGHT: usize = 256;

/// Starts a cluster shard's tasks: the role watcher, its own transport (fed by its replica's
/// outbox, stepping its replica with what peers send, all on this core) kept in step with the
/// membership; on shard 0 also the node's one Raft port, whose connections it hands to their
/// shards, and the view's and address book's sync.
fn start_cluster(
    shard: &Rc<Shard>,
    config: &Config,
    node_tls: Option<Arc<crate::security::node::NodeTls>>,
    outbox: LocalReceiver<Vec<raft::eraftpb::Message>>,
) -> Result<(), String> {
    let roles = shard.clone().role_loop();
    glommio::spawn_local(shard.clone().supervised("the role watcher", roles)).detach();
    if let (Some(store), Some(view)) = (shard.replicated().cloned(), shard.cluster.clone()) {
        glommio::spawn_local(membership::watch_shard(shard.id, store, view)).detach();
    }
    let Some(cluster) = &config.cluster else {
        return Ok(());
    };
    let transport = start_transport(shard, cluster, node_tls)?;
    let raft_out = shard.clone().raft_out_loop(outbox);
    glommio::spawn_local(shard.clone().supervised("the raft sender loop", raft_out)).detach();
    let Some(view) = shard.cluster.clone() else {
        return Ok(());
    };
    let sync = membership::sync_transport(shard.id, view.clone(), transport.clone());
    glommio::spawn_local(sync).detach();
    if shard.id != ShardId::FIRST {
        return Ok(());
    }
    let weak = Rc::downgrade(shard);
    let handoff: crate::cluster::transport::Handoff = Rc::new(move |to, accepted| {
        weak.upgrade()
            .is_some_and(|shard| shard.hand_raft_connection(ShardId::from_wire(to), accepted))
    });
    transport
        .listen(cluster.raft_listen, handoff)
        .map_err(|e| {
            format!(
                "cannot start the cluster transport on {}: {e}",
                cluster.raft_listen
            )
        })?;
    let sync = membership::sync_members(
        view,
        transport,
        config.server.data_dir.clone(),
        cluster.node_id,
    );
    glommio::spawn_local(sync).detach();
    Ok(())
}

/// This shard's transport, stepping its replica with what peers send.
fn start_transport(
    shard: &Rc<Shard>,
    cluster: &ClusterConfig,
    node_tls: Option<Arc<crate::security::node::NodeTls>>,
) -> Result<Rc<Transport>, String> {
    let weak = Rc::downgrade(shard);
    let inbound: Rc<dyn Fn(u64, raft::eraftpb::Message)> = Rc::new(move |_from, message| {
        if let Some(store) = weak.upgrade().as_ref().and_then(|s| s.replicated()) {
            store.step(message);
        }
    });
    let place = ShardPlace {
        index: shard.id.to_wire(),
        count: shard.count as u32,
    };
    let transport = Transport::start(cluster, place, node_tls, inbound).map_err(|e| {
        format!(
            "cannot start the cluster transport of shard {}: {e}",
            shard.id
        )
    })?;
    *shard.transport.borrow_mut() = Some(transport.clone());
    Ok(transport)
}

/// Accepts clients until dropped. A connection beyond `server.maxConnections` is handed to
/// [`connection::refuse`], which answers it with `tooManyConnections`. A failed accept (EMFILE:
/// out of file descriptors) backs off, doubling up to 1 s, and is logged at most once per
/// [`limits::ACCEPT_ERROR_LOG_INTERVAL_MS`] with the count of the failures not logged.
async fn accept_loop(
    shard: Rc<Shard>,
    topology: Topology,
    edge: Rc<EdgeLimits>,
    listener: glommio::net::TcpListener,
    own_port: bool,
) {
    let mut log = crate::ops::ratelimit::RateLimit::new(limits::ACCEPT_ERROR_LOG_INTERVAL_MS);
    let mut backoff = Backoff::default();
    loop {
        match listener.accept().await {
            Ok(stream) => {
                backoff.succeeded();
                let Some(slot) = edge.connections.try_open() else {
                    let tls = topology.security.tls.clone();
                    connection::refuse(shard.clone(), edge.clone(), tls, stream);
                    continue;
                };
                glommio::spawn_local(connection::serve(
                    shard.clone(),
                    topology.clone(),
                    edge.clone(),
                    slot,
                    stream,
                    own_port,
                ))
                .detach();
            }
            Err(e) => {
                let pause = backoff.failed();
                if let Some(suppressed) = log.admit(now_ms()) {
                    tracing::warn!(
                        shard = %shard.id,
                        suppressed,
                        "accept failed: {e}; retrying in {pause:?} ({suppressed} more failures since the last line)"
                    );
                }
                glommio::timer::sleep(pause).await;
            }
        }
    }
}
