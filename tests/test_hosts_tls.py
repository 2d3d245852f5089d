"""etcd with TLS and client certificates, as a user gives them: certificates made with openssl,
a real etcd requiring them, a job that meets there (one host; the agents' channels are the job's
own, authenticated with its secret)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time

import pytest
from conftest import TRAIN

from nonstop.store.etcd_server import etcd_binary, free_port, healthy

pytestmark = pytest.mark.integration

if shutil.which("openssl") is None:
    pytest.skip("openssl is needed to make certificates", allow_module_level=True)


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_etcd(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=nonstop-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-key.pem", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf",
                 cwd=d)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    log = open(tmp_path / "etcd.log", "wb")
    proc = subprocess.Popen(
        [etcd_binary(), "--name", "tls", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
         "--cert-file", str(d / "server.pem"), "--key-file", str(d / "server-key.pem"),
         "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth",
         "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
        ctx.load_cert_chain(str(d / "client.pem"), str(d / "client-key.pem"))
        deadline = time.time() + 30
        while time.time() < deadline:  # etcd answers TLS once it is up
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as raw, \
                        ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
                    break
            except OSError:
                time.sleep(0.1)
        yield url, d
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()


def _run(tmp_path, url, pki, *tls, name="t"):
    env = dict(os.environ, NONSTOP_JOB_SECRET="tls-test-secret-0123456789abcdef")
    cmd = [sys.executable, "-m", "nonstop", "run", "--no-live", "--quiet", "--nnodes", "1",
           "--nproc-per-node", "2", "--rdzv-endpoint", url, "--rdzv-id", name,
           "--node-addr", "127.0.0.1", f"--run-dir={tmp_path / name}", *tls, str(TRAIN),
           "--steps", "20"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_a_job_meets_in_an_etcd_that_requires_tls_and_client_certificates(tmp_path, tls_etcd):
    url, pki = tls_etcd
    r = _run(tmp_path, url, pki, "--etcd-cacert", str(pki / "ca.pem"), "--etcd-cert",
             str(pki / "client.pem"), "--etcd-key", str(pki / "client-key.pem"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # nonstop status reads the job from the same etcd, with the same flags
    certs = ["--etcd-cacert", str(pki / "ca.pem"), "--etcd-cert", str(pki / "client.pem"),
             "--etcd-key", str(pki / "client-key.pem")]
    st = subprocess.run([sys.executable, "-m", "nonstop", "status", "--rdzv-endpoint", url,
                         "--rdzv-id", "t", "--json", *certs], capture_output=True, text=True,
                        timeout=60)
    assert st.returncode == 0, st.stderr[-2000:]
    assert json.loads(st.stdout)["over"] is True
    st = subprocess.run([sys.executable, "-m", "nonstop", "status", "--rdzv-endpoint", url,
                         "--rdzv-id", "t", "--json", *certs[:2]], capture_output=True, text=True,
                        timeout=60)
    assert st.returncode == 2 and "cannot reach etcd" in st.stderr, st.stderr[-2000:]
    assert len([x for x in st.stderr.splitlines() if x.strip()]) == 1
    # without a client certificate etcd refuses us: one line, exit 2
    r = _run(tmp_path, url, pki, "--etcd-cacert", str(pki / "ca.pem"), name="nocert")
    assert r.returncode == 2 and "cannot reach etcd" in r.stderr, r.stderr[-2000:]
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1
    # a CA that did not sign etcd's certificate: refused too
    r = _run(tmp_path, url, pki, "--etcd-cacert", str(pki / "client.pem"), "--etcd-cert",
             str(pki / "client.pem"), "--etcd-key", str(pki / "client-key.pem"), name="badca")
    assert r.returncode == 2 and "cannot reach etcd" in r.stderr, r.stderr[-2000:]
