//! `pinq stats`, `pinq topics` and `pinq groups`: the broker's figures (one `Broker.stats` call)
//! as tables people can read, or as JSON (`--json`) for scripts.
//!
//! - `pinq stats --server ADDR [--json]`: per shard, then per group;
//! - `pinq topics --server ADDR [--json]`: topics with stored, due, scheduled, in flight (all
//!   counting messages) and their groups;
//! - `pinq groups --server ADDR --topic T [--json]`: the groups of one topic. A group's copies
//!   not yet ACKed are each in one column of `backlog`, `delayed`, `in_flight`, `scheduled`.

use anyhow::Context;

use super::client_cmds::block_on;
use super::connect_args::ConnectArgs;
use crate::client::Client;
use crate::rpc::{GroupStats, Stats};

/// Arguments of `pinq stats` and `pinq topics`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

/// Arguments of `pinq groups`.
#[derive(Debug, clap::Args)]
pub struct GroupsArgs {
    #[arg(long, default_value = "127.0.0.1:7400")]
    pub server: String,
    /// The topic whose groups to list.
    #[arg(long)]
    pub topic: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub connect: ConnectArgs,
}

pub fn stats(args: StatsArgs) -> anyhow::Result<()> {
    let stats = fetch(&args.server, &args.connect)?;
    if args.json {
        return print_json(&stats);
    }
    let mut shards = Table::new(&[
        "shard",
        "published",
        "dispatched",
        "acked",
        "nacked",
        "in_flight",
        "consumers",
        "redeliveries",
        "expired",
        "backlog",
        "delayed",
        "scheduled",
    ]);
    for s in &stats.shards {
        let backlog = if s.counted {
            s.backlog.to_string()
        } else {
            format!("{} (counting)", s.backlog)
        };
        shards.row(vec![
            s.shard_id.to_string(),
            s.published.to_string(),
            s.dispatched.to_string(),
            s.acked.to_string(),
            s.nacked.to_string(),
            s.in_flight.to_string(),
            s.active_consumers.to_string(),
            s.redeliveries.to_string(),
            s.expired.to_string(),
            backlog,
            s.delayed.to_string(),
            s.scheduled.to_string(),
        ]);
    }
    print!("{}", shards.render());
    if !stats.groups.is_empty() {
        println!();
        print!("{}", group_table(stats.groups.iter()).render());
    }
    Ok(())
}

pub fn topics(args: StatsArgs) -> anyhow::Result<()> {
    let stats = fetch(&args.server, &args.connect)?;
    if args.json {
        return print_json(&stats.topics);
    }
    let mut table = Table::new(&[
        "topic",
        "shard",
        "stored",
        "due",
        "scheduled",
        "in_flight",
        "groups",
    ]);
    for t in &stats.topics {
        table.row(vec![
            topic_name(&t.topic),
            t.shard_id.to_string(),
            t.stored.to_string(),
            t.due.to_string(),
            t.scheduled.to_string(),
            t.in_flight.to_string(),
            t.groups.to_string(),
        ]);
    }
    print!("{}", table.render());
    if stats.shards.iter().any(|s| !s.counted) {
        println!("(a shard is still counting its store: figures may be low)");
    }
    Ok(())
}

pub fn groups(args: GroupsArgs) -> anyhow::Result<()> {
    let stats = fetch(&args.server, &args.connect)?;
    let groups: Vec<&GroupStats> = stats
        .groups
        .iter()
        .filter(|g| g.topic == args.topic)
        .collect();
    if args.json {
        return print_json(&groups);
    }
    print!("{}", group_table(groups.into_iter()).render());
    Ok(())
}

fn fetch(server: &str, connect: &ConnectArgs) -> anyhow::Result<Stats> {
    let server = server.to_owned();
    let options = connect.client_options()?;
    block_on("pinq-stats", move || {
        Box::pin(async move {
            let client = Client::connect_with(server.as_str(), &options)
                .await
                .with_context(|| format!("connecting to {server}"))?;
            client.stats().await.context("stats")
        })
    })
}

fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn topic_name(topic: &str) -> String {
    if topic.is_empty() {
        "(other topics)".into()
    } else {
        topic.into()
    }
}

fn group_table<'a>(groups: impl Iterator<Item = &'a GroupStats>) -> Table {
    let mut table = Table::new(&[
        "topic",
        "group",
        "shard",
        "consumers",
        "backlog",
        "delayed",
        "in_flight",
        "scheduled",
        "dispatched",
        "acked",
        "nacked",
        "redeliveries",
        "expired",
        "dead_lettered",
    ]);
    for g in groups {
        let group = if g.group.is_empty() {
            "(universal)".to_owned()
        } else {
            g.group.clone()
        };
        table.row(vec![
            g.topic.clone(),
            group,
            g.shard_id.to_string(),
            g.consumers.to_string(),
            g.backlog.to_string(),
            g.delayed.to_string(),
            g.in_flight.to_string(),
            g.scheduled.to_string(),
            g.dispatched.to_string(),
            g.acked.to_string(),
            g.nacked.to_string(),
            g.redeliveries.to_string(),
            g.expired.to_string(),
            g.dead_lettered.to_string(),
        ]);
    }
    table
}

/// A text table: the first column left-aligned, the others right-aligned, each as wide as its
/// widest cell.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (cell, w))| match i {
                    0 => format!("{cell:<w$}"),
                    _ => format!("{cell:>w$}"),
                })
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Table;

    #[test]
    fn a_table_aligns_every_column_to_its_widest_cell() {
        let mut t = Table::new(&["topic", "stored"]);
        t.row(vec!["orders".into(), "5".into()]);
        t.row(vec!["a".into(), "123456".into()]);
        assert_eq!(
            t.render(),
            "topic   stored\norders       5\na       123456\n"
        );
    }
}
