//! `pinq bench`: a load generator over the real RPC that checks every message arrived and
//! reports throughput, the broker's CPU time and peak memory, and publish-ack, end-to-end
//! (publish → deliver) and ack latency from HdrHistograms (PRODUCT.md §8).
//!
//! Pure parts, tested without a broker: [`plan`] (the workload as data and the payload stamp),
//! [`tracker`] (exact delivery accounting) and [`report`] (percentiles, JSON, `.hgrm`, SVG).
//! Shells: [`broker`] (the `pinq serve` child process and `/proc` readings) and [`driver`] (the
//! glommio client threads). [`run`] wires them together and writes the files; the command line
//! lives in `crate::cli::bench_args`.

pub mod broker;
pub mod driver;
pub mod plan;
pub mod report;
pub mod tracker;

use std::path::PathBuf;

use anyhow::Context;

use self::broker::{Broker, ChildSpec};
use self::driver::{run_load, LoadOptions};
use self::report::{BrokerUsage, Percentiles, Series, Summary};

/// Where the broker comes from.
#[derive(Clone, Debug)]
pub enum Target {
    /// A broker already running; its pid, if given, is used to read its CPU time and memory.
    External { addr: String, pid: Option<u32> },
    /// A `pinq serve` child started for this run.
    Child(ChildSpec),
}

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct Options {
    pub target: Target,
    pub load: LoadOptions,
    /// The summary with exactly the documented keys.
    pub json: Option<PathBuf>,
    /// `.hgrm` files, the SVG plot and the text report.
    pub out_dir: PathBuf,
}

/// Runs a bench, prints the report, writes the files. Fails when messages went missing, after
/// writing everything, so scripts see both the figures and the failure.
pub fn run(options: &Options) -> anyhow::Result<Summary> {
    let broker = match &options.target {
        Target::External { addr, pid } => Broker::external(addr.clone(), *pid),
        Target::Child(spec) => Broker::start_child(spec)?,
    };
    let plan = &options.load.plan;
    eprintln!(
        "pinq bench: broker {}{}; {} producer(s), {} consumer(s) in {} group(s) + {} universal, \
         {} topic(s), {} B, {}, warm-up {:?}, measure {:?}",
        broker.addr,
        broker
            .pid
            .map(|p| format!(" (pid {p})"))
            .unwrap_or_default(),
        plan.producers,
        plan.consumers_per_group * plan.groups,
        plan.groups,
        plan.universal,
        plan.topics,
        plan.payload_bytes,
        plan.rate_per_sec
            .map(|r| format!("{r} msgs/s fixed"))
            .unwrap_or_else(|| "max rate".to_owned()),
        plan.warmup,
        plan.duration
    );
    let mut waits = Vec::with_capacity(3);
    let outcome = run_load(&broker.addr, &options.load, || {
        waits.push(broker.runqueue_wait_secs());
        broker.cpu_secs().unwrap_or(f64::NAN)
    })?;
    let runqueue_wait_secs = match waits.as_slice() {
        [Some(start), Some(end), ..] => Some(end - start),
        _ => None,
    };
    let usage = match (outcome.measured.as_slice(), broker.peak_rss_bytes()) {
        (&[start, end, drained], Some(peak_rss_bytes))
            if start.is_finite() && end.is_finite() && drained.is_finite() =>
        {
            Some(BrokerUsage {
                cpu_secs: end - start,
                peak_rss_bytes,
                drain_cpu_secs: drained - end,
                drain_secs: outcome.drain_secs,
                runqueue_wait_secs,
            })
        }
        _ => None,
    };
    drop(broker);

    let (msgs_per_sec, mb_per_sec) = report::throughput(
        outcome.received_in_window,
        plan.payload_bytes,
        outcome.window_secs,
    );
    let l = &outcome.latencies;
    let summary = Summary {
        msgs_per_sec,
        mb_per_sec,
        sent: outcome.tally.sent,
        received: outcome.tally.received,
        duplicates: outcome.tally.duplicates,
        missing: outcome.tally.missing,
        e2e_us: Percentiles::of(&l.e2e),
        publish_ack_us: Percentiles::of(&l.publish_ack),
        ack_us: Percentiles::of(&l.ack),
    };
    let text = report::text_report(&summary, outcome.window_secs, usage, outcome.tally.foreign);
    print!("{text}");
    if plan.rate_per_sec.is_some() && !l.send_lateness.is_empty() {
        let late = Percentiles::of(&l.send_lateness);
        println!(
            "load generator: sent each message after its intended time by p50 {} µs, p99 {} µs, \
             max {} µs (included in the latencies above)",
            late.p50, late.p99, late.max
        );
    }
    if outcome.errors > 0 {
        eprintln!(
            "pinq bench: {} call(s) failed, e.g. {:?}",
            outcome.errors, outcome.error_samples
        );
    }

    let dir = &options.out_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("e2e.hgrm", &report::hgrm(&l.e2e))?;
    write("publish_ack.hgrm", &report::hgrm(&l.publish_ack))?;
    write("ack.hgrm", &report::hgrm(&l.ack))?;
    let title = format!(
        "pinq bench: {} B, {}p/{}c, {}",
        plan.payload_bytes,
        plan.producers,
        plan.consumer_count(),
        plan.rate_per_sec
            .map(|r| format!("{r} msgs/s"))
            .unwrap_or_else(|| "max rate".to_owned())
    );
    write(
        "latency.svg",
        &report::svg_plot(
            &title,
            &[
                Series {
                    name: "end to end",
                    histogram: &l.e2e,
                    color: "#1f77b4",
                },
                Series {
                    name: "publish ack",
                    histogram: &l.publish_ack,
                    color: "#ff7f0e",
                },
                Series {
                    name: "ack",
                    histogram: &l.ack,
                    color: "#2ca02c",
                },
            ],
        ),
    )?;
    write("report.txt", &text)?;
    if let Some(path) = &options.json {
        let json = serde_json::to_string_pretty(&summary).context("encoding the JSON summary")?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!("pinq bench: wrote {}", dir.display());
    if summary.missing > 0 {
        anyhow::bail!("{} message copies never arrived", summary.missing);
    }
    Ok(summary)
}
