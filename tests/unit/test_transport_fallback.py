"""The client's one fallback policy (client/transport/base.py): a transport that passes
a call on (TransportUnavailable, nothing sent) hands it to the next; a failure after
sending (Unavailable) or a node's refusal ends the call there, never sent twice."""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.client.config import ClientConfig
from pagedkv.client.transport import Fallback, TransportUnavailable
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound, Unavailable


class Recorder:
    """A transport that answers, passes, or fails each call as told, and records it."""

    def __init__(self, name: str, outcome: Any, log: list[str]) -> None:
        self.name, self.outcome, self.log = name, outcome, log

    def attend(self, call: Any, timeout_s: float) -> Any:
        self.log.append(self.name)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def start_attend(self, call: Any, timeout_s: float) -> Any:
        """Passes or fails as attend does when told to at once; else a reply that answers
        (or fails) when read."""
        self.log.append(f"start {self.name}")
        if isinstance(self.outcome, TransportUnavailable | tuple):
            raise self.outcome[0] if isinstance(self.outcome, tuple) else self.outcome
        return Later(self.outcome, self.log, self.name)

    def connect(self, timeout_s: float) -> None:
        self.log.append(f"connect {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")


class Later:
    def __init__(self, outcome: Any, log: list[str], name: str) -> None:
        self.outcome, self.log, self.name = outcome, log, name

    def result(self) -> Any:
        self.log.append(f"read {self.name}")
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def chain(*outcomes: Any) -> tuple[Fallback, list[str]]:
    log: list[str] = []
    names = ["shm", "unix", "tcp", "grpc"][-len(outcomes) :]
    return Fallback([Recorder(n, o, log) for n, o in zip(names, outcomes, strict=True)]), log


def test_a_passed_call_goes_to_the_next_transport() -> None:
    fb, log = chain(TransportUnavailable("no region"), TransportUnavailable("no socket"), "tcp", "grpc")
    assert fb.call("attend", None, 1.0) == "tcp" and log == ["shm", "unix", "tcp"]


def test_the_last_transport_carries_what_every_other_passed() -> None:
    fb, log = chain(TransportUnavailable("off"), "grpc")
    assert fb.call("attend", None, 1.0) == "grpc" and log == ["tcp", "grpc"]
    fb, log = chain(TransportUnavailable("off"), TransportUnavailable("even gRPC"))
    with pytest.raises(TransportUnavailable, match="even gRPC"):
        fb.call("attend", None, 1.0)


@pytest.mark.parametrize(
    "error", [Unavailable("sent, reply lost"), SequenceNotFound("s"), InvalidArgument("x")]
)
def test_a_call_that_was_sent_is_never_sent_again(error: Exception) -> None:
    fb, log = chain(error, "grpc")
    with pytest.raises(type(error)):
        fb.call("attend", None, 1.0)
    assert log == ["tcp"]


def test_connect_and_close_reach_every_transport_and_names_find_them() -> None:
    fb, log = chain("a", "b")
    fb.connect(1.0)
    fb.close()
    assert log == ["connect tcp", "connect grpc", "close tcp", "close grpc"]
    assert fb.get("grpc") is fb.transports[-1] and fb.get("shm") is None
    with pytest.raises(ValueError):
        Fallback([])


def test_config_names_the_transports_and_grpc_comes_last() -> None:
    assert ClientConfig().data_transports() == ("shm", "unix", "tcp", "grpc")
    assert ClientConfig(bulk_min_bytes=None).data_transports() == ("grpc",)
    assert ClientConfig(transports=("tcp", "grpc")).data_transports() == ("tcp", "grpc")
    for bad in (("grpc", "tcp"), ("tcp",), ("tcp", "tcp", "grpc"), ("udp", "grpc"), ()):
        with pytest.raises(InvalidArgument, match="transports"):
            ClientConfig(transports=bad)


def test_a_started_call_takes_the_first_transport_that_sends_and_its_errors_are_rewritten() -> None:
    log: list[str] = []

    def rewrite(exc: Any, call: Any) -> Any:
        log.append(f"rewrite {type(exc).__name__} of {call}")
        return SequenceNotFound("worker-id")

    names = ("shm", "tcp", "grpc")
    outcomes = (TransportUnavailable("no region"), "answer", "never")
    fb = Fallback([Recorder(n, o, log) for n, o in zip(names, outcomes, strict=True)], rewrite)
    reply = fb.start("attend", "call-1", 1.0)
    assert log == ["start shm", "start tcp"]  # nothing read yet
    assert reply.result() == "answer" and log[-1] == "read tcp"
    log.clear()
    fb = Fallback([Recorder("tcp", SequenceNotFound("node-id"), log)], rewrite)
    reply = fb.start("attend", "call-2", 1.0)
    with pytest.raises(SequenceNotFound, match="worker-id"):  # the node's error, in the worker's words
        reply.result()
    assert log == ["start tcp", "read tcp", "rewrite SequenceNotFound of call-2"]
    log.clear()
    fb = Fallback([Recorder("tcp", (InvalidArgument("refused before sending"),), log)], rewrite)
    with pytest.raises(SequenceNotFound, match="worker-id"):
        fb.start("attend", "call-3", 1.0)
    assert log == ["start tcp", "rewrite InvalidArgument of call-3"]
