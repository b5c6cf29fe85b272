//! What one client can make a real `pinq serve` hold: the frame gate (eight bytes announcing
//! 64 MiB), `server.maxConnections`, the idle and stalled-frame timeouts, subscriptions and calls
//! in flight per connection. Every server binds 127.0.0.1 and is killed by pid when its test
//! ends; every wait is bounded so that a broken limit fails the test instead of hanging it.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, Client, ClientError, PublishMessage};
use pinq::rpc::refusal::Code;
use support::{http_get, on_executor, sample, Server};

/// The longest the server may take to close a connection it should close.
const CLOSE_WAIT: Duration = Duration::from_secs(30);
/// Upper bound on waiting for a metrics snapshot (published about once a second).
const SCRAPE_WAIT: Duration = Duration::from_secs(30);

/// Eight bytes of a Cap'n Proto frame header: one segment of 8 Mi words (64 MiB).
const HEADER_64_MIB: [u8; 8] = [0, 0, 0, 0, 0x00, 0x00, 0x80, 0x00];

fn start(env: &[(&str, &str)]) -> Server {
    Server::start_with_env(&["--cpus", "0", "--storage", "memory"], env)
}

/// The server's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line")
}

fn raw(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("read timeout");
    stream
}

/// Whether the server closed `stream` (end of stream or reset) before `deadline`. Bytes the
/// server sends first (an answer) are read and skipped.
fn closed_by(stream: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                continue
            }
            Err(_) => return true,
        }
    }
    false
}

