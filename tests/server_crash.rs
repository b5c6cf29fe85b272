//! A real `pinq serve --storage lsm` killed with SIGKILL while clients publish durable batches
//! and ACK deliveries, restarted on the same data directory, several seeded times.
//!
//! After each restart a consumer of the group must get every message whose durable publish was
//! acknowledged and that it had not ACKed, and must not get any message whose `durable` ACK
//! (the client's default level) was answered `ok` before the kill, up to the very last one: the
//! ACK's `ok` comes once its delete is fsynced. `delivery.deleteBatchInterval` is 10 s here, so
//! nothing in the test leans on the interval: a `leader` ACK would come back. Only ACKs sent
//! and not answered when the kill came, and publishes whose reply never came, may go either way.
//!
//! Replay a seed with `PINQ_CRASH_SEED=<seed>`.

mod support;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use pinq::client::{AckLevel, Client, PublishMessage, Subscription, TagResult};
use support::Server;

const TOPIC: &str = "crash";
const GROUP: &str = "g";
const ITERATIONS: u32 = 3;
const MESSAGES_PER_BATCH: usize = 10;
const PUBLISH_WINDOW: usize = 4;
/// Batches the last phase publishes at most (it usually is killed first). Bounds the messages
/// left unACKed: after the last restart the one consumer holds all of them in flight, and
/// `delivery.maxUnackedPerConsumer` (16,384 by default) would stop deliveries short of them.
const PHASE_B_BATCHES_MAX: u64 = 300;
/// Pause between the phases (the ACKs of phase A are durable when answered: nothing to wait for).
const SETTLE: Duration = Duration::from_millis(100);
/// After the last expected message arrived, keep listening this long for unexpected ones.
const QUIET: Duration = Duration::from_millis(500);
/// Bound on waiting for the messages that must come back.
const REDELIVERY_WAIT_MAX: Duration = Duration::from_secs(60);

const SERVER_ARGS: &[&str] = &["--cpus", "0", "--storage", "lsm"];
const SERVER_ENV: &[(&str, &str)] = &[
    ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "10s"),
    ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "60s"),
];

/// What the test knows about one message (by payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Publish acknowledged, not ACKed by the consumer: must be delivered after a restart.
    Live,
    /// Publish sent, reply not seen before the kill: may or may not exist.
    MaybePublished,
    /// ACKed at `durable` and answered `ok` before the kill: must never be delivered again.
    AckedSettled,
    /// ACK sent and not answered when the kill came: may come back.
    AckedRecently,
}

type Ledger = Rc<RefCell<BTreeMap<String, Fate>>>;

/// Publishes durable batches (up to `PUBLISH_WINDOW` in flight) until `batches` are done or the
/// broker goes away; records each message's fate.
async fn publish_batches(
    client: &Client,
    ledger: &Ledger,
    iteration: u32,
    first_batch: u64,
    batches: u64,
) -> u64 {
    let mut in_flight = std::collections::VecDeque::new();
    let mut next = first_batch;
    let end = first_batch + batches;
    loop {
        while in_flight.len() < PUBLISH_WINDOW && next < end {
            let payloads: Vec<String> = (0..MESSAGES_PER_BATCH)
                .map(|m| format!("i{iteration}-b{next}-m{m}"))
                .collect();
            let messages: Vec<PublishMessage> = payloads
                .iter()
                .map(|p| PublishMessage::new(TOPIC, p.as_bytes().to_vec()))
                .collect();
            {
                let mut l = ledger.borrow_mut();
                for p in &payloads {
                    l.insert(p.clone(), Fate::MaybePublished);
                }
            }
            in_flight.push_back((payloads, client.publish(&messages, AckLevel::Durable)));
            next += 1;
        }
        let Some((payloads, reply)) = in_flight.pop_front() else {
            return next;
        };
        match reply.await {
            Ok(_) => {
                let mut l = ledger.borrow_mut();
                for p in payloads {
                    if l.get(&p) == Some(&Fate::MaybePublished) {
                        l.insert(p, Fate::Live);
                    }
                }
            }
            // The broker is gone (killed): the rest stay "maybe".
            Err(_) => return next,
        }
    }
}

