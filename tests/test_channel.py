"""The authenticated channel between hosts: real sockets on 127.0.0.1, a man in the middle where a
test needs one, and a check that nothing from the network is ever unpickled."""

from __future__ import annotations

import array
import logging
import os
import pickle
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from nonstop.net import channel
from nonstop.net.listener import Listener
from nonstop.net.channel import (
    SECRET_ENV,
    AuthError,
    Channel,
    ChannelClosed,
    connect,
    load_secret,
    new_secret,
)

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
PREFIX = struct.Struct(">4sB3xIQ")  # the frame's fixed part, as the module documents it
HEAD = PREFIX.size + 16  # ... and its length tag
HELLO = 24
PROOF = 32


@pytest.fixture
def secret() -> bytes:
    return new_secret().encode()


def open_pair(secret: bytes, listener: Listener,
              port: int | None = None) -> tuple[Channel, Channel]:
    """A client channel and the server's end of it (through ``port``, a relay, if given)."""
    box: dict[str, Channel | None] = {}
    t = threading.Thread(target=lambda: box.setdefault("srv", listener.accept(timeout=5)))
    t.start()
    try:
        cli = connect(HOST, port or listener.port, secret)
    finally:
        t.join(10)
    srv = box["srv"]
    assert srv is not None
    return cli, srv


@pytest.fixture
def pair(secret):
    with Listener(HOST, secret) as lst:
        cli, srv = open_pair(secret, lst)
        yield cli, srv
        cli.close()
        srv.close()


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class Relay:
    """A man in the middle: passes the handshake on untouched, then hands every client-to-server
    frame to ``edit(index, frame)`` and sends on what it returns (a list of byte strings)."""

    def __init__(self, target_port: int, edit):
        self.target_port = target_port
        self.edit = edit
        self.server = socket.create_server((HOST, 0))
        self.port = self.server.getsockname()[1]
        self.socks: list[socket.socket] = [self.server]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        a, _ = self.server.accept()
        b = socket.create_connection((HOST, self.target_port))
        self.socks += [a, b]
        threading.Thread(target=self._pump, args=(b, a), daemon=True).start()
        try:
            b.sendall(read_exact(a, HELLO + PROOF))
            i = 0
            while True:
                head = read_exact(a, HEAD)
                if head is None:
                    return
                _, _, hlen, plen = PREFIX.unpack_from(head)
                frame = head + read_exact(a, hlen + plen + 32)
                for out in self.edit(i, frame):
                    b.sendall(out)
                i += 1
        except OSError:
            pass

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture
def relayed(secret):
    """(make, listener): make(edit) gives a (client, server) pair with a Relay between them."""
    relays: list[Relay] = []
    chans: list[Channel] = []
    with Listener(HOST, secret) as lst:
        def make(edit):
            relay = Relay(lst.port, edit)
            relays.append(relay)
            cli, srv = open_pair(secret, lst, port=relay.port)
            chans.extend((cli, srv))
            return cli, srv

        yield make
        for c in chans:
            c.close()
        for r in relays:
            r.close()


# -- round trips ---------------------------------------------------------------------------------


