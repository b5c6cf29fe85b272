//! `pinq bench` flags, and how they become a [`crate::bench::Options`].
//!
//! Exact form: `pinq bench [--server ADDR [--broker-pid PID]] [--broker-cpus LIST]
//! [--storage memory|lsm] [--producers N] [--consumers N] [--groups N] [--universal N]
//! [--topics N] [--size BYTES] [--delay-mix SPEC] [--nack-ratio F] [--rate MSGS_PER_SEC]
//! [--warmup DUR] [--duration DUR] [--json FILE] [--out-dir DIR]`, plus tuning flags below.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::client_cmds::AckArg;
use super::UsageError;
use crate::bench::broker::ChildSpec;
use crate::bench::driver::LoadOptions;
use crate::bench::plan::{DelayMix, Plan};
use crate::bench::{Options, Target};
use crate::config::CpuList;

fn parse_duration(text: &str) -> Result<Duration, String> {
    match text {
        "0" => Ok(Duration::ZERO),
        _ => humantime::parse_duration(text)
            .map_err(|e| format!("{text:?} is not a duration like 500ms or 2s: {e}")),
    }
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Drive this running broker instead of starting one.
    #[arg(long, value_name = "ADDR")]
    pub server: Option<String>,
    /// With --server: TLS and token of the bench's connections.
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    /// With --server: the broker's process id, to report its CPU time and peak memory.
    #[arg(long, value_name = "PID", requires = "server")]
    pub broker_pid: Option<u32>,
    /// CPUs of the broker the bench starts (`pinq serve --cpus`).
    #[arg(
        long,
        value_name = "LIST",
        default_value = "0",
        conflicts_with = "server"
    )]
    pub broker_cpus: String,
    /// Storage engine of the broker the bench starts.
    #[arg(long, value_parser = ["memory", "lsm"], default_value = "memory", conflicts_with = "server")]
    pub storage: String,
    /// Producers, one connection each.
    #[arg(long, default_value_t = 1)]
    pub producers: u32,
    /// Consumers in each group, one connection each.
    #[arg(long, default_value_t = 1)]
    pub consumers: u32,
    /// Consumer groups; each gets every message once.
    #[arg(long, default_value_t = 1)]
    pub groups: u32,
    /// Universal (fan-out) consumers; each gets every message.
    #[arg(long, default_value_t = 0)]
    pub universal: u32,
    /// Topics; messages go round robin over them and every consumer subscribes to all.
    #[arg(long, default_value_t = 1)]
    pub topics: u32,
    /// Payload bytes per message (at least 32: the bench's sequence number and timestamps).
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    /// Delays and their weights, e.g. "0:90,1s:10"; latency is then measured from when each
    /// message became due. Default: every message due at once.
    #[arg(long, value_name = "SPEC")]
    pub delay_mix: Option<String>,
    /// Fraction of first deliveries the consumers nack (redelivered at once).
    #[arg(long, default_value_t = 0.0)]
    pub nack_ratio: f64,
    /// Fixed publish rate over all producers, in messages per second; latency is measured from
    /// each message's intended send time (coordinated-omission correction). Absent: max rate.
    #[arg(long, value_name = "MSGS_PER_SEC")]
    pub rate: Option<u64>,
    /// Load before measuring starts.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub warmup: Duration,
    /// Measured time.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub duration: Duration,
    /// Write the JSON summary here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Directory for the .hgrm files, latency.svg and report.txt.
    #[arg(long, value_name = "DIR", default_value = "pinq-bench-out")]
    pub out_dir: PathBuf,
    /// Messages per publish batch (the most per batch at a fixed rate).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Publish batches in flight per producer.
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    /// Client threads (glommio executors, not pinned) carrying producers and consumers.
    #[arg(long, default_value_t = 2)]
    pub client_threads: usize,
    /// Pin the client threads to these CPUs (a list like 1 or 2-3), round robin; absent: not
    /// pinned. On a small machine, keeping them off the broker's CPUs keeps the load generator
    /// from competing with the broker.
    #[arg(long, value_name = "LIST")]
    pub client_cpus: Option<String>,
    /// Deliveries queued per consumer (0: the broker's default).
    #[arg(long, default_value_t = 0)]
    pub consumer_queue: u32,
    /// Consumers group their ACKs into one call per this window (`Subscription::ack_group`);
    /// 0: one ack call per delivered batch.
    #[arg(long, value_parser = parse_duration, default_value = "0", value_name = "DUR")]
    pub ack_group: Duration,
    /// The client threads poll this long for work before their executors sleep (glommio's
    /// `spin_before_park`, as `server.idlePoll` does for the broker); 0: sleep at once. Shows
    /// how much of a latency is the client's own sleep and wake-up.
    #[arg(long, value_parser = parse_duration, default_value = "0", value_name = "DUR")]
    pub client_idle_poll: Duration,
    /// Acknowledgement level of publishes.
    #[arg(long, value_enum, default_value = "durable")]
    pub ack: AckArg,
    /// Level of the consumers' ACKs and NACKs: `durable` (answered once committed) or `leader`
    /// (answered once accepted in memory).
    #[arg(long, value_enum, default_value = "durable")]
    pub ack_level: AckArg,
    /// Longest wait for the last deliveries after sending ends (beyond the longest delay).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub drain_timeout: Duration,
    /// At max rate, producers pause while more than this many message copies are sent and not
    /// yet delivered (0: no limit; the backlog, and so the end-to-end latency, then grow for as
    /// long as producers outpace consumers).
    #[arg(long, default_value_t = 20_000)]
    pub backlog_max: u64,
    /// Seeds the delay and nack choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl BenchArgs {
    /// The validated options of a run.
    pub fn to_options(&self) -> Result<Options, UsageError> {
        let delays = match &self.delay_mix {
            Some(spec) => {
                DelayMix::parse(spec).map_err(|e| UsageError(format!("--delay-mix: {e}")))?
            }
            None => DelayMix::immediate(),
        };
        let run_id = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() % 1_000_000_000)
            .unwrap_or(0);
        let plan = Plan {
            producers: self.producers,
            consumers_per_group: self.consumers,
            groups: self.groups,
            universal: self.universal,
            topics: self.topics,
            payload_bytes: self.size,
            delays,
            nack_ratio: self.nack_ratio,
            rate_per_sec: self.rate,
            warmup: self.warmup,
            duration: self.duration,
            batch_len_max: self.batch,
            publish_window: self.window,
            seed: self.seed,
            topic_prefix: format!("bench-{}-{run_id}", std::process::id()),
        }
        .validate()
        .map_err(|e| UsageError(e.to_string()))?;
        if self.duration.is_zero() {
            return Err(UsageError("--duration must be positive".to_owned()));
        }
        let target = match &self.server {
            Some(addr) => Target::External {
                addr: addr.clone(),
                pid: self.broker_pid,
            },
            None => Target::Child(ChildSpec {
                cpus: self.broker_cpus.clone(),
                storage: self.storage.clone(),
                env: Vec::new(),
            }),
        };
        Ok(Options {
            target,
            load: LoadOptions {
                plan,
                client_threads: self.client_threads,
                client_cpus: match &self.client_cpus {
                    Some(list) => CpuList::parse(list)
                        .map_err(|e| UsageError(format!("--client-cpus: {e}")))?
                        .cpus()
                        .to_vec(),
                    None => Vec::new(),
                },
                consumer_queue_len: self.consumer_queue,
                ack_group: self.ack_group,
                client_idle_poll: self.client_idle_poll,
                ack_level: self.ack.into(),
                settle_level: self.ack_level.into(),
                drain_timeout: self.drain_timeout,
                backlog_max: self.backlog_max,
                security: self
                    .connect
                    .security()
                    .map_err(|e| UsageError(format!("{e:#}")))?,
            },
            json: self.json.clone(),
            out_dir: self.out_dir.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn bench(argv: &[&str]) -> Result<crate::bench::Options, String> {
        let mut full = vec!["pinq", "bench"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full) {
            Ok(Cli {
                command: Command::Bench(args),
            }) => args.to_options().map_err(|e| e.to_string()),
            Ok(_) => Err("not bench".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn the_must_work_command_parses() {
        let o = bench(&[
            "--producers",
            "2",
            "--consumers",
            "2",
            "--size",
            "100",
            "--duration",
            "5s",
            "--json",
            "out.json",
        ])
        .expect("valid");
        assert_eq!(o.load.plan.producers, 2);
        assert_eq!(o.load.plan.consumer_count(), 2);
        assert!(matches!(o.target, crate::bench::Target::Child(_)));
    }

    #[test]
    fn fixed_rate_delay_mix_and_zero_warmup_parse() {
        let o = bench(&[
            "--rate",
            "10000",
            "--delay-mix",
            "0:90,1s:10",
            "--warmup",
            "0s",
            "--server",
            "127.0.0.1:7400",
        ])
        .expect("valid");
        assert_eq!(o.load.plan.rate_per_sec, Some(10_000));
        assert_eq!(o.load.plan.delays.delay_ms_max(), 1000);
        assert!(o.load.plan.warmup.is_zero());
    }

    #[test]
    fn bad_values_are_usage_errors() {
        assert!(bench(&["--size", "8"]).is_err());
        assert!(bench(&["--delay-mix", "1s"]).is_err());
        assert!(bench(&["--nack-ratio", "1.5"]).is_err());
        assert!(bench(&["--rate", "0"]).is_err());
        assert!(bench(&["--broker-pid", "1"]).is_err());
    }
}
