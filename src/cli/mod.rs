//! The `pinq` command line: the clap definitions of every subcommand and their exit codes.
//!
//! Only argument shapes live here (and, per subcommand, how its flags map onto the rest of
//! pinq); `src/main.rs` dispatches. Adding a subcommand is one variant of [`Command`] holding its
//! `clap::Args` struct (in its own file beside `serve_args.rs`) plus one match arm in `main.rs`.
//! Logs go to stderr, so a subcommand's stdout carries only its output (`pinq consume` prints
//! payloads there).

pub mod bench_args;
pub mod client_cmds;
pub mod cluster_cmds;
pub mod connect_args;
pub mod doctor_args;
pub mod group_cmds;
pub mod membership_cmds;
pub mod serve_args;
pub mod stats_cmds;

pub use bench_args::BenchArgs;
pub use client_cmds::{ConsumeArgs, PublishArgs, ServerArgs};
pub use doctor_args::DoctorArgs;
pub use serve_args::ServeArgs;

use clap::{Parser, Subcommand};

use crate::config::ConfigError;

/// pinq: a thread-per-core message broker for delayed and immediate delivery with
/// per-message acknowledgement.
#[derive(Debug, Parser)]
#[command(name = "pinq", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Every subcommand.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the broker: one pinned shard per CPU serving Cap'n Proto clients.
    ///
    /// Configuration, lowest precedence first: embedded defaults < --config FILE <
    /// PINQ_<SECTION>_<KEY> environment variables < these flags. See pinq.example.toml.
    Serve(ServeArgs),
    /// Publish messages (arguments, or one per line of stdin) and wait for their acknowledgement.
    Publish(PublishArgs),
    /// Consume messages: print each payload on its own line and ACK it (or NACK with --nack).
    Consume(ConsumeArgs),
    /// Print the broker's counters per shard and per group (`--json` for scripts).
    Stats(stats_cmds::StatsArgs),
    /// List topics with their stored, due, scheduled and in-flight messages.
    Topics(stats_cmds::StatsArgs),
    /// List the groups of a topic with their consumers, backlog and counters.
    Groups(stats_cmds::GroupsArgs),
    /// Print the broker's shards and the port of each.
    Topology(ServerArgs),
    /// Inspect a cluster (`pinq cluster status --server ADDR [--json]`), or convert a stopped
    /// standalone broker's data directory into a member's (`pinq cluster convert --data-dir DIR`).
    #[command(subcommand)]
    Cluster(cluster_cmds::ClusterCommand),
    /// Administer consumer groups: `pinq group policy --server ADDR --topic T --group G
    /// [--max-deliveries N] [--dead-letter-topic NAME] [--backoff INITIAL:MAX]`.
    #[command(subcommand)]
    Group(group_cmds::GroupCommand),
    /// Load-test a broker (one it starts, or --server): throughput, latency percentiles, and a
    /// check that every message arrived.
    Bench(BenchArgs),
    /// Check this host for running pinq (governor, SMT, isolated cores, IRQ affinity, THP,
    /// memlock, io_uring, O_DIRECT, NUMA) and say what to change.
    ///
    /// Exit status: 0 nothing to change, 1 warnings only, 2 pinq cannot run as configured.
    Doctor(DoctorArgs),
}

/// Exit status for a run that went wrong because of what the user asked for (bad configuration,
/// bad arguments), as clap itself uses for usage errors.
pub const EXIT_USAGE: u8 = 2;

/// Exit status for every other failure.
pub const EXIT_FAILURE: u8 = 1;

/// A usage error found after argument parsing (a combination clap cannot express, a value that
/// makes no sense): exits with [`EXIT_USAGE`], like clap's own.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit status for a subcommand's error: [`EXIT_USAGE`] when anywhere in its chain it is a
/// configuration or usage error, [`EXIT_FAILURE`] otherwise.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    let is_usage = err
        .chain()
        .any(|cause| cause.is::<ConfigError>() || cause.is::<UsageError>());
    if is_usage {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn config_and_usage_errors_exit_with_2_and_others_with_1() {
        let config_error = anyhow::Error::new(ConfigError::EnvNotUnicode {
            name: "PINQ_SERVER_LISTEN".to_owned(),
        })
        .context("loading the configuration");
        assert_eq!(exit_code(&config_error), EXIT_USAGE);
        let usage = anyhow::Error::new(UsageError("--count must be positive".to_owned()));
        assert_eq!(exit_code(&usage), EXIT_USAGE);
        assert_eq!(exit_code(&anyhow::anyhow!("disk gone")), EXIT_FAILURE);
    }
}