def test_messages_and_payloads_both_ways(pair):
    cli, srv = pair
    msg = {"op": "hello", "text": "héllo wörld ✓ 日本語 🚀",
           "nested": {"a": [1, 2.5, None, True, "x"]}}
    cli.send(msg)
    got, payload = srv.recv(timeout=5)
    assert got == msg
    assert isinstance(payload, memoryview) and payload.nbytes == 0

    srv.send({"op": "empty"}, b"")
    got, payload = cli.recv(timeout=5)
    assert got == {"op": "empty"} and payload.nbytes == 0

    srv.send({"op": "bytes"}, b"\x00\xff" * 1000)
    got, payload = cli.recv(timeout=5)
    assert got == {"op": "bytes"} and bytes(payload) == b"\x00\xff" * 1000

    floats = array.array("d", [1.5, -2.0, 3.25])  # a buffer of another format goes as its bytes
    cli.send({"op": "floats"}, memoryview(floats))
    cli.send({"op": "bytearray"}, bytearray(b"abc"))
    assert array.array("d", bytes(srv.recv(timeout=5)[1])) == floats
    assert bytes(srv.recv(timeout=5)[1]) == b"abc"

    with pytest.raises(TypeError):
        cli.send(["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cli.send({"x": object()})  # not JSON: refused before anything is written
    cli.send({"still": "usable"})
    assert srv.recv(timeout=5)[0] == {"still": "usable"}


def test_64_mib_payload_both_ways(pair):
    cli, srv = pair
    data = os.urandom(64 << 20)
    rates = []
    for sender, receiver in ((cli, srv), (srv, cli)):
        t0 = time.perf_counter()
        t = threading.Thread(target=sender.send, args=({"op": "big", "n": len(data)}, data))
        t.start()
        got, payload = receiver.recv(timeout=30)
        t.join(30)
        rates.append(len(data) / (time.perf_counter() - t0) / 1e9)
        assert got == {"op": "big", "n": len(data)}
        assert payload.nbytes == len(data) and payload == data
    print(f"64 MiB over loopback: {rates[0]:.2f} and {rates[1]:.2f} GB/s")


def test_concurrent_senders_every_frame_intact(pair):
    cli, srv = pair
    threads, per = 4, 100

    def body(t: int, k: int) -> bytes:
        return bytes([t, k % 256]) * ((k * 997) % 35000)

    def work(t: int) -> None:
        for k in range(per):
            cli.send({"t": t, "k": k}, body(t, k))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    last = dict.fromkeys(range(threads), -1)
    for _ in range(threads * per):
        msg, payload = srv.recv(timeout=10)
        assert payload == body(msg["t"], msg["k"])
        assert msg["k"] == last[msg["t"]] + 1  # each thread's frames arrive in its order
        last[msg["t"]] = msg["k"]
    for w in workers:
        w.join(10)
    assert all(k == per - 1 for k in last.values())


def test_selectors_see_frames_and_connections(secret):
    with Listener(HOST, secret) as lst, selectors.DefaultSelector() as sel:
        sel.register(lst, selectors.EVENT_READ)
        assert sel.select(0) == []
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("cli", connect(HOST, lst.port, secret)))
        t.start()
        srv = None
        while srv is None:  # readiness: accept has something to do, perhaps not a whole channel
            assert sel.select(5)
            srv = lst.accept(timeout=0)
        t.join(5)
        cli = box["cli"]
        with cli, srv, selectors.DefaultSelector() as sel2:
            sel2.register(srv, selectors.EVENT_READ)
            assert sel2.select(0) == []
            cli.send({"ping": 1})
            assert sel2.select(5)
            assert srv.recv(timeout=0)[0] == {"ping": 1}
            assert sel2.select(0) == []  # nothing read ahead, nothing left behind


# -- secrets and refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("wrong_side", ["client", "listener"])
def test_wrong_secret_is_refused_and_nothing_delivered(secret, wrong_side, caplog):
    other = new_secret().encode()
    refused = []
    lst_secret, cli_secret = (secret, other) if wrong_side == "client" else (other, secret)
    with Listener(HOST, lst_secret, on_refused=lambda a, why: refused.append((a, why))) as lst:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("srv", lst.accept(timeout=1.0)))
        t.start()
        with caplog.at_level(logging.WARNING, logger="nonstop.net.channel"):
            with pytest.raises(AuthError, match="refused"):
                connect(HOST, lst.port, cli_secret)
            t.join(5)
        assert box["srv"] is None  # accept never handed out a channel
        assert len(refused) == 1 and refused[0][0][0] == HOST and "wrong secret" in refused[0][1]
        assert any("refused" in r.getMessage() for r in caplog.records)
        # and a right client still gets in afterwards
        cli, srv = open_pair(lst_secret, lst)
        cli.send({"ok": 1})
        assert srv.recv(timeout=5)[0] == {"ok": 1}
        cli.close()
        srv.close()


