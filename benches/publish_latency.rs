//! Durable publish latency through the whole broker: a real `pinq serve --storage lsm` process
//! (one shard), the Rust client over Cap'n Proto RPC on loopback, batches of 128 × 100-byte
//! messages at `ack = durable` (the reply waits for the WAL fdatasync). Prints msgs/s and the
//! publish → reply latency p50/p99/p99.9/max per batch, with 1 and with 4 batches in flight.
//! A measuring program (harness = false), not a criterion bench: one figure is one long run.
//!
//! ```text
//! cargo bench --bench publish_latency
//! PINQ_BENCH_BATCHES=5000 cargo bench --bench publish_latency
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::VecDeque;
use std::time::Instant;

use pinq::client::{AckLevel, Client, PublishMessage};

const MESSAGES_PER_BATCH: usize = 128;
const PAYLOAD_BYTES: usize = 100;

async fn run(client: &Client, batches: usize, window: usize) {
    let messages: Vec<PublishMessage> = (0..MESSAGES_PER_BATCH)
        .map(|_| PublishMessage::new("latency", vec![0xAB; PAYLOAD_BYTES]))
        .collect();
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    let mut in_flight = VecDeque::new();
    let started = Instant::now();
    let mut sent = 0;
    while sent < batches || !in_flight.is_empty() {
        while in_flight.len() < window && sent < batches {
            in_flight.push_back((Instant::now(), client.publish(&messages, AckLevel::Durable)));
            sent += 1;
        }
        if let Some((at, reply)) = in_flight.pop_front() {
            reply.await.expect("durable publish");
            let _ = hist.record(at.elapsed().as_micros() as u64);
        }
    }
    let elapsed = started.elapsed();
    println!(
        "durable publish through RPC, {window} batch(es) in flight: {batches} batches of {MESSAGES_PER_BATCH} x {PAYLOAD_BYTES} B in {:.2} s = {:.0} msgs/s; \
         publish->reply p50 {} us, p99 {} us, p99.9 {} us, max {} us",
        elapsed.as_secs_f64(),
        (batches * MESSAGES_PER_BATCH) as f64 / elapsed.as_secs_f64(),
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        hist.value_at_quantile(0.999),
        hist.max(),
    );
}

fn main() {
    let batches: usize = std::env::var("PINQ_BENCH_BATCHES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    let server = support::Server::start(&["--cpus", "0", "--storage", "lsm"]);
    let addr = server.server_arg();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move {
            let client = Client::connect(addr.as_str()).await.expect("connect");
            // Warm-up: the first segment's preallocation and the connection's buffers.
            run(&client, 100, 1).await;
            run(&client, batches, 1).await;
            run(&client, batches, 4).await;
        })
        .expect("executor starts")
        .join()
        .expect("bench runs");
    drop(server);
}
