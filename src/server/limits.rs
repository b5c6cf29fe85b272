//! What one client may make the server hold, and the pieces that hold it to that: the node's
//! connection count, the frame gate in front of the Cap'n Proto reader, the idle and
//! stalled-frame watchdog, calls and subscriptions per connection, and each shard's budget of
//! publish bytes in flight.
//!
//! The cores here ([`FrameGate`]'s state machine, [`Watchdog`], [`BudgetCore`], [`Backoff`]) read no clock and do no I/O: the accept loop and `connection::serve` pass `now_ms`
//! in and act on what they return. Nothing here refuses a request by itself: callers turn a `None`
//! or an `Err` into a typed refusal (`crate::rpc::refusal::Code`) and count it.
//!
//! Why a gate in front of the reader: capnp-futures reads a frame's segment table, then
//! allocates (and zero-fills) the whole announced size before reading one byte of the body, so
//! eight bytes announcing 64 MiB made the server hold 64 MiB per connection. The gate refuses a
//! table announcing more than the frame limit, and collects a large frame's body itself, growing
//! with the bytes that actually arrive, before it hands the frame on: memory follows what the
//! client sent, never what it announced.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_lite::io::AsyncRead;

use crate::config::{ClientLimits, PublishConfig};

/// Bytes a frame may carry besides its messages' counted bytes (the params struct, list
/// pointers, an ack's tag list): also the whole frame limit of calls that are not publishes.
pub const FRAME_ALLOWANCE_BYTES: usize = 1 << 20;
/// What one message of a publish batch costs on the wire beyond its counted bytes: the struct,
/// its pointers and a topic of up to 255 bytes, rounded up.
pub const MESSAGE_OVERHEAD_BYTES: usize = 512;
/// A frame this small is handed straight to the Cap'n Proto reader, which allocates it whole
/// up front; a larger one is collected by the gate first.
pub const DIRECT_FRAME_BYTES_MAX: usize = 64 << 10;
/// The longest a publish waits for room in its shard's budget before it is refused.
pub const PUBLISH_ROOM_WAIT: Duration = Duration::from_secs(5);
/// The longest an over-limit connection is kept open waiting for its first call.
pub const REFUSED_CONNECTION_LINGER: Duration = Duration::from_secs(1);
/// Over-limit connections one shard keeps open at once to answer them; beyond it they are
/// closed at once (the client sees the connection closed, not a hang).
pub const REFUSING_CONNECTIONS_MAX: usize = 1024;
/// Publishes of one shard that may wait for room in its budget with their (small) frames in
/// memory; one more is refused `publishBytesInFlight` at once. Large frames wait in the gate
/// before they are read and are not counted here.
pub const PUBLISHES_WAITING_MAX: usize = 256;
/// A large frame admitted by the gate and not claimed by its call within this long gives its
/// bytes back (a frame no handler claims: an unknown method, a garbage call).
pub const FRAME_CLAIM_WAIT_MS: u64 = 1_000;
/// A connection that had at least this many bytes unanswered or in one request frame trims the
/// heap when it closes ([`trim_heap`]).
pub const TRIM_AFTER_BYTES: usize = 8 << 20;
/// At most one line per this many milliseconds for a repeated accept error.
pub const ACCEPT_ERROR_LOG_INTERVAL_MS: u64 = 5_000;

/// What one message of a publish takes from `publish.maxBytesInFlight`: its counted bytes
/// (payload, header names and values) plus [`MESSAGE_OVERHEAD_BYTES`], what the broker holds
/// for it besides them while the publish is in flight (the frame's struct and pointers, the
/// topic, the stored archive's fixed part). An empty message still costs the overhead, so a
/// batch of empty payloads cannot evade the bound (it counted 0 bytes: 1,000 calls of 10,000
/// empty messages were all admitted at once). Pure.
pub fn publish_charge_bytes(counted_bytes: usize) -> usize {
    counted_bytes.saturating_add(MESSAGE_OVERHEAD_BYTES)
}

/// The largest request frame a client may send: the smaller of a full batch and the shard's
/// publish budget, plus [`FRAME_ALLOWANCE_BYTES`]. The budget caps it because a publish larger
/// than the budget could only be admitted alone.
pub fn frame_bytes_max(publish: &PublishConfig) -> usize {
    let batch = publish.batch_len_max.saturating_mul(
        publish
            .message_bytes_max
            .saturating_add(MESSAGE_OVERHEAD_BYTES),
    );
    batch
        .min(publish.bytes_in_flight_max)
        .saturating_add(FRAME_ALLOWANCE_BYTES)
}

