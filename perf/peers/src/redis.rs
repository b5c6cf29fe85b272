//! Redis Streams driver: XADD to one stream (pipelined batches), one consumer group read with
//! XREADGROUP, each batch settled with XACK + XDEL in one round trip (so the stream does not
//! grow, like pinq deleting acknowledged messages). Durability is the server's: `perf/compare.sh`
//! starts redis-server with `appendonly yes` and `appendfsync everysec`.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;

use crate::{Driver, Hists, Run};

const STREAM: &[u8] = b"pinq-peers";
const GROUP: &[u8] = b"workers";

pub struct Redis;

/// A RESP reply.
#[derive(Debug)]
enum Reply {
    Simple,
    Int,
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

struct Conn {
    r: BufReader<TcpStream>,
    w: BufWriter<TcpStream>,
}

impl Conn {
    fn open(addr: &str) -> io::Result<Conn> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Conn {
            r: BufReader::with_capacity(1 << 20, s.try_clone()?),
            w: BufWriter::with_capacity(1 << 20, s),
        })
    }

    fn cmd(&mut self, args: &[&[u8]]) -> io::Result<()> {
        write!(self.w, "*{}\r\n", args.len())?;
        for a in args {
            write!(self.w, "${}\r\n", a.len())?;
            self.w.write_all(a)?;
            self.w.write_all(b"\r\n")?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    fn read(&mut self) -> io::Result<Reply> {
        let mut line = Vec::new();
        self.r.read_until(b'\n', &mut line)?;
        if line.len() < 3 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        let body = &line[1..line.len() - 2];
        let num = || -> io::Result<i64> {
            std::str::from_utf8(body)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad RESP number"))
        };
        match line[0] {
            b'+' => Ok(Reply::Simple),
            b'-' => Err(io::Error::other(String::from_utf8_lossy(body).into_owned())),
            b':' => Ok(Reply::Int),
            b'$' => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let mut buf = vec![0u8; n as usize + 2];
                self.r.read_exact(&mut buf)?;
                buf.truncate(n as usize);
                Ok(Reply::Bulk(Some(buf)))
            }
            b'*' => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Array(None));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.read()?);
                }
                Ok(Reply::Array(Some(items)))
            }
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, "bad RESP type")),
        }
    }
}

impl Driver for Redis {
    fn setup(&self, run: &Run) -> io::Result<()> {
        let mut c = Conn::open(&run.server)?;
        c.cmd(&[b"DEL", STREAM])?;
        c.cmd(&[b"XGROUP", b"CREATE", STREAM, GROUP, b"$", b"MKSTREAM"])?;
        c.flush()?;
        c.read()?;
        c.read()?;
        Ok(())
    }

    fn produce(&self, run: &Run, producer: u32, h: &mut Hists) -> io::Result<u64> {
        let mut c = Conn::open(&run.server)?;
        let mut payload = vec![0u8; run.size];
        let mut seq = 0u64;
        loop {
            let now = run.now_ns();
            if run.finished(producer, seq, now) {
                break;
            }
            let (n, wait) = run.next_batch(producer, seq, now);
            if n == 0 {
                std::thread::sleep(std::time::Duration::from_nanos(
                    wait.saturating_sub(now).clamp(50_000, 1_000_000),
                ));
                continue;
            }
            for i in 0..n as u64 {
                run.stamp(&mut payload, producer, seq + i, now);
                c.cmd(&[b"XADD", STREAM, b"*", b"p", &payload])?;
            }
            let written = run.now_ns();
            c.flush()?;
            run.copies_sent.fetch_add(n as u64, Ordering::Relaxed);
            for _ in 0..n {
                c.read()?;
            }
            let done = run.now_ns();
            if written >= run.measure_start_ns() {
                h.publish_call
                    .saturating_record_n(done.saturating_sub(written) / 1000, n as u64);
            }
            for i in 0..n as u64 {
                let sent = run.intended_ns(producer, seq + i).unwrap_or(now);
                if sent >= run.measure_start_ns() {
                    h.publish_ack
                        .saturating_record(done.saturating_sub(sent) / 1000);
                }
            }
            seq += n as u64;
        }
        Ok(seq)
    }

    fn consume(&self, run: &Run, consumer: u32, h: &mut Hists) -> io::Result<()> {
        let mut c = Conn::open(&run.server)?;
        let name = format!("c{consumer}");
        let count = run.batch.to_string();
        while !run.stop.load(Ordering::Acquire) {
            c.cmd(&[
                b"XREADGROUP",
                b"GROUP",
                GROUP,
                name.as_bytes(),
                b"COUNT",
                count.as_bytes(),
                b"BLOCK",
                b"50",
                b"STREAMS",
                STREAM,
                b">",
            ])?;
            c.flush()?;
            let mut ids: Vec<Vec<u8>> = Vec::new();
            let mut payloads: Vec<Vec<u8>> = Vec::new();
            if let Reply::Array(Some(streams)) = c.read()? {
                for s in streams {
                    let Reply::Array(Some(mut parts)) = s else {
                        continue;
                    };
                    let Some(Reply::Array(Some(entries))) = parts.pop() else {
                        continue;
                    };
                    for e in entries {
                        let Reply::Array(Some(mut kv)) = e else {
                            continue;
                        };
                        let fields = kv.pop();
                        if let Some(Reply::Bulk(Some(id))) = kv.pop() {
                            ids.push(id);
                        }
                        if let Some(Reply::Array(Some(mut f))) = fields {
                            if let Some(Reply::Bulk(Some(v))) = f.pop() {
                                payloads.push(v);
                            }
                        }
                    }
                }
            }
            if ids.is_empty() {
                continue;
            }
            let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
            run.delivered(&refs, &mut h.e2e);
            let sent = run.now_ns();
            let mut ack: Vec<&[u8]> = vec![b"XACK", STREAM, GROUP];
            ack.extend(ids.iter().map(Vec::as_slice));
            c.cmd(&ack)?;
            let mut del: Vec<&[u8]> = vec![b"XDEL", STREAM];
            del.extend(ids.iter().map(Vec::as_slice));
            c.cmd(&del)?;
            c.flush()?;
            c.read()?;
            c.read()?;
            if sent >= run.measure_start_ns() && sent < run.send_end_ns() {
                h.ack
                    .saturating_record(run.now_ns().saturating_sub(sent) / 1000);
            }
        }
        Ok(())
    }
}
