"""The client against a broker serving TLS with access tokens (certificates made with openssl):
publish and consume with a token; a missing, a wrong and an insufficient token each refused with
its typed code; a plain client on the TLS port gets no session."""

import os
import shutil
import ssl
import tempfile
import uuid

import pytest

import pinq
from conftest import Broker, make_pki, token_config

APP_SECRET = "python-app-secret-1234"
OPS_SECRET = "python-ops-secret-5678"


@pytest.fixture(scope="module")
def tls_broker():
    directory = tempfile.mkdtemp(prefix="pinq-py-tls-")
    make_pki(directory)
    config = os.path.join(directory, "pinq.toml")
    token_config(
        config,
        {
            "app": (APP_SECRET, ["py-"], ["py-"], False),
            "ops": (OPS_SECRET, [], [], True),
        },
    )
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    b = Broker(
        ["--storage", "memory", "--cpus", "0", "--config", config,
         "--tls-cert", path("server.pem"), "--tls-key", path("server.key")]
    ).start()
    b.ca = path("ca.pem")
    yield b
    b.cleanup()
    shutil.rmtree(directory, ignore_errors=True)


async def test_publish_and_consume_over_tls_with_a_token(tls_broker):
    t = f"py-orders-{uuid.uuid4().hex[:6]}"
    async with await pinq.connect(tls_broker.addr, tls=tls_broker.ca, token=APP_SECRET) as client:
        sub = await client.subscribe(t, group="billing")
        tags = await client.publish(t, [b"paid", b"shipped"])
        got = []
        async for d in sub:
            got.append(d.payload)
            assert await d.ack() == "ok"
            if len(got) == 2:
                break
        assert sorted(got) == [b"paid", b"shipped"] and len(tags) == 2
    # The same with an SSLContext the application made, checked against the name "localhost".
    context = ssl.create_default_context(cafile=tls_broker.ca)
    async with await pinq.connect(
        tls_broker.addr, tls=context, token=OPS_SECRET.encode(), tls_server_name="localhost"
    ) as admin:
        stats = await admin.stats()
        assert any(s.published >= 2 for s in stats.shards)


async def test_missing_and_wrong_tokens_are_unauthenticated(tls_broker):
    for token in (None, "not-a-token"):
        with pytest.raises(pinq.Refused) as refused:
            await pinq.connect(tls_broker.addr, tls=tls_broker.ca, token=token)
        assert refused.value.code == "unauthenticated", refused.value
        assert refused.value.retryable is False


async def test_a_token_without_the_permission_is_forbidden(tls_broker):
    async with await pinq.connect(tls_broker.addr, tls=tls_broker.ca, token=APP_SECRET) as client:
        with pytest.raises(pinq.Refused) as refused:
            await client.publish("elsewhere", [b"x"])
        assert refused.value.code == "forbidden" and refused.value.index == 0
        # subscribe refuses with an exception "forbidden: ...": the same typed error.
        with pytest.raises(pinq.Refused) as refused:
            await client.subscribe("elsewhere", group="g")
        assert refused.value.code == "forbidden" and refused.value.index is None
        with pytest.raises(pinq.Refused) as refused:
            await client.group_policy("py-x", "g", max_deliveries=3)
        assert refused.value.code == "forbidden"


async def test_plain_tcp_to_the_tls_port_and_an_untrusted_ca_fail_to_connect(tls_broker):
    with pytest.raises(pinq.ConnectionLost):
        await pinq.connect(tls_broker.addr, token=APP_SECRET, timeout=3, request_timeout=3)
    with pytest.raises(pinq.ConnectionLost):
        # The system's CAs do not trust the test CA.
        await pinq.connect(tls_broker.addr, tls=True, token=APP_SECRET, timeout=3)