/// The Cap'n Proto reader options of a client connection. The traversal limit is three times
/// the frame so that measuring a request and reading its fields twice never trips it; the gate has already refused
/// any frame larger than [`frame_bytes_max`].
pub fn reader_options(publish: &PublishConfig) -> capnp::message::ReaderOptions {
    reader_options_for_frames(frame_bytes_max(publish))
}

/// Reader options for frames of at most `frame_bytes_max` bytes: three traversals (a call's
/// `total_size`, which finds the frame the gate admitted for it, and two reads of its fields).
pub fn reader_options_for_frames(frame_bytes_max: usize) -> capnp::message::ReaderOptions {
    let words = (frame_bytes_max / 8).saturating_mul(3);
    let mut options = capnp::message::ReaderOptions::new();
    options.traversal_limit_in_words(Some(words));
    options
}

// ---------------------------------------------------------------------------------------------
// Connections per node

/// Client connections open on the whole node, shared by every shard's accept loops.
#[derive(Clone, Debug)]
pub struct ConnectionCount {
    open: Arc<AtomicUsize>,
    max: usize,
}

/// One counted connection; dropping it frees its place.
#[derive(Debug)]
pub struct ConnectionSlot {
    open: Arc<AtomicUsize>,
}

impl ConnectionCount {
    pub fn new(max: usize) -> ConnectionCount {
        ConnectionCount {
            open: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// A place for one more connection, or `None` when `server.maxConnections` are open.
    pub fn try_open(&self) -> Option<ConnectionSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            })
            .ok()
            .map(|_| ConnectionSlot {
                open: self.open.clone(),
            })
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    pub fn max(&self) -> usize {
        self.max
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

// ---------------------------------------------------------------------------------------------
// Calls and subscriptions per connection

/// What one connection holds: calls being served and subscriptions open; and the protocol
/// version its `hello` negotiated, which its `Broker` and `Subscription`s answer in.
#[derive(Debug)]
pub struct ConnectionUse {
    limits: ClientLimits,
    calls: Cell<usize>,
    subscriptions: Cell<usize>,
    /// 0 until a `hello` with a version the broker speaks.
    protocol_version: Cell<u32>,
    /// The large frame handed to the Cap'n Proto reader whose call has not claimed its bytes yet.
    held_frame: RefCell<Option<HeldFrame>>,
    /// The gate, waiting for `held_frame` to be claimed before it reads the next large frame.
    gate_waker: RefCell<Option<Waker>>,
    /// Whether the gate's current frame was counted as waiting for room.
    pub frame_waiting: Cell<bool>,
}

/// A large frame's bytes, taken from the budget before it was read, waiting for its call.
#[derive(Debug)]
struct HeldFrame {
    permit: BytePermit,
    frame_bytes: usize,
    /// When the watchdog first saw it unclaimed.
    seen_ms: Option<u64>,
}

/// Bytes a request frame holds besides its call's params: the segment table, the RPC message
/// and call structs, the cap table. A held frame is claimed by the call whose params are within
/// this of its size.
pub const FRAME_WRAPPER_BYTES_MAX: usize = 4096;

/// One call being served; dropping it (the call answered or cancelled) frees its place.
#[derive(Debug)]
pub struct CallSlot(Rc<ConnectionUse>);

/// One open subscription's place; dropping it frees the place.
#[derive(Debug)]
pub struct SubscriptionSlot(Rc<ConnectionUse>);

impl ConnectionUse {
    pub fn new(limits: ClientLimits) -> Rc<ConnectionUse> {
        Rc::new(ConnectionUse {
            limits,
            calls: Cell::new(0),
            subscriptions: Cell::new(0),
            protocol_version: Cell::new(0),
            held_frame: RefCell::new(None),
            gate_waker: RefCell::new(None),
            frame_waiting: Cell::new(false),
        })
    }

    /// Whether a large frame waits for its call to claim it; if so the gate is woken when it is.
    fn frame_held(&self, waker: &Waker) -> bool {
        let held = self.held_frame.borrow().is_some();
        if held {
            *self.gate_waker.borrow_mut() = Some(waker.clone());
        }
        held
    }

    fn hold_frame(&self, permit: BytePermit, frame_bytes: usize) {
        *self.held_frame.borrow_mut() = Some(HeldFrame {
            permit,
            frame_bytes,
            seen_ms: None,
        });
    }

    /// The bytes of the large frame that carried a call whose params take `params_bytes`, if it
    /// is the one held; the gate may then read the next large frame.
    pub fn claim_frame(&self, params_bytes: usize) -> Option<BytePermit> {
        let mut held = self.held_frame.borrow_mut();
        let frame_bytes = held.as_ref()?.frame_bytes;
        if !(params_bytes..=params_bytes.saturating_add(FRAME_WRAPPER_BYTES_MAX))
            .contains(&frame_bytes)
        {
            return None;
        }
        let frame = held.take()?;
        drop(held);
        self.wake_gate();
        Some(frame.permit)
    }

    /// Gives back a held frame no call claimed within [`FRAME_CLAIM_WAIT_MS`] (its Cap'n Proto
    /// message was not a call of ours); called by the watchdog each tick.
    pub fn release_unclaimed_frame(&self, now_ms: u64) {
        let mut held = self.held_frame.borrow_mut();
        let Some(frame) = held.as_mut() else {
            return;
        };
        let seen = *frame.seen_ms.get_or_insert(now_ms);
        if now_ms.saturating_sub(seen) < FRAME_CLAIM_WAIT_MS {
            return;
        }
        held.take();
        drop(held);
        self.wake_gate();
    }

    fn wake_gate(&self) {
        if let Some(waker) = self.gate_waker.borrow_mut().take() {
            waker.wake();
        }
    }

    /// The protocol version the connection speaks (0 before its `hello`).
    pub fn protocol_version(&self) -> u32 {
        self.protocol_version.get()
    }

    pub fn set_protocol_version(&self, version: u32) {
        self.protocol_version.set(version);
    }

    pub fn limits(&self) -> &ClientLimits {
        &self.limits
    }

    /// A place for one more call, or `None` when `server.maxCallsInFlight` are being served.
    pub fn try_call(self: &Rc<Self>) -> Option<CallSlot> {
        let calls = self.calls.get();
        if calls >= self.limits.calls_in_flight_max {
            return None;
        }
        self.calls.set(calls + 1);
        Some(CallSlot(self.clone()))
    }

    /// A place for one more subscription, or `None` at `server.maxSubscriptionsPerConnection`.
    pub fn try_subscribe(self: &Rc<Self>) -> Option<SubscriptionSlot> {
        let open = self.subscriptions.get();
        if open >= self.limits.subscriptions_max {
            return None;
        }
        self.subscriptions.set(open + 1);
        Some(SubscriptionSlot(self.clone()))
    }

    /// Whether a call is being served or a subscription is open (an idle connection has neither).
    pub fn busy(&self) -> bool {
        self.calls.get() > 0 || self.subscriptions.get() > 0
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        self.0.calls.set(self.0.calls.get().saturating_sub(1));
    }
}

impl Drop for SubscriptionSlot {
    fn drop(&mut self) {
        let open = &self.0.subscriptions;
        open.set(open.get().saturating_sub(1));
    }
}

// ---------------------------------------------------------------------------------------------
// The frame gate

/// What the gate has seen, for the watchdog: read by it once a tick, written by every read.
#[derive(Debug, Default)]
pub struct ReadProgress {
    /// Bytes read from the socket so far.
    pub bytes: Cell<u64>,
    /// Frames received whole so far.
    pub frames: Cell<u64>,
    /// Whether a frame's first byte arrived and its last has not (its body waiting for room in
    /// the budget included).
    pub frame_open: Cell<bool>,
    /// The largest frame announced so far, in bytes.
    pub largest_frame: Cell<usize>,
}

/// Why the gate refused a frame (the connection is then closed).
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("a frame announces {segments} segments, the limit is 512")]
    TooManySegments { segments: u64 },
    #[error(
        "a frame announces {bytes} bytes, the limit is {max} (derived from publish.maxMessageBytes, publish.maxBatchMessages and publish.maxBytesInFlight)"
    )]
    TooLarge { bytes: u64, max: usize },
}