/// Receives deliveries and ACKs about half of them (seeded, at the client's default level,
/// `durable`), until `stop` is set or the subscription ends. An ACK is recent while it waits for
/// its answer (one in flight at the kill may or may not have been applied), settled once
/// answered `ok`.
async fn consume_and_ack(
    sub: &Subscription,
    ledger: &Ledger,
    rng: &RefCell<fastrand::Rng>,
    stop: &std::cell::Cell<bool>,
) {
    while !stop.get() {
        let batch = futures_lite::future::or(
            async { Some(sub.recv_batch(256).await.unwrap_or_default()) },
            async {
                glommio::timer::sleep(Duration::from_millis(20)).await;
                None
            },
        )
        .await;
        let batch = match batch {
            // Nothing within the tick: look at `stop` again.
            None => continue,
            // The subscription ended (the broker is gone).
            Some(batch) if batch.is_empty() => return,
            Some(batch) => batch,
        };
        let mut tags = Vec::new();
        let mut payloads = Vec::new();
        for d in batch {
            if rng.borrow_mut().bool() {
                tags.push(d.tag);
                payloads.push(String::from_utf8_lossy(&d.payload).into_owned());
            }
        }
        if tags.is_empty() {
            continue;
        }
        {
            let mut l = ledger.borrow_mut();
            for p in &payloads {
                l.insert(p.clone(), Fate::AckedRecently);
            }
        }
        let Ok(results) = sub.ack(&tags).await else {
            return;
        };
        let mut l = ledger.borrow_mut();
        for (p, r) in payloads.into_iter().zip(results) {
            if r == TagResult::Ok {
                l.insert(p, Fate::AckedSettled);
            }
        }
    }
}

/// After a restart: every `Live` message must be delivered, no `AckedSettled` one may be.
/// Returns what was delivered (all of it now in flight to this consumer, so `Live`).
async fn check_redelivery(sub: &Subscription, ledger: &Ledger, seed: u64, iteration: u32) {
    let must: Vec<String> = ledger
        .borrow()
        .iter()
        .filter(|(_, f)| **f == Fate::Live)
        .map(|(p, _)| p.clone())
        .collect();
    let mut missing: std::collections::BTreeSet<String> = must.into_iter().collect();
    let mut delivered = std::collections::BTreeSet::new();
    let started = std::time::Instant::now();
    let mut quiet_since: Option<std::time::Instant> = None;
    loop {
        if missing.is_empty() && quiet_since.is_none() {
            quiet_since = Some(std::time::Instant::now());
        }
        if quiet_since.is_some_and(|q| q.elapsed() >= QUIET) {
            break;
        }
        if started.elapsed() > REDELIVERY_WAIT_MAX {
            panic!(
                "seed {seed} iteration {iteration}: {} acknowledged messages never came back after the restart, e.g. {:?}",
                missing.len(),
                missing.iter().take(5).collect::<Vec<_>>()
            );
        }
        let batch = futures_lite::future::or(
            async { Some(sub.recv_batch(1024).await.unwrap_or_default()) },
            async {
                glommio::timer::sleep(Duration::from_millis(50)).await;
                None
            },
        )
        .await;
        let batch = match batch {
            None => continue,
            Some(batch) if batch.is_empty() => {
                panic!(
                    "seed {seed} iteration {iteration}: the subscription ended after the restart"
                )
            }
            Some(batch) => batch,
        };
        for d in batch {
            let payload = String::from_utf8_lossy(&d.payload).into_owned();
            let fate = ledger.borrow().get(&payload).copied();
            match fate {
                Some(Fate::AckedSettled) => panic!(
                    "seed {seed} iteration {iteration}: {payload} was ACKed and settled before the kill, and was delivered again"
                ),
                None => panic!("seed {seed} iteration {iteration}: unknown message {payload:?}"),
                Some(_) => {}
            }
            missing.remove(&payload);
            delivered.insert(payload);
        }
    }
    // What came back is stored and now in flight to this consumer: it must come back again.
    // What did not come back is gone for good (never written, or deleted).
    let mut l = ledger.borrow_mut();
    for (payload, fate) in l.iter_mut() {
        if delivered.contains(payload) {
            *fate = Fate::Live;
        } else if *fate != Fate::Live {
            *fate = Fate::AckedSettled;
        }
    }
}

