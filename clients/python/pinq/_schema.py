"""Loads the protocol schema shipped with the package (the broker's `schema/pinq.capnp`).

The schema imports nothing, so no import path is needed. Everything else of the package takes
its constants from here rather than repeating them.
"""

import os

import capnp

_HERE = os.path.dirname(os.path.abspath(__file__))

# `capnp.load` keeps one module per path; loading it here once is what every module shares.
schema = capnp.load(os.path.join(_HERE, "pinq.capnp"))

PROTOCOL_VERSION = int(schema.protocolVersion)
NO_INDEX = int(schema.noIndex)
TAG_BYTES = int(schema.tagBytes)
# The names of `RefusalCode`, as the broker spells them in refusals.
REFUSAL_CODES = frozenset(schema.RefusalCode.schema.enumerants)
ACK_LEVELS = ("durable", "leader", "none")

# The seed of the topic hash (the schema's header): "pinq_top".
TOPIC_HASH_SEED = 0x70696E715F746F70
TOPIC_HASH_MASK = 0x7FFFFFFFFFFFFFFF

