//! The glommio shell of `pinq bench`: client threads that open the connections, publish the
//! plan's messages and consume them, and the main thread's timeline (start, warm-up, measure,
//! drain, stop).
//!
//! Each client thread is one glommio executor, not pinned, holding some of the producers and
//! consumers (one connection each). Threads share only the delivery [`Tracker`] (locked once per
//! delivery batch), a few atomics and the start time; each keeps its own histograms and hands
//! them back when it ends. Every decision (what to send, when, to which topic, whether to nack)
//! comes from the pure [`Plan`]; this file only reads the clock and moves bytes.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use crossbeam_utils::CachePadded;
use futures_lite::future;
use glommio::channels::local_channel;
use glommio::{LocalExecutorBuilder, Placement};
use hdrhistogram::Histogram;

use super::plan::{Plan, Stamp};
use super::report::latency_histogram;
use super::tracker::{Tally, Tracker};
use crate::client::{
    AckGroup, AckLevel, Client, ClientError, Pending, PublishMessage, Router, RouterOptions,
    Subscription,
};

/// How often an idle consumer or the main thread looks at the stop flag and the counts.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Deliveries a consumer takes from its queue at once.
const CONSUME_BATCH_MAX: usize = 1024;
/// Ack or nack calls a consumer keeps in flight.
const ACK_WINDOW: usize = 8;
/// Errors kept per thread for the report (the rest are only counted).
const ERRORS_KEPT_MAX: usize = 4;
/// How long a producer waits when the backlog is full before looking again.
const BACKLOG_PAUSE: Duration = Duration::from_micros(200);
/// Most messages one producer may send in a run: bounds the tracker's memory.
const SEQ_MAX: u64 = 1 << 32;

/// How the load runs, beyond the workload itself.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub plan: Plan,
    pub client_threads: usize,
    /// CPUs the client threads are pinned to, round robin; empty: not pinned.
    pub client_cpus: Vec<usize>,
    /// `queue_size` of each subscription (0: the broker's default).
    pub consumer_queue_len: u32,
    /// Consumers group ACKs into one call per this window (0: one call per delivered batch).
    pub ack_group: Duration,
    /// Client executors spin this long before sleeping (`pinq bench --client-idle-poll`).
    pub client_idle_poll: Duration,
    pub ack_level: AckLevel,
    /// Level of the consumers' ACKs and NACKs (`pinq bench --ack-level`).
    pub settle_level: AckLevel,
    /// How long after sending ends the bench waits for the last deliveries (beyond the longest
    /// delay of the mix).
    pub drain_timeout: Duration,
    /// At max rate, producers pause while more than this many message copies are sent and not
    /// yet delivered (0: never), so the figure is the rate the consumers sustain, with a latency
    /// that does not grow with the run's length.
    pub backlog_max: u64,
    /// TLS and token of every connection (`--tls-ca`, `--token-file`, …).
    pub security: crate::security::client::ClientSecurity,
}

/// Latency histograms (µs) of a thread, then of the whole run.
pub struct Latencies {
    pub e2e: Histogram<u64>,
    pub publish_ack: Histogram<u64>,
    pub ack: Histogram<u64>,
    /// At a fixed rate, how late the load generator sent each message after its intended
    /// time (µs): the part of every latency above that is the bench's own, not the broker's.
    pub send_lateness: Histogram<u64>,
}

impl Latencies {
    fn new() -> Latencies {
        Latencies {
            e2e: latency_histogram(),
            publish_ack: latency_histogram(),
            ack: latency_histogram(),
            send_lateness: latency_histogram(),
        }
    }

    fn add(&mut self, other: &Latencies) {
        // Same bounds everywhere, so adding cannot fail; saturate rather than lose a run if not.
        let _ = self.e2e.add(&other.e2e);
        let _ = self.publish_ack.add(&other.publish_ack);
        let _ = self.ack.add(&other.ack);
        let _ = self.send_lateness.add(&other.send_lateness);
    }
}

/// What a load run measured.
pub struct LoadOutcome {
    pub tally: Tally,
    pub latencies: Latencies,
    /// First deliveries received in the measured window.
    pub received_in_window: u64,
    pub window_secs: f64,
    /// Errors of calls (publish, ack), counted; a few are kept as text.
    pub errors: u64,
    pub error_samples: Vec<String>,
    /// What the caller's hook returned at the start and the end of the window and at the end of
    /// the drain (the broker's CPU seconds).
    pub measured: Vec<f64>,
    /// Seconds from the end of sending to the end of the drain.
    pub drain_secs: f64,
}

