"""gpud's own reading of the kubelet's PodResources List (gpud serve imports no grpc or protobuf): protobuf's
wire format against the protobuf library's encoding of the real proto, the gRPC call (HTTP/2 by h2) against
scripted and hostile servers whose frames are built with hyperframe and hpack, the libraries under h2. No
grpc here: these run on the pure tree too."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import RequestReceived
from hpack import Encoder
from hyperframe.frame import (ContinuationFrame, DataFrame, GoAwayFrame, HeadersFrame, RstStreamFrame,
                              SettingsFrame)

from gpud.device_plugin import podresources_pb2 as pb
from gpud.pod_resources.grpc_unary import GrpcCallError, call
from gpud.pod_resources.messages import (ClaimResource, Container, ContainerDevices, DynamicResource,
                                         MalformedAnswer, Pod, parse_list_answer)

# -- the List answer --------------------------------------------------------------------------------


def test_the_answer_reads_as_the_protobuf_library_wrote_it():
    answer = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="train", namespace="ml", containers=[
            pb.ContainerResources(name="main", cpu_ids=[1, 2, 3], devices=[
                pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-a"],
                                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)]))],
                memory=[pb.ContainerMemory(memory_type="memory", size=1 << 40)],
                dynamic_resources=[pb.DynamicResource(claim_name="c", claim_namespace="ml", claim_resources=[
                    pb.ClaimResource(cdi_devices=[pb.CDIDevice(name="gpud/gpu=0")], driver_name="gpu.nvidia.com",
                                     pool_name="node-a", device_name="gpu-0")])]),
            pb.ContainerResources(name="sidecar")]),
        pb.PodResources(name="idle", namespace="default")])
    # a field this proto does not know (the kubelet's newer ClaimResource.share_id is 5): skipped
    extra = b"\x2a\x03abc"
    data = answer.SerializeToString() + b"\x0a\x00" + b"\x0a" + bytes([len(extra)]) + extra
    assert parse_list_answer(data) == (
        Pod("train", "ml", (Container("main", (ContainerDevices("nvidia.com/gpu", ("GPU-a",)),), (
            DynamicResource("c", "ml", (ClaimResource("gpu.nvidia.com", "node-a", "gpu-0"),)),)),
            Container("sidecar", (), ()))),
        Pod("idle", "default", ()), Pod("", "", ()), Pod("", "", ()))
    assert parse_list_answer(b"") == ()


@pytest.mark.parametrize("data, why", [
    (b"\x0a\x05ab", "inside a length-delimited field"),
    (b"\x0b", "wire type 3"),
    (b"\x02", "field number 0"),
    (b"\x0a\x02\x0a\x80", "inside a varint"),
    (b"\x0a\x03\x0a\x01\xff", "not UTF-8"),
    (b"\x08\x01", "not a message"),
    (b"\x0a\x02\x08\x01", "not a string"),
    (b"\x0a" + b"\xff" * 11, "longer than 10 bytes"),
    (b"\x09\x00", "fixed-size"),
])
def test_hostile_answers_are_refused(data, why):
    with pytest.raises(MalformedAnswer, match=why):
        parse_list_answer(data)


def test_random_bytes_are_an_answer_or_refused_never_anything_else():
    rng = random.Random(37)
    valid = pb.ListPodResourcesResponse(pod_resources=[pb.PodResources(name="p", namespace="n", containers=[
        pb.ContainerResources(name="c", devices=[pb.ContainerDevices(resource_name="r", device_ids=["x"])])])])
    seed = valid.SerializeToString()
    for _ in range(3000):
        data = bytearray(seed if rng.random() < 0.5 else rng.randbytes(rng.randrange(64)))
        for _ in range(rng.randrange(4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            parse_list_answer(bytes(data))
        except MalformedAnswer:
            pass


# -- the call, against scripted servers -------------------------------------------------------------


class Scripted:
    """A Unix socket server that reads the client's opening, then writes `answer` (or nothing: hangs)."""

    def __init__(self, path, answer: bytes | None, close: bool = True, delay_s: float = 0.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.answer, self.close, self.delay_s = answer, close, delay_s
        self.received = bytearray()
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection, _ = self.sock.accept()
        connection.settimeout(0.2)
        try:
            self.received += connection.recv(65536)
        except socket.timeout:
            pass
        if self.answer is not None:
            self.stop.wait(self.delay_s)
            connection.sendall(self.answer)
            if self.close:
                connection.close()
                return
        self.stop.wait(30)
        connection.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4


def frame(kind, payload: bytes = b"", stream: int = 1, *flags: str, **fields) -> bytes:
    made = kind(stream, flags=flags, **fields)
    if payload:
        made.data = payload
    return made.serialize()


def block(fields) -> bytes:
    return Encoder().encode(fields)


def headers(fields, *flags: str) -> bytes:
    return frame(HeadersFrame, block(fields), 1, "END_HEADERS", *flags)


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
SETTINGS = frame(SettingsFrame, stream=0)


def message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


def test_an_answer_in_pieces_padding_and_continuations_is_read(short_tmp):
    fields = block(OK_HEADERS)
    answer = (SETTINGS + frame(HeadersFrame, fields[:5], 1, "PADDED", pad_length=2)
              + frame(ContinuationFrame, fields[5:], 1, "END_HEADERS")
              + frame(DataFrame, message(b"hello")[:4], 1, "PADDED", pad_length=3)
              + frame(DataFrame, message(b"hello")[4:]) + headers([("grpc-status", "0")], "END_STREAM"))
    server = Scripted(short_tmp / "k.sock", answer)
    assert call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 2.0, 1 << 20) == b"hello"
    assert server.received.startswith(PREFACE)
    (request,) = [event for event in H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
                  .receive_data(bytes(server.received)) if isinstance(event, RequestReceived)]
    sent = dict(request.headers)
    assert (sent[":method"], sent[":path"], sent["content-type"], sent["te"]) == (
        "POST", "/v1.PodResourcesLister/List", "application/grpc", "trailers")


