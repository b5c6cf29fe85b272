use super::*;
use futures_lite::future::block_on;
use futures_lite::io::{AsyncReadExt, Cursor};

/// A frame header: segment count and sizes in words, padded to a whole word.
fn table(sizes_words: &[u32]) -> Vec<u8> {
    let mut t = ((sizes_words.len() as u32) - 1).to_le_bytes().to_vec();
    for s in sizes_words {
        t.extend_from_slice(&s.to_le_bytes());
    }
    while t.len() % 8 != 0 {
        t.push(0);
    }
    t
}

fn frame(sizes_words: &[u32]) -> Vec<u8> {
    let mut f = table(sizes_words);
    let body: u32 = sizes_words.iter().sum();
    f.extend((0..body * 8).map(|i| i as u8));
    f
}

fn gate(bytes: Vec<u8>, max: usize) -> (FrameGate<Cursor<Vec<u8>>>, Rc<ReadProgress>) {
    let progress = Rc::new(ReadProgress::default());
    (
        FrameGate::new(Cursor::new(bytes), max, progress.clone()),
        progress,
    )
}

#[test]
fn frames_small_and_large_pass_the_gate_unchanged() {
    let mut stream = frame(&[3]);
    stream.extend(frame(&[40_000, 2, 5])); // 320 KiB: collected by the gate
    stream.extend(frame(&[1, 1]));
    let (mut g, progress) = gate(stream.clone(), 1 << 20);
    let mut out = Vec::new();
    block_on(g.read_to_end(&mut out)).unwrap();
    assert_eq!(out, stream);
    assert_eq!(progress.frames.get(), 3);
    assert!(!progress.frame_open.get());
    assert_eq!(progress.bytes.get(), stream.len() as u64);
}

#[test]
fn a_real_capnp_message_reads_back_through_the_gate() {
    let mut message = capnp::message::Builder::new_default();
    let mut root = message.initn_root::<capnp::text_list::Builder<'_>>(1000);
    for i in 0..1000 {
        root.set(i, "x".repeat(300).as_str());
    }
    let mut bytes = Vec::new();
    capnp::serialize::write_message(&mut bytes, &message).unwrap();
    let (mut g, _) = gate(bytes.clone(), 1 << 20);
    let mut out = Vec::new();
    block_on(g.read_to_end(&mut out)).unwrap();
    let reader = capnp::serialize::read_message(&mut out.as_slice(), Default::default()).unwrap();
    let list = reader.get_root::<capnp::text_list::Reader<'_>>().unwrap();
    assert_eq!(list.len(), 1000);
}

#[test]
fn a_frame_announcing_more_than_the_limit_is_refused_before_anything_is_held() {
    // Eight bytes: one segment of 64 MiB.
    let (mut g, _) = gate(table(&[8 << 20]), 1 << 20);
    let mut buf = [0u8; 8];
    let e = block_on(g.read(&mut buf)).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("announces 67108872 bytes"), "{e}");
    assert!(g.out.capacity() < 1024);
    let (mut g, _) = gate(vec![0xFF, 0xFF, 0, 0, 0, 0, 0, 0], 1 << 20);
    let e = block_on(g.read(&mut buf)).unwrap_err();
    assert!(e.to_string().contains("segments"), "{e}");
}

#[test]
fn a_large_frame_never_sent_holds_only_what_arrived() {
    // Announces 4 MiB (within the limit), sends 10 KiB of it, then the stream ends.
    let mut stream = table(&[512 << 10]);
    stream.extend(vec![7u8; 10 << 10]);
    let (mut g, progress) = gate(stream, 8 << 20);
    let mut buf = vec![0u8; 8];
    let e = block_on(g.read(&mut buf)).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    // Nothing was handed to the reader above (it would have allocated 512 KiB).
    assert_eq!(buf, vec![0u8; 8]);
    assert!(
        g.out.capacity() <= 4 * DIRECT_FRAME_BYTES_MAX,
        "{}",
        g.out.capacity()
    );
    assert!(progress.frame_open.get());
}

#[test]
fn default_frame_limit_is_the_publish_budget_plus_the_allowance() {
    let publish = PublishConfig::default();
    assert_eq!(
        frame_bytes_max(&publish),
        (64 << 20) + FRAME_ALLOWANCE_BYTES
    );
    let small = PublishConfig {
        message_bytes_max: 1000,
        batch_len_max: 10,
        ..PublishConfig::default()
    };
    assert_eq!(
        frame_bytes_max(&small),
        10 * (1000 + MESSAGE_OVERHEAD_BYTES) + FRAME_ALLOWANCE_BYTES
    );
}

fn limits(idle_ms: u64, frame_ms: u64) -> ClientLimits {
    ClientLimits {
        idle_timeout_ms: idle_ms,
        frame_timeout_ms: frame_ms,
        ..ClientLimits::default()
    }
}

fn seen(now_ms: u64, bytes: u64, frames: u64, frame_open: bool, busy: bool) -> Observation {
    Observation {
        now_ms,
        bytes,
        frames,
        frame_open,
        busy,
        send_blocked_since_ms: None,
    }
}