/// State every client thread shares.
struct Shared {
    plan: Plan,
    tracker: Mutex<Tracker>,
    foreign: AtomicU64,
    /// Messages each producer sent, set when it finishes.
    sent: Vec<AtomicU64>,
    producers_done: AtomicU32,
    stop: AtomicBool,
    received_in_window: AtomicU64,
    errors: AtomicU64,
    /// Message copies sent (messages × receivers) and first deliveries seen, for the backlog.
    /// Producer threads add to the first and consumer threads to the second on every batch, so
    /// each sits on its own cache line: side by side, every add on one side would evict the line
    /// the other side is writing, and the load generator would measure its own false sharing.
    copies_sent: CachePadded<AtomicU64>,
    copies_delivered: CachePadded<AtomicU64>,
}

impl Shared {
    fn error(&self, samples: &RefCell<Vec<String>>, what: &str, e: &ClientError) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut samples = samples.borrow_mut();
        if samples.len() < ERRORS_KEPT_MAX {
            samples.push(format!("{what}: {e}"));
        }
    }
}

/// The work of one client thread.
#[derive(Clone, Debug, Default)]
struct Assignment {
    producers: Vec<u32>,
    /// (receiver index, group name or "" for a universal consumer).
    consumers: Vec<(usize, String)>,
}

/// Splits producers and consumers over the client threads, round robin.
fn assign(plan: &Plan, threads: usize) -> Vec<Assignment> {
    let threads = threads.max(1);
    let mut work = vec![Assignment::default(); threads];
    let mut next = 0usize;
    for p in 0..plan.producers {
        work[next % threads].producers.push(p);
        next += 1;
    }
    let grouped = if plan.consumers_per_group == 0 {
        0
    } else {
        plan.groups
    };
    for g in 0..grouped {
        for _ in 0..plan.consumers_per_group {
            work[next % threads]
                .consumers
                .push((g as usize, plan.group(g)));
            next += 1;
        }
    }
    for u in 0..plan.universal {
        work[next % threads]
            .consumers
            .push(((grouped + u) as usize, String::new()));
        next += 1;
    }
    work.retain(|w| !w.producers.is_empty() || !w.consumers.is_empty());
    work
}

fn elapsed_ns(origin: Instant) -> u64 {
    origin.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64
}

