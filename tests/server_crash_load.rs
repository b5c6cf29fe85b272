//! kill -9 after 10 s of max-rate durable load, with the default delete settings: no message
//! whose ACK was answered more than 2 × `delivery.deleteBatchInterval` before the kill may be
//! delivered again after the restart (before the command log, 911,360 ACKed messages came back).
//!
//! Two producers publish durable batches as fast as the broker takes them (they pause while
//! more than `BACKLOG_MAX` messages are published and not ACKed, as `pinq bench` does); one
//! consumer ACKs everything and records when each ACK was answered. The server is killed, then
//! restarted, and everything it delivers is checked against those times.

mod support;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, PublishMessage};
use support::Server;

const TOPIC: &str = "load";
const LOAD: Duration = Duration::from_secs(10);
/// The default `delivery.deleteBatchInterval`.
const DELETE_BATCH_INTERVAL: Duration = Duration::from_millis(500);
const BATCH: usize = 256;
const WINDOW: usize = 8;
const BACKLOG_MAX: u64 = 50_000;
const PAYLOAD_BYTES: usize = 100;
/// Bound on the client's life after the kill, and on the drain after the restart.
const WAIT_MAX: Duration = Duration::from_secs(60);

fn payload(id: u64) -> Vec<u8> {
    let mut p = id.to_le_bytes().to_vec();
    p.resize(PAYLOAD_BYTES, b'.');
    p
}

fn id_of(payload: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&payload[..8]);
    u64::from_le_bytes(a)
}

struct Load {
    next_id: Cell<u64>,
    published: Cell<u64>,
    acked: Cell<u64>,
    /// When each ACK was answered, by message id.
    ack_answered: RefCell<HashMap<u64, Instant>>,
}

async fn produce(client: Rc<Client>, load: Rc<Load>, deadline: Instant) {
    let mut in_flight = std::collections::VecDeque::new();
    while Instant::now() < deadline {
        while in_flight.len() < WINDOW && load.published.get() - load.acked.get() < BACKLOG_MAX {
            let first = load.next_id.get();
            load.next_id.set(first + BATCH as u64);
            let messages: Vec<PublishMessage> = (first..first + BATCH as u64)
                .map(|id| PublishMessage::new(TOPIC, payload(id)))
                .collect();
            let client = Rc::clone(&client);
            in_flight.push_back(glommio::spawn_local(async move {
                client.publish(&messages, AckLevel::Durable).await.is_ok()
            }));
        }
        match in_flight.pop_front() {
            Some(reply) => {
                if !reply.await {
                    return; // the broker is gone
                }
                load.published.set(load.published.get() + BATCH as u64);
            }
            None => glommio::timer::sleep(Duration::from_millis(1)).await,
        }
    }
}

async fn consume(client: Rc<Client>, load: Rc<Load>, deadline: Instant) {
    let sub = client.subscribe(TOPIC, "g", 4096).await.expect("subscribe");
    while Instant::now() < deadline {
        let batch = sub.recv_batch(1024).await.unwrap_or_default();
        if batch.is_empty() {
            return; // the broker is gone
        }
        let tags: Vec<_> = batch.iter().map(|d| d.tag).collect();
        let Ok(_) = sub.ack(&tags).await else {
            return;
        };
        let answered = Instant::now();
        let mut times = load.ack_answered.borrow_mut();
        for d in &batch {
            times.insert(id_of(&d.payload), answered);
        }
        load.acked.set(load.acked.get() + batch.len() as u64);
    }
}

/// Drives the load until the broker dies (or `WAIT_MAX` after the load time); returns the ACK
/// answer times.
fn run_load(addr: String) -> HashMap<u64, Instant> {
    support::on_executor(move || async move {
        let deadline = Instant::now() + LOAD + WAIT_MAX;
        let load = Rc::new(Load {
            next_id: Cell::new(0),
            published: Cell::new(0),
            acked: Cell::new(0),
            ack_answered: RefCell::new(HashMap::new()),
        });
        let consumer = Rc::new(Client::connect(addr.as_str()).await.expect("connect"));
        let consuming = glommio::spawn_local(consume(consumer, Rc::clone(&load), deadline));
        let producers: Vec<_> = (0..2)
            .map(|_| {
                let (addr, load) = (addr.clone(), Rc::clone(&load));
                glommio::spawn_local(async move {
                    let client = Rc::new(Client::connect(addr.as_str()).await.expect("connect"));
                    produce(client, load, deadline).await;
                })
            })
            .collect();
        for p in producers {
            p.await;
        }
        consuming.await;
        load.ack_answered.take()
    })
}

/// Everything the restarted broker delivers until it has been quiet for 2 s.
fn drain(addr: String) -> Vec<u64> {
    support::on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let sub = client.subscribe(TOPIC, "g", 4096).await.expect("subscribe");
        let end = Instant::now() + WAIT_MAX;
        let mut ids = Vec::new();
        while Instant::now() < end {
            let batch = futures_lite::future::or(
                async { sub.recv_batch(1024).await.unwrap_or_default() },
                async {
                    glommio::timer::sleep(Duration::from_secs(2)).await;
                    Vec::new()
                },
            )
            .await;
            if batch.is_empty() {
                break;
            }
            let tags: Vec<_> = batch.iter().map(|d| d.tag).collect();
            ids.extend(batch.iter().map(|d| id_of(&d.payload)));
            sub.ack(&tags).await.expect("ack after the restart");
        }
        ids
    })
}

#[test]
fn after_kill_9_under_max_rate_durable_load_no_message_acked_well_before_comes_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data_dir = tmp.path().join("data");
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &[]);
    let addr = server.server_arg();
    let client = std::thread::spawn(move || run_load(addr));
    std::thread::sleep(LOAD);
    server.kill9();
    let killed = Instant::now();
    let answered = client.join().expect("the load thread");
    assert!(
        answered.len() > 10_000,
        "only {} ACKs in {LOAD:?}: too little load to test anything",
        answered.len()
    );

    let server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &[]);
    let redelivered = drain(server.server_arg());
    let limit = killed - 2 * DELETE_BATCH_INTERVAL;
    let acked_back: Vec<(u64, Duration)> = redelivered
        .iter()
        .filter_map(|id| answered.get(id).map(|at| (*id, killed.duration_since(*at))))
        .collect();
    let too_old: Vec<&(u64, Duration)> = acked_back
        .iter()
        .filter(|(_, age)| killed - *age < limit)
        .collect();
    eprintln!(
        "{} ACKs answered in {LOAD:?}; after the restart {} messages delivered, {} of them ACKed before the kill (the oldest ACK {:?} before it)",
        answered.len(),
        redelivered.len(),
        acked_back.len(),
        acked_back.iter().map(|(_, age)| *age).max()
    );
    assert!(
        too_old.is_empty(),
        "{} messages whose ACK was answered more than {:?} before the kill came back, e.g. {:?}",
        too_old.len(),
        2 * DELETE_BATCH_INTERVAL,
        &too_old[..too_old.len().min(5)]
    );
}
