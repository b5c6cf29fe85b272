//! The protocol versions over the wire, against a real `pinq serve`: a connection whose `hello`
//! said protocol 2 gets refusals of `publish`, `ack`, `nack` and `touch` as the results'
//! `refusal` field (code, index of the offending message, nothing stored); a connection of
//! protocol 1 gets the exceptions it always got, same kind and same text. The Rust client and
//! `pinq publish` read the field.
//!
//! The raw connections here are what a client in another language does with the schema alone.

mod support;

use std::time::Duration;

use capnp_rpc::rpc_twoparty_capnp::Side;
use pinq::client::{AckLevel, Client, ClientError, PublishMessage, RefusalCode};
use pinq::rpc::pinq_capnp::{broker, consumer, subscription, RefusalCode as WireCode};
use support::{cli, on_executor, Server};

const MEMORY: &[&str] = &["--storage", "memory", "--cpus", "0"];

/// Runs `body` on its own thread, failing the test if it has not finished within `limit`.
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(body());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("did not finish within {limit:?}"))
}

/// A raw connection whose `hello` asked for `version`; returns the broker, the RPC task (keep
/// it) and the version the broker answered.
async fn raw(
    addr: std::net::SocketAddr,
    version: u32,
) -> (broker::Client, glommio::Task<Result<(), capnp::Error>>, u32) {
    let stream = glommio::net::TcpStream::connect(addr)
        .await
        .expect("connect");
    let (reader, writer) = futures_lite::io::split(stream);
    let network = capnp_rpc::twoparty::VatNetwork::new(
        futures_lite::io::BufReader::new(reader),
        futures_lite::io::BufWriter::new(writer),
        Side::Client,
        Default::default(),
    );
    let mut rpc = capnp_rpc::RpcSystem::new(Box::new(network), None);
    let broker: broker::Client = rpc.bootstrap(Side::Server);
    let task = glommio::spawn_local(rpc);
    let mut hello = broker.hello_request();
    hello.get().set_client_version(version);
    let reply = hello.send().promise.await.expect("hello");
    let answered = reply.get().expect("hello results").get_server_version();
    (broker, task, answered)
}

/// Five messages to `topic`, the third (index 2) with an empty topic.
fn third_refused(topic: &str) -> Vec<PublishMessage> {
    (0..5)
        .map(|i| PublishMessage::new(if i == 2 { "" } else { topic }, format!("m{i}")))
        .collect()
}

/// What a publish answered: the refusal's (code, index, message), or the exception's
/// (kind, text), and the number of tags.
#[derive(Debug)]
enum Answer {
    Refusal(WireCode, u32, String, usize),
    Exception(capnp::ErrorKind, String),
}

async fn publish_raw(broker: &broker::Client, messages: &[PublishMessage]) -> Answer {
    let mut request = broker.publish_request();
    pinq::rpc::write_publish_batch(request.get().init_messages(messages.len() as u32), messages)
        .expect("encode");
    request.get().set_ack_level(AckLevel::Durable.into());
    match request.send().promise.await {
        Err(e) => Answer::Exception(e.kind, e.extra),
        Ok(reply) => {
            let results = reply.get().expect("results");
            let refusal = results.get_refusal().expect("refusal");
            Answer::Refusal(
                refusal.get_code().expect("known code"),
                refusal.get_index(),
                refusal
                    .get_message()
                    .expect("text")
                    .to_string()
                    .expect("utf-8"),
                results.get_tags().expect("tags").len() as usize,
            )
        }
    }
}

async fn published(addr: String) -> u64 {
    let client = Client::connect(addr.as_str()).await.expect("connect");
    let stats = client.stats().await.expect("stats");
    stats.shards.iter().map(|s| s.published).sum()
}

#[test]
fn a_v2_publish_whose_third_message_is_refused_answers_code_and_index_and_stores_nothing() {
    let server = Server::start(MEMORY);
    let (addr, arg) = (server.addr, server.server_arg());
    let (answer, version, stored) = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let (broker, _task, version) = raw(addr, 2).await;
            let answer = publish_raw(&broker, &third_refused("orders")).await;
            (answer, version, published(arg).await)
        })
    });
    assert_eq!(
        version, 2,
        "the broker answers the version the connection speaks"
    );
    match answer {
        Answer::Refusal(code, index, message, tags) => {
            assert_eq!((code, index, tags), (WireCode::InvalidTopic, 2, 0));
            assert_eq!(message, "messages[2].topic: topic name is empty");
        }
        other => panic!("expected a refusal in the results, got {other:?}"),
    }
    assert_eq!(stored, 0, "a refused batch stores nothing");
}