@pytest.mark.parametrize("trick", ["random proof", "reflected proof"])
def test_a_server_without_the_secret_is_refused_by_the_client(secret, trick):
    """The client checks the server too: a server that cannot prove the secret gets no channel."""
    server = socket.create_server((HOST, 0))
    got_frames = []

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            hello_c = read_exact(conn, HELLO)
            hello_s = b"NSH\x01S\x00\x00\x00" + os.urandom(16)
            if trick == "reflected proof":
                hello_s = b"NSH\x01S\x00\x00\x00" + hello_c[-16:]
            conn.sendall(hello_s)
            proof_c = read_exact(conn, PROOF)
            conn.sendall(b"\x01" + (proof_c if trick == "reflected proof" else os.urandom(32)))
            conn.settimeout(2)
            try:
                got_frames.append(conn.recv(1))
            except OSError:
                pass

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(AuthError, match="did not prove"):
        connect(HOST, server.getsockname()[1], secret)
    t.join(5)
    server.close()
    assert got_frames in ([b""], [])  # the client hung up; it sent no frame


def test_empty_secret_is_refused_everywhere(tmp_path, secret):
    for env in ({}, {SECRET_ENV: ""}, {SECRET_ENV: " \n\t"}):
        with pytest.raises(ValueError, match="no job secret") as e:
            load_secret(env=env)
        assert "\n" not in str(e.value)
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    empty.chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        load_secret(str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        load_secret(str(tmp_path / "missing"))
    for bad in (b"", "", b"  "):
        with pytest.raises(ValueError):
            Listener(HOST, bad)
        with pytest.raises(ValueError):
            connect(HOST, 9, bad)  # refused before any connection is tried


def test_load_secret_from_file_and_env(tmp_path):
    value = new_secret()
    assert len(value) == 64 and int(value, 16) >= 0 and new_secret() != value
    path = tmp_path / "secret"
    path.write_text(f"  {value}\n")
    path.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_secret(str(path)) == value.encode()
        assert load_secret(env={SECRET_ENV: value + "\n"}) == value.encode()
        # the file, when given, wins over the environment
        assert load_secret(str(path), env={SECRET_ENV: "x" * 40}) == value.encode()
    path.chmod(0o644)
    with pytest.warns(UserWarning, match="readable by other users"):
        assert load_secret(str(path)) == value.encode()
    with pytest.warns(UserWarning, match="only 3 bytes"):
        assert load_secret(env={SECRET_ENV: "abc"}) == b"abc"


def test_listener_binds_only_the_address_given(secret):
    with Listener(HOST, secret) as lst:
        assert lst.addr == HOST and lst.port > 0
        # nothing answers on another address of this host at that port
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", lst.port), timeout=1).close()
    with pytest.raises(ValueError, match="address"):
        Listener("", secret)


# -- a man in the middle -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["length", "tag", "header", "payload", "mac"])
def test_a_tampered_frame_is_refused_and_closes_the_channel(relayed, where):
    def flip(i, frame):
        hlen = PREFIX.unpack_from(frame)[2]
        at = {"length": PREFIX.size - 1, "tag": PREFIX.size + 3, "header": HEAD + 2,
              "payload": HEAD + hlen + 500, "mac": len(frame) - 1}[where]
        frame = bytearray(frame)
        frame[at] ^= 0x01
        return [bytes(frame)]

    cli, srv = relayed(flip)
    cli.send({"op": "weights"}, b"w" * 1000)
    with pytest.raises(AuthError):
        srv.recv(timeout=5)
    assert srv.closed
    with pytest.raises(ChannelClosed):
        srv.recv(timeout=1)


def test_a_replayed_frame_is_refused(relayed):
    cli, srv = relayed(lambda i, frame: [frame, frame] if i == 0 else [frame])
    cli.send({"op": "step", "n": 1}, b"once")
    assert srv.recv(timeout=5) == ({"op": "step", "n": 1}, b"once")
    with pytest.raises(AuthError):
        srv.recv(timeout=5)  # the same bytes again
    assert srv.closed


def test_reordered_frames_are_refused(relayed):
    held = []

    def swap(i, frame):
        if i == 0:
            held.append(frame)
            return []
        return [frame, *held] if i == 1 else [frame]

    cli, srv = relayed(swap)
    cli.send({"n": 0})
    cli.send({"n": 1})
    with pytest.raises(AuthError):
        srv.recv(timeout=5)
    assert srv.closed


def test_oversize_claims_are_refused_before_allocating(pair, monkeypatch):
    cli, srv = pair
    cli.send({"op": "x"}, b"z" * 100_000)
    monkeypatch.setattr(channel, "MAX_PAYLOAD", 1000)  # as if the peer claimed more than the cap
    with pytest.raises(AuthError, match="claims"):
        srv.recv(timeout=5)
    assert srv.closed
    with pytest.raises(ValueError, match="limit"):
        cli.send({}, b"z" * 1001)


# -- timeouts and closing ------------------------------------------------------------------------


def test_recv_timeout_then_still_usable(pair):
    cli, srv = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        srv.recv(timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        srv.recv(timeout=0)
    cli.send({"after": "timeout"})
    assert srv.recv(timeout=5)[0] == {"after": "timeout"}


def test_peer_close_is_channel_closed(pair):
    cli, srv = pair
    cli.close()
    cli.close()  # idempotent
    with pytest.raises(ChannelClosed):
        cli.send({"x": 1})
    with pytest.raises(ChannelClosed):
        srv.recv(timeout=5)
    assert srv.closed
    with pytest.raises(ChannelClosed):
        srv.send({"x": 1})


def test_sending_to_a_gone_peer_is_channel_closed(pair):
    cli, srv = pair
    cli._sock.close()  # the peer vanishes without a word
    with pytest.raises(ChannelClosed):
        for _ in range(100):
            srv.send({"x": 1}, b"y" * 10_000)
            time.sleep(0.01)


def test_close_wakes_a_blocked_recv(pair):
    cli, srv = pair
    errors = []

    def wait() -> None:
        try:
            srv.recv(timeout=None)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    srv.close()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], ChannelClosed)


