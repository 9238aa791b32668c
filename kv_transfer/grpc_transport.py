"""`GrpcTransport`: the KV plane over gRPC -- the only hand-written module that imports grpc.

Registered as "grpc" in `contract.TRANSPORTS`. The service is `KVTransfer.Push` of
proto/kv_transfer.proto, registered with identity (de)serializers for the request stream: frames travel
as the wire bytes the codec made, and the receiver parses them with `codec.parse_frame` -- the decoder
the fuzz tests drive -- with no second copy by a generated stub. Server side, `serve(sink, config)`
starts a gRPC server whose `Push` handler reads the bearer token from call metadata and hands the
request stream to `sink.handle_push`; a typed `TransferError` becomes the matching status code. Client
side, `push(address, frames, config, cancel)` streams frames with a per-call deadline and the token as
metadata, cancels the call when `cancel` is set, and turns a failed call back into the typed error of
its status code. Both ends set message-size caps and
keepalive; TLS or mutual TLS is used when `config.tls` names certificate files. Channels are cached per
(address, config) and closed by `close()`.
"""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.contract import Cancelled, ErrorCode, PushResult, TransferConfigError, TransferError, error_for

_TO_GRPC = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}
_FROM_GRPC = {status: code for code, status in _TO_GRPC.items()}
_AUTH_KEY = "authorization"
REPLY_CAP = 64 << 10
SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name  # pdserve.kv_transfer.v1.KVTransfer
PUSH = f"/{SERVICE}/Push"


def _keepalive_options(ka) -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", ka.time_ms), ("grpc.keepalive_timeout_ms", ka.timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(ka.permit_without_calls)),
            ("grpc.http2.max_pings_without_data", 0)]


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == _AUTH_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def _frames(request_iterator):
    """The request stream, with a broken or cancelled call surfacing as a typed error."""
    try:
        yield from request_iterator
    except grpc.RpcError as e:
        raise Cancelled(f"push stream broken: {e}") from None


class _Push:
    """The `Push` handler: request messages arrive as wire bytes (no deserializer)."""

    def __init__(self, sink):
        self.sink = sink

    def __call__(self, request_iterator, context):
        try:
            r = self.sink.handle_push(_frames(request_iterator), _bearer(context.invocation_metadata()))
        except TransferError as e:
            context.abort(_TO_GRPC[e.code], e.message)
        return pb.PushReply(state=r.state, reason=r.reason, chunks_accepted=r.chunks_accepted,
                            duplicates=r.duplicates, bytes_accepted=r.bytes_accepted)


@dataclass
class GrpcServer:
    address: str
    server: grpc.Server

    def stop(self, grace_s: float = 0.0) -> None:
        self.server.stop(grace_s).wait()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcTransport:
    name = "grpc"

    def __init__(self):
        self._channels: dict[tuple, tuple[grpc.Channel, object]] = {}
        self._lock = threading.Lock()  # push threads share the channel cache

    # ---- receiving side ----------------------------------------------------------------------
    def serve(self, sink, config) -> GrpcServer:
        options = [("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.max_send_message_length", REPLY_CAP),
                   ("grpc.max_concurrent_streams", config.max_streams),
                   ("grpc.http2.min_recv_ping_interval_without_data_ms", config.keepalive.min_ping_interval_ms),
                   ("grpc.so_reuseport", 0)] + _keepalive_options(config.keepalive)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_streams, thread_name_prefix="kv-rx"),
                             options=options, maximum_concurrent_rpcs=config.max_streams)
        push = grpc.stream_unary_rpc_method_handler(_Push(sink), request_deserializer=None,
                                                    response_serializer=pb.PushReply.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": push}),))
        where = _host_port(config.host, config.port)
        if config.tls is not None:
            key, cert = config.tls.read("key_file"), config.tls.read("cert_file")
            if key is None or cert is None:
                raise TransferConfigError("tls", "a TLS receiver needs cert_file and key_file")
            ca = config.tls.read("ca_file")
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
            port = server.add_secure_port(where, creds)
        else:
            port = server.add_insecure_port(where)
        if port == 0:
            raise TransferConfigError("port", f"cannot bind {where}")
        server.start()
        return GrpcServer(_host_port(config.host, port), server)

    # ---- sending side ------------------------------------------------------------------------
    def push(self, address: str, frames, config, cancel: threading.Event | None = None) -> PushResult:
        token = config.token()
        metadata = ((_AUTH_KEY, f"Bearer {token}"),) if token else None
        call = self._stub(address, config).future(frames, timeout=config.call_timeout_s, metadata=metadata)
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        while not done.wait(0.05):
            if cancel is not None and cancel.is_set():
                call.cancel()
        try:
            reply = call.result()
        except grpc.FutureCancelledError:
            raise Cancelled("push cancelled by the sender") from None
        except grpc.RpcError as e:
            code = _FROM_GRPC.get(e.code(), ErrorCode.INTERNAL)
            raise error_for(code, e.details() or str(e.code())) from None
        return PushResult(reply.state, reply.reason, reply.chunks_accepted, reply.duplicates, reply.bytes_accepted)

    def _stub(self, address: str, config):
        key = (address, config)
        with self._lock:
            if key not in self._channels:
                self._channels[key] = self._connect(address, config)
            return self._channels[key][1]

    def _connect(self, address: str, config) -> tuple[grpc.Channel, object]:
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", REPLY_CAP)] + _keepalive_options(config.keepalive)
        if config.tls is not None:
            if config.tls.server_name:
                options.append(("grpc.ssl_target_name_override", config.tls.server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=config.tls.read("ca_file"),
                                                 private_key=config.tls.read("key_file"),
                                                 certificate_chain=config.tls.read("cert_file"))
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return channel, channel.stream_unary(PUSH, request_serializer=None,
                                             response_deserializer=pb.PushReply.FromString)

    def close(self) -> None:
        for channel, _ in self._channels.values():
            channel.close()
        self._channels.clear()