/// Runs the load against the broker at `addr`. `on_window` is called on the main thread at the
/// start and at the end of the measured window (to sample the broker's CPU time).
pub fn run_load(
    addr: &str,
    options: &LoadOptions,
    mut on_window: impl FnMut() -> f64,
) -> anyhow::Result<LoadOutcome> {
    let plan = options.plan.clone();
    let shared = Arc::new(Shared {
        tracker: Mutex::new(Tracker::new(
            plan.receivers() as usize,
            plan.producers as usize,
            SEQ_MAX,
        )),
        foreign: AtomicU64::new(0),
        sent: (0..plan.producers).map(|_| AtomicU64::new(0)).collect(),
        producers_done: AtomicU32::new(0),
        stop: AtomicBool::new(false),
        received_in_window: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        copies_sent: CachePadded::new(AtomicU64::new(0)),
        copies_delivered: CachePadded::new(AtomicU64::new(0)),
        plan: plan.clone(),
    });
    let origin = Instant::now();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let mut go_senders = Vec::new();
    let mut handles = Vec::new();
    for (index, work) in assign(&plan, options.client_threads)
        .into_iter()
        .enumerate()
    {
        let (go_tx, go_rx) = mpsc::channel::<u64>();
        go_senders.push(go_tx);
        let shared = shared.clone();
        let ready = ready_tx.clone();
        let addr = addr.to_owned();
        let options = options.clone();
        let placement = match options.client_cpus.as_slice() {
            [] => Placement::Unbound,
            cpus => Placement::Fixed(cpus[index % cpus.len()]),
        };
        let mut builder = LocalExecutorBuilder::new(placement).name(&format!("pinq-bench-{index}"));
        if !options.client_idle_poll.is_zero() {
            builder = builder.spin_before_park(options.client_idle_poll);
        }
        let handle = builder
            .spawn(move || async move {
                client_thread(work, shared, addr, options, origin, ready, go_rx).await
            })
            .map_err(|e| anyhow::anyhow!("starting bench client thread {index}: {e}"))?;
        handles.push(handle);
    }
    drop(ready_tx);

    // Every connection open and every consumer subscribed before the first message.
    let mut setup_error = None;
    for _ in 0..handles.len() {
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                setup_error = Some(e);
                break;
            }
            Err(_) => {
                setup_error = Some("a client thread stopped during set-up".to_owned());
                break;
            }
        }
    }
    if let Some(e) = setup_error {
        shared.stop.store(true, Ordering::Relaxed);
        drop(go_senders);
        for h in handles {
            let _ = h.join();
        }
        anyhow::bail!(e);
    }
    let start_ns = elapsed_ns(origin) + 5_000_000;
    for go in &go_senders {
        let _ = go.send(start_ns);
    }
    let measure_start = plan.measure_start_ns(start_ns);
    let send_end = plan.send_end_ns(start_ns);

    let mut measured = Vec::with_capacity(3);
    sleep_until(origin, measure_start);
    measured.push(on_window());
    sleep_until(origin, send_end);
    measured.push(on_window());

    // Drain: until every copy arrived or the deadline passed.
    let deadline =
        send_end + options.drain_timeout.as_nanos() as u64 + plan.delays.delay_ms_max() * 1_000_000;
    loop {
        let producers_done = shared.producers_done.load(Ordering::Acquire) == plan.producers;
        if producers_done {
            let sent: u64 = shared.sent.iter().map(|s| s.load(Ordering::Acquire)).sum();
            let expected = sent * u64::from(plan.receivers());
            let distinct = shared.tracker.lock().map(|t| t.distinct()).unwrap_or(0);
            if distinct >= expected {
                break;
            }
        }
        if elapsed_ns(origin) >= deadline {
            tracing::warn!("drain timeout: stopping with deliveries outstanding");
            break;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    shared.stop.store(true, Ordering::Release);
    measured.push(on_window());
    let drain_secs = elapsed_ns(origin).saturating_sub(send_end) as f64 / 1e9;

    let mut latencies = Latencies::new();
    let mut error_samples = Vec::new();
    for handle in handles {
        match handle.join() {
            Ok(Ok((thread_latencies, samples))) => {
                latencies.add(&thread_latencies);
                error_samples.extend(samples);
            }
            Ok(Err(e)) => error_samples.push(format!("{e:#}")),
            Err(e) => error_samples.push(format!("client thread failed: {e}")),
        }
    }
    let sent: Vec<u64> = shared
        .sent
        .iter()
        .map(|s| s.load(Ordering::Acquire))
        .collect();
    let tally = shared
        .tracker
        .lock()
        .map_err(|_| anyhow::anyhow!("a client thread panicked while counting deliveries"))?
        .tally(&sent, shared.foreign.load(Ordering::Relaxed));
    Ok(LoadOutcome {
        tally,
        latencies,
        received_in_window: shared.received_in_window.load(Ordering::Relaxed),
        window_secs: plan.duration.as_secs_f64(),
        errors: shared.errors.load(Ordering::Relaxed),
        error_samples,
        measured,
        drain_secs,
    })
}

fn sleep_until(origin: Instant, ns: u64) {
    let now = elapsed_ns(origin);
    if ns > now {
        std::thread::sleep(Duration::from_nanos(ns - now));
    }
}

type ThreadResult = anyhow::Result<(Latencies, Vec<String>)>;

/// One client thread: connect and subscribe, report ready, wait for the start, run the load.
async fn client_thread(
    work: Assignment,
    shared: Arc<Shared>,
    addr: String,
    options: LoadOptions,
    origin: Instant,
    ready: mpsc::Sender<Result<(), String>>,
    go: mpsc::Receiver<u64>,
) -> ThreadResult {
    let plan = &shared.plan;
    // One topic: talk to its owner shard directly, as a client that cares about latency does.
    let first_topic = plan.topic(0);
    let connect = || async {
        // In a cluster the first topic's shard may be led by another node than `addr`.
        let mut router_options = RouterOptions::default();
        router_options.client.security = options.security.clone();
        let router = Router::connect(addr.as_str(), router_options)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let client = router
            .client_for(router.shard_of(&first_topic))
            .await
            .with_context(|| format!("finding the leader of {first_topic} from {addr}"))?;
        if plan.topics == 1 && client.server().shard_count > 1 {
            return client
                .connect_to_owner(&first_topic)
                .await
                .context("connecting to the topic's owner shard");
        }
        Ok::<Client, anyhow::Error>(client)
    };
    let setup = async {
        let mut subscriptions = Vec::new();
        for (receiver, group) in &work.consumers {
            let client = connect().await?;
            for t in 0..plan.topics {
                let sub = client
                    .subscribe(&plan.topic(t), group, options.consumer_queue_len)
                    .await
                    .with_context(|| format!("subscribing to {}", plan.topic(t)))?;
                subscriptions.push((*receiver, sub));
            }
        }
        let mut producers = Vec::new();
        for &p in &work.producers {
            producers.push((p, connect().await?));
        }
        Ok::<_, anyhow::Error>((subscriptions, producers))
    };
    let (subscriptions, producers) = match setup.await {
        Ok(v) => {
            let _ = ready.send(Ok(()));
            v
        }
        Err(e) => {
            let _ = ready.send(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    let Ok(start_ns) = go.recv() else {
        return Ok((Latencies::new(), Vec::new()));
    };

    let latencies = Rc::new(RefCell::new(Latencies::new()));
    let samples = Rc::new(RefCell::new(Vec::new()));
    let mut tasks = Vec::new();
    for (receiver, sub) in subscriptions {
        sub.set_ack_level(options.settle_level);
        let acks = (!options.ack_group.is_zero())
            .then(|| sub.ack_group(options.ack_group, CONSUME_BATCH_MAX));
        tasks.push(glommio::spawn_local(consume(
            Receiving {
                sub,
                receiver,
                acks,
            },
            shared.clone(),
            latencies.clone(),
            samples.clone(),
            origin,
            start_ns,
        )));
    }
    for (producer, client) in producers {
        tasks.push(glommio::spawn_local(produce(
            client,
            producer,
            shared.clone(),
            options.ack_level,
            options.backlog_max,
            latencies.clone(),
            samples.clone(),
            origin,
            start_ns,
        )));
    }
    for task in tasks {
        task.await;
    }
    let latencies = std::mem::replace(&mut *latencies.borrow_mut(), Latencies::new());
    let samples = std::mem::take(&mut *samples.borrow_mut());
    Ok((latencies, samples))
}

/// A publish batch in flight: its reply, first sequence number, length and send time.
type InFlightBatch = (Pending<Vec<crate::client::EventKey>>, u64, usize, u64);

#[allow(clippy::too_many_arguments)]
async fn produce(
    client: Client,
    producer: u32,
    shared: Arc<Shared>,
    ack_level: AckLevel,
    backlog_max: u64,
    latencies: Rc<RefCell<Latencies>>,
    samples: Rc<RefCell<Vec<String>>>,
    origin: Instant,
    start_ns: u64,
) {
    let plan = &shared.plan;
    let measure_start = plan.measure_start_ns(start_ns);
    let send_end = plan.send_end_ns(start_ns);
    let topics: Vec<String> = (0..plan.topics).map(|t| plan.topic(t)).collect();
    // The batch buffer is reused: `publish` encodes the messages before it returns.
    let mut batch: Vec<PublishMessage> = (0..plan.batch_len_max)
        .map(|_| PublishMessage::new(String::new(), vec![0u8; plan.payload_bytes]))
        .collect();

    let (tx, rx) = local_channel::new_bounded::<InFlightBatch>(plan.publish_window);
    let replies = {
        let shared = shared.clone();
        let latencies = latencies.clone();
        glommio::spawn_local(async move {
            let plan = &shared.plan;
            while let Some((reply, first_seq, len, sent_ns)) = rx.recv().await {
                let result = reply.await;
                let now = elapsed_ns(origin);
                if let Err(e) = result {
                    shared.error(&samples, "publish", &e);
                    continue;
                }
                let mut l = latencies.borrow_mut();
                match plan.rate_per_sec {
                    // Each message from the time it was due to be sent.
                    Some(_) => {
                        for seq in first_seq..first_seq + len as u64 {
                            let due = plan
                                .intended_send_ns(start_ns, producer, seq)
                                .unwrap_or(sent_ns);
                            if due >= measure_start {
                                l.publish_ack
                                    .saturating_record(now.saturating_sub(due) / 1000);
                            }
                        }
                    }
                    None if sent_ns >= measure_start => {
                        l.publish_ack
                            .saturating_record_n(now.saturating_sub(sent_ns) / 1000, len as u64);
                    }
                    None => {}
                }
            }
        })
    };

    let mut seq = 0u64;
    loop {
        let now = elapsed_ns(origin);
        // At a fixed rate every message due before the end is sent, late or not (its latency
        // counts from when it was due); at max rate sending stops at the end.
        let finished = match plan.intended_send_ns(start_ns, producer, seq) {
            Some(due) => due >= send_end,
            None => now >= send_end,
        };
        if finished || seq >= SEQ_MAX {
            break;
        }
        let len = match plan.rate_per_sec {
            None if backlog_max > 0
                && shared
                    .copies_sent
                    .load(Ordering::Relaxed)
                    .saturating_sub(shared.copies_delivered.load(Ordering::Relaxed))
                    > backlog_max =>
            {
                glommio::timer::sleep(BACKLOG_PAUSE).await;
                continue;
            }
            None => plan.batch_len_max,
            Some(_) => {
                let mut due = 0usize;
                while due < plan.batch_len_max
                    && plan
                        .intended_send_ns(start_ns, producer, seq + due as u64)
                        .is_some_and(|t| t <= now && t < send_end)
                {
                    due += 1;
                }
                if due == 0 {
                    let next = plan
                        .intended_send_ns(start_ns, producer, seq)
                        .unwrap_or(now)
                        .min(send_end);
                    glommio::timer::sleep(Duration::from_nanos(next.saturating_sub(now))).await;
                    continue;
                }
                due
            }
        };
        for (i, m) in batch[..len].iter_mut().enumerate() {
            let s = seq + i as u64;
            if let Some(due) = plan.intended_send_ns(start_ns, producer, s) {
                if due >= measure_start {
                    latencies
                        .borrow_mut()
                        .send_lateness
                        .saturating_record(now.saturating_sub(due) / 1000);
                }
            }
            m.topic.clear();
            m.topic
                .push_str(&topics[plan.topic_of(producer, s) as usize]);
            let delay_ms = plan.delays.delay_ms(plan.seed, producer, s);
            m.delay_ms = delay_ms;
            Stamp {
                producer,
                seq: s,
                sent_ns: plan.intended_send_ns(start_ns, producer, s).unwrap_or(now),
                delay_ms,
            }
            .write(&mut m.payload);
        }
        let reply = client.publish(&batch[..len], ack_level);
        shared
            .copies_sent
            .fetch_add(len as u64 * u64::from(plan.receivers()), Ordering::Relaxed);
        if tx.send((reply, seq, len, now)).await.is_err() {
            break;
        }
        seq += len as u64;
    }
    drop(tx);
    replies.await;
    shared.sent[producer as usize].store(seq, Ordering::Release);
    shared.producers_done.fetch_add(1, Ordering::AcqRel);
}

/// An ack or nack call in flight and when it was sent.
type InFlightSettle = (Pending<Vec<crate::client::TagResult>>, u64);

/// One consumer's subscription, its index among the receivers, and its ACK grouping if any.
struct Receiving {
    sub: Subscription,
    receiver: usize,
    acks: Option<AckGroup>,
}

impl Receiving {
    fn ack(&self, tags: &[crate::client::EventKey]) -> Pending<Vec<crate::client::TagResult>> {
        match &self.acks {
            Some(group) => group.ack(tags),
            None => self.sub.ack(tags),
        }
    }
}

async fn consume(
    receiving: Receiving,
    shared: Arc<Shared>,
    latencies: Rc<RefCell<Latencies>>,
    samples: Rc<RefCell<Vec<String>>>,
    origin: Instant,
    start_ns: u64,
) {
    let plan = &shared.plan;
    let measure_start = plan.measure_start_ns(start_ns);
    let send_end = plan.send_end_ns(start_ns);
    let (tx, rx) = local_channel::new_bounded::<InFlightSettle>(ACK_WINDOW);
    let replies = {
        let shared = shared.clone();
        let latencies = latencies.clone();
        let samples = samples.clone();
        glommio::spawn_local(async move {
            while let Some((reply, sent_ns)) = rx.recv().await {
                let result = reply.await;
                let now = elapsed_ns(origin);
                match result {
                    Ok(_) if sent_ns >= measure_start && sent_ns < send_end => latencies
                        .borrow_mut()
                        .ack
                        .saturating_record(now.saturating_sub(sent_ns) / 1000),
                    Ok(_) => {}
                    Err(e) => shared.error(&samples, "ack", &e),
                }
            }
        })
    };
    let mut acks = Vec::with_capacity(CONSUME_BATCH_MAX);
    let mut nacks = Vec::new();
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let batch = future::or(
            async { Some(receiving.sub.recv_batch(CONSUME_BATCH_MAX).await) },
            async {
                glommio::timer::sleep(POLL_INTERVAL).await;
                None
            },
        )
        .await;
        let batch = match batch {
            None => continue,
            Some(Ok(batch)) => batch,
            Some(Err(e)) => {
                // The subscription is over: the broker ended it or the connection is gone.
                if !shared.stop.load(Ordering::Acquire) {
                    shared.error(&samples, "consume", &e);
                }
                break;
            }
        };
        let now = elapsed_ns(origin);
        acks.clear();
        nacks.clear();
        let mut in_window = 0u64;
        let mut first_deliveries = 0u64;
        let mut foreign = 0u64;
        {
            let mut l = latencies.borrow_mut();
            let Ok(mut tracker) = shared.tracker.lock() else {
                break;
            };
            for d in &batch {
                let Some(stamp) = Stamp::read(&d.payload) else {
                    foreign += 1;
                    acks.push(d.tag);
                    continue;
                };
                if !tracker.record(receiving.receiver, stamp.producer, stamp.seq) {
                    foreign += 1;
                }
                if d.attempt <= 1 {
                    first_deliveries += 1;
                    if stamp.sent_ns >= measure_start {
                        l.e2e
                            .saturating_record(now.saturating_sub(stamp.due_ns()) / 1000);
                    }
                    if now >= measure_start && now < send_end {
                        in_window += 1;
                    }
                    if plan.nacks(stamp.producer, stamp.seq) {
                        tracker.note_nack(receiving.receiver);
                        nacks.push(d.tag);
                        continue;
                    }
                }
                acks.push(d.tag);
            }
        }
        shared
            .received_in_window
            .fetch_add(in_window, Ordering::Relaxed);
        shared
            .copies_delivered
            .fetch_add(first_deliveries, Ordering::Relaxed);
        if foreign > 0 {
            shared.foreign.fetch_add(foreign, Ordering::Relaxed);
        }
        if !acks.is_empty() && tx.send((receiving.ack(&acks), now)).await.is_err() {
            break;
        }
        if !nacks.is_empty() && tx.send((receiving.sub.nack(&nacks, 0), now)).await.is_err() {
            break;
        }
    }
    if let Some(group) = &receiving.acks {
        group.flush();
    }
    drop(tx);
    replies.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::plan::DelayMix;

    fn plan() -> Plan {
        Plan {
            producers: 2,
            consumers_per_group: 2,
            groups: 1,
            universal: 3,
            topics: 1,
            payload_bytes: 100,
            delays: DelayMix::immediate(),
            nack_ratio: 0.0,
            rate_per_sec: None,
            warmup: Duration::ZERO,
            duration: Duration::from_secs(1),
            batch_len_max: 16,
            publish_window: 2,
            seed: 1,
            topic_prefix: "t".to_owned(),
        }
    }

    #[test]
    fn assignment_spreads_every_producer_and_consumer_once() {
        let work = assign(&plan(), 2);
        assert_eq!(work.len(), 2);
        let producers: usize = work.iter().map(|w| w.producers.len()).sum();
        let consumers: Vec<(usize, String)> =
            work.iter().flat_map(|w| w.consumers.clone()).collect();
        assert_eq!(producers, 2);
        assert_eq!(consumers.len(), 5);
        let grouped = consumers.iter().filter(|(r, _)| *r == 0).count();
        assert_eq!(grouped, 2);
        // Universal consumers are receivers 1, 2 and 3, with no group.
        for r in 1..=3 {
            assert!(consumers.contains(&(r, String::new())));
        }
        // More threads than tasks: no idle thread is started.
        assert_eq!(assign(&plan(), 64).len(), 7);
    }
}
