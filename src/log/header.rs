//! The WAL segment header (pure codec): the length a segment was durably written to, so
//! recovery can tell a file cut short from a torn last write.
//!
//! ```text
//! block 0 of a segment (WRITE_ALIGN bytes; records start after it):
//!   copy at byte 0 and again at byte 512, each:
//!     magic "PQWL" | version u16 LE | reserved u16 | first_seq u64 LE | written_bytes u64 LE
//!     | crc32c u32 LE (of the 24 bytes before it)
//!   zeros elsewhere
//! ```
//!
//! Why: the writer zero-fills a segment ahead of its records and fdatasyncs that before any
//! record lands there, so the file's size on stable storage is always at least the end of every
//! write. `written_bytes` is that zero-filled size, written after the zeros are synced and
//! before (in the same fdatasync as) the first record past the previous size. A segment shorter
//! than its header says was cut after it was written (a truncated file, a copy that stopped
//! short), never torn by a crash: recovery refuses it (see `super::recovery`).
//!
//! Two copies, one per 512-byte sector (the unit a device writes whole): a crash during a
//! header rewrite leaves at least one whole copy, old or new; the larger valid length wins.
//!
//! Compatibility: segments written before the header existed start with a record at byte 0.
//! The magic, read as a record length, is above `RECORD_PAYLOAD_MAX`, so such a segment is never
//! taken for one with a header, and a header block that never reached the disk (zeros) reads as
//! padding. Both are read by the older rules ([`HeaderRead::Absent`]).
//!
//! Called by the WAL writer (encode) and by recovery and tests (read). Never does I/O.

use crate::storage::io::WRITE_ALIGN;

/// Bytes at the start of a segment held by its header; the first record starts after them.
/// One aligned block, so records keep their alignment.
pub const SEGMENT_HEADER_BYTES: usize = WRITE_ALIGN;

/// Read as a little-endian record length this is 0x4C57_5150, above `RECORD_PAYLOAD_MAX`.
const MAGIC: [u8; 4] = *b"PQWL";
const VERSION: u16 = 1;
/// Offset of the second copy: its own sector.
const SECOND_COPY_AT: usize = 512;
const COPY_BODY_BYTES: usize = 24;
const COPY_BYTES: usize = COPY_BODY_BYTES + 4;

/// What a segment's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The segment's first log index (its file name says the same).
    pub first_seq: u64,
    /// Bytes of the file that were on stable storage (zero-filled or written) before any record
    /// past the previous value was written: the file is at least this long unless it was cut.
    pub written_bytes: u64,
}

/// The header block of a segment as recovery finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderRead {
    /// No header (a segment of the older format, or one whose header block never reached the
    /// disk): records start at byte 0.
    Absent,
    Present(SegmentHeader),
    /// The block starts with the magic but no copy is intact.
    Damaged {
        reason: String,
    },
}

impl HeaderRead {
    /// Where the segment's records start.
    pub fn records_start(&self) -> usize {
        match self {
            HeaderRead::Absent => 0,
            HeaderRead::Present(_) | HeaderRead::Damaged { .. } => SEGMENT_HEADER_BYTES,
        }
    }
}

/// The header block (exactly [`SEGMENT_HEADER_BYTES`]) for `header`.
pub fn encode_segment_header(header: &SegmentHeader) -> Vec<u8> {
    let mut copy = Vec::with_capacity(COPY_BYTES);
    copy.extend_from_slice(&MAGIC);
    copy.extend_from_slice(&VERSION.to_le_bytes());
    copy.extend_from_slice(&[0u8; 2]);
    copy.extend_from_slice(&header.first_seq.to_le_bytes());
    copy.extend_from_slice(&header.written_bytes.to_le_bytes());
    let crc = crc32c::crc32c(&copy);
    copy.extend_from_slice(&crc.to_le_bytes());
    let mut block = vec![0u8; SEGMENT_HEADER_BYTES];
    block[..COPY_BYTES].copy_from_slice(&copy);
    block[SECOND_COPY_AT..SECOND_COPY_AT + COPY_BYTES].copy_from_slice(&copy);
    block
}

