//! The WAL's group commit with one round in flight against two (pipelined), interleaved in one
//! run: durable appends arrive at a fixed rate (open loop, 10,000/s by default, as
//! `perf/low-rate.sh` offers them), each waits for its fdatasync, and the time from its
//! intended arrival to `wait_durable` resolving is recorded. Prints, per bound, p50/p99/p99.9 of
//! that latency, fdatasyncs per record and the executor's CPU per record; phases of the two
//! bounds alternate so a busy disk hits both alike. A measuring program (harness = false).
//!
//! ```text
//! cargo bench --bench wal_pipeline                          # under target/, 10,000/s
//! PINQ_BENCH_DIR=/path/on/the/disk PINQ_BENCH_WAL_RATE=2000 cargo bench --bench wal_pipeline
//! PINQ_BENCH_WAL_PHASES=6 PINQ_BENCH_WAL_RECORDS=5000 PINQ_BENCH_WAL_BYTES=200 ...
//! PINQ_BENCH_WAL_BOUNDS=1,2,3 cargo bench --bench wal_pipeline    # the bounds compared
//! ```

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use pinq::log::wal::{Payload, Wal};

/// A record payload of fixed bytes (the WAL does not decode what it writes).
struct Filler(Vec<u8>);

impl Payload for Filler {
    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0);
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Settings {
    rate: u64,
    records: u64,
    phases: usize,
    bytes: usize,
}

fn main() {
    let settings = Settings {
        rate: env_or("PINQ_BENCH_WAL_RATE", 10_000u64).max(1),
        records: env_or("PINQ_BENCH_WAL_RECORDS", 5_000u64),
        phases: env_or("PINQ_BENCH_WAL_PHASES", 6usize),
        bytes: env_or("PINQ_BENCH_WAL_BYTES", 200usize),
    };
    let dir = std::env::var_os("PINQ_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/wal-pipeline-bench"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench directory");
    // Absolute: glommio opens a directory through io_uring, which fails a relative path (EBADF).
    let dir = std::fs::canonicalize(&dir).expect("bench directory");
    let run_dir = dir.clone();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Fixed(0))
        .spawn(move || async move { run(&run_dir, &settings).await })
        .expect("executor")
        .join()
        .expect("bench");
    let _ = std::fs::remove_dir_all(&dir);
}

/// CPU time of the calling thread (the executor's), in ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[derive(Default)]
struct Totals {
    hist: Option<hdrhistogram::Histogram<u64>>,
    /// p50 of each phase, in µs: pairs that disagree show a noisy machine.
    phase_p50_us: Vec<u64>,
    records: u64,
    fsyncs: u64,
    cpu_ns: u64,
}

async fn run(dir: &Path, settings: &Settings) {
    pinq::storage::io::probe_disk(dir).await.expect("probe");
    let bounds: Vec<usize> = std::env::var("PINQ_BENCH_WAL_BOUNDS")
        .unwrap_or_else(|_| "1,2".to_string())
        .split(',')
        .filter_map(|b| b.trim().parse().ok())
        .collect();
    let mut totals: Vec<Totals> = bounds.iter().map(|_| Totals::default()).collect();
    for phase in 0..settings.phases {
        for (i, &bound) in bounds.iter().enumerate() {
            let sub = dir.join(format!("phase-{phase}-{bound}"));
            std::fs::create_dir_all(&sub).expect("phase directory");
            phase_run(&sub, bound, settings, &mut totals[i]).await;
            let _ = std::fs::remove_dir_all(&sub);
        }
    }
    for (bound, t) in bounds.iter().zip(&totals) {
        let Some(h) = &t.hist else { continue };
        println!(
            "rounds in flight {bound}: records {:>6}  fsyncs/record {:.2}  cpu {:>5.1} µs/record  p50 {:>6} µs  p99 {:>6} µs  p99.9 {:>6} µs  max {:>6} µs",
            t.records,
            t.fsyncs as f64 / t.records.max(1) as f64,
            t.cpu_ns as f64 / 1e3 / t.records.max(1) as f64,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        );
    }
    for (bound, t) in bounds.iter().zip(&totals) {
        println!(
            "rounds in flight {bound}: p50 per phase µs {:?}",
            t.phase_p50_us
        );
    }
}

/// One phase: `settings.records` durable appends at `settings.rate`, rounds bounded by `bound`.
async fn phase_run(dir: &Path, bound: usize, settings: &Settings, totals: &mut Totals) {
    let wal = Rc::new(Wal::new(dir, 1, Vec::new(), 64 << 20, 8 << 20));
    wal.set_rounds_in_flight_max(bound);
    wal.start();
    let hist = Rc::new(std::cell::RefCell::new(
        hdrhistogram::Histogram::<u64>::new(3).expect("histogram"),
    ));
    let filler = Filler(vec![0x5A; settings.bytes.max(4)]);
    let interval = Duration::from_nanos(1_000_000_000 / settings.rate);
    let (fsyncs0, cpu0) = (wal.counters().fsyncs, thread_cpu_ns());
    let start = Instant::now();
    let mut waiters = Vec::with_capacity(settings.records as usize);
    for n in 0..settings.records {
        let intended = start + interval * n as u32;
        let now = Instant::now();
        if intended > now {
            glommio::timer::sleep(intended - now).await;
        }
        let seq = wal.append(&filler).expect("append");
        let (wal, hist) = (Rc::clone(&wal), Rc::clone(&hist));
        waiters.push(glommio::spawn_local(async move {
            wal.wait_durable(seq).await.expect("durable");
            let us = intended.elapsed().as_micros() as u64;
            hist.borrow_mut().record(us).expect("record");
        }));
    }
    for w in waiters {
        w.await;
    }
    totals.cpu_ns += thread_cpu_ns() - cpu0;
    totals.fsyncs += wal.counters().fsyncs - fsyncs0;
    totals.records += settings.records;
    wal.shutdown().await.expect("shutdown");
    let h = hist.borrow();
    totals.phase_p50_us.push(h.value_at_quantile(0.5));
    match &mut totals.hist {
        Some(all) => all.add(&*h).expect("histograms"),
        None => totals.hist = Some(h.clone()),
    }
}
