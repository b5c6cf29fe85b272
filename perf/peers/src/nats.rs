//! NATS JetStream driver: a work-queue stream on file storage, one durable pull consumer with
//! explicit acks shared by the consumers (competing, like one pinq group). Producers publish
//! with a reply inbox and count a message as published when its PubAck arrives (a window of
//! batches in flight). Acks are fire-and-forget in the NATS protocol, so no ack latency is
//! reported for NATS (zeros in the JSON).

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;

use crate::{Driver, Hists, Run};

const STREAM: &str = "PINQPEERS";
const DURABLE: &str = "workers";
/// Publish batches in flight per producer.
const WINDOW_BATCHES: usize = 4;

pub struct Nats;

/// A message from the server.
enum Incoming {
    Msg {
        subject: String,
        reply: Option<String>,
        /// Status code of a header-only status message (404, 408, 409), else 0.
        status: u16,
        payload: Vec<u8>,
    },
    /// Nothing arrived within the read timeout.
    Timeout,
    Other,
}

/// How long a consumer waits on a silent connection before it issues a new pull.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(100);

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

struct Conn {
    r: BufReader<TcpStream>,
    w: BufWriter<TcpStream>,
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

impl Conn {
    fn open(addr: &str) -> io::Result<Conn> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut c = Conn {
            r: BufReader::with_capacity(1 << 20, s.try_clone()?),
            w: BufWriter::with_capacity(1 << 20, s),
        };
        let mut info = String::new();
        c.r.read_line(&mut info)?;
        if !info.starts_with("INFO") {
            return Err(invalid("no INFO from the server"));
        }
        c.w.write_all(
            b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true,\"lang\":\"rust\",\"version\":\"0.1\",\"protocol\":1}\r\nPING\r\n",
        )?;
        c.w.flush()?;
        loop {
            let mut line = String::new();
            c.r.read_line(&mut line)?;
            if line.starts_with("PONG") {
                return Ok(c);
            }
            if line.starts_with("-ERR") {
                return Err(io::Error::other(line));
            }
        }
    }

    fn sub(&mut self, subject: &str, sid: u32) -> io::Result<()> {
        write!(self.w, "SUB {subject} {sid}\r\n")
    }

    fn publish(&mut self, subject: &str, reply: Option<&str>, payload: &[u8]) -> io::Result<()> {
        match reply {
            Some(r) => write!(self.w, "PUB {subject} {r} {}\r\n", payload.len())?,
            None => write!(self.w, "PUB {subject} {}\r\n", payload.len())?,
        }
        self.w.write_all(payload)?;
        self.w.write_all(b"\r\n")
    }

    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// Reads exactly `buf.len()` bytes, retrying across read timeouts (the data is on its way).
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            match self.r.read(&mut buf[at..]) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed")),
                Ok(n) => at += n,
                Err(e) if is_timeout(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn next(&mut self) -> io::Result<Incoming> {
        let mut line = String::new();
        loop {
            match self.r.read_line(&mut line) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed",
                    ))
                }
                Ok(_) if line.ends_with('\n') => break,
                Ok(_) => continue,
                Err(e) if is_timeout(&e) && line.is_empty() => return Ok(Incoming::Timeout),
                Err(e) if is_timeout(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.first().copied() {
            Some("MSG") => {
                let (subject, reply, len) = match parts.len() {
                    4 => (parts[1], None, parts[3]),
                    5 => (parts[1], Some(parts[3]), parts[4]),
                    _ => return Err(invalid("bad MSG line")),
                };
                let len: usize = len.parse().map_err(|_| invalid("bad MSG length"))?;
                let mut payload = vec![0u8; len + 2];
                self.fill(&mut payload)?;
                payload.truncate(len);
                Ok(Incoming::Msg {
                    subject: subject.to_owned(),
                    reply: reply.map(str::to_owned),
                    status: 0,
                    payload,
                })
            }
            Some("HMSG") => {
                let (subject, reply, hlen, tlen) = match parts.len() {
                    5 => (parts[1], None, parts[3], parts[4]),
                    6 => (parts[1], Some(parts[3]), parts[4], parts[5]),
                    _ => return Err(invalid("bad HMSG line")),
                };
                let hlen: usize = hlen.parse().map_err(|_| invalid("bad HMSG length"))?;
                let tlen: usize = tlen.parse().map_err(|_| invalid("bad HMSG length"))?;
                let mut all = vec![0u8; tlen + 2];
                self.fill(&mut all)?;
                let headers = String::from_utf8_lossy(&all[..hlen.min(tlen)]).into_owned();
                // "NATS/1.0 408 Request Timeout": a status message; else a message with headers.
                let status = headers
                    .lines()
                    .next()
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0);
                Ok(Incoming::Msg {
                    subject: subject.to_owned(),
                    reply: reply.map(str::to_owned),
                    status,
                    payload: all[hlen.min(tlen)..tlen].to_vec(),
                })
            }
            Some("PING") => {
                self.w.write_all(b"PONG\r\n")?;
                self.w.flush()?;
                Ok(Incoming::Other)
            }
            Some("-ERR") => Err(io::Error::other(line.trim().to_owned())),
            _ => Ok(Incoming::Other),
        }
    }

    /// A request/reply on the control inbox (sid 1).
    fn request(&mut self, subject: &str, payload: &str) -> io::Result<String> {
        self.publish(subject, Some("_INBOX.ctl"), payload.as_bytes())?;
        self.flush()?;
        loop {
            if let Incoming::Msg {
                subject, payload, ..
            } = self.next()?
            {
                if subject == "_INBOX.ctl" {
                    return Ok(String::from_utf8_lossy(&payload).into_owned());
                }
            }
        }
    }
}