#[test]
fn a_connection_with_nothing_in_flight_and_no_bytes_is_idle_after_the_timeout() {
    let mut dog = Watchdog::new(&limits(1000, 500), 0);
    assert_eq!(dog.observe(seen(400, 0, 0, false, false)), Verdict::Keep);
    assert_eq!(dog.observe(seen(999, 0, 0, false, false)), Verdict::Keep);
    assert_eq!(dog.observe(seen(1000, 0, 0, false, false)), Verdict::Idle);
    // Bytes arriving restart the clock.
    let mut dog = Watchdog::new(&limits(1000, 500), 0);
    assert_eq!(dog.observe(seen(900, 10, 1, false, false)), Verdict::Keep);
    assert_eq!(dog.observe(seen(1800, 10, 1, false, false)), Verdict::Keep);
    assert_eq!(dog.observe(seen(1900, 10, 1, false, false)), Verdict::Idle);
}

#[test]
fn a_call_in_flight_or_a_subscription_keeps_a_quiet_connection_open() {
    let mut dog = Watchdog::new(&limits(1000, 500), 0);
    for now in (0..10_000).step_by(250) {
        assert_eq!(dog.observe(seen(now, 0, 0, false, true)), Verdict::Keep);
    }
    assert_eq!(dog.observe(seen(10_500, 0, 0, false, false)), Verdict::Keep);
    assert_eq!(dog.observe(seen(11_000, 0, 0, false, false)), Verdict::Idle);
}

#[test]
fn a_frame_begun_and_not_finished_within_the_timeout_is_stalled() {
    let mut dog = Watchdog::new(&limits(60_000, 500), 0);
    assert_eq!(dog.observe(seen(100, 4, 0, true, false)), Verdict::Keep);
    // More bytes of the same frame do not restart the frame's clock.
    assert_eq!(dog.observe(seen(400, 8, 0, true, false)), Verdict::Keep);
    assert_eq!(
        dog.observe(seen(600, 9, 0, true, false)),
        Verdict::StalledFrame
    );
    // Frames that finish between ticks are progress.
    let mut dog = Watchdog::new(&limits(60_000, 500), 0);
    for (i, now) in (0..20u64).zip((100..).step_by(300)) {
        assert_eq!(dog.observe(seen(now, i * 10, i, true, true)), Verdict::Keep);
    }
}

#[test]
fn the_budget_admits_in_arrival_order_and_a_batch_larger_than_it_alone() {
    let mut b = BudgetCore::new(100);
    assert!(b.try_take(1, 60, 0));
    assert!(!b.try_take(2, 60, 0));
    let waker = futures_lite::future::block_on(futures_lite::future::poll_fn(|cx| {
        Poll::Ready(cx.waker().clone())
    }));
    b.wait(2, &waker);
    // A small one that would fit must not pass the waiter ahead of it.
    assert!(!b.try_take(3, 10, 0));
    b.release(60);
    assert!(b.try_take(2, 60, 0));
    assert!(b.try_take(3, 10, 0));
    b.release(70);
    assert_eq!(b.in_use(), 0);
    // Larger than the whole budget: admitted when nothing else is held.
    assert!(b.try_take(4, 500, 0));
    assert!(!b.try_take(5, 1, 0));
    b.release(500);
    assert!(b.try_take(5, 1, 0));
}