fn scrape_until(server: &Server, done: impl Fn(&str) -> bool) -> String {
    let addr = server.metrics_addr.expect("metrics address");
    let deadline = Instant::now() + SCRAPE_WAIT;
    loop {
        let (_, page) = http_get(addr, "/metrics");
        if done(&page) || Instant::now() > deadline {
            return page;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn refusals(page: &str, code: Code) -> f64 {
    sample(
        page,
        "pinq_refusals_total",
        &format!(r#"shard="0",code="{}""#, code.name()),
    )
    .unwrap_or(0.0)
}

#[test]
fn eight_bytes_announcing_64_mib_hold_no_memory_and_their_connections_are_closed() {
    let server = start(&[("PINQ_SERVER_FRAME_TIMEOUT", "2s")]);
    let before = rss_kib(server.pid());
    let mut streams: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = raw(server.addr);
            s.write_all(&HEADER_64_MIB).expect("send the header");
            s
        })
        .collect();
    // Watch the server's memory while the frames stay unfinished (before the frame timeout).
    let mut peak = before;
    let watch_until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < watch_until {
        peak = peak.max(rss_kib(server.pid()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let grown_mib = peak.saturating_sub(before) / 1024;
    // Before the gate: 20 × 64 MiB = 1280 MiB. One announced segment's worth for all 20 is
    // already far more than the gate holds (8 bytes each).
    assert!(
        grown_mib < 64,
        "RSS grew by {grown_mib} MiB for 20 eight-byte frame headers"
    );
    let deadline = Instant::now() + CLOSE_WAIT;
    for (i, s) in streams.iter_mut().enumerate() {
        assert!(closed_by(s, deadline), "connection {i} was not closed");
    }
    eprintln!("RSS before {before} KiB, peak {peak} KiB with 20 headers announcing 64 MiB");
}

#[test]
fn a_frame_announcing_more_than_the_frame_limit_is_refused_at_once() {
    // 1 KiB messages × 10 per batch: frames are limited to about 16 KiB + 1 MiB.
    let server = start(&[
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "1KiB"),
        ("PINQ_PUBLISH_MAX_BATCH_MESSAGES", "10"),
    ]);
    let mut s = raw(server.addr);
    s.write_all(&HEADER_64_MIB).expect("send the header");
    // The default frame timeout is 10 s: closing well before it is the gate's doing.
    let deadline = Instant::now() + Duration::from_secs(5);
    assert!(closed_by(&mut s, deadline), "the connection stayed open");
}

#[test]
fn connections_beyond_max_connections_are_refused_with_their_code_until_some_close() {
    let server = start(&[("PINQ_SERVER_MAX_CONNECTIONS", "50")]);
    let addr = server.addr;
    let mut held: Vec<TcpStream> = (0..50).map(|_| raw(addr)).collect();
    // The server counts a connection once it accepted it: wait until a 51st is refused.
    let refused_client = on_executor(move || async move {
        let deadline = Instant::now() + CLOSE_WAIT;
        loop {
            match Client::connect(addr.to_string().as_str()).await {
                Err(e) if e.refusal() == Some(Code::TooManyConnections) => return Ok(e),
                Err(e) if Instant::now() > deadline => return Err(format!("{e}")),
                Ok(_) if Instant::now() > deadline => return Err("served".to_string()),
                _ => glommio::timer::sleep(Duration::from_millis(50)).await,
            }
        }
    });
    let refused = refused_client.expect("a client beyond the limit is refused");
    assert!(
        refused.to_string().contains("server.maxConnections"),
        "{refused}"
    );
    // 2,000 idle connections beyond the cap: each is answered or closed, none hangs.
    let mut extra: Vec<TcpStream> = (0..2000).map(|_| raw(addr)).collect();
    let deadline = Instant::now() + CLOSE_WAIT;
    let open = extra
        .iter_mut()
        .map(|s| closed_by(s, deadline))
        .filter(|closed| !closed)
        .count();
    assert_eq!(open, 0, "connections beyond the cap left open");
    let page = scrape_until(&server, |p| refusals(p, Code::TooManyConnections) >= 2001.0);
    assert!(
        refusals(&page, Code::TooManyConnections) >= 2001.0,
        "{page}"
    );
    // Closing the idle ones makes room: a new client is served.
    held.clear();
    let served = on_executor(move || async move {
        let deadline = Instant::now() + CLOSE_WAIT;
        loop {
            match Client::connect(addr.to_string().as_str()).await {
                Ok(client) => return client.stats().await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) if Instant::now() > deadline => return Err(e.to_string()),
                Err(_) => glommio::timer::sleep(Duration::from_millis(50)).await,
            }
        }
    });
    served.expect("a client is served once the idle connections closed");
}

#[test]
fn an_idle_connection_is_closed_and_one_with_a_subscription_is_not() {
    let server = start(&[("PINQ_SERVER_IDLE_TIMEOUT", "500ms")]);
    let mut idle = raw(server.addr);
    let started = Instant::now();
    assert!(
        closed_by(&mut idle, started + CLOSE_WAIT),
        "an idle connection stayed open"
    );
    let addr = server.server_arg();
    let outcome = on_executor(move || async move {
        let client = Client::connect(addr.as_str())
            .await
            .map_err(|e| e.to_string())?;
        let _subscription = client
            .subscribe("idle-t", "g", 0)
            .await
            .map_err(|e| e.to_string())?;
        // Three idle timeouts with nothing but an open subscription.
        glommio::timer::sleep(Duration::from_millis(1500)).await;
        client.stats().await.map(|_| ()).map_err(|e| e.to_string())
    });
    outcome.expect("a connection with a subscription is not idle");
}

#[test]
fn a_stalled_frame_closes_its_connection() {
    let server = start(&[("PINQ_SERVER_FRAME_TIMEOUT", "500ms")]);
    let mut s = raw(server.addr);
    // Half a frame: a header announcing 2 words, then one of them.
    s.write_all(&[0, 0, 0, 0, 2, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
        .expect("send half a frame");
    // The idle timeout is 5 minutes: closing within the wait is the frame timeout's doing.
    assert!(
        closed_by(&mut s, Instant::now() + CLOSE_WAIT),
        "a stalled frame kept its connection open"
    );
}

#[test]
fn subscriptions_beyond_the_limit_are_refused_with_their_code() {
    let server = start(&[("PINQ_SERVER_MAX_SUBSCRIPTIONS_PER_CONNECTION", "2")]);
    let addr = server.server_arg();
    let outcome = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let first = client.subscribe("sub-t", "a", 0).await.expect("first");
        let _second = client.subscribe("sub-t", "b", 0).await.expect("second");
        let third = client.subscribe("sub-t", "c", 0).await.err();
        first.close().await.expect("close");
        let after_close = client.subscribe("sub-t", "d", 0).await.map(|_| ());
        (third.and_then(|e| e.refusal()), after_close.is_ok())
    });
    assert_eq!(outcome, (Some(Code::TooManySubscriptions), true));
    let page = scrape_until(&server, |p| refusals(p, Code::TooManySubscriptions) >= 1.0);
    assert_eq!(refusals(&page, Code::TooManySubscriptions), 1.0, "{page}");
}

#[test]
fn calls_beyond_max_calls_in_flight_are_refused_and_the_server_keeps_serving() {
    // Durable publishes on the lsm engine wait for fdatasync: many stay in flight at once.
    let server = Server::start_with_env(
        &["--cpus", "0"],
        &[("PINQ_SERVER_MAX_CALLS_IN_FLIGHT", "4")],
    );
    let addr = server.server_arg();
    let (ok, too_many, other, after) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let pending: Vec<_> = (0..500)
            .map(|i| {
                client.publish(
                    [PublishMessage::new("calls-t", format!("m{i}"))],
                    AckLevel::Durable,
                )
            })
            .collect();
        let (mut ok, mut too_many, mut other) = (0, 0, Vec::new());
        for reply in pending {
            match reply.await {
                Ok(_) => ok += 1,
                Err(e) if e.refusal() == Some(Code::TooManyCalls) => too_many += 1,
                Err(e) => other.push(e.to_string()),
            }
        }
        let after = client
            .publish([PublishMessage::new("calls-t", "after")], AckLevel::Durable)
            .await
            .map(|_| ())
            .map_err(|e: ClientError| e.to_string());
        (ok, too_many, other, after)
    });
    assert!(other.is_empty(), "unexpected errors: {other:?}");
    assert!(ok >= 1, "no publish was served");
    assert!(too_many >= 1, "no call was refused ({ok} served)");
    after.expect("the connection serves calls after the refusals");
    let page = scrape_until(&server, |p| {
        refusals(p, Code::TooManyCalls) >= too_many as f64
    });
    assert_eq!(
        refusals(&page, Code::TooManyCalls),
        too_many as f64,
        "{page}"
    );
}

#[test]
fn a_batch_of_large_frames_across_both_shards_is_stored_whole() {
    // 2 MiB in one request: the gate collects the frame before the reader sees it, and the
    // parts for the two shards are stored concurrently.
    let server = Server::start(&["--cpus", "0,1", "--storage", "memory"]);
    let addr = server.server_arg();
    let (tags, published) = on_executor(move || async move {
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let batch: Vec<PublishMessage> = (0..100)
            .map(|i| PublishMessage::new(format!("big-{i}"), vec![i as u8; 20 << 10]))
            .collect();
        let tags = client
            .publish(&batch, AckLevel::Durable)
            .await
            .expect("publish");
        let stats = client.stats().await.expect("stats");
        let published: u64 = stats.shards.iter().map(|s| s.published).sum();
        let shards_used = stats.shards.iter().filter(|s| s.published > 0).count();
        assert_eq!(shards_used, 2, "the batch did not span both shards");
        (tags.len(), published)
    });
    assert_eq!((tags, published), (100, 100));
}
