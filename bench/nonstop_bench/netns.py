"""Test hosts on one machine: network namespaces on a bridge, each with its own IPv4 address.

Why: multi-host behaviour (a host killed, a host partitioned, a host healed) has to be proven in
tests and benchmarks without a second machine. Each :class:`Host` is a network namespace with
one veth on a private bridge; the bridge has an address in the root namespace, so the test
process itself reaches every host.

Rules this module keeps:

* Addresses come only from the RFC 2544 benchmarking range 198.18.0.0/15, one /24 per
  :class:`TestHosts` (``198.18.K.0/24``: hosts ``.1``..``.n``, the bridge ``.254``). ``K`` starts
  from the pid and skips any /24 an address or route of the root namespace already uses, under a
  machine-wide lock, so two fixtures (two pytest processes) never collide. No other address,
  route or interface is touched; no route leaves the subnet.
* Every name it makes (namespaces, bridge, veths) is ``<tag><pid>s<seq><kind>``: the creating
  pid is in the name, so :func:`sweep_stale` can remove what a crashed run left and leave live
  runs alone. Interface names fit Linux's 15 characters.
* Neighbours (ARP) are static: a cut host then looks like a real partition - packets vanish, a
  connect to it times out - instead of the sender's kernel answering "no route to host" after
  three unanswered ARP probes.
* Every wait has a deadline. :meth:`TestHosts.destroy` also runs at interpreter exit.

Import-light on purpose (no torch): benchmarks and tests import it before anything heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from nonstop.pids import pid_alive

RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: benchmarking, never routed
SUBNETS = RANGE.num_addresses // 256  # 512 /24s to choose from
GATEWAY_HOST = 254
NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps its names
IFNAMSIZ = 15
IP_TIMEOUT_S = 10.0
REACH_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 10.0
ETCD_PORT = 2379  # the test hosts' etcd members listen here (each host has its own addresses)
PROBE_PORT = 9  # discard: a refusal from it proves the path both ways without any server

_TAG = re.compile(r"^[a-z]{1,4}$")
_lock = threading.Lock()
_live: set["TestHosts"] = set()
_seqs: set[tuple[str, int]] = set()  # (tag, seq) held by a live TestHosts of this process


def _name_re(tag: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(tag)}(\d+)s(\d+)(br|v\d+|h\d+|probe)$")


def _ip(*args: str, ns: str | None = None, check: bool = True, input: str | None = None,
        timeout: float = IP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``ip`` (in namespace ``ns`` when given); ``check`` raises with its stderr."""
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def _tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tc`` (in namespace ``ns`` when given); ``check`` raises with its stderr."""
    cmd = ["tc", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def _gone(r: subprocess.CompletedProcess) -> bool:
    """Whether an ``ip`` failure only says the thing is not there (already removed)."""
    err = r.stderr.lower()
    return r.returncode == 0 or any(s in err for s in (
        "cannot find device", "does not exist", "no such file", "no such device"))


def _links() -> set[str]:
    """Interface names of the root namespace (this process's)."""
    try:
        return set(os.listdir("/sys/class/net"))
    except OSError:
        return set(_ip("-o", "link", "show").stdout.split(": ")[1::2])


def _netns_names() -> set[str]:
    try:
        return set(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return set()


def _ns_pids(ns: str) -> list[int]:
    """Live processes in namespace ``ns`` - what ``ip netns pids`` prints, without a process per
    call (the kill loops poll it). Zombies have no namespace any more and are not listed."""
    try:
        st = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            s = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            found.append(int(entry))
    return sorted(found)


def _signal_all(ns: str, sig: int, timeout_s: float) -> None:
    """Freeze every process of ``ns`` (SIGSTOP until no new one appears), then send ``sig`` to
    all of them at once, so none of them sees another die first and reacts (as on a lost host);
    then wait until they are gone."""
    deadline = time.monotonic() + timeout_s
    stopped: set[int] = set()
    while True:
        fresh = [p for p in _ns_pids(ns) if p not in stopped]
        if not fresh:
            break
        for p in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
            stopped.add(p)
        if time.monotonic() > deadline:
            break
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)
    if sig != signal.SIGKILL:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
    sent = set(stopped)
    while True:
        left = _ns_pids(ns)
        if not left:
            return
        for p in left:  # started after the freeze: they get the same
            if p not in sent:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
                sent.add(p)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes of namespace {ns} still alive after {timeout_s:g} s "
                               f"(signal {sig}): {left}")
        time.sleep(0.01)