impl Driver for Nats {
    fn setup(&self, run: &Run) -> io::Result<()> {
        let mut c = Conn::open(&run.server)?;
        c.sub("_INBOX.ctl", 1)?;
        c.request(&format!("$JS.API.STREAM.DELETE.{STREAM}"), "")?;
        let created = c.request(
            &format!("$JS.API.STREAM.CREATE.{STREAM}"),
            &format!(
                r#"{{"name":"{STREAM}","subjects":["pinqpeers.>"],"retention":"workqueue","storage":"file","discard":"old","num_replicas":1}}"#
            ),
        )?;
        if created.contains("\"error\"") {
            return Err(io::Error::other(format!("creating the stream: {created}")));
        }
        let consumer = c.request(
            &format!("$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{DURABLE}"),
            &format!(
                r#"{{"stream_name":"{STREAM}","config":{{"durable_name":"{DURABLE}","ack_policy":"explicit","deliver_policy":"all","max_ack_pending":1000000,"ack_wait":30000000000,"max_waiting":512}}}}"#
            ),
        )?;
        if consumer.contains("\"error\"") {
            return Err(io::Error::other(format!(
                "creating the consumer: {consumer}"
            )));
        }
        Ok(())
    }

    fn produce(&self, run: &Run, producer: u32, h: &mut Hists) -> io::Result<u64> {
        let mut c = Conn::open(&run.server)?;
        let inbox = format!("_INBOX.p{producer}");
        c.sub(&format!("{inbox}.*"), 1)?;
        let subject = format!("pinqpeers.p{producer}");
        let mut payload = vec![0u8; run.size];
        let mut seq = 0u64;
        // (first seq after the batch, send time) of batches awaiting PubAcks.
        let mut batches: VecDeque<(u64, u64)> = VecDeque::new();
        let mut acked = 0u64;
        let on_ack = |c: &mut Conn,
                      batches: &mut VecDeque<(u64, u64)>,
                      acked: &mut u64,
                      h: &mut Hists|
         -> io::Result<()> {
            if let Incoming::Msg { payload, .. } = c.next()? {
                if payload.windows(7).any(|w| w == b"\"error\"") {
                    return Err(io::Error::other(
                        String::from_utf8_lossy(&payload).into_owned(),
                    ));
                }
                let now = run.now_ns();
                while batches.front().is_some_and(|&(end, _)| end <= *acked) {
                    batches.pop_front();
                }
                let batch_sent = batches.front().map(|&(_, t)| t).unwrap_or(now);
                let sent = run.intended_ns(producer, *acked).unwrap_or(batch_sent);
                if sent >= run.measure_start_ns() {
                    h.publish_ack
                        .saturating_record(now.saturating_sub(sent) / 1000);
                }
                *acked += 1;
            }
            Ok(())
        };
        loop {
            let now = run.now_ns();
            if run.finished(producer, seq, now) {
                break;
            }
            let (n, wait) = run.next_batch(producer, seq, now);
            if n == 0 {
                // Collect acks while waiting, without blocking past the next due time.
                if acked < seq {
                    on_ack(&mut c, &mut batches, &mut acked, h)?;
                } else {
                    std::thread::sleep(std::time::Duration::from_nanos(
                        wait.saturating_sub(now).clamp(50_000, 1_000_000),
                    ));
                }
                continue;
            }
            for i in 0..n as u64 {
                run.stamp(&mut payload, producer, seq + i, now);
                c.publish(&subject, Some(&format!("{inbox}.{}", seq + i)), &payload)?;
            }
            c.flush()?;
            run.copies_sent.fetch_add(n as u64, Ordering::Relaxed);
            seq += n as u64;
            batches.push_back((seq, now));
            while seq - acked > (WINDOW_BATCHES * run.batch) as u64 {
                on_ack(&mut c, &mut batches, &mut acked, h)?;
            }
        }
        while acked < seq {
            on_ack(&mut c, &mut batches, &mut acked, h)?;
        }
        Ok(seq)
    }

    fn consume(&self, run: &Run, consumer: u32, h: &mut Hists) -> io::Result<()> {
        let mut c = Conn::open(&run.server)?;
        c.r.get_ref().set_read_timeout(Some(READ_TIMEOUT))?;
        let inbox = format!("_INBOX.c{consumer}");
        c.sub(&inbox, 1)?;
        let next = format!("$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{DURABLE}");
        let pull = format!(r#"{{"batch":{},"expires":50000000}}"#, run.batch);
        let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(run.batch);
        let mut replies: Vec<String> = Vec::with_capacity(run.batch);
        while !run.stop.load(Ordering::Acquire) {
            c.publish(&next, Some(&inbox), pull.as_bytes())?;
            c.flush()?;
            payloads.clear();
            replies.clear();
            // Until the batch is full, the server ends the request with a status, or the
            // connection stays silent (a request that expired without a status).
            while payloads.len() < run.batch {
                match c.next()? {
                    Incoming::Msg { status, .. } if status != 0 => break,
                    Incoming::Msg {
                        reply: Some(reply),
                        payload,
                        ..
                    } => {
                        payloads.push(payload);
                        replies.push(reply);
                    }
                    Incoming::Timeout => break,
                    _ => {}
                }
            }
            if payloads.is_empty() {
                continue;
            }
            let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
            run.delivered(&refs, &mut h.e2e);
            for r in &replies {
                c.publish(r, None, b"")?;
            }
        }
        c.flush()
    }
}
