//! The Rust client on tokio: publish, subscribe as a group, receive, ACK, read the stats, with
//! no glommio executor anywhere. The client is built on `Rc` (capnp-rpc is), so it runs on a
//! `tokio::task::LocalSet`; a current-thread runtime is the simplest home for it.
//!
//!   pinq serve &                                          # a broker on 127.0.0.1:7400
//!   cargo run --release --example tokio_client -- 127.0.0.1:7400

use std::time::Duration;

use pinq::client::{AckLevel, Client, PublishMessage};

const TOPIC: &str = "tokio-example";

/// The whole example on one connection (`tests/client_tokio.rs` runs it too).
pub async fn run(addr: String) -> anyhow::Result<()> {
    let client = Client::connect(addr.as_str()).await?;
    let sub = client.subscribe(TOPIC, "workers", 64).await?;
    let messages: Vec<PublishMessage> = (0..3)
        .map(|i| PublishMessage::new(TOPIC, format!("hello from tokio {i}")))
        .collect();
    let tags = client.publish(&messages, AckLevel::Durable).await?;
    println!("published {} messages", tags.len());
    // ACKs of a 5 ms window go to the broker in one call (the timer is tokio's).
    let acks = sub.ack_group(Duration::from_millis(5), 1024);
    for _ in 0..tags.len() {
        let delivery = sub.recv().await?;
        println!(
            "received {:?} (attempt {})",
            String::from_utf8_lossy(&delivery.payload),
            delivery.attempt
        );
        acks.ack(&[delivery.tag]).await?;
    }
    let stats = client.stats().await?;
    for g in stats.groups.iter().filter(|g| g.topic == TOPIC) {
        println!(
            "group {}: {} acked, {} in flight",
            g.group, g.acked, g.in_flight
        );
    }
    sub.close().await?;
    client.close().await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7400".to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, run(addr))
}