@pytest.mark.parametrize("answer, why", [
    (headers([*OK_HEADERS, ("grpc-status", "14"), ("grpc-message", "kubelet%20down")], "END_STREAM"),
     "gRPC status 14: kubelet down"),
    (headers([(":status", "404")], "END_STREAM"), "HTTP status 404"),
    (headers(OK_HEADERS) + frame(RstStreamFrame, error_code=2), "RST_STREAM, error code 2"),
    (frame(GoAwayFrame, stream=0, last_stream_id=0, error_code=11), "GOAWAY, error code 11"),
    (headers(OK_HEADERS) + frame(DataFrame, message(b"x" * 100)), "closed the connection mid-answer"),
    (headers(OK_HEADERS) + frame(DataFrame, message(b"x" * 2000)), "larger than 1024 bytes"),
    (headers(OK_HEADERS) + frame(DataFrame, b"\x01\x00\x00\x00\x01x") + headers([("grpc-status", "0")], "END_STREAM"),
     "no uncompressed message"),
    (headers(OK_HEADERS) + frame(DataFrame, message(b"abc")[:6]) + headers([("grpc-status", "0")], "END_STREAM"),
     "1 bytes where its prefix says 3"),
    (frame(HeadersFrame, b"\xbe", 1, "END_HEADERS", "END_STREAM"), "protocol error"),  # no table entry 62
    (b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(range(256)), "protocol error|closed the connection"),
])
def test_what_is_no_answer_is_said(short_tmp, answer, why):
    Scripted(short_tmp / "k.sock", answer)
    with pytest.raises(GrpcCallError, match=why):
        call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 2.0, 1024)


def test_a_silent_server_costs_the_deadline_and_no_more(short_tmp):
    server = Scripted(short_tmp / "k.sock", SETTINGS, close=False)
    started = time.monotonic()
    with pytest.raises(GrpcCallError, match="no answer within 0.5 s"):
        call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    assert 0.45 < time.monotonic() - started < 1.5
    server.stop.set()


@pytest.mark.parametrize("ending", [
    headers(OK_HEADERS) + frame(RstStreamFrame, error_code=8),  # grpc-go's server: http2_server.go closeStream
    headers([*OK_HEADERS, ("grpc-status", "4"), ("grpc-message", "Deadline Exceeded")], "END_STREAM"),  # grpc core
])
def test_a_server_ending_the_call_at_the_deadline_sent_is_a_timeout(short_tmp, ending):
    """Whichever gives up first at the deadline, gpud or the server it sent grpc-timeout, it is said the same."""
    server = Scripted(short_tmp / "k.sock", SETTINGS + ending, close=False, delay_s=0.5)
    with pytest.raises(GrpcCallError, match="no answer within 0.5 s"):
        call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    server.stop.set()
    Scripted(short_tmp / "early.sock", SETTINGS + ending)  # the same ending well before the deadline says what it is
    with pytest.raises(GrpcCallError, match="RST_STREAM, error code 8|gRPC status 4: Deadline Exceeded"):
        call(short_tmp / "early.sock", "/v1.PodResourcesLister/List", b"", 2.0, 1024)


def test_no_socket_and_a_refused_one_are_said(short_tmp):
    with pytest.raises(GrpcCallError, match="FileNotFoundError"):
        call(short_tmp / "none.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    lonely = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lonely.bind(str(short_tmp / "bound.sock"))  # bound, never listening: connection refused
    with pytest.raises(GrpcCallError, match="ConnectionRefusedError"):
        call(short_tmp / "bound.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    lonely.close()