/// Where the gate is in the stream of frames.
#[derive(Debug)]
enum Phase {
    /// Reading the next frame's segment table into `table`.
    Table,
    /// A large frame's table is read: its bytes wait for room in the shard's budget (and for
    /// the connection's previous large frame to be claimed) before its body is read.
    Admit { body: usize },
    /// Handing `table` (or, collected, `table` and the body) on from `out[served..]`, then
    /// `direct_left` bytes straight from the socket.
    Serve { served: usize, direct_left: usize },
    /// Collecting a large frame's body into `out` after its table; `body_left` still to come.
    Collect { body_left: usize },
}

/// An `AsyncRead` in front of the Cap'n Proto reader that bounds what a frame can make the server
/// allocate (see the module docs). It adds no system call: it reads from the buffered socket
/// only what the reader above asks for, and the table a few bytes at a time from that buffer.
pub struct FrameGate<R> {
    inner: R,
    frame_bytes_max: usize,
    progress: Rc<ReadProgress>,
    phase: Phase,
    /// The segment table being read, then what is owed to the reader above.
    out: Vec<u8>,
    /// Where large frames take their bytes before they are read; `None`: not admitted.
    admission: Option<Admission>,
}

/// A connection's gate's way into its shard's publish budget.
pub struct Admission {
    pub budget: Rc<ByteBudget>,
    pub conn: Rc<ConnectionUse>,
    pub counters: Rc<EdgeLimits>,
    /// The gate's place in the budget's queue while a frame waits; left on drop.
    waiting: Option<u64>,
    /// The bytes of the frame being collected.
    admitted: Option<BytePermit>,
}

