//! `pinq publish`, `pinq consume`, `pinq stats` and `pinq topology`: the broker's CLI for people
//! and scripts, over the client library on a single glommio executor.
//!
//! Exact forms (scripts depend on them):
//! - `pinq publish --server ADDR --topic T [--delay DUR] [--ttl DUR] [--ack durable|leader|none] [MESSAGE...]`
//!   (no MESSAGE: one message per line of stdin, sent in batches); exits 0 once every message is
//!   acknowledged at the requested level.
//! - `pinq consume --server ADDR --topic T [--group G] [--count N] [--timeout DUR] [--nack]
//!   [--ack-level durable|leader]`: prints each payload on its own line, then ACKs (or NACKs)
//!   it, at `durable` unless told otherwise (the ACK is committed before the next batch);
//!   never handles more than N; exits 0 when N are handled or DUR has passed.
//! - `pinq stats --server ADDR`, `pinq topology --server ADDR`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use glommio::{LocalExecutorBuilder, Placement};

use super::UsageError;
use std::rc::Rc;

use crate::client::{Client, ClientError, Router, Subscription};
use crate::config::AckLevel;
use crate::rpc::PublishMessage;

/// Messages per publish batch when reading stdin.
const STDIN_BATCH_LEN: usize = 256;
/// Publish batches in flight at once.
const PUBLISH_WINDOW: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AckArg {
    Durable,
    Leader,
    None,
}