/// One life of the server: check what the previous one left, then publish and ACK; if
/// `kill_after` is set, kill the server with SIGKILL that long into the last phase.
fn session(
    addr: String,
    pid: u32,
    ledger: BTreeMap<String, Fate>,
    seed: u64,
    iteration: u32,
    kill_after: Option<Duration>,
) -> BTreeMap<String, Fate> {
    support::on_executor(move || async move {
        let ledger: Ledger = Rc::new(RefCell::new(ledger));
        let rng = RefCell::new(fastrand::Rng::with_seed(seed ^ u64::from(iteration)));
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let sub = client
            .subscribe(TOPIC, GROUP, 4096)
            .await
            .expect("subscribe");
        if iteration > 0 {
            check_redelivery(&sub, &ledger, seed, iteration).await;
        }
        let Some(kill_after) = kill_after else {
            return Rc::try_unwrap(ledger)
                .map(RefCell::into_inner)
                .unwrap_or_default();
        };

        // Phase A: publish and ACK, every ACK awaited.
        let batches_a = rng.borrow_mut().u64(5..30);
        let stop = std::cell::Cell::new(false);
        let next = futures_lite::future::zip(
            async {
                let next = publish_batches(&client, &ledger, iteration, 0, batches_a).await;
                // Give the consumer a moment to take the last deliveries.
                glommio::timer::sleep(Duration::from_millis(100)).await;
                stop.set(true);
                next
            },
            consume_and_ack(&sub, &ledger, &rng, &stop),
        )
        .await
        .0;
        glommio::timer::sleep(SETTLE).await;

        // Phase B: publish and ACK without pause until the kill.
        stop.set(false);
        let killer = async {
            glommio::timer::sleep(kill_after).await;
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            // Let the client notice the broken connection; then stop whatever still runs.
            glommio::timer::sleep(Duration::from_millis(200)).await;
            stop.set(true);
        };
        futures_lite::future::zip(
            killer,
            futures_lite::future::zip(
                // A reply the dead broker never sends must not hold the test: `stop` ends it.
                futures_lite::future::or(
                    publish_batches(&client, &ledger, iteration, next, PHASE_B_BATCHES_MAX),
                    async {
                        while !stop.get() {
                            glommio::timer::sleep(Duration::from_millis(20)).await;
                        }
                        next
                    },
                ),
                consume_and_ack(&sub, &ledger, &rng, &stop),
            ),
        )
        .await;
        drop(sub);
        drop(client);
        Rc::try_unwrap(ledger)
            .map(RefCell::into_inner)
            .unwrap_or_default()
    })
}

#[test]
fn acknowledged_messages_survive_kill_9_and_settled_acks_stay_deleted() {
    let seed: u64 = match std::env::var("PINQ_CRASH_SEED") {
        Ok(s) => s.parse().expect("PINQ_CRASH_SEED is a number"),
        Err(_) => fastrand::u64(..),
    };
    eprintln!("server crash test seed {seed}; replay with PINQ_CRASH_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut ledger = BTreeMap::new();
    for iteration in 0..=ITERATIONS {
        let mut server = Server::start_in(&data_dir, SERVER_ARGS, SERVER_ENV);
        let kill_after = (iteration < ITERATIONS).then(|| Duration::from_millis(rng.u64(0..300)));
        ledger = session(
            server.server_arg(),
            server.pid(),
            ledger,
            seed,
            iteration,
            kill_after,
        );
        server.kill9();
    }
    let live = ledger.values().filter(|f| **f == Fate::Live).count();
    let deleted = ledger
        .values()
        .filter(|f| **f == Fate::AckedSettled)
        .count();
    eprintln!("seed {seed}: {live} messages live at the end, {deleted} deleted");
    assert!(
        live > 0 && deleted > 0,
        "seed {seed}: the run must both keep and delete messages to test anything"
    );
}
