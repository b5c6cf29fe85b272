//! [`AddressBook`]: where this node reaches each member of its cluster (Raft and client
//! address), kept in `<dataDir>/cluster-members` so that a restart knows the members added at
//! run time even when `cluster.peers` (only a new cluster's first members) no longer lists them.
//!
//! The membership itself (who votes, who learns) lives in each shard's Raft log; the book
//! only says where the members are. It is filled from `cluster.peers` (or, for a node started
//! with `cluster.join`, from the member it asked), from the changes that add a node (they carry
//! its addresses), and from the peers' handshakes (their client addresses); a node no shard
//! counts as a member any more is dropped from it.
//!
//! ```text
//! file = "pinq-members 1\n" (id " " raft " " client-or-"-" "\n")*
//! ```
//!
//! Encoding and decoding are pure; [`load`] reads the file at start-up (before any executor
//! runs), [`save`] replaces it through a temporary file, a rename and a directory fsync.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::storage::io as dio;
use crate::storage::StoreError;

const HEADER: &str = "pinq-members 1";
/// The file's name in the data directory.
pub const FILE_NAME: &str = "cluster-members";

/// One member's addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub raft: SocketAddr,
    /// Where clients reach it; `None` until heard.
    pub client: Option<String>,
}

/// Member id → addresses.
pub type AddressBook = BTreeMap<u64, Address>;

pub fn path_in(data_dir: &Path) -> PathBuf {
    data_dir.join(FILE_NAME)
}

pub fn encode(book: &AddressBook) -> String {
    let mut out = format!("{HEADER}\n");
    for (id, a) in book {
        let client = a.client.as_deref().unwrap_or("-");
        out.push_str(&format!("{id} {} {client}\n", a.raft));
    }
    out
}

/// Reads a book; the error names the line that is wrong.
pub fn decode(text: &str) -> Result<AddressBook, String> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(format!("the first line is not {HEADER:?}"));
    }
    let mut book = AddressBook::new();
    for (n, line) in lines.enumerate() {
        let bad = || format!("line {}: {line:?} is not \"ID RAFT CLIENT\"", n + 2);
        let mut parts = line.split(' ');
        let id: u64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let raft: SocketAddr = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let client = match parts.next().ok_or_else(bad)? {
            "-" => None,
            text => Some(text.to_string()),
        };
        if parts.next().is_some() || id == 0 {
            return Err(bad());
        }
        book.insert(id, Address { raft, client });
    }
    Ok(book)
}

/// The book kept in `data_dir`, if there is one. Blocking: for start-up only.
pub fn load(data_dir: &Path) -> Result<Option<AddressBook>, String> {
    let path = path_in(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) => decode(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Replaces the book in `data_dir` (a crash leaves the old one or the new one).
pub async fn save(data_dir: &Path, book: &AddressBook) -> Result<(), StoreError> {
    // glommio opens a directory by an absolute path only.
    let data_dir =
        &std::path::absolute(data_dir).map_err(|e| crate::storage::io_error(data_dir, e))?;
    let path = path_in(data_dir);
    let staged = data_dir.join(format!("{FILE_NAME}.tmp"));
    let mut writer = dio::DmaWriter::create(&staged, 4096).await?;
    writer.append(encode(book).as_bytes()).await?;
    writer.finish().await?;
    dio::rename(&staged, &path).await?;
    dio::sync_dir(data_dir).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_book_round_trips() {
        let mut book = AddressBook::new();
        book.insert(
            1,
            Address {
                raft: "127.0.0.1:7101".parse().unwrap(),
                client: Some("127.0.0.1:7401".into()),
            },
        );
        book.insert(
            4,
            Address {
                raft: "[::1]:7104".parse().unwrap(),
                client: None,
            },
        );
        let text = encode(&book);
        assert_eq!(
            text,
            "pinq-members 1\n1 127.0.0.1:7101 127.0.0.1:7401\n4 [::1]:7104 -\n"
        );
        assert_eq!(decode(&text), Ok(book));
        assert_eq!(decode("pinq-members 1\n"), Ok(AddressBook::new()));
    }

    #[test]
    fn a_bad_line_is_named() {
        for (text, wanted) in [
            ("", "first line"),
            ("pinq-members 2\n", "first line"),
            ("pinq-members 1\nx 127.0.0.1:1 -\n", "line 2"),
            ("pinq-members 1\n1 127.0.0.1:1 -\n2 nowhere -\n", "line 3"),
            ("pinq-members 1\n1 127.0.0.1:1\n", "line 2"),
            ("pinq-members 1\n1 127.0.0.1:1 - more\n", "line 2"),
            ("pinq-members 1\n0 127.0.0.1:1 -\n", "line 2"),
        ] {
            let err = decode(text).unwrap_err();
            assert!(err.contains(wanted), "{text:?}: {err}");
        }
    }
}