impl From<AckArg> for AckLevel {
    fn from(a: AckArg) -> AckLevel {
        match a {
            AckArg::Durable => AckLevel::Durable,
            AckArg::Leader => AckLevel::Leader,
            AckArg::None => AckLevel::None,
        }
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration like 500ms or 2s: {e}"))
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// Broker address, e.g. 127.0.0.1:7400.
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    /// Topic to publish to.
    #[arg(long)]
    pub topic: String,
    /// Deliver no earlier than this after publishing (e.g. 500ms, 10s).
    #[arg(long, value_parser = parse_duration)]
    pub delay: Option<Duration>,
    /// Expire the message this long after publishing (never by default).
    #[arg(long, value_parser = parse_duration)]
    pub ttl: Option<Duration>,
    /// Acknowledgement level to wait for.
    #[arg(long, value_enum, default_value = "durable")]
    pub ack: AckArg,
    /// Idempotent publish: number the messages under this producer id, so running the same
    /// command again (after a failure) stores none of them twice within publish.dedupWindow.
    #[arg(long)]
    pub producer_id: Option<String>,
    /// With --producer-id: the first message's sequence number; the next get N+1, N+2, ...
    #[arg(long, default_value_t = 1, requires = "producer_id")]
    pub first_sequence: u64,
    /// Messages to publish; without any, each line of stdin is one message.
    pub messages: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ConsumeArgs {
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
    #[arg(long)]
    pub topic: String,
    /// Consumer group (competing consumers); empty or absent: a universal (fan-out) consumer.
    #[arg(long, default_value = "")]
    pub group: String,
    /// Handle at most this many messages, then exit.
    #[arg(long)]
    pub count: Option<u64>,
    /// Exit after this long, however many messages were handled.
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// NACK each message instead of ACKing it (it will be redelivered).
    #[arg(long)]
    pub nack: bool,
    /// When the broker answers an ACK (or NACK): `durable` once it is committed (the message
    /// is never delivered again, even after a crash or failover), `leader` once the broker
    /// accepted it in memory.
    #[arg(long, value_enum, default_value = "durable")]
    pub ack_level: AckArg,
}

#[derive(Debug, Args)]
pub struct ServerArgs {
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    #[command(flatten)]
    pub connect: super::connect_args::ConnectArgs,
}

fn ms(d: Option<Duration>) -> i64 {
    d.map_or(0, |d| d.as_millis().min(i64::MAX as u128) as i64)
}

/// Runs a client future on a one-off glommio executor.
pub(crate) fn block_on<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<T>>>>
        + Send
        + 'static,
) -> anyhow::Result<T> {
    LocalExecutorBuilder::new(Placement::Unbound)
        .name(name)
        .spawn(move || async move { f().await })
        .map_err(|e| anyhow::anyhow!("starting the client executor: {e}"))?
        .join()
        .map_err(|e| anyhow::anyhow!("client executor failed: {e}"))?
}

pub fn publish(args: PublishArgs) -> anyhow::Result<()> {
    crate::key::validate_topic(&args.topic).map_err(|e| UsageError(format!("--topic: {e}")))?;
    if let Some(id) = &args.producer_id {
        if id.is_empty() || id.len() > crate::rpc::PRODUCER_ID_LEN_MAX {
            return Err(UsageError(format!(
                "--producer-id: must be 1 to {} bytes",
                crate::rpc::PRODUCER_ID_LEN_MAX
            ))
            .into());
        }
    }
    block_on("pinq-publish", move || {
        Box::pin(async move {
            // Follows the topic's leader in a cluster (and across a failover); one connection
            // to a standalone broker.
            let router = Rc::new(
                Router::connect(args.server.as_str(), args.connect.router_options()?)
                    .await
                    .with_context(|| format!("connecting to {}", args.server))?,
            );
            let sequences = std::cell::Cell::new(args.first_sequence);
            let make = |payload: Vec<u8>| {
                let message = PublishMessage {
                    delay_ms: ms(args.delay) as u64,
                    ttl_ms: ms(args.ttl) as u64,
                    ..PublishMessage::new(args.topic.clone(), payload)
                };
                match &args.producer_id {
                    Some(id) => {
                        let sequence = sequences.get();
                        sequences.set(sequence.wrapping_add(1));
                        message.with_sequence(id.clone(), sequence)
                    }
                    None => message,
                }
            };
            let mut window = PublishWindow::new(router, args.ack.into());
            let mut sent = 0usize;
            if args.messages.is_empty() {
                let stdin = std::io::stdin();
                let mut batch = Vec::with_capacity(STDIN_BATCH_LEN);
                for line in stdin.lock().lines() {
                    let line = line.context("reading stdin")?;
                    batch.push(make(line.into_bytes()));
                    if batch.len() == STDIN_BATCH_LEN {
                        let first = sent;
                        sent += batch.len();
                        window.send(std::mem::take(&mut batch), first).await?;
                    }
                }
                if !batch.is_empty() {
                    let first = sent;
                    sent += batch.len();
                    window.send(batch, first).await?;
                }
            } else {
                let batch: Vec<PublishMessage> = args
                    .messages
                    .iter()
                    .map(|m| make(m.clone().into_bytes()))
                    .collect();
                sent += batch.len();
                window.send(batch, 0).await?;
            }
            window.flush().await?;
            tracing::info!(messages = sent, topic = %args.topic, "published");
            Ok(())
        })
    })
}

/// A batch being published: the number (from 0) of its first message among all the command
/// publishes, and its reply.
type InFlight = (usize, glommio::task::JoinHandle<Result<(), ClientError>>);

/// Up to [`PUBLISH_WINDOW`] batches in flight through a [`Router`], answered in order.
struct PublishWindow {
    router: Rc<Router>,
    ack: AckLevel,
    in_flight: std::collections::VecDeque<InFlight>,
}

impl PublishWindow {
    fn new(router: Rc<Router>, ack: AckLevel) -> PublishWindow {
        PublishWindow {
            router,
            ack,
            in_flight: std::collections::VecDeque::new(),
        }
    }

    /// Sends `batch`, whose first message is message `first` (from 0) of the command's input.
    async fn send(&mut self, batch: Vec<PublishMessage>, first: usize) -> anyhow::Result<()> {
        if self.in_flight.len() >= PUBLISH_WINDOW {
            self.wait_oldest().await?;
        }
        let router = self.router.clone();
        let ack = self.ack;
        let task =
            glommio::spawn_local(async move { router.publish(&batch, ack).await.map(|_| ()) })
                .detach();
        self.in_flight.push_back((first, task));
        Ok(())
    }

