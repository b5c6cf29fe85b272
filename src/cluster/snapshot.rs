//! The data of a shard's Raft snapshot: its state machine as commands (pure codec).
//!
//! A snapshot carries every live message of the shard as `Store` commands (and the event-id
//! high-water mark in them), its idempotent-publish entries in `StoreSequenced` commands, and
//! each group policy as the `GroupPolicy` command the log applied, and its copy records
//! (deliveries so far, group ACKs: `crate::log::copies`) in `Copies` commands. A follower drops
//! its own messages, publish entries and copy records before it applies them. The leader builds it by scanning its engine page by page while it
//! keeps applying, so the pages may show effects of entries after the snapshot's index; that
//! is sound because every command is idempotent per key (a key is stored once, with one value,
//! and a delete is final), and the follower replays the entries after the index anyway.
//!
//! ```text
//! data = version u8 (1) | count u32 LE | (len u32 LE | command[len]){count}   each command
//!        checksummed itself; a count that disagrees refuses the snapshot (a truncation)
//! ```

use crate::log::Command;

pub const SNAPSHOT_VERSION: u8 = 1;

/// Appends commands to a snapshot's data, refusing to grow past `max` bytes.
pub struct SnapshotWriter {
    data: Vec<u8>,
    max: usize,
    count: u32,
}

/// The shard's state does not fit in one snapshot message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the shard's state needs more than {max} bytes, more than one snapshot message carries (cluster.maxFrameBytes)")]
pub struct TooLarge {
    pub max: usize,
}

impl SnapshotWriter {
    pub fn new(max: usize) -> SnapshotWriter {
        SnapshotWriter {
            data: vec![SNAPSHOT_VERSION, 0, 0, 0, 0],
            max,
            count: 0,
        }
    }

    pub fn push(&mut self, command: &Command) -> Result<(), TooLarge> {
        let len = command.encoded_len();
        if self.data.len() + 4 + len > self.max {
            return Err(TooLarge { max: self.max });
        }
        self.data.extend_from_slice(&(len as u32).to_le_bytes());
        command.encode(&mut self.data);
        self.count += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.data[1..5].copy_from_slice(&self.count.to_le_bytes());
        self.data
    }
}

/// Decodes a snapshot's data into its commands; any damage refuses the whole snapshot.
pub fn decode(data: &[u8]) -> Result<Vec<Command>, String> {
    let Some((&version, rest)) = data.split_first() else {
        return Err("empty snapshot data".into());
    };
    if version != SNAPSHOT_VERSION {
        return Err(format!("snapshot data version {version} is not supported"));
    }
    if rest.len() < 4 {
        return Err("snapshot data truncated in its count".into());
    }
    let count = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    let mut rest = &rest[4..];
    let mut commands = Vec::new();
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err("snapshot data truncated in a length".into());
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let body = rest
            .get(4..4 + len)
            .ok_or("snapshot data truncated in a command")?;
        commands.push(Command::decode(body).map_err(|e| format!("snapshot command: {e}"))?);
        rest = &rest[4 + len..];
    }
    if commands.len() != count {
        return Err(format!(
            "snapshot data holds {} commands where it announces {count}",
            commands.len()
        ));
    }
    Ok(commands)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{EventKey, TopicHash};
    use crate::message::Value;

    fn store(i: u64) -> Command {
        Command::Store {
            messages: vec![(
                EventKey::new(TopicHash(3), i, i),
                Value::copy_from_slice(&[i as u8; 30]),
            )],
            event_id_high_water: i,
        }
    }

    #[test]
    fn commands_round_trip_and_damage_is_refused() {
        let mut w = SnapshotWriter::new(1 << 20);
        for i in 0..5 {
            w.push(&store(i)).unwrap();
        }
        let data = w.finish();
        assert_eq!(
            decode(&data).unwrap(),
            (0..5).map(store).collect::<Vec<_>>()
        );
        for cut in 0..data.len() {
            assert!(decode(&data[..cut]).is_err(), "cut {cut}");
        }
        let mut bad = data.clone();
        bad[10] ^= 1;
        assert!(decode(&bad).is_err());
    }

    #[test]
    fn the_size_bound_holds() {
        let mut w = SnapshotWriter::new(100);
        assert!(w.push(&store(1)).is_ok());
        assert_eq!(w.push(&store(2)), Err(TooLarge { max: 100 }));
    }
}