#[test]
fn a_v1_connection_still_gets_the_exception_with_the_old_text() {
    let server = Server::start(MEMORY);
    let (addr, arg) = (server.addr, server.server_arg());
    let (refused, version, stored) = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let (broker, _task, version) = raw(addr, 1).await;
            let refused = publish_raw(&broker, &third_refused("orders")).await;
            (refused, version, published(arg).await)
        })
    });
    assert_eq!(version, 1, "a v1 client is answered with version 1");
    match refused {
        Answer::Exception(kind, text) => {
            assert_eq!(kind, capnp::ErrorKind::Failed);
            assert!(
                text.contains("messages[2].topic: topic name is empty"),
                "{text}"
            );
        }
        other => panic!("expected an exception, got {other:?}"),
    }
    assert_eq!(stored, 0);
}

/// A consumer that takes nothing (no message is published to its topic).
struct Idle;
impl consumer::Server for Idle {}

/// Subscribes on a raw connection of `version`, closes the subscription, then ACKs a tag on it.
async fn ack_after_close(
    addr: std::net::SocketAddr,
    version: u32,
) -> Result<(WireCode, u32, String, usize), capnp::Error> {
    let (broker, _task, _) = raw(addr, version).await;
    let mut request = broker.subscribe_request();
    request.get().set_topic("closing");
    request.get().set_group("g");
    request
        .get()
        .set_consumer(capnp_rpc::new_client::<consumer::Client, _>(Idle));
    let reply = request.send().promise.await?;
    let sub: subscription::Client = reply.get()?.get_subscription()?;
    sub.close_request().send().promise.await?;
    let mut ack = sub.ack_request();
    ack.get().init_tags(1).set(0, &[0u8; 24]);
    let reply = ack.send().promise.await?;
    let results = reply.get()?;
    let refusal = results.get_refusal()?;
    Ok((
        refusal.get_code().expect("known code"),
        refusal.get_index(),
        refusal.get_message()?.to_string().expect("utf-8"),
        results.get_results()?.len() as usize,
    ))
}

#[test]
fn an_ack_on_a_closed_subscription_is_a_typed_refusal_on_v2_and_the_old_exception_on_v1() {
    let server = Server::start(MEMORY);
    let addr = server.addr;
    let (v2, v1) = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let v2 = ack_after_close(addr, 2).await;
            let v1 = ack_after_close(addr, 1)
                .await
                .map(|_| ())
                .map_err(|e| e.extra);
            (v2.map_err(|e| e.extra), v1)
        })
    });
    let (code, index, message, results) = v2.expect("a v2 settle answers normally");
    assert_eq!(code, WireCode::SubscriptionClosed);
    assert_eq!(index, pinq::rpc::NO_INDEX, "the call as a whole");
    assert_eq!(message, "subscription is closed");
    assert_eq!(results, 0);
    let text = v1.expect_err("a v1 settle fails");
    assert!(text.contains("subscription is closed"), "{text}");
}

#[test]
fn the_rust_client_reads_the_refusal_as_a_typed_error_with_the_index() {
    let server = Server::start(MEMORY);
    let addr = server.server_arg();
    let (error, version) = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let client = Client::connect(addr.as_str()).await.expect("connect");
            let e = client
                .publish(third_refused("orders"), AckLevel::Durable)
                .await
                .expect_err("refused");
            (e, client.server().protocol_version)
        })
    });
    assert_eq!(version, pinq::rpc::PROTOCOL_VERSION);
    assert!(matches!(error, ClientError::Rejected(_)), "{error:?}");
    assert_eq!(error.refusal(), Some(RefusalCode::InvalidTopic));
    assert_eq!(error.refused_index(), Some(2));
    let text = error.to_string();
    assert!(
        text.contains("messages[2].topic: topic name is empty (invalidTopic, message 2)"),
        "{text}"
    );
}

#[test]
fn pinq_publish_names_the_refused_message_from_the_field() {
    let server = Server::start_with_env(MEMORY, &[("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "16")]);
    let (code, _, err) = cli(
        &[
            "publish",
            "--server",
            &server.server_arg(),
            "--topic",
            "orders",
            "short",
            "fine too",
            "this one is longer than sixteen bytes",
        ],
        None,
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("message 3 was refused, nothing of its batch was stored"),
        "{err}"
    );
    assert!(err.contains("messageTooLarge, message 2"), "{err}");
}