impl Admission {
    pub fn new(conn: Rc<ConnectionUse>, edge: Rc<EdgeLimits>) -> Admission {
        Admission {
            budget: edge.budget.clone(),
            conn,
            counters: edge,
            waiting: None,
            admitted: None,
        }
    }

    /// Ready with the frame's bytes taken, once the connection's previous large frame was
    /// claimed and the budget has room; counts a frame that had to wait.
    fn poll_admit(&mut self, cx: &mut Context<'_>, frame_bytes: usize) -> Poll<()> {
        if self.admitted.is_some() {
            return Poll::Ready(());
        }
        let held = self.conn.frame_held(cx.waker());
        let id = match self.waiting {
            Some(id) => id,
            None => {
                let id = self.budget.next_ticket();
                self.waiting = Some(id);
                id
            }
        };
        if !held {
            if let Some(permit) = self.budget.poll_take(cx, id, frame_bytes) {
                self.waiting = None;
                self.admitted = Some(permit);
                return Poll::Ready(());
            }
        }
        let memory = &self.counters.memory;
        if !self.conn.frame_waiting.replace(true) {
            memory.frames_waited.set(memory.frames_waited.get() + 1);
        }
        Poll::Pending
    }

    /// The frame is read whole: its bytes wait for its call to claim them.
    fn hand_on(&mut self, frame_bytes: usize) {
        self.conn.frame_waiting.set(false);
        if let Some(permit) = self.admitted.take() {
            self.conn.hold_frame(permit, frame_bytes);
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(id) = self.waiting.take() {
            self.budget.leave(id);
        }
    }
}

impl<R> FrameGate<R> {
    pub fn new(inner: R, frame_bytes_max: usize, progress: Rc<ReadProgress>) -> FrameGate<R> {
        FrameGate {
            inner,
            frame_bytes_max,
            progress,
            phase: Phase::Table,
            out: Vec::with_capacity(64),
            admission: None,
        }
    }

