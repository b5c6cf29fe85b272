//! The metrics endpoint: `GET /metrics` and `GET /healthz` on `server.metricsListen`, served by
//! one plain OS thread with `tiny_http`, off every shard's core and hot path.
//!
//! `/metrics` renders the shards' latest snapshots (`encode.rs`). `/healthz` answers `503 starting`
//! until every shard listens, `200 ok` while every shard serves, `200 degraded` with one line
//! per degraded shard while every shard serves but one dropped WAL records at start-up (a torn
//! last write, or an accepted truncation: reported until the next restart), `503 unhealthy`
//! with one line per unhealthy shard naming why (disk full, unreadable blocks, fenced, stalled)
//! and `503 shutting down` once a shutdown has begun, so a load balancer sends clients only to
//! a broker that takes them, and an operator sees what a restart lost.
//! Anything else is a 404.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::encode::render;
use super::{MetricsSlots, STALLED_AFTER};

/// In a cluster, which shards this node leads (from the shards' latest snapshots): a load
/// balancer or an operator can tell a leader from a follower. Empty for a standalone broker.
fn leadership(slots: &MetricsSlots) -> String {
    let shards = slots.read();
    if !shards.iter().flatten().any(|s| s.raft.is_some()) {
        return String::new();
    }
    let led: Vec<String> = shards
        .iter()
        .enumerate()
        .filter(|(_, s)| {
            s.as_ref()
                .and_then(|s| s.raft.as_ref())
                .is_some_and(|r| r.serving)
        })
        .map(|(i, _)| i.to_string())
        .collect();
    if led.is_empty() {
        "; cluster member, leader of no shard".to_string()
    } else {
        format!("; cluster member, leader of shard(s) {}", led.join(","))
    }
}

/// What `/healthz` answers while the broker serves: `(status, body)`.
pub fn health(slots: &MetricsSlots) -> (u16, String) {
    if let Some(body) = unhealthy(slots) {
        return (503, body);
    }
    let degraded: Vec<String> = slots
        .read_aged()
        .into_iter()
        .enumerate()
        .flat_map(|(shard, slot)| {
            let problems = slot.map(|(_, snap)| snap.problems).unwrap_or_default();
            problems
                .into_iter()
                .map(move |p| format!("shard {shard}: {p}"))
        })
        .collect();
    if degraded.is_empty() {
        return (200, format!("ok{}\n", leadership(slots)));
    }
    (
        200,
        format!("degraded{}\n{}\n", leadership(slots), degraded.join("\n")),
    )
}

/// `None` while every shard serves; otherwise one line per unhealthy shard naming why.
/// A shard is unhealthy when its last snapshot names a problem that stops it serving, or is
/// older than [`STALLED_AFTER`] (the shard stopped running its tasks), or is missing after
/// start-up.
pub fn unhealthy(slots: &MetricsSlots) -> Option<String> {
    let mut lines = Vec::new();
    for (shard, slot) in slots.read_aged().into_iter().enumerate() {
        match slot {
            None => lines.push(format!("shard {shard}: no snapshot yet")),
            Some((age, _)) if age > STALLED_AFTER => lines.push(format!(
                "shard {shard}: stalled (last snapshot {:.1} s ago)",
                age.as_secs_f64()
            )),
            Some((_, snap)) => {
                for problem in snap.problems.iter().filter(|p| !p.is_degraded_only()) {
                    lines.push(format!("shard {shard}: {problem}"));
                }
            }
        }
    }
    if lines.is_empty() {
        return None;
    }
    Some(format!("unhealthy\n{}\n", lines.join("\n")))
}

/// The content type of the OpenMetrics text format that `prometheus-client` writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A running endpoint; [`MetricsEndpoint::stop`] ends its thread.
pub struct MetricsEndpoint {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    /// The address actually bound (port 0 resolved).
    pub addr: SocketAddr,
}

