//! `pinq-peers`: drives NATS JetStream or Redis Streams with the workload of `pinq bench`
//! (producers, one group of competing consumers with explicit acks, message size, max or fixed
//! rate) and writes a JSON summary with the same keys, so `perf/compare.sh` can print one table.
//!
//! Each producer and each consumer is one OS thread with one blocking TCP connection; the
//! brokers' protocols are spoken directly (see `redis.rs`, `nats.rs`). As in `pinq bench`,
//! every payload carries its producer, sequence number and (intended) send time, every delivery
//! is counted, and latency at a fixed rate is measured from the intended send time; the Redis
//! driver also reports `publish_call_us`, measured from when the batch was actually written.
//!
//!   pinq-peers nats|redis --server HOST:PORT [--producers N] [--consumers N] [--size B]
//!       [--rate N] [--warmup DUR] [--duration DUR] [--batch N] [--backlog-max N] --json FILE

mod nats;
mod redis;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

pub const HEADER_BYTES: usize = 24;

/// The workload and the shared counters of a run.
pub struct Run {
    pub server: String,
    pub producers: u32,
    pub consumers: u32,
    pub size: usize,
    pub rate: Option<u64>,
    pub warmup: Duration,
    pub duration: Duration,
    pub batch: usize,
    pub backlog_max: u64,
    pub origin: Instant,
    /// ns since `origin` when sending starts.
    pub start_ns: u64,
    pub stop: AtomicBool,
    pub sent: Vec<AtomicU64>,
    pub copies_sent: AtomicU64,
    pub copies_delivered: AtomicU64,
    pub received_in_window: AtomicU64,
    pub counts: Mutex<Vec<Vec<u8>>>,
    pub deliveries: AtomicU64,
}

impl Run {
    pub fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
    pub fn measure_start_ns(&self) -> u64 {
        self.start_ns + self.warmup.as_nanos() as u64
    }
    pub fn send_end_ns(&self) -> u64 {
        self.measure_start_ns() + self.duration.as_nanos() as u64
    }
    /// Intended send time of message `seq` of `producer` at a fixed rate.
    pub fn intended_ns(&self, producer: u32, seq: u64) -> Option<u64> {
        let rate = self.rate?;
        let index = u128::from(seq) * u128::from(self.producers) + u128::from(producer);
        Some(self.start_ns + (index * 1_000_000_000 / u128::from(rate)) as u64)
    }

    /// Whether a producer is done: at a fixed rate once every message due before the end is
    /// sent (late or not), at max rate at the end.
    pub fn finished(&self, producer: u32, seq: u64, now: u64) -> bool {
        match self.intended_ns(producer, seq) {
            Some(due) => due >= self.send_end_ns(),
            None => now >= self.send_end_ns(),
        }
    }

    /// How many messages a producer sends next (0: wait until `wait_ns`).
    pub fn next_batch(&self, producer: u32, seq: u64, now: u64) -> (usize, u64) {
        match self.rate {
            None => {
                let backlog = self
                    .copies_sent
                    .load(Ordering::Relaxed)
                    .saturating_sub(self.copies_delivered.load(Ordering::Relaxed));
                if self.backlog_max > 0 && backlog > self.backlog_max {
                    (0, now + 200_000)
                } else {
                    (self.batch, now)
                }
            }
            Some(_) => {
                let mut due = 0;
                while due < self.batch
                    && self
                        .intended_ns(producer, seq + due as u64)
                        .is_some_and(|t| t <= now && t < self.send_end_ns())
                {
                    due += 1;
                }
                let next = self.intended_ns(producer, seq).unwrap_or(now);
                (due, next)
            }
        }
    }

    /// Writes the stamp of a message into `payload`.
    pub fn stamp(&self, payload: &mut [u8], producer: u32, seq: u64, now: u64) {
        let sent = self.intended_ns(producer, seq).unwrap_or(now);
        payload[0..4].copy_from_slice(&producer.to_le_bytes());
        payload[4..12].copy_from_slice(&seq.to_le_bytes());
        payload[12..20].copy_from_slice(&sent.to_le_bytes());
        payload[20..24].copy_from_slice(b"PEER");
    }

