//! The `setGroupPolicy` admin call on the server side: reads and checks the request, routes it
//! to the topic's owning shard (which writes the policy command and answers the policy in
//! force), and writes the answer, or where the shard's leader is when this node does not lead it. Kept apart from `connection.rs`, which only delegates here.

use std::rc::Rc;

use super::mesh::{Refused, Request};
use super::shard::Shard;
use crate::pipeline::policy::{Backoff, Policy, PolicyOverride};
use crate::rpc::pinq_capnp::broker;
use crate::rpc::refusal::{code_first, Code};

/// Reads the parameters, asks the owning shard, writes the policy in force. `failed` turns a
/// refusal's text into its typed error (the connection's helper).
pub async fn set_group_policy(
    shard: &Rc<Shard>,
    params: broker::SetGroupPolicyParams,
    mut results: broker::SetGroupPolicyResults,
    failed: fn(String) -> capnp::Error,
) -> Result<(), capnp::Error> {
    let (topic, group, policy) =
        read(params).map_err(|(code, e)| code.error(format!("setGroupPolicy: {e}")))?;
    let owner = shard.owner_of(&topic);
    let answer = shard
        .call(owner, |reply| Request::SetGroupPolicy {
            topic: topic.clone(),
            group,
            policy,
            reply,
        })
        .await;
    let policy: Policy = match answer {
        Ok(policy) => policy,
        Err(Refused::NotLeader(hint)) => {
            super::connection::write_not_leader(results.get().init_not_leader(), &hint);
            return Ok(());
        }
        Err(e) => return Err(failed(code_first("setGroupPolicy", &e.to_string()))),
    };
    let mut out = results.get().init_policy();
    out.set_max_deliveries(policy.max_deliveries);
    out.set_dead_letter_topic(policy.dead_letter_topic_of(&topic).as_str());
    let (initial, max) = policy.backoff.map_or((0, 0), |b| (b.initial_ms, b.max_ms));
    out.set_backoff_initial_ms(initial);
    out.set_backoff_max_ms(max);
    Ok(())
}

/// A bad request: the refusal's code and what is wrong.
type Bad = (Code, String);

/// The request as (topic, group, overrides), every field checked.
fn read(params: broker::SetGroupPolicyParams) -> Result<(String, String, PolicyOverride), Bad> {
    let invalid = |e: capnp::Error| (Code::InvalidRequest, e.to_string());
    let p = params.get().map_err(invalid)?;
    let text = |r: capnp::Result<capnp::text::Reader<'_>>, what: &str| -> Result<String, Bad> {
        r.map_err(invalid)?
            .to_str()
            .map(str::to_owned)
            .map_err(|_| (Code::NotUtf8, format!("{what} is not UTF-8")))
    };
    let topic = text(p.get_topic(), "topic")?;
    let group = text(p.get_group(), "group")?;
    crate::key::validate_topic(&topic).map_err(|e| (Code::InvalidTopic, format!("topic: {e}")))?;
    if group.is_empty() {
        return Err((
            Code::InvalidRequest,
            "group is empty: a policy belongs to a named consumer group".into(),
        ));
    }
    if group.len() > crate::key::TOPIC_LEN_MAX {
        return Err((
            Code::InvalidRequest,
            format!(
                "group is {} bytes, at most {} are allowed",
                group.len(),
                crate::key::TOPIC_LEN_MAX
            ),
        ));
    }
    let mut policy = PolicyOverride::default();
    if p.get_set_max_deliveries() {
        policy.max_deliveries = Some(p.get_max_deliveries());
    }
    if p.get_set_dead_letter_topic() {
        let name = text(p.get_dead_letter_topic(), "deadLetterTopic")?;
        if !name.is_empty() {
            crate::key::validate_topic(&name.replace("{topic}", &topic))
                .map_err(|e| (Code::InvalidTopic, format!("deadLetterTopic: {e}")))?;
        }
        // Empty: back to the default.
        policy.dead_letter_topic = Some(name);
    }
    if p.get_set_backoff() {
        let (initial, max) = (p.get_backoff_initial_ms(), p.get_backoff_max_ms());
        policy.backoff = Some(if initial == 0 {
            None
        } else {
            Some(
                Backoff::new(initial, max)
                    .map_err(|e| (Code::InvalidRequest, format!("backoff: {e}")))?,
            )
        });
    }
    Ok((topic, group, policy))
}
