//! Failover probe: publishes one `durable` message every `--interval` through a [`Router`]
//! (which follows the leader) for `--duration`, and reports the longest gap between two
//! consecutive acknowledged publishes — the unavailability a client saw across a leader's
//! death. Used by `perf/cluster-failover.sh`, which kills the leader in the middle.
//!
//! `cargo run --release --example failover_probe -- --server ADDR [--topic T] [--interval 5ms] [--duration 10s]`
//! prints one JSON line: `{"acked":N,"failed":F,"longest_gap_ms":G,"gap_started_at_ms":S}`.

use std::time::{Duration, Instant};

use pinq::client::{AckLevel, PublishMessage, Router, RouterOptions};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let server = arg(&args, "--server", "127.0.0.1:7410");
    let topic = arg(&args, "--topic", "failover-probe");
    let interval = humantime::parse_duration(&arg(&args, "--interval", "5ms"))?;
    let duration = humantime::parse_duration(&arg(&args, "--duration", "10s"))?;
    let line = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move { probe(&server, &topic, interval, duration).await })
        .map_err(|e| anyhow::anyhow!("starting the executor: {e}"))?
        .join()
        .map_err(|e| anyhow::anyhow!("the executor failed: {e}"))??;
    println!("{line}");
    Ok(())
}

async fn probe(
    server: &str,
    topic: &str,
    interval: Duration,
    duration: Duration,
) -> anyhow::Result<String> {
    let router = Router::connect(server, RouterOptions::default()).await?;
    let start = Instant::now();
    let mut last_ack = start;
    let (mut acked, mut failed, mut longest, mut gap_at) = (0u64, 0u64, Duration::ZERO, 0u128);
    let mut seq = 0u64;
    while start.elapsed() < duration {
        seq += 1;
        let message = PublishMessage::new(topic.to_string(), seq.to_string().into_bytes());
        match router.publish(&[message], AckLevel::Durable).await {
            Ok(_) => {
                let now = Instant::now();
                let gap = now - last_ack;
                if gap > longest {
                    longest = gap;
                    gap_at = (last_ack - start).as_millis();
                }
                last_ack = now;
                acked += 1;
            }
            Err(e) => {
                failed += 1;
                eprintln!("publish {seq} failed: {e}");
            }
        }
        glommio::timer::sleep(interval).await;
    }
    Ok(format!(
        "{{\"acked\":{acked},\"failed\":{failed},\"longest_gap_ms\":{},\"gap_started_at_ms\":{gap_at}}}",
        longest.as_millis()
    ))
}