    /// Records a delivered payload: counts it and its end-to-end latency.
    pub fn delivered(&self, payloads: &[&[u8]], e2e: &mut Histogram<u64>) {
        let now = self.now_ns();
        let mut counts = match self.counts.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        let mut in_window = 0;
        for payload in payloads {
            if payload.len() < HEADER_BYTES || &payload[20..24] != b"PEER" {
                continue;
            }
            let producer = u32::from_le_bytes(payload[0..4].try_into().unwrap_or([0; 4]));
            let seq = u64::from_le_bytes(payload[4..12].try_into().unwrap_or([0; 8]));
            let sent = u64::from_le_bytes(payload[12..20].try_into().unwrap_or([0; 8]));
            if let Some(c) = counts.get_mut(producer as usize) {
                if c.len() <= seq as usize {
                    c.resize((seq as usize + 1).next_power_of_two(), 0);
                }
                c[seq as usize] = c[seq as usize].saturating_add(1);
            }
            if sent >= self.measure_start_ns() {
                e2e.saturating_record(now.saturating_sub(sent) / 1000);
            }
            if now >= self.measure_start_ns() && now < self.send_end_ns() {
                in_window += 1;
            }
        }
        drop(counts);
        self.deliveries
            .fetch_add(payloads.len() as u64, Ordering::Relaxed);
        self.copies_delivered
            .fetch_add(payloads.len() as u64, Ordering::Relaxed);
        self.received_in_window
            .fetch_add(in_window, Ordering::Relaxed);
    }

    pub fn distinct(&self) -> u64 {
        let counts = match self.counts.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        counts
            .iter()
            .map(|c| c.iter().filter(|&&n| n > 0).count() as u64)
            .sum()
    }
}

/// Latency histograms of one thread.
pub struct Hists {
    pub e2e: Histogram<u64>,
    pub publish_ack: Histogram<u64>,
    /// A publish batch's round trip from when it was actually written (not from when it was
    /// due): the call itself, without the producer's own lateness in waking up for it.
    pub publish_call: Histogram<u64>,
    pub ack: Histogram<u64>,
}

impl Default for Hists {
    fn default() -> Hists {
        Hists::new()
    }
}

impl Hists {
    pub fn new() -> Hists {
        let h = || Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant bounds");
        Hists {
            e2e: h(),
            publish_ack: h(),
            publish_call: h(),
            ack: h(),
        }
    }
    fn add(&mut self, o: &Hists) {
        let _ = self.e2e.add(&o.e2e);
        let _ = self.publish_ack.add(&o.publish_ack);
        let _ = self.publish_call.add(&o.publish_call);
        let _ = self.ack.add(&o.ack);
    }
}

/// A broker driver.
pub trait Driver: Send + Sync + 'static {
    /// Creates the stream / group afresh.
    fn setup(&self, run: &Run) -> std::io::Result<()>;
    fn produce(&self, run: &Run, producer: u32, h: &mut Hists) -> std::io::Result<u64>;
    fn consume(&self, run: &Run, consumer: u32, h: &mut Hists) -> std::io::Result<()>;
}

fn parse_duration(s: &str) -> Duration {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .unwrap_or_else(|_| die(&format!("bad duration {s}")));
    match unit {
        "" | "s" => Duration::from_secs(n),
        "ms" => Duration::from_millis(n),
        "m" => Duration::from_secs(60 * n),
        _ => die(&format!("bad duration {s}")),
    }
}

fn die(msg: &str) -> ! {
    eprintln!("pinq-peers: {msg}");
    std::process::exit(2)
}