@contextlib.contextmanager
def _machine_lock():
    """Choosing a subnet and claiming it is atomic across processes using this module."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    with open(base / "nonstop-netns.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network of an address or a route in the root namespace (all tables)."""
    nets = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        parts = line.split()
        if not parts:
            continue
        dst = parts[1] if parts[0] in {"unicast", "local", "broadcast", "blackhole",
                                       "unreachable", "prohibit", "throw", "multicast"} \
            else parts[0]
        if dst == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _subnet(k: int) -> ipaddress.IPv4Network:
    return ipaddress.ip_network(f"{RANGE.network_address + 256 * k}/24")


def _mac(k: int, host: int) -> str:
    """Locally administered, unique per (subnet, host): static neighbours can be written
    before the links exist."""
    return f"02:4e:{k >> 8:02x}:{k & 0xff:02x}:00:{host:02x}"


def _reachable(addr: str, timeout_s: float = 0.2) -> bool:
    """A TCP connect to the probe port is answered (accepted or refused): the path works."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((addr, PROBE_PORT))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return True


def _wait_reachable(addr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _reachable(addr):
        if time.monotonic() > deadline:
            raise TimeoutError(f"test host {addr} not reachable within {timeout_s:g} s")
        time.sleep(0.01)


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether test hosts can be made here, and why not: root, ``ip``, and a probe namespace
    with a bridge, a veth and ``ip netns exec`` (containers may forbid any of them). Cached."""
    global _available
    if _available is not None:
        return _available
    if os.geteuid() != 0:
        _available = (False, "test hosts need root (network namespaces, a bridge, veths)")
        return _available
    if shutil.which("ip") is None:
        _available = (False, "test hosts need the `ip` command (iproute2)")
        return _available
    probe = f"nst{os.getpid()}s0probe"
    try:
        _ip("netns", "add", probe)
        try:
            # all inside the probe namespace: nothing of the root namespace is touched
            _ip("link", "add", "name", "b", "type", "bridge", ns=probe)
            _ip("link", "add", "name", "v0", "type", "veth", "peer", "name", "v1", ns=probe)
            r = subprocess.run(["ip", "netns", "exec", probe, "true"], capture_output=True,
                               text=True, timeout=IP_TIMEOUT_S)
            if r.returncode != 0:
                raise RuntimeError(f"ip netns exec: {r.stderr.strip()}")
        finally:
            _ip("netns", "delete", probe, check=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        _available = (False, f"cannot make a network namespace here: {e}")
        return _available
    _available = (True, "")
    return _available


class Host:
    """One test host: a network namespace with one address on the bridge."""

    def __init__(self, name: str, ns: str, addr: str, veth: str, mac: str, owner: "TestHosts"):
        self.name = name
        self.ns = ns
        self.addr = addr
        self.veth = veth  # the end on the bridge, in the root namespace; inside it is eth0
        self.mac = mac
        self.prefix = ["ip", "netns", "exec", ns]
        self._owner = owner
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ns={self.ns!r}, addr={self.addr!r})"

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` in the namespace, in its own session (a process group to kill), tracked
        so :meth:`TestHosts.destroy` ends it by pid even if it left the namespace's view."""
        kw["start_new_session"] = True
        p = subprocess.Popen([*self.prefix, *cmd], **kw)
        self._procs = [q for q in self._procs if q.poll() is None]
        self._procs.append(p)
        return p

    def run(self, cmd: list[str], timeout: float, check: bool = False, input=None,
            capture_output: bool = False, **kw) -> subprocess.CompletedProcess:
        """Like :func:`subprocess.run` in the namespace; on timeout its whole process group is
        killed (not only the first process), then ``TimeoutExpired`` is raised."""
        if capture_output:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        p = self.popen(cmd, **kw)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=KILL_TIMEOUT_S)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._procs.remove(p)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    def cut(self) -> None:
        """Partition: the link goes down on the bridge side and inside. Packets vanish (no
        reset, no refusal, no ARP failure): a connect to this host times out, and from it
        finds no route."""
        _ip("link", "set", self.veth, "down")
        _ip("link", "set", "eth0", "down", ns=self.ns)

    def heal(self, timeout_s: float = REACH_TIMEOUT_S) -> None:
        """Link up again; returns once the host is reachable (from the root namespace, through
        the same bridge the other hosts use)."""
        _ip("link", "set", "eth0", "up", ns=self.ns)
        _ip("link", "set", self.veth, "up")
        # a link going down flushes its neighbours, the static ones too: write them again
        self._owner._neighbours(self.ns)
        _wait_reachable(self.addr, timeout_s)

    def throttle(self, kbit: int) -> None:
        """A slow data link: what the host sends and what it is sent, in packets of 1 KB or
        more (bulk data: a collective's), held to ``kbit`` kilobits a second each way, with no
        drop; smaller packets (acknowledgements, heartbeats), the control plane's connections
        (marked CS6) and etcd's traffic pass at full speed, as on a cluster whose control traffic
        has a network, or a class of service, of its own. Connections stay up and deliver,
        slowly. (A delay line, netem, is not in every kernel: a rate with classes, htb, is.)"""
        if kbit <= 0:
            raise ValueError(f"kbit must be positive, not {kbit}")
        for dev, ns in (("eth0", self.ns), (self.veth, None)):
            _tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20",
                "r2q", "1", ns=ns)
            _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
                "1gbit", ns=ns)
            _tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate",
                f"{kbit}kbit", "burst", "4kb", ns=ns)
            _tc("qdisc", "add", "dev", dev, "parent", "1:20", "pfifo", "limit", "100000", ns=ns)
            # an IPv4 packet's total length (bytes 2-3) under 1024: its top six bits clear
            _tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "u16", "0", "0xfc00", "at", "2", "flowid", "1:10", ns=ns)
            # the control plane's connections (IP TOS CS6, net/channel.CONTROL_TOS), whatever
            # their size: a network with classes of service keeps them ahead of the bulk
            _tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "tos", "0xc0", "0xfc", "flowid", "1:10", ns=ns)
            for end in ("sport", "dport"):  # etcd's, whatever their size
                _tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2",
                    "u32", "match", "ip", end, str(ETCD_PORT), "0xffff", "flowid", "1:10", ns=ns)

    def unthrottle(self) -> None:
        """The link at full speed again (idempotent)."""
        for dev, ns in (("eth0", self.ns), (self.veth, None)):
            r = _tc("qdisc", "del", "dev", dev, "root", ns=ns, check=False)
            err = r.stderr.lower()
            if r.returncode != 0 and not _gone(r) and "handle of zero" not in err \
                    and "no such" not in err and "invalid handle" not in err:
                raise RuntimeError(f"tc qdisc del dev {dev}: {r.stderr.strip()}")

    def deafen(self) -> None:
        """A one-way cut: every packet the network sends the host is dropped (a queue of length
        zero on the bridge's end of its link, ``tc``: no firewall needed); what the host sends
        still leaves, and its own processes still hear each other (loopback). Its peers'
        connects time out, its orders still arrive. ``hear`` lifts it; it goes with the link."""
        _tc("qdisc", "replace", "dev", self.veth, "root", "pfifo", "limit", "0")

    def hear(self) -> None:
        """The one-way cut lifted (``deafen``); no error if there was none."""
        r = _tc("qdisc", "del", "dev", self.veth, "root", check=False)
        err = r.stderr.lower()
        if r.returncode != 0 and not _gone(r) and "handle of zero" not in err \
                and "no such" not in err and "invalid handle" not in err:
            raise RuntimeError(f"tc qdisc del dev {self.veth}: {r.stderr.strip()}")

    def pids(self) -> list[int]:
        """Every live process in the namespace (as ``ip netns pids``)."""
        return _ns_pids(self.ns)

    def freeze(self, timeout_s: float = KILL_TIMEOUT_S) -> None:
        """Every process of the host stopped (SIGSTOP, until no new one appears): a virtual
        machine paused, as its peers see it - its kernel still accepts connections."""
        deadline = time.monotonic() + timeout_s
        stopped: set[int] = set()
        while time.monotonic() < deadline:
            fresh = [p for p in _ns_pids(self.ns) if p not in stopped]
            if not fresh:
                return
            for p in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
                stopped.add(p)

    def thaw(self) -> None:
        """Every process of the host running again (SIGCONT)."""
        for p in _ns_pids(self.ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)

    def kill_all(self, sig: int = signal.SIGKILL, timeout_s: float = KILL_TIMEOUT_S) -> None:
        """A whole host lost: every process in it frozen, then signalled at once, whatever its
        process group or parent; returns once they are gone (``TimeoutError`` otherwise)."""
        try:
            _signal_all(self.ns, sig, timeout_s)
        finally:
            for p in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(0.5 if p.poll() is None else 0)  # reap ours: no zombie left


class TestHosts:
    """``n`` test hosts on one bridge. Use as a context manager, or :meth:`create` and
    :meth:`destroy`; destroy also runs at interpreter exit if nobody called it."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, n: int, tag: str = "nst"):
        if not _TAG.match(tag):
            raise ValueError(f"tag must be 1-4 lower-case letters (it starts interface names), "
                             f"not {tag!r}")
        if not 1 <= n < GATEWAY_HOST:
            raise ValueError(f"1 to {GATEWAY_HOST - 1} hosts, not {n}")
        self.n = n
        self.tag = tag
        self.pid = os.getpid()
        self.seq: int | None = None
        self.k: int | None = None
        self.hosts: list[Host] = []
        self.bridge = ""
        self.gateway = ""
        self.network: ipaddress.IPv4Network | None = None
        self._created = False

    def __repr__(self) -> str:
        return f"TestHosts({self.n}, bridge={self.bridge!r}, network={self.network})"

    def __enter__(self) -> "TestHosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _names(self, seq: int) -> tuple[str, list[str], list[str]]:
        base = f"{self.tag}{self.pid}s{seq}"
        return f"{base}br", [f"{base}v{i}" for i in range(self.n)], \
            [f"{base}h{i}" for i in range(self.n)]

    def _claim(self) -> None:
        """Under the machine lock: a sequence number whose names are all free, and a /24 of
        the range that nothing in the root namespace uses (first one tried comes from the pid)."""
        links, spaces = _links(), _netns_names()
        seq = 0
        while True:
            br, veths, nss = self._names(seq)
            if ((self.tag, seq) not in _seqs and br not in links
                    and not any(v in links for v in veths) and not any(s in spaces for s in nss)):
                break
            seq += 1
        if max(len(br), *(len(v) for v in veths)) > IFNAMSIZ:
            raise ValueError(f"interface name {veths[-1]!r} longer than {IFNAMSIZ} characters: "
                             f"use a shorter tag or fewer hosts")
        used = _used_networks()
        start = (self.pid + 97 * seq) % SUBNETS
        for j in range(SUBNETS):
            k = (start + j) % SUBNETS
            if not any(_subnet(k).overlaps(u) for u in used):
                break
        else:
            raise RuntimeError(f"no free /24 left in {RANGE}")
        _seqs.add((self.tag, seq))
        self.seq, self.k, self.network = seq, k, _subnet(k)
        self.bridge = br
        self.gateway = str(self.network.network_address + GATEWAY_HOST)
        self.hosts = [Host(f"h{i}", nss[i], str(self.network.network_address + i + 1), veths[i],
                           _mac(k, i + 1), self) for i in range(self.n)]

    def _neighbours(self, ns: str | None) -> None:
        """Static ARP entries for every other address of the subnet, in ``ns`` (``None``: the
        bridge in the root namespace)."""
        dev = "eth0" if ns else self.bridge
        peers = [(h.addr, h.mac) for h in self.hosts if h.ns != ns]
        if ns:
            peers.append((self.gateway, _mac(self.k, GATEWAY_HOST)))
        lines = "".join(f"neigh replace {a} lladdr {m} dev {dev} nud permanent\n"
                        for a, m in peers)
        _ip("-batch", "-", ns=ns, input=lines)

    def create(self, timeout_s: float = REACH_TIMEOUT_S) -> "TestHosts":
        """Make the bridge, the namespaces and veths, and wait until every host is reachable.
        Calling it again is a no-op; a failure half-way undoes what was made, then raises."""
        if self._created:
            return self
        if os.getpid() != self.pid:
            raise RuntimeError("create() in a forked child of the process that made this object")
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        sweep_stale(self.tag)  # what a killed run of this tag left (its pid is dead)
        with _lock:
            _live.add(self)
        try:
            with _machine_lock():
                self._claim()
                prefix = self.network.prefixlen
                _ip("link", "add", "name", self.bridge, "address", _mac(self.k, GATEWAY_HOST),
                    "type", "bridge", "stp_state", "0", "forward_delay", "0")
                _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
            _ip("link", "set", "dev", self.bridge, "addrgenmode", "none", "up")
            for h in self.hosts:
                _ip("netns", "add", h.ns)
                _ip("link", "add", "name", h.veth, "type", "veth", "peer", "name", "eth0",
                    "address", h.mac, "netns", h.ns)
                _ip("link", "set", "dev", h.veth, "master", self.bridge, "addrgenmode", "none",
                    "up")
                _ip("-batch", "-", ns=h.ns, input=(
                    "link set dev lo up\n"
                    f"addr add {h.addr}/{prefix} dev eth0\n"
                    "link set dev eth0 addrgenmode none up\n"))
                self._neighbours(h.ns)
            self._neighbours(None)
            deadline = time.monotonic() + timeout_s
            for h in self.hosts:
                _wait_reachable(h.addr, max(0.1, deadline - time.monotonic()))
        except BaseException:
            with contextlib.suppress(Exception):
                self.destroy()
            raise
        self._created = True
        return self

    def destroy(self, timeout_s: float = KILL_TIMEOUT_S) -> None:
        """Kill every process in every namespace and every tracked process (by pid), then
        delete veths, namespaces and the bridge. Idempotent; "already gone" is no error; raises
        only if something of ours is still there afterwards."""
        if os.getpid() != self.pid:
            return  # a forked child (atexit runs there too) must not tear down its parent's hosts
        errors: list[str] = []
        for h in self.hosts:
            for p in h._procs:
                if p.poll() is None:  # not reaped yet: the pid is still ours
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
            try:
                _signal_all(h.ns, signal.SIGKILL, timeout_s)
            except (TimeoutError, OSError) as e:
                errors.append(str(e))
            for p in h._procs:
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    errors.append(f"process {p.pid} did not end")
                for f in (p.stdin, p.stdout, p.stderr):
                    if f is not None:
                        with contextlib.suppress(OSError):
                            f.close()
            h._procs = [p for p in h._procs if p.returncode is None]
        for h in self.hosts:
            r = _ip("link", "del", "dev", h.veth, check=False)  # eth0 inside goes with it
            if not _gone(r):
                errors.append(r.stderr.strip())
            r = _ip("netns", "delete", h.ns, check=False)
            if not _gone(r):
                errors.append(r.stderr.strip())
        if self.bridge:
            r = _ip("link", "del", "dev", self.bridge, check=False)
            if not _gone(r):
                errors.append(r.stderr.strip())
        links, spaces = _links(), _netns_names()
        left = [x for x in [self.bridge, *(h.veth for h in self.hosts)] if x and x in links]
        left += [h.ns for h in self.hosts if h.ns in spaces]
        self._created = False
        if not left:
            with _lock:
                _live.discard(self)
                _seqs.discard((self.tag, self.seq))
            return
        raise RuntimeError(f"test hosts not fully removed: {left} ({'; '.join(errors)})")


def sweep_stale(tag: str = "nst") -> list[str]:
    """Remove namespaces, veths and bridges an earlier run of this module left (it crashed, or
    was killed before atexit): only names of this module's pattern whose creating pid is dead.
    Processes still running in such a namespace are killed first. Returns what was removed."""
    if not _TAG.match(tag):
        raise ValueError(f"tag must be 1-4 lower-case letters, not {tag!r}")
    pattern = _name_re(tag)

    def stale(name: str) -> str | None:
        m = pattern.match(name)
        return m.group(3) if m and not pid_alive(int(m.group(1))) else None

    removed = []
    for ns in sorted(_netns_names()):
        if stale(ns) is not None:
            with contextlib.suppress(TimeoutError):
                _signal_all(ns, signal.SIGKILL, KILL_TIMEOUT_S)
    links = sorted(_links())
    for name in links:  # veths first: each takes its peer in a namespace along
        if (stale(name) or "").startswith("v") \
                and _gone(_ip("link", "del", "dev", name, check=False)):
            removed.append(name)
    for ns in sorted(_netns_names()):
        if stale(ns) is not None and _gone(_ip("netns", "delete", ns, check=False)):
            removed.append(ns)
    for name in links:
        kind = stale(name)
        if kind is not None and not kind.startswith("v") \
                and _gone(_ip("link", "del", "dev", name, check=False)):
            removed.append(name)
    return removed


@atexit.register
def _destroy_all() -> None:
    """Hosts nobody destroyed (a test forgot, an exception escaped) go with the interpreter."""
    for th in list(_live):
        with contextlib.suppress(Exception):
            th.destroy()
