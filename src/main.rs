#![deny(clippy::unwrap_used)]
//! The `pinq` binary: parses the command line, sets up logging and runs one subcommand.
//!
//! The clap definitions live in `pinq::cli`; this file only dispatches. Adding a subcommand is
//! one variant of `pinq::cli::Command` plus one arm in `main` below. A subcommand returns
//! `anyhow::Result<()>`; its error is printed to stderr and decides the exit status
//! (`pinq::cli::exit_code`: 2 for bad configuration or usage, 1 otherwise).

use std::process::ExitCode;

use clap::Parser;
use pinq::cli::{self, Cli, Command, ServeArgs};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The client commands print their results on stdout for scripts; their stderr carries only
    // warnings and errors unless RUST_LOG asks for more.
    let quiet = matches!(
        cli.command,
        Command::Publish(_)
            | Command::Consume(_)
            | Command::Stats(_)
            | Command::Topics(_)
            | Command::Groups(_)
            | Command::Topology(_)
            | Command::Cluster(_)
            | Command::Group(_)
    );
    init_logging(if quiet { "warn" } else { "info" });
    let outcome = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Publish(args) => cli::client_cmds::publish(args),
        Command::Consume(args) => cli::client_cmds::consume(args),
        Command::Stats(args) => cli::stats_cmds::stats(args),
        Command::Topics(args) => cli::stats_cmds::topics(args),
        Command::Groups(args) => cli::stats_cmds::groups(args),
        Command::Topology(args) => cli::client_cmds::topology(args),
        Command::Cluster(command) => cli::cluster_cmds::run(command),
        Command::Group(command) => cli::group_cmds::run(command),
        Command::Bench(args) => bench(&args),
        // Doctor's exit status is its verdict, not an error.
        Command::Doctor(args) => {
            return ExitCode::from(pinq::ops::doctor::run(
                &args.cpus,
                &args.data_dir,
                args.tls_cert.as_deref(),
            ))
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("pinq: error: {err:#}");
            ExitCode::from(cli::exit_code(&err))
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (else `default`); colours only on a terminal.
fn init_logging(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// `pinq serve`: builds the configuration (defaults < file < `PINQ_` env < flags), logs it and
/// runs the broker until it is told to stop.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let env = pinq::config::env_from_process()?;
    let mut config = args.load_config(env)?;
    pinq::ops::numa::apply(&mut config)?;
    tracing::info!(
        shards = config.server.cpus.len(),
        cpus = %config.server.cpus,
        listen = %config.server.listen,
        metrics = %config.server.metrics_listen,
        storage = config.storage.engine.as_str(),
        data_dir = %config.server.data_dir.display(),
        "starting pinq serve"
    );
    tracing::info!("effective configuration:\n{}", config.to_toml());
    pinq::server::run(config)
}

/// `pinq bench`: runs the load and writes the reports.
fn bench(args: &cli::BenchArgs) -> anyhow::Result<()> {
    let options = args.to_options()?;
    pinq::bench::run(&options).map(|_| ())
}
