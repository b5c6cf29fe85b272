//! One hop across cores on the shard mesh's channel type: a `ShardMsg` sent over a bounded
//! glommio shared channel (the mesh's bound, `MESH_CHANNEL_LEN`) from an executor pinned to CPU 0
//! to one pinned to CPU 1, which sends it straight back on a second channel. No store, no sockets.
//!
//! - `pipelined_10k`: 10,000 messages an iteration, the sender never waiting for an echo (only for
//!   room in the bounded channel), reported per message (one way out and back);
//! - `round_trip`: one message, then wait for its echo before the next, per round trip (includes
//!   waking a parked executor on each side).
//!
//! Both executors are started once; each sample is timed inside the executor on CPU 0 (criterion's
//! `iter_custom`) and handed back over a std channel. Needs two CPUs (0 and 1). Run with
//! `cargo bench --bench cross_core`.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use glommio::channels::shared_channel::{self, ConnectedReceiver, ConnectedSender};
use glommio::{LocalExecutorBuilder, Placement};

use pinq::pipeline::ConsumerId;
use pinq::server::mesh::ShardMsg;
use pinq::server::MESH_CHANNEL_LEN;

const PIPELINED_MESSAGES: u64 = 10_000;

enum Command {
    /// Send `n` messages without waiting for echoes, then receive the `n` echoes.
    Pipelined(u64),
    /// `n` sequential round trips.
    RoundTrips(u64),
}

fn message(i: u64) -> ShardMsg {
    ShardMsg::Credit {
        consumer: ConsumerId(i),
        keys: Vec::new(),
    }
}

async fn pipelined(
    n: u64,
    out: &std::rc::Rc<ConnectedSender<ShardMsg>>,
    back: &ConnectedReceiver<ShardMsg>,
) -> Duration {
    let start = Instant::now();
    let sender = std::rc::Rc::clone(out);
    let sending = glommio::spawn_local(async move {
        for i in 0..n {
            if sender.send(message(i)).await.is_err() {
                panic!("the echo executor stopped");
            }
        }
    });
    for _ in 0..n {
        back.recv().await.expect("an echo for every message");
    }
    sending.await;
    start.elapsed()
}

async fn round_trips(
    n: u64,
    out: &ConnectedSender<ShardMsg>,
    back: &ConnectedReceiver<ShardMsg>,
) -> Duration {
    let start = Instant::now();
    for i in 0..n {
        if out.send(message(i)).await.is_err() {
            panic!("the echo executor stopped");
        }
        back.recv().await.expect("an echo");
    }
    start.elapsed()
}

fn cross_core(c: &mut Criterion) {
    let (to_echo, echo_rx) = shared_channel::new_bounded::<ShardMsg>(MESH_CHANNEL_LEN);
    let (echo_tx, from_echo) = shared_channel::new_bounded::<ShardMsg>(MESH_CHANNEL_LEN);
    let (command_tx, command_rx) = mpsc::channel::<Command>();
    let (elapsed_tx, elapsed_rx) = mpsc::channel::<Duration>();

    let echo = LocalExecutorBuilder::new(Placement::Fixed(1))
        .name("bench-echo")
        .spawn(move || async move {
            let rx = echo_rx.connect().await;
            let tx = echo_tx.connect().await;
            while let Some(msg) = rx.recv().await {
                if tx.send(msg).await.is_err() {
                    break;
                }
            }
        })
        .expect("an executor on CPU 1");

    let driver = LocalExecutorBuilder::new(Placement::Fixed(0))
        .name("bench-driver")
        .spawn(move || async move {
            let out = std::rc::Rc::new(to_echo.connect().await);
            let back = from_echo.connect().await;
            // Blocking on the std channel between samples is fine: this executor has nothing else
            // to run, and the echo executor parks on its own channel meanwhile.
            while let Ok(command) = command_rx.recv() {
                let elapsed = match command {
                    Command::Pipelined(n) => pipelined(n, &out, &back).await,
                    Command::RoundTrips(n) => round_trips(n, &out, &back).await,
                };
                if elapsed_tx.send(elapsed).is_err() {
                    break;
                }
            }
        })
        .expect("an executor on CPU 0");

    let run = |command: Command| {
        command_tx.send(command).expect("the driver executor runs");
        elapsed_rx.recv().expect("the driver executor answers")
    };

    let mut group = c.benchmark_group("cross_core");
    group.throughput(Throughput::Elements(PIPELINED_MESSAGES));
    group.bench_function("pipelined_10k", |b| {
        b.iter_custom(|iters| run(Command::Pipelined(iters * PIPELINED_MESSAGES)))
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("round_trip", |b| {
        b.iter_custom(|iters| run(Command::RoundTrips(iters)))
    });
    group.finish();

    drop(command_tx);
    driver.join().expect("the driver executor stops cleanly");
    echo.join().expect("the echo executor stops cleanly");
}

criterion_group!(benches, cross_core);
criterion_main!(benches);