    /// Large frames take their bytes from `admission`'s budget before their body is read.
    pub fn admitted(mut self, admission: Admission) -> FrameGate<R> {
        self.admission = Some(admission);
        self
    }
}

/// Bytes of a segment table announcing `segments` segments (a count word, a size per segment,
/// padded to a whole word).
fn table_bytes(segments: usize) -> usize {
    (4 + 4 * segments + 7) & !7
}

/// What the first table bytes say: how long the whole table is, if the count is known.
fn table_len(table: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(count) = table.get(..4) else {
        return Ok(None);
    };
    let segments = u64::from(u32::from_le_bytes([count[0], count[1], count[2], count[3]])) + 1;
    if segments > 512 {
        return Err(FrameError::TooManySegments { segments });
    }
    Ok(Some(table_bytes(segments as usize)))
}

/// The body bytes a complete segment table announces, checked against the limit.
fn body_len(table: &[u8], frame_bytes_max: usize) -> Result<usize, FrameError> {
    let word = |at: usize| {
        u64::from(u32::from_le_bytes([
            table[at],
            table[at + 1],
            table[at + 2],
            table[at + 3],
        ]))
    };
    let segments = (word(0) + 1) as usize;
    // The sizes follow the count; a padding word after them (an even count) is not a size.
    let words: u64 = (0..segments).map(|i| word(4 + 4 * i)).sum();
    let bytes = words.saturating_mul(8).saturating_add(table.len() as u64);
    if bytes > frame_bytes_max as u64 {
        return Err(FrameError::TooLarge {
            bytes,
            max: frame_bytes_max,
        });
    }
    Ok((bytes - table.len() as u64) as usize)
}

fn refused(e: FrameError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl<R: AsyncRead + Unpin> FrameGate<R> {
    /// Reads from the socket into `buf`, counting the bytes; `Ok(0)` is end of stream.
    fn read_inner(&mut self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let n = std::task::ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        self.progress
            .bytes
            .set(self.progress.bytes.get() + n as u64);
        Poll::Ready(Ok(n))
    }

    /// Reads the segment table; `Ok(false)` when the stream ended cleanly between frames.
    fn poll_table(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            let want = table_len(&self.out).map_err(refused)?.unwrap_or(4);
            let have = self.out.len();
            if have == want {
                return Poll::Ready(Ok(true));
            }
            let mut chunk = [0u8; 64];
            let take = (want - have).min(chunk.len());
            let n = std::task::ready!(self.read_inner(cx, &mut chunk[..take]))?;
            if n == 0 {
                if have == 0 {
                    return Poll::Ready(Ok(false));
                }
                return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
            }
            self.progress.frame_open.set(true);
            self.out.extend_from_slice(&chunk[..n]);
        }
    }

    /// Collects a large frame's body after its table in `out`.
    fn poll_collect(
        &mut self,
        cx: &mut Context<'_>,
        body_left: &mut usize,
    ) -> Poll<io::Result<()>> {
        while *body_left > 0 {
            // Grow with what arrives: at most doubling what is already held.
            let grow = (*body_left).min(self.out.len().max(DIRECT_FRAME_BYTES_MAX));
            let start = self.out.len();
            self.out.resize(start + grow, 0);
            let mut scratch = std::mem::take(&mut self.out);
            let read = self.read_inner(cx, &mut scratch[start..]);
            self.out = scratch;
            match read {
                Poll::Ready(Ok(0)) => {
                    self.out.truncate(start);
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
                Poll::Ready(Ok(n)) => {
                    self.out.truncate(start + n);
                    *body_left -= n;
                }
                Poll::Ready(Err(e)) => {
                    self.out.truncate(start);
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    self.out.truncate(start);
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for FrameGate<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        loop {
            match &mut this.phase {
                Phase::Table => {
                    if !std::task::ready!(this.poll_table(cx))? {
                        return Poll::Ready(Ok(0));
                    }
                    this.begin_frame()?;
                }
                Phase::Admit { body } => {
                    let body = *body;
                    let frame = body + this.out.len();
                    // The wait counts toward `server.frameTimeout`: a frame that announced many
                    // bytes and never sends them holds the budget no longer than that.
                    if let Some(admission) = this.admission.as_mut() {
                        std::task::ready!(admission.poll_admit(cx, frame));
                    }
                    this.phase = Phase::Collect { body_left: body };
                }
                Phase::Collect { body_left } => {
                    let mut left = *body_left;
                    let done = this.poll_collect(cx, &mut left);
                    this.phase = Phase::Collect { body_left: left };
                    std::task::ready!(done)?;
                    this.phase = Phase::Serve {
                        served: 0,
                        direct_left: 0,
                    };
                }
                Phase::Serve { .. } => {
                    if let Some(read) = this.poll_serve(cx, buf) {
                        return read;
                    }
                }
            }
        }
    }
}

impl<R: AsyncRead + Unpin> FrameGate<R> {
    /// The segment table is in: checks the frame's size and chooses how its body goes (read
    /// straight through when small, admitted first when large).
    fn begin_frame(&mut self) -> io::Result<()> {
        let body = body_len(&self.out, self.frame_bytes_max).map_err(refused)?;
        let frame = body + self.out.len();
        let largest = &self.progress.largest_frame;
        largest.set(largest.get().max(frame));
        self.phase = if frame <= DIRECT_FRAME_BYTES_MAX {
            Phase::Serve {
                served: 0,
                direct_left: body,
            }
        } else {
            Phase::Admit { body }
        };
        Ok(())
    }

    /// Serves the frame's bytes: the buffered ones first, then (a small frame) the rest of its
    /// body straight from the socket. `None` when the frame is done and the next one begins.
    fn poll_serve(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Option<Poll<io::Result<usize>>> {
        let Phase::Serve {
            served,
            direct_left,
        } = &mut self.phase
        else {
            return None;
        };
        if *served < self.out.len() {
            let n = (self.out.len() - *served).min(buf.len());
            buf[..n].copy_from_slice(&self.out[*served..*served + n]);
            *served += n;
            if *served == self.out.len() && *direct_left == 0 {
                self.finish_frame();
            }
            return Some(Poll::Ready(Ok(n)));
        }
        if *direct_left == 0 {
            self.finish_frame();
            return None;
        }
        let take = (*direct_left).min(buf.len());
        let left = *direct_left;
        let n = match self.read_inner(cx, &mut buf[..take]) {
            Poll::Pending => return Some(Poll::Pending),
            Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
            Poll::Ready(Ok(n)) => n,
        };
        if n == 0 {
            return Some(Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into())));
        }
        let left = left - n;
        self.phase = Phase::Serve {
            served: self.out.len(),
            direct_left: left,
        };
        if left == 0 {
            self.finish_frame();
        }
        Some(Poll::Ready(Ok(n)))
    }
}

impl<R> FrameGate<R> {
    /// The frame is received whole: the next read starts a new table. A collected frame's
    /// buffer is given back (it may be large); a small table buffer is kept.
    fn finish_frame(&mut self) {
        if let Some(admission) = self.admission.as_mut() {
            admission.hand_on(self.out.len());
        }
        self.progress.frame_open.set(false);
        self.progress.frames.set(self.progress.frames.get() + 1);
        if self.out.capacity() > DIRECT_FRAME_BYTES_MAX {
            self.out = Vec::with_capacity(64);
        } else {
            self.out.clear();
        }
        self.phase = Phase::Table;
    }
}

// ---------------------------------------------------------------------------------------------
// The watchdog

/// What the watchdog looks at each tick.
#[derive(Clone, Copy, Debug)]
pub struct Observation {
    pub now_ms: u64,
    pub bytes: u64,
    pub frames: u64,
    pub frame_open: bool,
    /// A call in flight or a subscription open.
    pub busy: bool,
    /// Since when deliveries have waited for room with none of the connection's calls returning
    /// ([`send::SendGate::blocked_since_ms`]).
    pub send_blocked_since_ms: Option<u64>,
}

/// What the watchdog decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// Nothing in flight, nothing subscribed and no byte for `server.idleTimeout`.
    Idle,
    /// A frame begun and not finished for `server.frameTimeout`.
    StalledFrame,
    /// Deliveries waited for room, and no `deliver` call returned, for `server.sendStallTimeout`.
    SendStalled,
}

/// Decides when a connection is idle or its frame stalled, from observations a tick apart.
#[derive(Debug)]
pub struct Watchdog {
    idle_timeout_ms: u64,
    frame_timeout_ms: u64,
    send_stall_timeout_ms: u64,
    last_bytes: u64,
    quiet_since_ms: u64,
    /// The frame seen open: its number (frames received before it) and when it was first seen.
    open_frame: Option<(u64, u64)>,
}

impl Watchdog {
    pub fn new(limits: &ClientLimits, now_ms: u64) -> Watchdog {
        Watchdog {
            idle_timeout_ms: limits.idle_timeout_ms,
            frame_timeout_ms: limits.frame_timeout_ms,
            send_stall_timeout_ms: limits.send_stall_timeout_ms,
            last_bytes: 0,
            quiet_since_ms: now_ms,
            open_frame: None,
        }
    }

    /// How often to observe: a quarter of the shortest timeout, within 10 ms..1 s.
    pub fn tick(limits: &ClientLimits) -> Duration {
        let shortest = limits
            .idle_timeout_ms
            .min(limits.frame_timeout_ms)
            .min(limits.send_stall_timeout_ms);
        let ms = (shortest / 4).clamp(10, 1000);
        Duration::from_millis(ms)
    }

    pub fn observe(&mut self, seen: Observation) -> Verdict {
        if let Some(since) = seen.send_blocked_since_ms {
            if seen.now_ms.saturating_sub(since) >= self.send_stall_timeout_ms {
                return Verdict::SendStalled;
            }
        }
        if seen.bytes != self.last_bytes || seen.busy {
            self.last_bytes = seen.bytes;
            self.quiet_since_ms = seen.now_ms;
        }
        if seen.frame_open {
            match self.open_frame {
                Some((frame, since)) if frame == seen.frames => {
                    if seen.now_ms.saturating_sub(since) >= self.frame_timeout_ms {
                        return Verdict::StalledFrame;
                    }
                }
                _ => self.open_frame = Some((seen.frames, seen.now_ms)),
            }
            return Verdict::Keep;
        }
        self.open_frame = None;
        if seen.now_ms.saturating_sub(self.quiet_since_ms) >= self.idle_timeout_ms {
            return Verdict::Idle;
        }
        Verdict::Keep
    }
}

// ---------------------------------------------------------------------------------------------
// Publish bytes in flight per shard

/// The accounting of a byte budget: who holds how much, and who waits in what order. A request
/// larger than the whole budget is admitted alone (when nothing else holds any).
#[derive(Debug)]
pub struct BudgetCore {
    max: usize,
    in_use: usize,
    /// Waiters in arrival order: id and its waker.
    queue: VecDeque<(u64, Option<Waker>)>,
}

impl BudgetCore {
    pub fn new(max: usize) -> BudgetCore {
        BudgetCore {
            max,
            in_use: 0,
            queue: VecDeque::new(),
        }
    }

    /// Takes `bytes` for `id` if they fit and no earlier waiter is ahead of it. `own` is what
    /// `id` already holds: a taker holding everything in use may always grow (a frame's call
    /// adding its messages' charge to the frame's bytes), as anything fits an empty budget.
    pub fn try_take(&mut self, id: u64, bytes: usize, own: usize) -> bool {
        let first = self.queue.front().is_none_or(|(head, _)| *head == id);
        let fits = self.in_use <= own || self.in_use.saturating_add(bytes) <= self.max;
        if !(first && fits) {
            return false;
        }
        self.leave(id);
        self.in_use = self.in_use.saturating_add(bytes);
        true
    }

    /// Queues `id` (once) with the waker to call when it may try again.
    pub fn wait(&mut self, id: u64, waker: &Waker) {
        match self.queue.iter_mut().find(|(waiting, _)| *waiting == id) {
            Some((_, slot)) => *slot = Some(waker.clone()),
            None => self.queue.push_back((id, Some(waker.clone()))),
        }
    }

    /// Removes `id` from the queue (it took its bytes, or gave up).
    pub fn leave(&mut self, id: u64) {
        self.queue.retain(|(waiting, _)| *waiting != id);
    }

    pub fn release(&mut self, bytes: usize) {
        self.in_use = self.in_use.saturating_sub(bytes);
    }

    /// The waker of the first waiter, to call after anything that may let it in.
    pub fn head_waker(&mut self) -> Option<Waker> {
        self.queue.front_mut().and_then(|(_, waker)| waker.take())
    }

    pub fn in_use(&self) -> usize {
        self.in_use
    }

    pub fn max(&self) -> usize {
        self.max
    }
}

/// One shard's budget of publish bytes in flight (`publish.maxBytesInFlight`).
#[derive(Debug)]
pub struct ByteBudget {
    core: RefCell<BudgetCore>,
    next_id: Cell<u64>,
}

/// Bytes taken from a budget; dropping the permit gives them back.
#[derive(Debug)]
pub struct BytePermit {
    budget: Rc<ByteBudget>,
    bytes: usize,
}

/// A waiter's place in the queue; dropping it (taken, timed out or cancelled) leaves the queue
/// and lets the next waiter try.
struct Ticket<'a> {
    budget: &'a ByteBudget,
    id: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let waker = {
            let mut core = self.budget.core.borrow_mut();
            core.leave(self.id);
            core.head_waker()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl ByteBudget {
    pub fn new(max: usize) -> Rc<ByteBudget> {
        Rc::new(ByteBudget {
            core: RefCell::new(BudgetCore::new(max)),
            next_id: Cell::new(0),
        })
    }

    pub fn in_use(&self) -> usize {
        self.core.borrow().in_use()
    }

    pub fn max(&self) -> usize {
        self.core.borrow().max()
    }

    /// A new place in the queue for [`ByteBudget::poll_take`].
    pub fn next_ticket(&self) -> u64 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// Takes `bytes` for ticket `id` if they fit now; otherwise queues it (once) with the
    /// waker. The caller leaves the queue with [`ByteBudget::leave`] if it gives up.
    pub fn poll_take(
        self: &Rc<Self>,
        cx: &mut Context<'_>,
        id: u64,
        bytes: usize,
    ) -> Option<BytePermit> {
        let mut core = self.core.borrow_mut();
        if core.try_take(id, bytes, 0) {
            return Some(BytePermit {
                budget: self.clone(),
                bytes,
            });
        }
        core.wait(id, cx.waker());
        None
    }

    /// Leaves the queue (a waiter that gave up), waking the next one.
    pub fn leave(&self, id: u64) {
        let waker = {
            let mut core = self.core.borrow_mut();
            core.leave(id);
            core.head_waker()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Takes `bytes`, waiting in arrival order for room; `None` once `wait` has passed.
    pub async fn acquire(self: &Rc<Self>, bytes: usize, wait: Duration) -> Option<BytePermit> {
        self.acquire_beside(bytes, 0, wait).await
    }

    /// [`ByteBudget::acquire`] for a caller already holding `own` bytes of this budget.
    pub async fn acquire_beside(
        self: &Rc<Self>,
        bytes: usize,
        own: usize,
        wait: Duration,
    ) -> Option<BytePermit> {
        let id = self.next_ticket();
        let ticket = Ticket { budget: self, id };
        let take = futures_lite::future::poll_fn(|cx| {
            let mut core = self.core.borrow_mut();
            if core.try_take(id, bytes, own) {
                Poll::Ready(true)
            } else {
                core.wait(id, cx.waker());
                Poll::Pending
            }
        });
        let taken = futures_lite::future::or(take, async {
            glommio::timer::sleep(wait).await;
            false
        })
        .await;
        // Leaving the queue wakes the next waiter: it may fit beside us, or in our place.
        drop(ticket);
        taken.then(|| BytePermit {
            budget: self.clone(),
            bytes,
        })
    }
}

impl BytePermit {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BytePermit {
    fn drop(&mut self) {
        let waker = {
            let mut core = self.budget.core.borrow_mut();
            core.release(self.bytes);
            core.head_waker()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The accept loop's error handling

/// The pause after a failed accept: doubling from 10 ms to 1 s, back to 10 ms on success.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let ms = 10u64 << (self.failures - 1).min(7);
        Duration::from_millis(ms.min(1000))
    }

    pub fn succeeded(&mut self) {
        self.failures = 0;
    }
}

/// What a shard counts of its client memory bounds, for its metrics snapshot.
#[derive(Debug, Default)]
pub struct MemoryCounters {
    /// Times a delivery stream found no room in its send budgets and waited.
    pub sends_waited: Cell<u64>,
    /// Connections closed after `server.sendStallTimeout`.
    pub send_stall_closes: Cell<u64>,
    /// Large request frames whose body waited for room before it was read.
    pub frames_waited: Cell<u64>,
    /// `malloc_trim` calls after a connection that held much memory closed.
    pub trims: Cell<u64>,
}

/// Everything a shard's accept loops and connections share about client limits.
pub struct EdgeLimits {
    pub client: ClientLimits,
    pub connections: ConnectionCount,
    pub budget: Rc<ByteBudget>,
    /// This shard's share of `server.maxNodeSendBufferBytes`.
    pub send: Rc<send::SendBudget>,
    pub memory: MemoryCounters,
    /// Publishes of this shard waiting for room with their frames in memory.
    pub publishes_waiting: Cell<usize>,
    pub frame_bytes_max: usize,
    pub reader_options: capnp::message::ReaderOptions,
    /// Over-limit connections of this shard being answered.
    pub refusing: Cell<usize>,
}

impl EdgeLimits {
    pub fn new(
        client: ClientLimits,
        publish: &PublishConfig,
        connections: ConnectionCount,
        shards: usize,
    ) -> Rc<EdgeLimits> {
        let send_share = client.node_send_buffer_bytes_max / shards.max(1);
        Rc::new(EdgeLimits {
            client,
            connections,
            budget: ByteBudget::new(publish.bytes_in_flight_max),
            send: send::SendBudget::new(send_share),
            memory: MemoryCounters::default(),
            publishes_waiting: Cell::new(0),
            frame_bytes_max: frame_bytes_max(publish),
            reader_options: reader_options(publish),
            refusing: Cell::new(0),
        })
    }
}

pub mod send;

#[cfg(test)]
mod tests;

/// Gives freed heap memory back to the OS: glibc's `malloc_trim` walks every arena (each shard
/// thread has its own) and returns their free pages. Called after a connection that held much
/// memory closes; it costs a walk of the free lists, milliseconds at most.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks; it takes no pointer.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Allocations of at least this many bytes get pages of their own from the OS (mmap), given
/// back the moment they are freed.
pub const MMAP_THRESHOLD_BYTES: usize = 256 << 10;

/// Sets glibc's allocator up so that the large buffers of a client (frames, `deliver` calls,
/// 64 KiB..1 MiB values) are returned to the OS when freed: a fixed `M_MMAP_THRESHOLD` of
/// [`MMAP_THRESHOLD_BYTES`]. Without it glibc raises the threshold after each large free (up to
/// 32 MiB), so those buffers came from the shard threads' arenas, and after a hostile client
/// was gone RSS stayed 120-150 MiB above where it was even with `malloc_trim` (measured in
/// `tests/server_memory_bytes.rs`; README). Called once, before the shard threads start.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's allocator parameters; it takes no pointer.
    unsafe {
        let threshold = libc::c_int::try_from(MMAP_THRESHOLD_BYTES).unwrap_or(libc::c_int::MAX);
        if libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) != 1 {
            tracing::warn!(
                "mallopt(M_MMAP_THRESHOLD) refused: freed client buffers may stay resident"
            );
        }
    }
}