impl MetricsEndpoint {
    /// Binds `addr` and starts the serving thread. `/healthz` is 200 while `serving` is set and
    /// `shutting_down` is not.
    pub fn start(
        addr: SocketAddr,
        slots: MetricsSlots,
        serving: Arc<AtomicBool>,
        shutting_down: Arc<AtomicBool>,
    ) -> anyhow::Result<MetricsEndpoint> {
        let server = tiny_http::Server::http(addr).map_err(|e| {
            anyhow::anyhow!(
                "cannot serve metrics on {addr} (server.metricsListen / --metrics-listen): {e}"
            )
        })?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| anyhow::anyhow!("metrics endpoint {addr} is not an IP address"))?;
        let server = Arc::new(server);
        let server_ref = server.clone();
        let thread = std::thread::Builder::new()
            .name("pinq-metrics".into())
            .spawn(move || serve(&server_ref, &slots, &serving, &shutting_down))?;
        Ok(MetricsEndpoint {
            server,
            thread: Some(thread),
            addr: bound,
        })
    }

    /// Stops accepting scrapes and joins the thread.
    pub fn stop(mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(
    server: &tiny_http::Server,
    slots: &MetricsSlots,
    serving: &AtomicBool,
    shutting_down: &AtomicBool,
) {
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("");
        let response = match (request.method(), path) {
            (tiny_http::Method::Get, "/metrics") => match render(slots) {
                Ok(page) => text(200, page, OPENMETRICS),
                Err(_) => text(500, "encoding the metrics failed\n".into(), "text/plain"),
            },
            (tiny_http::Method::Get, "/healthz") => {
                if shutting_down.load(Ordering::Relaxed) {
                    text(503, "shutting down\n".into(), "text/plain")
                } else if !serving.load(Ordering::Relaxed) {
                    text(503, "starting\n".into(), "text/plain")
                } else {
                    let (status, body) = health(slots);
                    text(status, body, "text/plain")
                }
            }
            _ => text(
                404,
                "not found: try /metrics or /healthz\n".into(),
                "text/plain",
            ),
        };
        if let Err(e) = request.respond(response) {
            tracing::debug!("metrics response not sent: {e}");
        }
    }
}

fn text(
    status: u16,
    body: String,
    content_type: &str,
) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let response = tiny_http::Response::from_string(body).with_status_code(status);
    match tiny_http::Header::from_bytes("Content-Type", content_type) {
        Ok(header) => response.with_header(header),
        Err(()) => response,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Problem, ShardSnapshot};

    #[test]
    fn healthy_only_while_every_shard_has_a_fresh_snapshot_without_problems() {
        let slots = MetricsSlots::new(2);
        assert!(unhealthy(&slots).is_some_and(|b| b.contains("shard 0: no snapshot yet")));
        slots.publish(0, ShardSnapshot::default());
        slots.publish(1, ShardSnapshot::default());
        assert_eq!(unhealthy(&slots), None);
        let mut sick = ShardSnapshot::default();
        sick.problems.push(Problem::UnreadableBlocks(2));
        slots.publish(1, sick);
        let body = unhealthy(&slots).expect("shard 1 is unhealthy");
        assert!(body.starts_with("unhealthy\n"), "{body}");
        assert!(
            body.contains("shard 1: 2 unreadable table block(s)"),
            "{body}"
        );
        assert!(!body.contains("shard 0"), "{body}");
    }

    #[test]
    fn dropped_wal_records_make_a_serving_broker_degraded_not_unhealthy() {
        let slots = MetricsSlots::new(2);
        slots.publish(0, ShardSnapshot::default());
        let mut torn = ShardSnapshot::default();
        torn.problems.push(Problem::WalTailDropped(
            "torn WAL tail cut at byte 8192 of wal-1.log: 2 record(s) dropped".into(),
        ));
        slots.publish(1, torn.clone());
        assert_eq!(unhealthy(&slots), None);
        let (status, body) = health(&slots);
        assert_eq!(status, 200);
        assert!(body.starts_with("degraded\n"), "{body}");
        assert!(
            body.contains("shard 1: degraded: torn WAL tail cut at byte 8192"),
            "{body}"
        );
        torn.problems.push(Problem::UnreadableBlocks(1));
        slots.publish(1, torn);
        let (status, body) = health(&slots);
        assert_eq!(status, 503, "{body}");
        assert!(!body.contains("torn WAL"), "{body}");
        slots.publish(1, ShardSnapshot::default());
        assert_eq!(health(&slots), (200, "ok\n".to_string()));
    }
}
