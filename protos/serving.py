"""Server plumbing shared by the node and the coordinator: a gRPC server with
health checking and reflection, a graceful stop, and a timed, error-mapping
wrapper for handlers. Role-neutral: it knows services by name only."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from .status import abort_details
from .tls import TlsConfig

T = TypeVar("T")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_PR_SET_NAME = 15
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


class Offload(BaseException):  # noqa: N818 (not an error: a request changing threads)
    """Raised by a batch handler's answer on a framed loop's thread, when its call would wait
    there on another thread (the handler changed nothing for it): the loop answers that
    request from a thread of its own (framed_loop.py). A BaseException, so that handlers'
    error mapping lets it through."""


def name_os_thread() -> None:
    """Give the calling thread's Python name to the OS (`top -H`, /proc/*/task/*/comm
    show it; first 15 bytes), so a process's CPU can be split by role. A pool's
    `initializer`; Linux only, a no-op elsewhere."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)


def raise_open_files_limit() -> int:
    """Raise the soft limit on this process's open descriptors to its hard limit (capped at
    2^20) and return it: a coordinator holds a connection per node, and the soft limit is
    often 1,024. A no-op where it is already there or the platform has none."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # (the kernel's nr_open is lower: keep what we have)
            pass
    return int(soft)


class Companion(Protocol):
    """A listener that lives and dies with a gRPC server (the coordinator's framed port)."""

    port: int

    def start(self) -> object: ...

    def stop(self) -> None: ...


class GrpcServer:
    """A built (not yet started) gRPC server with its health servicer, and the
    listeners that start and stop with it."""

    def __init__(
        self,
        server: grpc.Server,
        health_servicer: health.HealthServicer,
        services: Iterable[str],
        companions: Iterable[Companion] = (),
    ):
        self.grpc_server = server
        self.health = health_servicer
        self.services = ("", *services)
        self.companions = tuple(companions)

    def start(self) -> GrpcServer:
        self.grpc_server.start()
        for companion in self.companions:
            companion.start()
        for name in self.services:
            self.health.set(name, SERVING)
        return self

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Flip health to NOT_SERVING, refuse new calls, let running ones finish
        for up to grace_s seconds, then cancel the rest. Blocks until stopped."""
        self.health.enter_graceful_shutdown()
        for companion in self.companions:
            companion.stop()
        self.grpc_server.stop(grace_s).wait()

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout_s)


def build_server(
    add_servicers: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    address: str,
    *,
    max_workers: int = 16,
    options: Iterable[tuple[str, Any]] = (),
    tls: TlsConfig | None = None,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A server bound to `address` (port 0 = any free port) with health (NOT_SERVING
    until started) and reflection on; TLS with `tls` (plaintext without). Returns
    (server, health servicer, port)."""
    names = tuple(service_names)
    pool = futures.ThreadPoolExecutor(
        max_workers, thread_name_prefix="grpc-handler", initializer=name_os_thread
    )
    server = grpc.server(pool, options=list(options))
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *names):
        health_servicer.set(name, NOT_SERVING)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    listed = (*names, health_name, reflection.SERVICE_NAME, REFLECTION_V1)
    reflection.enable_server_reflection(listed, server)
    # grpcio-reflection ships v1alpha only; v1's messages are the same on the wire, so the same
    # servicer answers v1 clients (grpcurl, Postman) under the v1 service name.
    v1 = reflection.ReflectionServicer(listed)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        v1.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials())
    if port == 0:
        raise OSError(f"could not bind a gRPC server to {address}")
    return server, health_servicer, port


def observe(
    method: str,
    context: grpc.ServicerContext,
    fn: Callable[[], T],
    on_done: Callable[[str, float, str], None] | None = None,
    start: float | None = None,
) -> T | None:
    """Run a handler body: on a raised error, abort the call with its mapped
    status (the server keeps serving); report (method, seconds, code name), the
    seconds from `start` (perf_counter) when given: a batch's calls began together."""
    start = time.perf_counter() if start is None else start
    code = "OK"
    try:
        return fn()
    except Offload:  # answered again from another thread: reported there
        code = ""
        raise
    except Exception as exc:  # every failure becomes a status
        status, details = abort_details(context, method, exc)
        code = status.name
        context.abort(status, details)
        return None  # unreachable: abort raises
    finally:
        if on_done is not None and code:
            on_done(method, time.perf_counter() - start, code)
