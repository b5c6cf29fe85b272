//! The delivery pipeline as pure, I/O-free state machines.