fn decode_copy(bytes: &[u8]) -> Option<SegmentHeader> {
    let copy = bytes.get(..COPY_BYTES)?;
    if copy[..4] != MAGIC || u16::from_le_bytes([copy[4], copy[5]]) != VERSION {
        return None;
    }
    let stored = u32::from_le_bytes(copy[COPY_BODY_BYTES..].try_into().ok()?);
    if crc32c::crc32c(&copy[..COPY_BODY_BYTES]) != stored {
        return None;
    }
    Some(SegmentHeader {
        first_seq: u64::from_le_bytes(copy[8..16].try_into().ok()?),
        written_bytes: u64::from_le_bytes(copy[16..24].try_into().ok()?),
    })
}

/// Reads the header at the start of a segment's bytes (the whole file, or at least its first
/// block). Pure.
pub fn read_segment_header(bytes: &[u8]) -> HeaderRead {
    if bytes.get(..4) != Some(&MAGIC[..]) {
        return HeaderRead::Absent;
    }
    let first = decode_copy(bytes);
    let second = bytes.get(SECOND_COPY_AT..).and_then(decode_copy);
    match (first, second) {
        (Some(a), Some(b)) if a.first_seq != b.first_seq => HeaderRead::Damaged {
            reason: format!(
                "its two header copies name different first records ({} and {})",
                a.first_seq, b.first_seq
            ),
        },
        (Some(a), Some(b)) => HeaderRead::Present(if a.written_bytes >= b.written_bytes {
            a
        } else {
            b
        }),
        (Some(h), None) | (None, Some(h)) => HeaderRead::Present(h),
        (None, None) => HeaderRead::Damaged {
            reason: "its header block starts with the segment magic but neither copy is intact"
                .into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::wal::RECORD_PAYLOAD_MAX;

    #[test]
    fn a_header_round_trips_from_either_copy() {
        let header = SegmentHeader {
            first_seq: 77,
            written_bytes: 8 << 20,
        };
        let block = encode_segment_header(&header);
        assert_eq!(block.len(), SEGMENT_HEADER_BYTES);
        assert_eq!(read_segment_header(&block), HeaderRead::Present(header));
        let mut first_gone = block.clone();
        first_gone[10] ^= 1;
        assert_eq!(
            read_segment_header(&first_gone),
            HeaderRead::Present(header)
        );
        let mut second_gone = block.clone();
        second_gone[SECOND_COPY_AT + 17] ^= 1;
        assert_eq!(
            read_segment_header(&second_gone),
            HeaderRead::Present(header)
        );
        let mut both_gone = first_gone;
        both_gone[SECOND_COPY_AT + 17] ^= 1;
        assert!(matches!(
            read_segment_header(&both_gone),
            HeaderRead::Damaged { .. }
        ));
    }

    #[test]
    fn a_torn_rewrite_keeps_the_larger_intact_length() {
        let old = encode_segment_header(&SegmentHeader {
            first_seq: 5,
            written_bytes: 1 << 20,
        });
        let new = encode_segment_header(&SegmentHeader {
            first_seq: 5,
            written_bytes: 2 << 20,
        });
        let mut torn = old.clone();
        torn[SECOND_COPY_AT..].copy_from_slice(&new[SECOND_COPY_AT..]);
        let HeaderRead::Present(h) = read_segment_header(&torn) else {
            panic!("a torn rewrite keeps a copy")
        };
        assert_eq!(h.written_bytes, 2 << 20);
    }

    #[test]
    fn the_magic_is_never_a_record_length_and_old_segments_have_no_header() {
        assert!(u32::from_le_bytes(MAGIC) as usize > RECORD_PAYLOAD_MAX);
        let mut old = vec![0u8; 64];
        old[..4].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(read_segment_header(&old), HeaderRead::Absent);
        assert_eq!(read_segment_header(&[0u8; 4096]), HeaderRead::Absent);
        assert_eq!(read_segment_header(&[]), HeaderRead::Absent);
    }
}
