use capnp::message::{Builder, HeapAllocator, ReaderOptions};
use capnp::serialize;

use super::*;
use crate::key::TopicHash;
use crate::message::Value;
use crate::rpc::pinq_capnp::{broker, consumer, subscription};

/// Serializes a message to bytes and reads it back, as the wire does.
fn through_bytes(
    message: &Builder<HeapAllocator>,
) -> capnp::message::Reader<serialize::OwnedSegments> {
    let mut bytes = Vec::new();
    serialize::write_message(&mut bytes, message).unwrap();
    serialize::read_message(&mut bytes.as_slice(), ReaderOptions::new()).unwrap()
}

fn limits() -> PublishLimits {
    PublishLimits::from(&PublishConfig::default())
}

fn key(id: u64) -> EventKey {
    EventKey::new(TopicHash::of("orders"), 1_000 + id, id)
}

fn sample_messages() -> Vec<PublishMessage> {
    vec![
        PublishMessage::new("orders", b"first".to_vec()),
        PublishMessage {
            topic: "payments/eu".into(),
            payload: vec![0, 1, 2, 255],
            delay_ms: 1_500,
            ttl_ms: 60_000,
            headers: vec![
                Header {
                    key: "trace".into(),
                    value: b"abc".to_vec(),
                },
                Header {
                    key: "trace".into(),
                    value: Vec::new(),
                },
            ],
            producer_id: "billing-1".into(),
            sequence: 77,
        },
        PublishMessage::new("x".repeat(255), Vec::new()),
    ]
}

fn publish_request(messages: &[PublishMessage], ack: AckLevel) -> Builder<HeapAllocator> {
    let mut message = Builder::new_default();
    let mut params = message.init_root::<broker::publish_params::Builder>();
    params.set_ack_level(ack.into());
    let list = params.init_messages(messages.len() as u32);
    write_publish_batch(list, messages).unwrap();
    message
}

#[test]
fn publish_batch_round_trips_through_bytes() {
    let messages = sample_messages();
    let reader = through_bytes(&publish_request(&messages, AckLevel::Leader));
    let params = reader.get_root::<broker::publish_params::Reader>().unwrap();
    assert_eq!(
        read_ack_level(params.get_ack_level()).unwrap(),
        AckLevel::Leader
    );
    let batch = read_publish_batch(params.get_messages().unwrap(), &limits()).unwrap();
    let back: Vec<PublishMessage> = batch.iter().map(|m| m.to_owned_message()).collect();
    assert_eq!(back, messages);
    let stored = batch[1].to_stored(42);
    assert_eq!(stored.enqueued_at_ms, 42);
    assert_eq!(stored.delay_ms, 1_500);
    assert_eq!(stored.ttl_ms, 60_000);
    assert_eq!(stored.headers, messages[1].headers);
}

#[test]
fn ack_level_defaults_to_durable_when_unset() {
    // Cap'n Proto's default is the first enumerant: a client that never sets the level asks for
    // the strongest one.
    let mut message = Builder::new_default();
    message.init_root::<broker::publish_params::Builder>();
    let reader = through_bytes(&message);
    let params = reader.get_root::<broker::publish_params::Reader>().unwrap();
    assert_eq!(
        read_ack_level(params.get_ack_level()).unwrap(),
        AckLevel::Durable
    );
    for level in [AckLevel::Durable, AckLevel::Leader, AckLevel::None] {
        assert_eq!(AckLevel::from(WireAckLevel::from(level)), level);
    }
}

/// Builds a one-message publish request with raw field values, as a client in another language
/// could send them.
fn raw_publish(
    topic: &[u8],
    payload_len: usize,
    delay_ms: i64,
    ttl_ms: i64,
) -> Builder<HeapAllocator> {
    let mut message = Builder::new_default();
    let params = message.init_root::<broker::publish_params::Builder>();
    let mut list = params.init_messages(2);
    list.reborrow()
        .get(0)
        .set_topic(capnp::text::Reader::from("fine"));
    let mut bad = list.get(1);
    // Text setter with raw bytes, so that invalid UTF-8 can be sent.
    bad.reborrow()
        .init_topic(topic.len() as u32)
        .as_bytes_mut()
        .copy_from_slice(topic);
    bad.set_payload(&vec![7u8; payload_len]);
    bad.set_delay_ms(delay_ms);
    bad.set_ttl_ms(ttl_ms);
    message
}

