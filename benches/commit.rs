//! One WAL commit on this disk, two ways, interleaved in one run: a 4 KiB DMA write followed by
//! an fdatasync (two submissions, two reactor wake-ups), and the same write to a file opened
//! with `O_DSYNC` (one submission). Both overwrite a zero-filled, synced region, as WAL commits
//! do. Prints p50/p99/p99.9 of each in µs; the two alternate so a busy disk hits both alike.
//! A measuring program (harness = false).
//!
//! ```text
//! cargo bench --bench commit                      # PINQ_BENCH_COMMITS=2000, under target/
//! PINQ_BENCH_DIR=/path/on/the/disk cargo bench --bench commit
//! PINQ_BENCH_COMMIT_BYTES=65536 cargo bench --bench commit     # a max-rate group commit
//! ```

use std::path::PathBuf;
use std::time::Instant;

use pinq::storage::io as dio;

const REGION_BLOCKS: u64 = 256;

fn main() {
    let commits: usize = std::env::var("PINQ_BENCH_COMMITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let dir = std::env::var_os("PINQ_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/commit-bench"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench directory");
    let run_dir = dir.clone();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Fixed(0))
        .spawn(move || async move { run(&run_dir, commits).await })
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

async fn run(dir: &std::path::Path, commits: usize) {
    dio::probe_disk(dir).await.expect("probe");
    let plain_path = dir.join("plain.log");
    let dsync_path = dir.join("dsync.log");
    let plain = dio::open_rw(&plain_path, true).await.expect("open");
    let dsync = dio::open_rw_dsync(&dsync_path, true).await.expect("open");
    let region = REGION_BLOCKS * dio::WRITE_ALIGN as u64;
    for (file, path) in [(&plain, &plain_path), (&dsync, &dsync_path)] {
        dio::write_zeros(file, path, 0, region)
            .await
            .expect("zeros");
        dio::fdatasync(file, path).await.expect("sync");
    }
    dio::sync_dir_blocking(dir).expect("sync dir");
    // The bytes of one commit: 200 (a lone message) by default; a max-rate commit is tens of KiB.
    let record_bytes: usize = std::env::var("PINQ_BENCH_COMMIT_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
        .clamp(1, region as usize / 2);
    let record = vec![0x5Au8; record_bytes];
    let mut hist = [
        hdrhistogram::Histogram::<u64>::new(3).expect("histogram"),
        hdrhistogram::Histogram::<u64>::new(3).expect("histogram"),
    ];
    let mut cpu_ns = [0u64; 2];
    for i in 0..commits {
        let blocks = dio::align_up(record_bytes) / dio::WRITE_ALIGN;
        let slots = REGION_BLOCKS / blocks as u64;
        let pos = (i as u64 % slots) * (blocks * dio::WRITE_ALIGN) as u64;
        let (t, c) = (Instant::now(), thread_cpu_ns());
        dio::write_padded(&plain, &plain_path, pos, &record)
            .await
            .expect("write");
        dio::fdatasync(&plain, &plain_path).await.expect("sync");
        hist[0]
            .record(t.elapsed().as_micros() as u64)
            .expect("record");
        cpu_ns[0] += thread_cpu_ns() - c;
        let (t, c) = (Instant::now(), thread_cpu_ns());
        dio::write_padded(&dsync, &dsync_path, pos, &record)
            .await
            .expect("write");
        hist[1]
            .record(t.elapsed().as_micros() as u64)
            .expect("record");
        cpu_ns[1] += thread_cpu_ns() - c;
    }
    let names = ["write + fdatasync", "O_DSYNC write"];
    for ((name, h), cpu) in names.iter().zip(&hist).zip(cpu_ns) {
        println!(
            "{name:<18} commits {:>6}  cpu {:>5.1} µs  p50 {:>6} µs  p99 {:>6} µs  p99.9 {:>6} µs  max {:>6} µs",
            h.len(),
            cpu as f64 / 1e3 / h.len().max(1) as f64,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        );
    }
    let _ = dio::close(plain, &plain_path).await;
    let _ = dio::close(dsync, &dsync_path).await;
}