    async fn wait_oldest(&mut self) -> anyhow::Result<()> {
        if let Some((first, task)) = self.in_flight.pop_front() {
            match task.await {
                Some(Err(e)) => return Err(publish_failed(e, first)),
                Some(Ok(())) => {}
                None => anyhow::bail!("publishing: the publish task was cancelled"),
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        while !self.in_flight.is_empty() {
            self.wait_oldest().await?;
        }
        Ok(())
    }
}

/// A failed batch as the user reads it: a typed refusal names the message (counting from 1
/// over the whole input: the argument or the line of stdin) that the broker refused.
fn publish_failed(e: ClientError, first: usize) -> anyhow::Error {
    let index = e.refused_index();
    let context = match index {
        Some(i) => format!(
            "publishing: message {} was refused, nothing of its batch was stored",
            first + i as usize + 1
        ),
        None => "publishing".to_owned(),
    };
    anyhow::Error::new(e).context(context)
}

pub fn consume(args: ConsumeArgs) -> anyhow::Result<()> {
    crate::key::validate_topic(&args.topic).map_err(|e| UsageError(format!("--topic: {e}")))?;
    if args.count == Some(0) {
        return Ok(());
    }
    block_on("pinq-consume", move || {
        Box::pin(async move {
            let deadline = args.timeout.map(|t| Instant::now() + t);
            let limit = args.count.unwrap_or(u64::MAX);
            let router = Router::connect(args.server.as_str(), args.connect.router_options()?)
                .await
                .with_context(|| format!("connecting to {}", args.server))?;
            let mut subscription = subscribe_for(&router, &args, limit)
                .await
                .context("subscribing")?;
            let mut handled = 0u64;
            let stdout = std::io::stdout();
            while handled < limit {
                let wait = match deadline {
                    Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                        Some(left) => left,
                        None => break,
                    },
                    None => Duration::from_secs(3600),
                };
                let want = (limit - handled).min(256) as usize;
                let batch = futures_lite::future::or(
                    async { Some(subscription.recv_batch(want).await) },
                    async {
                        glommio::timer::sleep(wait).await;
                        None
                    },
                )
                .await;
                let batch = match batch {
                    // --timeout passed (or an hour without messages): look at the deadline.
                    None => continue,
                    Some(Ok(batch)) => batch,
                    // In a cluster the shard moved to another leader, or this node went away:
                    // subscribe again on the leader the router finds (within its patience).
                    Some(Err(e)) if router.is_cluster() => {
                        tracing::info!(topic = %args.topic, "subscription ended ({e}); subscribing again");
                        subscription = subscribe_for(&router, &args, limit - handled)
                            .await
                            .context("subscribing again")?;
                        continue;
                    }
                    // A standalone broker that closed the connection is gone: say so and fail.
                    Some(Err(e)) => {
                        return Err(anyhow::Error::new(e)
                            .context(format!("consuming {} from {}", args.topic, args.server)))
                    }
                };
                let take = batch.len().min((limit - handled) as usize);
                {
                    let mut out = stdout.lock();
                    for delivery in &batch[..take] {
                        out.write_all(&delivery.payload)?;
                        out.write_all(b"\n")?;
                    }
                    out.flush()?;
                }
                let tags: Vec<_> = batch[..take].iter().map(|d| d.tag).collect();
                subscription.set_ack_level(args.ack_level.into());
                let settled = if args.nack {
                    subscription.nack(&tags, 0).await
                } else {
                    subscription.ack(&tags).await
                };
                match settled {
                    Ok(_) => handled += take as u64,
                    // The leader went away before the settle: these copies will be delivered
                    // again (printed again) by the new leader; they are not counted.
                    Err(e @ (ClientError::Disconnected(_) | ClientError::NotLeader(_))) => {
                        tracing::info!("settle failed ({e}); subscribing again");
                    }
                    Err(e) => return Err(anyhow::Error::new(e).context("ack")),
                }
            }
            subscription.close().await.ok();
            Ok(())
        })
    })
}

/// Subscribes `pinq consume` for at most `left` more deliveries (`u64::MAX`: no `--count`).
/// Never take more than we may handle: a consumer that exits holding copies would only delay
/// them until its disconnect releases them, and a copy it NACKed would come back to it (one
/// more, unshown, delivery attempt) before it exits.
async fn subscribe_for(
    router: &Router,
    args: &ConsumeArgs,
    left: u64,
) -> Result<Subscription, ClientError> {
    if left == u64::MAX {
        router.subscribe(&args.topic, &args.group, 1024).await
    } else {
        router
            .subscribe_at_most(&args.topic, &args.group, left)
            .await
    }
}

pub fn topology(args: ServerArgs) -> anyhow::Result<()> {
    block_on("pinq-topology", move || {
        Box::pin(async move {
            let client =
                Client::connect_with(args.server.as_str(), &args.connect.client_options()?)
                    .await
                    .with_context(|| format!("connecting to {}", args.server))?;
            for shard in client.topology().await.context("topology")? {
                println!(
                    "shard {} cpu {} {}:{}",
                    shard.shard_id, shard.cpu, shard.host, shard.port
                );
            }
            Ok(())
        })
    })
}