fn publish_error(request: &Builder<HeapAllocator>, limits: &PublishLimits) -> String {
    let reader = through_bytes(request);
    let params = reader.get_root::<broker::publish_params::Reader>().unwrap();
    match read_publish_batch(params.get_messages().unwrap(), limits) {
        Ok(_) => panic!("batch was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_publish_messages_are_refused_with_the_field_and_index_named() {
    let limits = PublishLimits {
        message_bytes_max: 16,
        batch_len_max: 10,
    };
    assert_eq!(
        publish_error(&raw_publish(b"t", 0, -1, 0), &limits),
        "messages[1].delayMs is -1: negative values are refused"
    );
    assert_eq!(
        publish_error(&raw_publish(b"t", 0, 0, -5), &limits),
        "messages[1].ttlMs is -5: negative values are refused"
    );
    assert_eq!(
        publish_error(&raw_publish(b"", 0, 0, 0), &limits),
        "messages[1].topic: topic name is empty"
    );
    assert_eq!(
        publish_error(&raw_publish(&[b'x'; 256], 0, 0, 0), &limits),
        "messages[1].topic: topic name is 256 bytes, the limit is 255"
    );
    assert_eq!(
        publish_error(&raw_publish(&[0xFF, 0xFE], 0, 0, 0), &limits),
        "messages[1].topic is not valid UTF-8"
    );
    assert_eq!(
        publish_error(&raw_publish(b"t", 17, 0, 0), &limits),
        "messages[1].payload is 17 bytes, the limit is 16"
    );
    let small_batches = PublishLimits {
        batch_len_max: 1,
        ..limits
    };
    assert_eq!(
        publish_error(&raw_publish(b"t", 0, 0, 0), &small_batches),
        "batch of 2 messages, the limit is 1"
    );
    // The server answers with a `failed` exception carrying that text.
    let e = WireError::Negative {
        field: Field::at("messages", 0, "delayMs"),
        value: -1,
    }
    .into_capnp();
    assert_eq!(e.kind, capnp::ErrorKind::Failed);
    assert!(e.extra.contains("messages[0].delayMs"));
}

fn publish_refusal(
    request: &Builder<HeapAllocator>,
    limits: &PublishLimits,
) -> crate::rpc::refusal::Refusal {
    let reader = through_bytes(request);
    let params = reader.get_root::<broker::publish_params::Reader>().unwrap();
    match read_publish_batch(params.get_messages().unwrap(), limits) {
        Ok(_) => panic!("batch was accepted"),
        Err(e) => e.refusal().unwrap(),
    }
}

#[test]
fn each_bad_publish_message_maps_to_its_refusal_code_and_index() {
    use crate::rpc::refusal::Code;
    let limits = PublishLimits {
        message_bytes_max: 16,
        batch_len_max: 10,
    };
    let cases = [
        (raw_publish(b"t", 0, -1, 0), Code::InvalidDelay),
        (raw_publish(b"t", 0, 0, -5), Code::InvalidTtl),
        (raw_publish(b"", 0, 0, 0), Code::InvalidTopic),
        (raw_publish(&[b'x'; 256], 0, 0, 0), Code::InvalidTopic),
        (raw_publish(&[0xFF, 0xFE], 0, 0, 0), Code::NotUtf8),
        (raw_publish(b"t", 17, 0, 0), Code::MessageTooLarge),
    ];
    for (request, code) in &cases {
        let refusal = publish_refusal(request, &limits);
        assert_eq!((refusal.code, refusal.index), (*code, Some(1)), "{refusal}");
        assert_eq!(refusal.message, publish_error(request, &limits));
        assert!(!refusal.retryable);
    }
    let small_batches = PublishLimits {
        batch_len_max: 1,
        ..limits
    };
    let refusal = publish_refusal(&raw_publish(b"t", 0, 0, 0), &small_batches);
    assert_eq!((refusal.code, refusal.index), (Code::BatchTooLarge, None));
    let with_headers = WireError::MessageTooLarge {
        field: Field::at("messages", 4, ""),
        bytes: 20,
        max: 16,
    };
    let refusal = with_headers.refusal().unwrap();
    assert_eq!(
        (refusal.code, refusal.index),
        (Code::MessageTooLarge, Some(4))
    );
    let headers = WireError::TooLarge {
        field: Field::at("messages", 3, "headers (count)"),
        value: 300,
        max: 256,
    };
    let refusal = headers.refusal().unwrap();
    assert_eq!(
        (refusal.code, refusal.index),
        (Code::TooManyHeaders, Some(3))
    );
    let producer = WireError::TooLong {
        field: Field::at("messages", 0, "producerId"),
        len: 300,
        max: 255,
    };
    assert_eq!(producer.refusal().unwrap().code, Code::InvalidProducerId);
    let ack = read_ack_level(Err(capnp::NotInSchema(9))).unwrap_err();
    let refusal = ack.refusal().unwrap();
    assert_eq!((refusal.code, refusal.index), (Code::InvalidAckLevel, None));
}

#[test]
fn a_malformed_message_is_not_a_refusal() {
    let broken = WireError::Capnp(capnp::Error::disconnected("gone".into()));
    let e = broken.refusal().unwrap_err();
    assert_eq!(e.kind, capnp::ErrorKind::Disconnected);
}

#[test]
fn delays_beyond_the_signed_range_cannot_be_sent() {
    let mut message = Builder::new_default();
    let params = message.init_root::<broker::publish_params::Builder>();
    let list = params.init_messages(1);
    let mut too_late = PublishMessage::new("t", Vec::new());
    too_late.delay_ms = i64::MAX as u64 + 1;
    let e = write_publish_batch(list, &[too_late]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "messages[0].delayMs is {}, more than the protocol carries ({})",
            i64::MAX as u64 + 1,
            i64::MAX
        )
    );
}

#[test]
fn deliveries_round_trip_from_owned_and_archived_messages() {
    let stored = StoredMessage {
        topic: "orders".into(),
        payload: vec![9; 100],
        enqueued_at_ms: 1_700_000_000_000,
        delay_ms: 250,
        ttl_ms: 0,
        headers: vec![Header {
            key: "k".into(),
            value: b"v".to_vec(),
        }],
    };
    let value = Value::encode(&stored).unwrap();
    let archived = value.message().unwrap();

    let mut message = Builder::new_default();
    let params = message.init_root::<consumer::deliver_params::Builder>();
    let mut list = params.init_deliveries(2);
    write_delivery(
        list.reborrow().get(0),
        &OutgoingDelivery {
            tag: key(1),
            message: &stored,
            attempt: 1,
        },
    );
    write_delivery(
        list.reborrow().get(1),
        &OutgoingDelivery {
            tag: key(2),
            message: archived,
            attempt: 3,
        },
    );
    let reader = through_bytes(&message);
    let params = reader
        .get_root::<consumer::deliver_params::Reader>()
        .unwrap();
    let deliveries = read_deliveries(params.get_deliveries().unwrap()).unwrap();
    let expected = |tag, attempt| Delivery {
        topic: "orders".into(),
        payload: vec![9; 100],
        tag,
        enqueued_at_ms: 1_700_000_000_000,
        delay_ms: 250,
        attempt,
        headers: stored.headers.clone(),
    };
    assert_eq!(deliveries, vec![expected(key(1), 1), expected(key(2), 3)]);
}

#[test]
fn a_delivery_with_a_bad_tag_is_refused() {
    let mut message = Builder::new_default();
    let params = message.init_root::<consumer::deliver_params::Builder>();
    let mut list = params.init_deliveries(1);
    let mut d = list.reborrow().get(0);
    d.set_topic("orders");
    d.set_tag(&[1u8; 23]);
    let reader = through_bytes(&message);
    let params = reader
        .get_root::<consumer::deliver_params::Reader>()
        .unwrap();
    let e = read_deliveries(params.get_deliveries().unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "deliveries[0].tag: delivery tag is 23 bytes, expected 24"
    );
}

#[test]
fn tags_and_tag_results_round_trip_and_malformed_tags_are_named() {
    let tags = [key(1), key(2), key(3), key(4), key(5)];
    let mut message = Builder::new_default();
    let params = message.init_root::<subscription::ack_params::Builder>();
    let mut list = params.init_tags(5);
    write_tags(list.reborrow(), &tags);
    // Two entries overwritten with what a buggy client might send.
    let mut wrong = list;
    wrong.set(3, &[0u8; 5]);
    wrong.set(4, &[0xFF; 24]);
    let reader = through_bytes(&message);
    let tags_reader = reader
        .get_root::<subscription::ack_params::Reader>()
        .unwrap()
        .get_tags()
        .unwrap();
    let parsed: Vec<Result<EventKey, String>> = (0..tags_reader.len())
        .map(|i| parse_tag(tags_reader, i).map_err(|e| e.to_string()))
        .collect();
    assert_eq!(parsed[..3], [Ok(key(1)), Ok(key(2)), Ok(key(3))]);
    assert_eq!(
        parsed[3],
        Err("tags[3]: delivery tag is 5 bytes, expected 24".to_string())
    );
    assert!(parsed[4].as_ref().is_err_and(|e| e.starts_with("tags[4]:")));
    assert!(read_tags(tags_reader).is_err());

    let results = [
        TagResult::Ok,
        TagResult::UnknownTag,
        TagResult::NotHolder,
        TagResult::AlreadyAcked,
        TagResult::Malformed,
    ];
    let mut message = Builder::new_default();
    let reply = message.init_root::<subscription::ack_results::Builder>();
    write_tag_results(reply.init_results(results.len() as u32), &results);
    let reader = through_bytes(&message);
    let back = read_tag_results(
        reader
            .get_root::<subscription::ack_results::Reader>()
            .unwrap()
            .get_results()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(back, results);
}

#[test]
fn consumer_ids_are_sixteen_byte_uuids() {
    let id = Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
    assert_eq!(read_consumer_id(id.as_bytes()).unwrap(), id);
    assert_eq!(
        read_consumer_id(&[0; 15]).unwrap_err().to_string(),
        "consumerId is 15 bytes, expected 16"
    );
}

#[test]
fn topology_round_trip() {
    let shards = vec![
        ShardInfo {
            shard_id: 0,
            host: "127.0.0.1".into(),
            port: 7401,
            cpu: 0,
            ..ShardInfo::default()
        },
        ShardInfo {
            shard_id: 1,
            host: "127.0.0.1".into(),
            port: 7402,
            cpu: 1,
            leader_node_id: 2,
            term: 7,
            leader_address: "127.0.0.1:7420".into(),
        },
    ];
    let mut message = Builder::new_default();
    let reply = message.init_root::<broker::topology_results::Builder>();
    write_topology(reply.init_shards(2), &shards);
    let reader = through_bytes(&message);
    let back = read_topology(
        reader
            .get_root::<broker::topology_results::Reader>()
            .unwrap()
            .get_shards()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(back, shards);
}

#[test]
fn stats_round_trip() {
    let stats = Stats {
        shards: vec![ShardStats {
            shard_id: 1,
            published: 10,
            dispatched: 9,
            acked: 8,
            nacked: 7,
            in_flight: 6,
            active_consumers: 5,
            redeliveries: 4,
            expired: 3,
            delete_failures: 2,
            backlog: 1,
            scheduled: 11,
            counted: true,
            delayed: 12,
        }],
        groups: vec![GroupStats {
            topic: "orders".into(),
            group: "billing".into(),
            shard_id: 1,
            consumers: 2,
            backlog: 3,
            in_flight: 4,
            dispatched: 5,
            acked: 6,
            nacked: 7,
            redeliveries: 8,
            expired: 9,
            dead_lettered: 10,
            scheduled: 11,
            delayed: 12,
        }],
        topics: vec![TopicStats {
            topic: "orders".into(),
            shard_id: 1,
            stored: 12,
            due: 13,
            scheduled: 14,
            in_flight: 15,
            groups: 16,
        }],
    };
    let mut message = Builder::new_default();
    let reply = message.init_root::<broker::stats_results::Builder>();
    write_stats(reply.init_stats(), &stats).unwrap();
    let reader = through_bytes(&message);
    let back = read_stats(
        reader
            .get_root::<broker::stats_results::Reader>()
            .unwrap()
            .get_stats()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(back, stats);
}

#[test]
fn unknown_enumerants_from_a_newer_peer_are_refused() {
    let unknown = Err(capnp::NotInSchema(9));
    assert_eq!(
        read_ack_level(unknown).unwrap_err().to_string(),
        "ackLevel has an unknown value 9 (newer peer?)"
    );
}

#[test]
fn settle_tags_are_parsed_once_into_event_keys_and_malformed_ones_answered_per_tag() {
    let mut message = Builder::new_default();
    let params = message.init_root::<subscription::ack_params::Builder>();
    let mut list = params.init_tags(5);
    list.set(0, &[1u8; 3]);
    list.set(1, key(7).as_bytes());
    list.set(2, &[0u8; 25]);
    list.set(3, key(8).as_bytes());
    list.set(4, &[]);
    let reader = through_bytes(&message);
    let tags_reader = reader
        .get_root::<subscription::ack_params::Reader>()
        .unwrap()
        .get_tags()
        .unwrap();
    let mut tags = SettleTags::read(tags_reader).unwrap();
    assert_eq!(tags.len(), 5);
    assert_eq!(tags.keys, vec![key(7), key(8)]);
    // The shard answers only the keys it was sent; the edge puts them back in request order.
    let sent = std::mem::take(&mut tags.keys);
    assert_eq!(sent.len(), 2);
    let answers = tags.answers(&[TagResult::Ok, TagResult::NotHolder], TagResult::Malformed);
    assert_eq!(
        answers,
        vec![
            TagResult::Malformed,
            TagResult::Ok,
            TagResult::Malformed,
            TagResult::NotHolder,
            TagResult::Malformed,
        ]
    );
}