fn percentiles(h: &Histogram<u64>) -> serde_json::Value {
    let q = |x: f64| {
        if h.is_empty() {
            0
        } else {
            h.value_at_quantile(x)
        }
    };
    serde_json::json!({
        "p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "p999": q(0.999), "p9999": q(0.9999),
        "max": h.max(),
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(kind) = args.get(1).cloned() else {
        die("usage: pinq-peers nats|redis --server HOST:PORT [...] --json FILE")
    };
    let mut server = String::new();
    let (mut producers, mut consumers, mut size, mut batch, mut backlog_max) =
        (2u32, 2u32, 100usize, 256usize, 20_000u64);
    let mut rate = None;
    let (mut warmup, mut duration) = (Duration::from_secs(1), Duration::from_secs(10));
    let mut json = None;
    let mut i = 2;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--server" => server = v,
            "--producers" => producers = v.parse().unwrap_or_else(|_| die("--producers")),
            "--consumers" => consumers = v.parse().unwrap_or_else(|_| die("--consumers")),
            "--size" => size = v.parse().unwrap_or_else(|_| die("--size")),
            "--rate" => rate = Some(v.parse().unwrap_or_else(|_| die("--rate"))),
            "--batch" => batch = v.parse().unwrap_or_else(|_| die("--batch")),
            "--backlog-max" => backlog_max = v.parse().unwrap_or_else(|_| die("--backlog-max")),
            "--warmup" => warmup = parse_duration(&v),
            "--duration" => duration = parse_duration(&v),
            "--json" => json = Some(v),
            other => die(&format!("unknown flag {other}")),
        }
        i += 2;
    }
    if size < HEADER_BYTES {
        die(&format!("--size must be at least {HEADER_BYTES}"));
    }
    let driver: Arc<dyn Driver> = match kind.as_str() {
        "nats" => Arc::new(nats::Nats),
        "redis" => Arc::new(redis::Redis),
        _ => die("the first argument is nats or redis"),
    };
    let origin = Instant::now();
    let mut run = Run {
        server,
        producers,
        consumers,
        size,
        rate,
        warmup,
        duration,
        batch,
        backlog_max,
        origin,
        start_ns: 0,
        stop: AtomicBool::new(false),
        sent: (0..producers).map(|_| AtomicU64::new(0)).collect(),
        copies_sent: AtomicU64::new(0),
        copies_delivered: AtomicU64::new(0),
        received_in_window: AtomicU64::new(0),
        counts: Mutex::new(vec![Vec::new(); producers as usize]),
        deliveries: AtomicU64::new(0),
    };
    if let Err(e) = driver.setup(&run) {
        die(&format!("{kind} setup failed: {e}"));
    }
    run.start_ns = run.now_ns() + 200_000_000;
    let run = Arc::new(run);
    let mut handles = Vec::new();
    for c in 0..consumers {
        let (run, driver) = (run.clone(), driver.clone());
        handles.push(std::thread::spawn(move || {
            let mut h = Hists::new();
            if let Err(e) = driver.consume(&run, c, &mut h) {
                eprintln!("consumer {c}: {e}");
            }
            h
        }));
    }
    let mut producer_handles = Vec::new();
    for p in 0..producers {
        let (run, driver) = (run.clone(), driver.clone());
        producer_handles.push(std::thread::spawn(move || {
            let mut h = Hists::new();
            while run.now_ns() < run.start_ns {
                std::thread::sleep(Duration::from_millis(1));
            }
            match driver.produce(&run, p, &mut h) {
                Ok(sent) => run.sent[p as usize].store(sent, Ordering::Release),
                Err(e) => eprintln!("producer {p}: {e}"),
            }
            h
        }));
    }
    let mut total = Hists::new();
    for h in producer_handles {
        if let Ok(h) = h.join() {
            total.add(&h);
        }
    }
    let sent: u64 = run.sent.iter().map(|s| s.load(Ordering::Acquire)).sum();
    let deadline = run.now_ns() + 15_000_000_000;
    while run.distinct() < sent && run.now_ns() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    run.stop.store(true, Ordering::Release);
    for h in handles {
        if let Ok(h) = h.join() {
            total.add(&h);
        }
    }
    let received = run.distinct();
    let deliveries = run.deliveries.load(Ordering::Relaxed);
    let counts = match run.counts.lock() {
        Ok(c) => c,
        Err(p) => p.into_inner(),
    };
    let mut missing = 0u64;
    for (p, c) in counts.iter().enumerate() {
        let n = run.sent[p].load(Ordering::Acquire);
        missing += (0..n)
            .filter(|&s| c.get(s as usize).copied().unwrap_or(0) == 0)
            .count() as u64;
    }
    let per_sec = run.received_in_window.load(Ordering::Relaxed) as f64 / duration.as_secs_f64();
    let summary = serde_json::json!({
        "msgs_per_sec": per_sec,
        "mb_per_sec": per_sec * size as f64 / 1e6,
        "sent": sent,
        "received": received,
        "duplicates": deliveries.saturating_sub(received),
        "missing": missing,
        "e2e_us": percentiles(&total.e2e),
        "publish_ack_us": percentiles(&total.publish_ack),
        "publish_call_us": percentiles(&total.publish_call),
        "ack_us": percentiles(&total.ack),
    });
    let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
    println!("{text}");
    if let Some(path) = json {
        if let Err(e) = std::fs::write(&path, text + "\n") {
            die(&format!("writing {path}: {e}"));
        }
    }
}
