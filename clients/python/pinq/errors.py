"""The exceptions of the pinq client, and how Cap'n Proto failures map onto them.

Every error the client raises is a `PinqError`. A request the broker refused is a `Refused`
carrying the schema's `RefusalCode` name (`code`), the offending entry of the batch (`index`,
`None` for the call as a whole), the broker's sentence (`message`) and whether the same request
may succeed later (`retryable`). Nothing of a refused request was done.
"""

from __future__ import annotations

from ._schema import NO_INDEX, REFUSAL_CODES

# Codes the schema documents as retryable; used for refusals that travel as exceptions (the
# calls other than publish/ack/nack/touch), whose exception type may say `failed` anyway.
_RETRYABLE_CODES = frozenset(
    {"tooManyConnections", "tooManyCalls", "publishBytesInFlight", "diskFull"}
)

# Texts of `failed` exceptions the broker sends while a shard changes hands: another node (or
# the same one a moment later) may answer.
_TRANSIENT_TEXTS = ("leadership changed", "shutting down")

_REMOTE_PREFIX = "remote exception: "


class PinqError(Exception):
    """Base class of every error of the pinq client."""


class Refused(PinqError):
    """The broker refused the request; nothing of it was done.

    `code` is the schema's `RefusalCode` name ("messageTooLarge", "forbidden", ...), `index` the
    offending entry of the batch (None when the call as a whole was refused), `message` the
    broker's sentence for people, `retryable` whether the same request may succeed later.
    """

    def __init__(self, code: str, index: int | None, message: str, retryable: bool):
        super().__init__(f"{code}: {message}" if not message.startswith(code) else message)
        self.code = code
        self.index = index
        self.message = message
        self.retryable = retryable

    def __repr__(self) -> str:
        return (
            f"Refused(code={self.code!r}, index={self.index!r}, "
            f"message={self.message!r}, retryable={self.retryable!r})"
        )


class ConnectionLost(PinqError):
    """The connection to the broker (or the object behind a capability) is gone, or a node did
    not answer in time. A publish whose answer was lost may or may not have been stored."""


class SubscriptionEnded(PinqError):
    """The broker ended the subscription on a live connection (its shard changed leader, or the
    broker is shutting down) and the subscription was not allowed to follow (`follow=False`)."""


class NotLeader(PinqError):
    """In a cluster no node answered as the leader of the shard within the client's patience."""

    def __init__(self, shard_id: int, leader_address: str, term: int):
        where = leader_address or "none known yet"
        super().__init__(f"no leader answered for shard {shard_id} (last hint: {where})")
        self.shard_id = shard_id
        self.leader_address = leader_address
        self.term = term


class VersionMismatch(PinqError):
    """The broker does not speak the protocol version of this client."""


class CallFailed(PinqError):
    """The broker failed the call without a refusal code: a malformed message or an internal
    failure. The request may or may not have taken effect."""


class BadReply(PinqError):
    """The broker's answer does not follow the protocol."""


def refusal_from_reply(refusal) -> Refused | None:
    """The `Refused` of a protocol-2 results' `refusal` field, or None when the code is `none`."""
    code = str(refusal.code)
    if code == "none":
        return None
    index = None if refusal.index == NO_INDEX else int(refusal.index)
    return Refused(code, index, refusal.message, bool(refusal.retryable))


def from_kj(error: Exception) -> PinqError:
    """Maps an exception of a Cap'n Proto call onto the client's errors.

    A refusal sent as an exception reads "code: sentence" (possibly after "remote exception: ");
    its code makes it a `Refused`. `disconnected` is `ConnectionLost`; `overloaded` without a
    code is a retryable `Refused` of code "overloaded".
    """
    if isinstance(error, PinqError):
        return error
    kind = str(getattr(error, "type", "") or "").upper()
    text = str(getattr(error, "description", None) or error)
    if text.startswith(_REMOTE_PREFIX):
        text = text[len(_REMOTE_PREFIX) :]
    if kind == "DISCONNECTED":
        return ConnectionLost(text)
    code = code_of(text)
    if code is not None:
        retryable = kind == "OVERLOADED" or code in _RETRYABLE_CODES
        return Refused(code, None, text, retryable)
    if kind == "OVERLOADED":
        return Refused("overloaded", None, text, True)
    return CallFailed(text)


def code_of(text: str) -> str | None:
    """The refusal code a text starts with ("forbidden: ..."), or None."""
    head, sep, _ = text.partition(": ")
    if sep and head in REFUSAL_CODES and head != "none":
        return head
    return None


def is_transient(error: PinqError) -> bool:
    """Whether another node, or the same one a moment later, may answer the same request:
    the connection dropped, the node did not answer, or leadership changed under the call."""
    if isinstance(error, ConnectionLost):
        return True
    if isinstance(error, CallFailed):
        return any(t in str(error) for t in _TRANSIENT_TEXTS)
    return False