def test_bad_clients_do_not_hold_up_a_good_one(secret):
    refused = []
    hs = 1.0
    with Listener(HOST, secret, handshake_timeout_s=hs,
                  on_refused=lambda a, why: refused.append(why)) as lst:
        silent = socket.create_connection((HOST, lst.port))
        garbage = socket.create_connection((HOST, lst.port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: nonstop\r\n\r\n")
        quitter = socket.create_connection((HOST, lst.port))
        quitter.close()
        t0 = time.monotonic()
        cli, srv = open_pair(secret, lst)
        assert time.monotonic() - t0 < hs  # handshakes run side by side: no wait for the silent one
        cli.send({"hi": 1})
        assert srv.recv(timeout=5)[0] == {"hi": 1}
        # the garbage was refused at once (and told so); the silent one when its time is up
        assert lst.accept(timeout=hs + 0.5) is None
        assert any("bad hello" in why for why in refused)
        # a client that connects and leaves without a byte is a liveness probe: not refused
        assert not any("closed the connection during the handshake" in why for why in refused)
        assert any("no complete handshake" in why for why in refused)
        garbage.settimeout(2)
        told = b""
        while chunk := garbage.recv(64):
            told += chunk
        assert told == told[:HELLO] + b"\x00" and told.startswith(b"NSH\x01S")
        silent.close()
        garbage.close()
        cli.close()
        srv.close()


def test_close_wakes_a_blocked_accept(secret):
    lst = Listener(HOST, secret)
    errors = []

    def wait() -> None:
        try:
            lst.accept(timeout=None)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    lst.close()
    lst.close()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], ChannelClosed)


# -- never pickle --------------------------------------------------------------------------------

UNPICKLED = []


def _mark() -> str:
    UNPICKLED.append(True)
    return "unpickled"


class Trap:
    def __reduce__(self):
        return (_mark, ())


def test_nothing_received_is_unpickled(pair):
    source = Path(channel.__file__).read_text()
    assert "pickle" not in source
    cli, srv = pair
    trap = pickle.dumps({"weights": Trap()})
    cli.send({"kind": "state"}, trap)
    msg, payload = srv.recv(timeout=5)
    assert msg == {"kind": "state"} and payload == trap  # bytes stay bytes
    assert UNPICKLED == []
    pickle.loads(bytes(payload))  # the trap was live: loading it would have run code
    assert UNPICKLED == [True]


