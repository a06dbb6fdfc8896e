"""gpud's own reading of the kubelet's PodResources List (gpud serve imports no grpc or protobuf): HPACK
against RFC 7541's examples, protobuf's wire format against the protobuf library's encoding of the real
proto, the gRPC call against scripted and hostile servers. No grpc here: these run on the pure tree too."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from gpud.device_plugin import podresources_pb2 as pb
from gpud.pod_resources import grpc_unary
from gpud.pod_resources.grpc_unary import (CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PADDED,
                                           RST_STREAM, SETTINGS, GrpcCallError, _frame, call)
from gpud.pod_resources.hpack import Decoder, HpackError, encode_literals, huffman_decode
from gpud.pod_resources.messages import (ClaimResource, Container, ContainerDevices, DynamicResource,
                                         MalformedAnswer, Pod, parse_list_answer)

# -- HPACK: RFC 7541 Appendix C ---------------------------------------------------------------------


def test_hpack_decodes_rfc_7541s_requests_with_huffman_and_the_dynamic_table():
    decoder = Decoder()  # C.4.1 - C.4.3: one connection's three requests
    assert decoder.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")) == [
        (":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")]
    assert decoder.decode(bytes.fromhex("828684be5886a8eb10649cbf"))[-1] == ("cache-control", "no-cache")
    assert decoder.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))[-1] == (
        "custom-key", "custom-value")
    assert decoder.dynamic == [("custom-key", "custom-value"), ("cache-control", "no-cache"),
                               (":authority", "www.example.com")]


def test_hpack_evicts_as_rfc_7541s_responses_do():
    decoder = Decoder(256)  # C.6: SETTINGS_HEADER_TABLE_SIZE 256
    decoder.table_size = 256
    first = decoder.decode(bytes.fromhex("488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e"
                                         "919d29ad171863c78f0b97c8e9ae82ae43d3"))
    assert first[0] == (":status", "302") and first[2] == ("date", "Mon, 21 Oct 2013 20:13:21 GMT")
    second = decoder.decode(bytes.fromhex("4883640effc1c0bf"))  # C.6.2: ":status 307" evicts ":status 302"
    assert second[0] == (":status", "307") and (":status", "302") not in decoder.dynamic
    assert sum(len(n) + len(v) + 32 for n, v in decoder.dynamic) <= 256


def test_hpack_literals_read_back():
    fields = [(":path", "/v1.PodResourcesLister/List"), ("x-long", "v" * 300)]
    assert Decoder().decode(encode_literals(fields)) == fields


@pytest.mark.parametrize("block, why", [
    (b"\xff", "ends inside an integer"),
    (b"\xff\xff\xff\xff\xff\xff\x7f", "too large"),
    (b"\xbe", "no table entry 62"),
    (b"\x80", "no table entry 0"),
    (b"\x00\x85ab", "ends inside a string"),
    (b"\x00\x01a\x01\xff", "not UTF-8"),
    (b"\x3f\xe2\x1f", "4097 above the 4096 allowed"),
    (b"\x00\x81\x00\x00", "padding"),
])
def test_hpack_refuses_hostile_blocks(block, why):
    with pytest.raises(HpackError, match=why):
        Decoder().decode(block)


def test_huffman_refuses_eos_and_long_padding():
    with pytest.raises(HpackError, match="EOS"):
        huffman_decode(b"\xff\xff\xff\xff")
    with pytest.raises(HpackError, match="padding"):
        huffman_decode(b"\x1f\xff")  # "a" then 11 bits of ones


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

    def __init__(self, path, answer: bytes | None, close: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.answer, self.close = answer, close
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
            connection.sendall(self.answer)
            if self.close:
                connection.close()
                return
        self.stop.wait(30)
        connection.close()


def headers(fields, flags=END_HEADERS) -> bytes:
    return _frame(HEADERS, flags, 1, encode_literals(fields))


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


def test_an_answer_in_pieces_padding_and_continuations_is_read(short_tmp):
    block = encode_literals(OK_HEADERS)
    padded = bytes([3]) + message(b"hello")[:4] + b"\x00" * 3
    answer = (_frame(SETTINGS, 0, 0, b"") + _frame(HEADERS, PADDED, 1, bytes([2]) + block[:5] + b"\x00\x00")
              + _frame(CONTINUATION, END_HEADERS, 1, block[5:]) + _frame(DATA, PADDED, 1, padded)
              + _frame(DATA, 0, 1, message(b"hello")[4:]) + headers([("grpc-status", "0")], END_HEADERS | END_STREAM))
    server = Scripted(short_tmp / "k.sock", answer)
    assert call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 2.0, 1 << 20) == b"hello"
    assert server.received.startswith(grpc_unary.PREFACE)
    assert b"/v1.PodResourcesLister/List" in server.received and b"application/grpc" in server.received


@pytest.mark.parametrize("answer, why", [
    (headers([*OK_HEADERS, ("grpc-status", "14"), ("grpc-message", "kubelet%20down")], END_HEADERS | END_STREAM),
     "gRPC status 14: kubelet down"),
    (headers([(":status", "404")], END_HEADERS | END_STREAM), "HTTP status 404"),
    (headers(OK_HEADERS) + _frame(RST_STREAM, 0, 1, struct.pack(">I", 2)), "RST_STREAM, error code 2"),
    (_frame(GOAWAY, 0, 0, struct.pack(">II", 0, 11)), "GOAWAY, error code 11"),
    (headers(OK_HEADERS) + _frame(DATA, 0, 1, message(b"x" * 100)), "closed the connection mid-answer"),
    (headers(OK_HEADERS) + _frame(DATA, 0, 1, message(b"x" * 2000)), "larger than 1024 bytes"),
    (headers(OK_HEADERS) + _frame(DATA, 0, 1, b"\x01\x00\x00\x00\x01x")
     + headers([("grpc-status", "0")], END_HEADERS | END_STREAM), "no uncompressed message"),
    (headers(OK_HEADERS) + _frame(DATA, 0, 1, message(b"abc")[:6])
     + headers([("grpc-status", "0")], END_HEADERS | END_STREAM), "1 bytes where its prefix says 3"),
    (_frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xbe"), "undecodable headers"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(range(256)), "a frame of|closed the connection"),
])
def test_what_is_no_answer_is_said(short_tmp, answer, why):
    Scripted(short_tmp / "k.sock", answer)
    with pytest.raises(GrpcCallError, match=why):
        call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 2.0, 1024)


def test_a_silent_server_costs_the_deadline_and_no_more(short_tmp):
    server = Scripted(short_tmp / "k.sock", _frame(SETTINGS, 0, 0, b""), close=False)
    started = time.monotonic()
    with pytest.raises(GrpcCallError, match="no answer within 0.5 s"):
        call(short_tmp / "k.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    assert 0.45 < time.monotonic() - started < 1.5
    server.stop.set()


def test_no_socket_and_a_refused_one_are_said(short_tmp):
    with pytest.raises(GrpcCallError, match="FileNotFoundError"):
        call(short_tmp / "none.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    lonely = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lonely.bind(str(short_tmp / "bound.sock"))  # bound, never listening: connection refused
    with pytest.raises(GrpcCallError, match="ConnectionRefusedError"):
        call(short_tmp / "bound.sock", "/v1.PodResourcesLister/List", b"", 0.5, 1024)
    lonely.close()
