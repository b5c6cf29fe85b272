//! `pinq group policy --server ADDR --topic T --group G [--max-deliveries N]
//! [--dead-letter-topic NAME] [--backoff INITIAL:MAX]`: sets a consumer group's redelivery
//! policy on the broker (durably) and prints the policy in force. With no option it only prints
//! it. `--backoff none` switches backoff off for the group; `--dead-letter-topic ""` goes back
//! to the broker's default (`delivery.deadLetterTopic`).
//!
//! Output, one `key: value` per line (scripts may read it):
//! `topic: jobs` / `group: workers` / `maxDeliveries: 5` / `deadLetterTopic: jobs.dlq` /
//! `backoff: 100ms:10000ms` (or `none`).

use anyhow::Context;
use clap::{Args, Subcommand};

use super::client_cmds::block_on;
use super::UsageError;
use crate::client::Router;
use crate::pipeline::policy::{Backoff, PolicyOverride};

#[derive(Debug, Subcommand)]
pub enum GroupCommand {
    /// Set (or, with no option, show) a group's max deliveries, dead-letter topic and
    /// redelivery backoff.
    Policy(PolicyArgs),
}

#[derive(Debug, Args)]
pub struct PolicyArgs {
    /// The broker (in a cluster: the leader of the topic's shard).
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    #[arg(long)]
    pub topic: String,
    #[arg(long)]
    pub group: String,
    /// Deliveries of one message before it goes to the dead-letter topic; 0 = unlimited.
    #[arg(long)]
    pub max_deliveries: Option<u32>,
    /// Where dead letters go; `{topic}` stands for the topic. "" = the broker's default.
    #[arg(long)]
    pub dead_letter_topic: Option<String>,
    /// Exponential backoff of redeliveries after a plain NACK or a lease timeout, INITIAL:MAX
    /// (e.g. 100ms:10s), or `none`.
    #[arg(long)]
    pub backoff: Option<String>,
}

impl PolicyArgs {
    /// The overrides these flags name, checked before anything is sent.
    pub fn change(&self) -> Result<PolicyOverride, UsageError> {
        crate::key::validate_topic(&self.topic).map_err(|e| UsageError(format!("--topic: {e}")))?;
        if self.group.is_empty() {
            return Err(UsageError("--group must not be empty".into()));
        }
        let backoff = match self.backoff.as_deref().map(str::trim) {
            None => None,
            Some("none") => Some(None),
            Some(text) => Some(Some(
                Backoff::parse(text).map_err(|e| UsageError(format!("--backoff: {e}")))?,
            )),
        };
        Ok(PolicyOverride {
            max_deliveries: self.max_deliveries,
            dead_letter_topic: self.dead_letter_topic.clone(),
            backoff,
        })
    }
}

pub fn run(command: GroupCommand) -> anyhow::Result<()> {
    match command {
        GroupCommand::Policy(args) => policy(args),
    }
}

fn policy(args: PolicyArgs) -> anyhow::Result<()> {
    let change = args.change()?;
    let options = args.connect.router_options()?;
    block_on("pinq-group", move || {
        Box::pin(async move {
            let router = Router::connect(args.server.as_str(), options)
                .await
                .with_context(|| format!("connecting to {}", args.server))?;
            let policy = router
                .set_group_policy(&args.topic, &args.group, &change)
                .await
                .context("setGroupPolicy")?;
            println!("topic: {}", args.topic);
            println!("group: {}", args.group);
            println!("maxDeliveries: {}", policy.max_deliveries);
            println!("deadLetterTopic: {}", policy.dead_letter_topic);
            println!(
                "backoff: {}",
                policy
                    .backoff
                    .map_or_else(|| "none".to_owned(), |b| b.text())
            );
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(backoff: Option<&str>) -> PolicyArgs {
        PolicyArgs {
            server: "x".into(),
            connect: Default::default(),
            topic: "jobs".into(),
            group: "w".into(),
            max_deliveries: Some(3),
            dead_letter_topic: None,
            backoff: backoff.map(str::to_owned),
        }
    }

    #[test]
    fn flags_map_to_overrides_and_bad_backoff_is_a_usage_error() {
        let change = args(Some("100ms:10s")).change().unwrap();
        assert_eq!(change.max_deliveries, Some(3));
        assert_eq!(change.backoff, Some(Backoff::new(100, 10_000).ok()));
        assert_eq!(args(Some("none")).change().unwrap().backoff, Some(None));
        assert_eq!(args(None).change().unwrap().backoff, None);
        let err = args(Some("10s:1s")).change().unwrap_err();
        assert!(err.0.starts_with("--backoff"), "{err}");
    }
}