#[test]
fn a_publish_waits_for_room_and_gives_up_after_its_wait() {
    let outcome = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .io_memory(512 << 10)
        .spawn(|| async {
            let budget = ByteBudget::new(100);
            let held = budget.acquire(80, Duration::from_millis(10)).await.unwrap();
            let refused = budget
                .acquire(30, Duration::from_millis(20))
                .await
                .is_none();
            let waiter = {
                let budget = budget.clone();
                glommio::spawn_local(async move {
                    budget
                        .acquire(30, Duration::from_secs(10))
                        .await
                        .map(|p| p.bytes)
                })
            };
            glommio::timer::sleep(Duration::from_millis(20)).await;
            drop(held);
            let admitted = waiter.await;
            (refused, admitted, budget.in_use())
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(outcome, (true, Some(30), 0));
}

#[test]
fn connections_beyond_the_limit_are_refused_until_one_closes() {
    let count = ConnectionCount::new(2);
    let a = count.try_open().unwrap();
    let _b = count.clone().try_open().unwrap();
    assert!(count.try_open().is_none());
    drop(a);
    assert!(count.try_open().is_some());
}

#[test]
fn calls_and_subscriptions_are_bounded_per_connection() {
    let conn = ConnectionUse::new(ClientLimits {
        calls_in_flight_max: 2,
        subscriptions_max: 1,
        ..ClientLimits::default()
    });
    let a = conn.try_call().unwrap();
    let _b = conn.try_call().unwrap();
    assert!(conn.try_call().is_none());
    drop(a);
    assert!(conn.try_call().is_some());
    let s = conn.try_subscribe().unwrap();
    assert!(conn.try_subscribe().is_none());
    drop(s);
    assert!(conn.try_subscribe().is_some());
}

#[test]
fn a_repeated_accept_error_is_logged_once_per_interval_with_the_count_held_back() {
    let mut log = crate::ops::ratelimit::RateLimit::new(ACCEPT_ERROR_LOG_INTERVAL_MS);
    assert_eq!(log.admit(0), Some(0));
    for now in 1..100 {
        assert_eq!(log.admit(now * 10), None);
    }
    assert_eq!(log.admit(5000), Some(99));
    assert_eq!(log.admit(5001), None);
    let mut backoff = Backoff::default();
    let pauses: Vec<u64> = (0..10)
        .map(|_| backoff.failed().as_millis() as u64)
        .collect();
    assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    backoff.succeeded();
    assert_eq!(backoff.failed(), Duration::from_millis(10));
}

/// Regression (issue 25): empty payloads counted 0 bytes against `publish.maxBytesInFlight`, so
/// any number of calls of 10,000 empty messages were admitted at once.
#[test]
fn empty_messages_take_a_fixed_overhead_from_the_publish_budget() {
    assert_eq!(publish_charge_bytes(0), MESSAGE_OVERHEAD_BYTES);
    assert_eq!(publish_charge_bytes(100), 100 + MESSAGE_OVERHEAD_BYTES);
    let batch: usize = (0..10_000).map(|_| publish_charge_bytes(0)).sum();
    let mut budget = BudgetCore::new(64 << 20);
    let mut admitted = 0;
    while budget.try_take(admitted, batch, 0) {
        admitted += 1;
        assert!(admitted <= 1_000, "the budget never fills");
    }
    assert_eq!(admitted as usize, (64 << 20) / batch);
}

#[test]
fn deliveries_blocked_past_the_send_stall_timeout_close_the_connection() {
    let limits = ClientLimits {
        send_stall_timeout_ms: 1000,
        ..ClientLimits::default()
    };
    let mut dog = Watchdog::new(&limits, 0);
    let blocked = |now_ms: u64, since: Option<u64>| Observation {
        send_blocked_since_ms: since,
        ..seen(now_ms, 10, 1, false, true)
    };
    assert_eq!(dog.observe(blocked(500, Some(100))), Verdict::Keep);
    assert_eq!(dog.observe(blocked(1099, Some(100))), Verdict::Keep);
    // A call returned: blocked again from 1200 on.
    assert_eq!(dog.observe(blocked(1150, None)), Verdict::Keep);
    assert_eq!(dog.observe(blocked(2100, Some(1200))), Verdict::Keep);
    assert_eq!(dog.observe(blocked(2200, Some(1200))), Verdict::SendStalled);
}

#[test]
fn a_large_frame_is_not_read_until_its_bytes_fit_the_budget_and_its_call_claims_them() {
    let publish = PublishConfig {
        bytes_in_flight_max: 512 << 10,
        ..PublishConfig::default()
    };
    let edge = EdgeLimits::new(
        ClientLimits::default(),
        &publish,
        ConnectionCount::new(4),
        1,
    );
    let conn = ConnectionUse::new(ClientLimits::default());
    let mut stream = frame(&[40_000]); // 320 KiB
    stream.extend(frame(&[40_000]));
    let frame_bytes = stream.len() / 2;
    let (g, progress) = gate(stream, 1 << 20);
    let mut g = g.admitted(Admission::new(conn.clone(), edge.clone()));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // Another publish holds 256 KiB: 320 KiB more do not fit, so the body is not read.
    let other = edge
        .budget
        .poll_take(&mut cx, edge.budget.next_ticket(), 256 << 10);
    let mut buf = vec![0u8; 1 << 20];
    assert!(Pin::new(&mut g).poll_read(&mut cx, &mut buf).is_pending());
    assert_eq!(progress.bytes.get(), 8, "only the segment table was read");
    drop(other);
    let mut read = 0;
    while read < frame_bytes {
        match Pin::new(&mut g).poll_read(&mut cx, &mut buf) {
            Poll::Ready(Ok(n)) => read += n,
            other => panic!("the admitted frame did not pass: {other:?}"),
        }
    }
    assert_eq!(
        edge.budget.in_use(),
        frame_bytes,
        "the frame's bytes are held for its call"
    );
    // The next large frame waits for the first to be claimed by its call.
    assert!(Pin::new(&mut g).poll_read(&mut cx, &mut buf).is_pending());
    assert!(
        conn.claim_frame(frame_bytes - 10_000).is_none(),
        "not this call's frame"
    );
    let claimed = conn
        .claim_frame(frame_bytes - 100)
        .expect("the call claims its frame");
    assert_eq!(claimed.bytes(), frame_bytes);
    // Claimed, but its call still holds the bytes: two frames do not fit in 512 KiB.
    assert!(Pin::new(&mut g).poll_read(&mut cx, &mut buf).is_pending());
    drop(claimed);
    assert!(Pin::new(&mut g).poll_read(&mut cx, &mut buf).is_ready());
}
