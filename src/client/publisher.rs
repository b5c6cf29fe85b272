//! A producer that keeps a fixed number of publish batches in flight on one connection.

use std::collections::VecDeque;

use super::{AckLevel, Client, ClientError, EventKey, Pending, PublishMessage};

/// Pipelines publish batches: up to `window` batches are in flight at once, and replies are
/// returned in the order the batches were sent. With a window of 1 it is a plain request/reply
/// loop; a window of a few batches hides the round trip.
///
/// If a batch fails, the error is returned by the [`Publisher::send`] or [`Publisher::flush`]
/// that awaited it; later batches are still in flight and their replies come after.
pub struct Publisher {
    client: Client,
    ack: AckLevel,
    window: usize,
    in_flight: VecDeque<Pending<Vec<EventKey>>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("ack", &self.ack)
            .field("window", &self.window)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl Publisher {
    /// A publisher on `client`'s connection; `window` is at least 1.
    pub fn new(client: &Client, ack: AckLevel, window: usize) -> Publisher {
        let window = window.max(1);
        Publisher {
            client: client.clone(),
            ack,
            window,
            in_flight: VecDeque::with_capacity(window),
        }
    }

    /// Sends a batch. If `window` batches are already in flight, first waits for the oldest
    /// and returns its tags (`Some`); otherwise returns `None` at once. On an error from the
    /// oldest batch, this batch is not sent.
    pub async fn send(
        &mut self,
        messages: impl AsRef<[PublishMessage]>,
    ) -> Result<Option<Vec<EventKey>>, ClientError> {
        let oldest = match self.in_flight.len() >= self.window {
            true => match self.in_flight.pop_front() {
                Some(reply) => Some(reply.await?),
                None => None,
            },
            false => None,
        };
        self.in_flight
            .push_back(self.client.publish(messages, self.ack));
        Ok(oldest)
    }

    /// Waits for every batch in flight and returns their tags, oldest first. Stops at the first
    /// error; the batches after it stay in flight and a later `flush` returns them.
    pub async fn flush(&mut self) -> Result<Vec<Vec<EventKey>>, ClientError> {
        let mut done = Vec::with_capacity(self.in_flight.len());
        while let Some(reply) = self.in_flight.pop_front() {
            done.push(reply.await?);
        }
        Ok(done)
    }

    /// Batches sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}