@pytest.mark.integration
def test_the_module_is_import_light():
    heavy = "('pickle', 'torch', 'numpy', 'pydantic')"
    code = (f"import sys, nonstop.net.channel; "
            f"print(sorted(m for m in {heavy} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_connect_errors_are_connection_or_timeout_errors(secret):
    closed = socket.create_server((HOST, 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ConnectionError):
        connect(HOST, port, secret, timeout_s=2)
    mute = socket.create_server((HOST, 0))  # accepts (in the kernel) but never answers
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        connect(HOST, mute.getsockname()[1], secret, timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    mute.close()


def test_a_frame_that_stops_midway_closes_the_channel(relayed):
    cli, srv = relayed(lambda i, frame: [frame[:HEAD + 3]])  # the rest never comes
    srv.stall_timeout_s = 0.3
    cli.send({"op": "half"}, b"h" * 1000)
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed, match="stalled"):
        srv.recv(timeout=5)
    assert time.monotonic() - t0 < 3 and srv.closed


def test_recv_ready_never_waits_and_returns_frames_as_they_complete(relayed):
    # the relay holds back the second half of the first frame until the second frame passes,
    # and tampers with the third
    held: list[bytes] = []

    def edit(i, frame):
        if i == 0:
            held.append(frame[len(frame) // 2:])
            return [frame[:len(frame) // 2]]
        if i == 2:
            frame = bytearray(frame)
            frame[-1] ^= 0x01
            return [bytes(frame)]
        return [held.pop(), frame]

    cli, srv = relayed(edit)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    assert srv.recv_ready() == []  # nothing yet: an empty list, at once
    cli.send({"op": "a", "n": 1}, b"x" * 3000)
    assert sel.select(5.0)  # half a frame has come
    t0 = time.monotonic()
    assert srv.recv_ready() == [] and time.monotonic() - t0 < 0.5  # kept, not waited for
    cli.send({"op": "b"})
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        if sel.select(1.0):
            got += srv.recv_ready()
    assert [m for m, _ in got] == [{"op": "a", "n": 1}, {"op": "b"}]
    assert bytes(got[0][1]) == b"x" * 3000 and bytes(got[1][1]) == b""
    # both ends still in step: a reply goes the other way as usual
    srv.send({"op": "ok"})
    assert cli.recv(timeout=5)[0] == {"op": "ok"}
    cli.send({"op": "c"})  # the relay tampers with this one
    with pytest.raises(AuthError):
        while time.monotonic() < deadline:
            sel.select(1.0)
            srv.recv_ready()
    assert srv.closed
    sel.close()


def test_recv_ready_returns_the_last_frames_then_channel_closed(pair):
    cli, srv = pair
    cli.send({"op": "last"})
    cli.close()
    deadline = time.monotonic() + 10
    got: list = []
    with pytest.raises(ChannelClosed):
        while time.monotonic() < deadline:
            got += srv.recv_ready()
            time.sleep(0.01)
    assert [m for m, _ in got] == [{"op": "last"}]


def test_the_control_planes_connections_ask_for_their_class_of_service(secret):
    """Both ends of a control connection mark what they send CS6 (a network with classes of
    service keeps it ahead of bulk traffic); other channels keep the default class."""
    def tos(ch: Channel) -> int:
        return ch._sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)

    with Listener(HOST, secret, tos=channel.CONTROL_TOS) as control, Listener(HOST, secret) as bulk:
        box: dict[str, Channel | None] = {}
        t = threading.Thread(target=lambda: box.setdefault("srv", control.accept(timeout=5)))
        t.start()
        cli = connect(HOST, control.port, secret, tos=channel.CONTROL_TOS)
        t.join(10)
        srv = box["srv"]
        assert srv is not None
        plain, plain_srv = open_pair(secret, bulk)
        try:
            assert tos(cli) == tos(srv) == channel.CONTROL_TOS == 0xC0
            assert tos(plain) == tos(plain_srv) == 0
        finally:
            for ch in (cli, srv, plain, plain_srv):
                ch.close()
