"""The deploy recipes, checked: the Kubernetes manifests against the API schema and against each
other (K+M pods, the etcd members the command names, the policy nonstop accepts), and the Slurm
batch script run with a fake ``srun`` (and a fake or the real ``nonstop``) on fake nodes."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import yaml

from nonstop.cli import build_parser
from nonstop.store.etcd import parse_endpoints

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
SBATCH = ROOT / "deploy" / "slurm" / "nonstop.sbatch"
TRAIN = ROOT / "examples" / "train_ddp.py"
K8S_VERSION = "1.30.0"


# == Kubernetes ====================================================================================
def _manifests() -> dict[str, list[dict]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return out


def _objects() -> list[dict]:
    return [d for docs in _manifests().values() for d in docs]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _objects() if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _job() -> dict:
    return _one("Job")


def _container(pod_spec: dict, name: str, init: bool = False) -> dict:
    key = "initContainers" if init else "containers"
    [c] = [c for c in pod_spec.get(key, []) if c["name"] == name]
    return c


def _run_args(command: list[str]):
    """The Job's container command, parsed by nonstop's own parser (a flag it lacks fails)."""
    assert command[:2] == ["nonstop", "run"], command
    return build_parser().parse_args(command[1:])


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _mount_path(container: dict, volume: str) -> str:
    [m] = [m for m in container["volumeMounts"] if m["name"] == volume]
    return m["mountPath"]


def test_kubernetes_manifests_match_the_api_schema():
    kv = pytest.importorskip("kubernetes_validate")
    objects = _objects()
    assert {o["kind"] for o in objects} >= {"Job", "Service", "StatefulSet", "ConfigMap", "Secret"}
    for name, docs in _manifests().items():
        for doc in docs:
            try:
                kv.validate(doc, K8S_VERSION, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message} "
                            f"at {'.'.join(map(str, exc.absolute_path))}")
    # strict mode does catch a misspelt field (the check above is not vacuous)
    bad = json.loads(json.dumps(_job()))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(_manifests())
    assert (K8S / "README.md").is_file()


def test_job_runs_one_pod_per_host_k_plus_m():
    job = _job()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    c = _container(pod, "nonstop")
    args = _run_args(c["command"])
    k, m = int(args.nnodes), args.spare_nodes
    assert k >= 1 and m >= 1
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == k + m
    # nonstop handles failures: the kubelet restarts nothing, and a job that gave up (1) or was
    # given bad input (2) fails at once instead of being retried
    assert pod["restartPolicy"] == "Never"
    assert 0 <= spec["backoffLimit"] <= 10
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"] == {"containerName": "nonstop", "operator": "In",
                                               "values": [1, 2]}
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
               for r in rules)
    assert spec["podReplacementPolicy"] == "Failed"
    # GPUs: P ranks per host, P GPUs per pod
    p = args.nproc_per_node
    assert c["resources"]["limits"]["nvidia.com/gpu"] == p
    assert c["resources"]["requests"]["nvidia.com/gpu"] == p
    # /dev/shm in memory
    vols = {v["name"]: v for v in pod["volumes"]}
    shm = [n for n, v in vols.items() if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1 and _mount_path(c, shm[0]) == "/dev/shm"
    # the pod's identity from the downward API; every $(VAR) of the command is defined
    env = _env(c)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    used = {v for arg in c["command"] for v in re.findall(r"\$\(([A-Z_]+)\)", arg)}
    assert used <= set(env), used - set(env)
    assert args.node_id == "$(POD_NAME)" and args.node_addr == "$(POD_IP)"
    assert "$(JOB_NAME)" in args.rdzv_id
    assert args.script == "train.py"


def test_job_mounts_the_secret_and_the_policy_it_names():
    pod = _job()["spec"]["template"]["spec"]
    c = _container(pod, "nonstop")
    args = _run_args(c["command"])
    vols = {v["name"]: v for v in pod["volumes"]}

    def file_of(kind: str) -> tuple[dict, str]:
        [(name, vol)] = [(n, v) for n, v in vols.items() if kind in v]
        [item] = vol[kind]["items"]
        return vol[kind], f"{_mount_path(c, name)}/{item['path']}"

    secret_vol, secret_path = file_of("secret")
    assert args.secret_file == secret_path == "/var/run/nonstop/secret"
    assert secret_vol["defaultMode"] == 0o400  # nonstop warns about a secret others can read
    secret = _one("Secret", secret_vol["secretName"])
    assert secret_vol["items"][0]["key"] in secret["stringData"]

    policy_vol, policy_path = file_of("configMap")
    assert args.policy == policy_path == "/etc/nonstop/policy.yaml"
    cm = _one("ConfigMap", policy_vol["name"])
    assert policy_vol["items"][0]["key"] in cm["data"]


def test_shipped_secret_is_empty_and_nonstop_refuses_it(tmp_path):
    """No working secret lives in the repository: the placeholder fails closed (exit 2)."""
    from nonstop.net.channel import load_secret

    value = _one("Secret")["stringData"]["secret"]
    assert value == ""
    path = tmp_path / "secret"
    path.write_text(value)
    path.chmod(0o400)
    with pytest.raises(ValueError, match="empty"):
        load_secret(str(path))


def test_job_pods_have_a_headless_service():
    job = _job()
    pod = job["spec"]["template"]["spec"]
    svc = _one("Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}


def test_rdzv_endpoint_names_every_etcd_member():
    sts = _one("StatefulSet")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True  # members find each other unready
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    n, name, domain = sts["spec"]["replicas"], sts["metadata"]["name"], svc["metadata"]["name"]
    assert n == 3
    members = [f"{name}-{i}.{domain}" for i in range(n)]

    pod = _job()["spec"]["template"]["spec"]
    args = _run_args(_container(pod, "nonstop")["command"])
    assert args.rdzv_endpoint.startswith("etcd://")
    assert parse_endpoints(args.rdzv_endpoint) == [(h, ports["client"]) for h in members]
    wait = _env(_container(pod, "wait-for-etcd", init=True))["ETCD_ENDPOINTS"]["value"]
    assert parse_endpoints(wait) == parse_endpoints(args.rdzv_endpoint)

    etcd = _container(sts["spec"]["template"]["spec"], "etcd")
    assert etcd["image"].startswith(("gcr.io/etcd-development/etcd:", "quay.io/coreos/etcd:"))
    flags = dict(a.split("=", 1) for a in etcd["args"])
    cluster = dict(x.split("=", 1) for x in flags["--initial-cluster"].split(","))
    assert cluster == {f"{name}-{i}": f"http://{h}:{ports['peer']}" for i, h in enumerate(members)}
    assert flags["--name"] == "$(POD_NAME)"
    assert _env(etcd)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flags["--advertise-client-urls"] == f"http://$(POD_NAME).{domain}:{ports['client']}"
    assert flags["--initial-advertise-peer-urls"] == f"http://$(POD_NAME).{domain}:{ports['peer']}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert etcd[probe]["httpGet"]["path"].startswith("/health")
    # the data on a persistent volume claim per member
    [claim] = sts["spec"]["volumeClaimTemplates"]
    data = _mount_path(etcd, claim["metadata"]["name"])
    assert flags["--data-dir"].startswith(data + "/")


@pytest.mark.integration
def test_policy_configmap_passes_nonstop_policy_check(tmp_path):
    job = _job()
    [vol] = [v for v in job["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    cm = _one("ConfigMap", vol["configMap"]["name"])
    path = tmp_path / "policy.yaml"
    path.write_text(cm["data"]["policy.yaml"])
    proc = subprocess.run([sys.executable, "-m", "nonstop", "policy", "check", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout
    assert "hosts" in yaml.safe_load(path.read_text())


# == Slurm =========================================================================================
FAKE_SRUN = r'''
import json, os, subprocess, sys
args = sys.argv[1:]
opts = []
while args and args[0].startswith("-"):  # the script passes srun's options as --opt=value
    opts.append(args.pop(0))
log = os.environ["FAKE_LOG"]
with open(os.path.join(log, "srun.json"), "w") as f:
    json.dump({"opts": opts, "cmd": args}, f)
names = os.environ["FAKE_NODES"].split()
procs = []
for i, name in enumerate(names):  # one task per node, with what srun sets for it
    env = dict(os.environ, SLURM_PROCID=str(i), SLURM_NODEID=str(i), SLURM_LOCALID="0",
               SLURMD_NODENAME=name, SLURM_STEP_ID="0", SLURM_NTASKS=str(len(names)),
               SLURM_STEP_NUM_NODES=str(len(names)), SLURM_STEP_NUM_TASKS=str(len(names)),
               SLURM_STEP_NODELIST=os.environ.get("SLURM_JOB_NODELIST", ""))
    procs.append(subprocess.Popen(args, env=env))
sys.exit(max(p.wait() for p in procs))  # srun: the highest exit code of the tasks
'''

FAKE_NONSTOP = r'''
import json, os, stat, sys, urllib.request
argv = sys.argv[1:]
node = os.environ["SLURMD_NODENAME"]
rec = {"argv": argv, "env": {k: os.environ.get(k) for k in
                             ("SLURM_PROCID", "SLURM_JOB_ID", "SLURMD_NODENAME")}}
path = argv[argv.index("--secret-file") + 1]
rec["secret_mode"] = stat.S_IMODE(os.stat(path).st_mode)
rec["secret_dir_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
with open(path) as f:
    rec["secret"] = f.read()
if os.environ.get("FAKE_CHECK_ETCD"):
    ep = argv[argv.index("--rdzv-endpoint") + 1].split("://", 1)[1].split(",")[0]
    with urllib.request.urlopen(f"http://{ep}/health", timeout=5) as r:
        rec["etcd_health"] = json.loads(r.read())["health"]
with open(os.path.join(os.environ["FAKE_LOG"], node + ".json"), "w") as f:
    json.dump(rec, f)
sys.exit(int(json.loads(os.environ.get("FAKE_EXIT", "{}")).get(node, 0)))
'''


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def _free_port_pair() -> int:
    """A port the OS gave whose next one is free too (etcd's client port and its peers')."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row")


class FakeSlurm:
    """A batch step as sbatch starts it, on fake nodes: ``srun`` runs the per-node command once
    per node with that node's variables; ``nonstop`` records its argv and exits as told."""

    def __init__(self, base: Path, nodes: list[str], job_id: str = "4242"):
        self.base, self.nodes, self.job_id = base, nodes, job_id
        self.bin = base / "bin"
        self.log = base / "log"
        self.submit = base / "submit"
        for d in (self.bin, self.log, self.submit):
            d.mkdir(parents=True, exist_ok=True)
        _script(self.bin / "srun", FAKE_SRUN)
        _script(self.bin / "nonstop", FAKE_NONSTOP)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM", "NONSTOP_")) or k == "NONSTOP_TEST_SESSION"}
        env.update(PATH=os.pathsep.join([str(self.bin), str(Path(sys.executable).parent),
                                         env.get("PATH", "")]),
                   PYTHON=sys.executable, SLURM_JOB_ID=self.job_id,
                   SLURM_JOB_NUM_NODES=str(len(self.nodes)), SLURM_NNODES=str(len(self.nodes)),
                   SLURM_JOB_NODELIST=",".join(self.nodes), SLURM_SUBMIT_DIR=str(self.submit),
                   SLURMD_NODENAME=self.nodes[0], SLURM_CPUS_ON_NODE="2",
                   FAKE_LOG=str(self.log), FAKE_NODES=" ".join(self.nodes))
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SBATCH), *args], env=self.env(**extra),
                              cwd=self.submit, capture_output=True, text=True, timeout=timeout)

    def records(self) -> dict[str, dict]:
        return {n: json.loads((self.log / f"{n}.json").read_text())
                for n in self.nodes if (self.log / f"{n}.json").exists()}

    def srun(self) -> dict | None:
        p = self.log / "srun.json"
        return json.loads(p.read_text()) if p.exists() else None


def _parsed(rec: dict):
    """A node's ``nonstop run`` argv, parsed by nonstop's own parser (a flag it lacks fails)."""
    assert rec["argv"][0] == "run", rec["argv"]
    return build_parser().parse_args(rec["argv"])


@pytest.mark.integration
def test_sbatch_runs_nonstop_on_every_node_with_one_job_identity(tmp_path):
    slurm = FakeSlurm(tmp_path, ["gpu01", "gpu02", "gpu03", "gpu04"])
    endpoint = "etcd://10.9.8.7:2379,10.9.8.8:2379,10.9.8.9:2379"
    proc = slurm.run("--spare-nodes", "1", "--policy", "policy.yaml", "train.py", "--lr", "0.1",
                     NONSTOP_ETCD_ENDPOINT=endpoint, SLURM_GPUS_ON_NODE="8")
    assert proc.returncode == 0, proc.stderr
    recs = slurm.records()
    assert sorted(recs) == slurm.nodes
    args = {n: _parsed(r) for n, r in recs.items()}
    for node, a in args.items():
        assert a.nnodes == "3" and a.spare_nodes == 1  # K = 4 allocated - M
        assert a.nproc_per_node == 8  # from the GPUs Slurm gave the node
        assert a.rdzv_endpoint == endpoint
        assert a.rdzv_id == slurm.job_id
        assert a.node_id == node
        assert a.run_dir == str(slurm.submit / "nonstop-runs" / slurm.job_id / node)
        assert a.policy == "policy.yaml"
        assert a.script == "train.py" and a.script_args == ["--lr", "0.1"]
    assert len({a.node_id for a in args.values()}) == len(slurm.nodes)
    assert len({a.secret_file for a in args.values()}) == 1
    assert len({a.run_dir for a in args.values()}) == len(slurm.nodes)
    # one secret, fresh, readable by the user alone, in the shared (submit) directory
    secret_file = Path(next(iter(args.values())).secret_file)
    assert secret_file.parent.parent == slurm.submit
    secrets = {r["secret"].strip() for r in recs.values()}
    assert len(secrets) == 1 and re.fullmatch(r"[0-9a-f]{64}", secrets.pop())
    assert all(r["secret_mode"] == 0o600 and r["secret_dir_mode"] == 0o700 for r in recs.values())
    assert not secret_file.exists() and not secret_file.parent.exists()  # removed at the end
    assert [r["env"]["SLURM_PROCID"] for r in recs.values()] == ["0", "1", "2", "3"]
    # one task per node, and a lost node does not end the Slurm job
    opts = slurm.srun()["opts"]
    assert "--ntasks-per-node=1" in opts and "--nodes=4" in opts and "--ntasks=4" in opts
    assert "--no-kill" in opts


@pytest.mark.integration
def test_sbatch_secret_is_new_for_every_job(tmp_path):
    seen = []
    for job in ("11", "12"):
        slurm = FakeSlurm(tmp_path / job, ["a", "b"], job_id=job)
        proc = slurm.run("--spare-nodes=1", "--nproc-per-node=2", "train.py",
                         NONSTOP_ETCD_ENDPOINT="etcd://e:2379")
        assert proc.returncode == 0, proc.stderr
        [rec] = {r["secret"] for r in slurm.records().values()}
        seen.append(rec)
        a = _parsed(slurm.records()["a"])
        assert a.nnodes == "1" and a.spare_nodes == 1 and a.nproc_per_node == 2
    assert seen[0] != seen[1]


@pytest.mark.integration
@pytest.mark.parametrize("code", [1, 2])
def test_sbatch_exit_code_follows_the_nodes(tmp_path, code):
    slurm = FakeSlurm(tmp_path, ["n1", "n2", "n3"])
    proc = slurm.run("train.py", NONSTOP_ETCD_ENDPOINT="etcd://e:2379",
                     FAKE_EXIT=json.dumps({"n2": code}))
    assert proc.returncode == code, proc.stderr
    assert f"nonstop exited {code}" in proc.stdout
    assert sorted(slurm.records()) == ["n1", "n2", "n3"]


@pytest.mark.parametrize("args, extra, why", [
    (["--spare-nodes", "3", "train.py"], {}, "no node left"),
    (["--spare-nodes", "x", "train.py"], {}, "whole number"),
    (["--rdzv-id", "mine", "train.py"], {}, "--rdzv-id is set by this script"),
    (["--nnodes=2", "train.py"], {}, "--nnodes is set by this script"),
    (["--spare-nodes", "1"], {}, "no training script"),
    (["train.py"], {"SLURM_JOB_ID": ""}, "not in a Slurm job"),
])
@pytest.mark.integration
def test_sbatch_bad_input_exits_2_before_starting_anything(tmp_path, args, extra, why):
    slurm = FakeSlurm(tmp_path, ["n1", "n2", "n3"])
    proc = slurm.run(*args, NONSTOP_ETCD_ENDPOINT="etcd://e:2379", **extra)
    assert proc.returncode == 2, proc.stderr
    assert why in proc.stderr
    assert slurm.srun() is None
    assert not list(slurm.submit.glob(".nonstop-*"))


def _etcd_or_skip() -> str:
    from nonstop.store.etcd_server import EtcdUnavailable, etcd_binary

    try:
        return etcd_binary()
    except EtcdUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.integration
def test_sbatch_starts_its_own_etcd_and_stops_it(tmp_path):
    _etcd_or_skip()
    slurm = FakeSlurm(tmp_path, ["n1", "n2"])
    port = _free_port_pair()
    proc = slurm.run("--spare-nodes", "1", "train.py", NONSTOP_ETCD_HOST="127.0.0.1",
                     NONSTOP_ETCD_PORT=str(port), FAKE_CHECK_ETCD="1",
                     TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    recs = slurm.records()
    assert sorted(recs) == ["n1", "n2"]
    for rec in recs.values():
        assert _parsed(rec).rdzv_endpoint == f"etcd://127.0.0.1:{port}"
        assert rec["etcd_health"] == "true"  # etcd was up while the nodes ran
    with pytest.raises(OSError):  # and is gone with the job, its data too
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    assert not list(tmp_path.glob("nonstop-etcd-*"))
    assert (slurm.submit / "nonstop-runs" / slurm.job_id / "etcd.log").exists()


@pytest.mark.integration
def test_sbatch_end_to_end_with_real_nonstop(tmp_path):
    """The real ``nonstop run`` on two fake nodes (one holds the rank, one is a spare node), with
    the etcd the script starts: the job trains to the end and the script exits 0."""
    _etcd_or_skip()
    slurm = FakeSlurm(tmp_path, ["n1", "n2"])
    nonstop = Path(sys.executable).parent / "nonstop"
    if not nonstop.exists():
        pytest.skip("no nonstop console script next to this Python")
    proc = slurm.run("--spare-nodes", "1", "--nproc-per-node", "1", "--no-live", str(TRAIN),
                     "--steps", "20", timeout=240, NONSTOP=str(nonstop),
                     NONSTOP_ETCD_HOST="127.0.0.1", NONSTOP_ETCD_PORT=str(_free_port_pair()),
                     TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the first controller says the job's shape; on a loaded machine its lease may lapse before
    # the job forms, and a successor takes over (it says so instead). The job starts once the
    # hosts of its ranks have joined: a spare host that registers later joins the running job
    assert "1 rank(s) on 1 host(s) + 1 spare host(s)" in proc.stdout or (
        "1 rank(s) on 1 host(s) + 0 spare host(s)" in proc.stdout
        and "joined: a spare node" in proc.stdout) or (
        "takes over at generation" in proc.stdout), proc.stdout
    assert "nonstop exited 0" in proc.stdout
    runs = slurm.submit / "nonstop-runs" / slurm.job_id
    assert (runs / "n1").is_dir() and (runs / "n2").is_dir()
    assert list(runs.glob("*/summary.json"))  # the controller's host wrote the summary


@pytest.mark.skipif(os.environ.get("NONSTOP_TEST_SLURM") != "1" or not shutil.which("sbatch"),
                    reason="real Slurm: set NONSTOP_TEST_SLURM=1 on a cluster with 2 free nodes")
def test_sbatch_on_real_slurm(tmp_path):
    """``sbatch --wait`` on a real Slurm cluster (opt-in; it submits a job): 1 node + 1 spare."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(NONSTOP=str(Path(sys.executable).parent / "nonstop"), PYTHON=sys.executable)
    proc = subprocess.run(["sbatch", "--wait", "--nodes=2", str(SBATCH), "--spare-nodes", "1",
                           "--nproc-per-node", "1", "--no-live", str(TRAIN), "--steps", "20"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = "".join(p.read_text() for p in tmp_path.glob("nonstop-*.out"))
    assert proc.returncode == 0, proc.stderr + out
    assert "nonstop exited 0" in out


def test_sbatch_is_shellcheck_clean():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(SBATCH)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sbatch_is_executable_with_sbatch_directives():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert os.stat(SBATCH).st_mode & stat.S_IXUSR
    assert "set -euo pipefail" in text
    head = text.split("set -euo pipefail", 1)[0]
    assert re.search(r"^#SBATCH --nodes=\d+$", head, re.M)
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", head, re.M)
    assert re.search(r"^#SBATCH --no-kill$", head, re.M)


def test_the_grafana_dashboard_uses_only_metrics_nonstop_serves():
    from prometheus_client import CollectorRegistry

    from nonstop.observe.metrics import HostMetrics, JobMetrics
    from nonstop.policy import Policy

    reg = CollectorRegistry()
    JobMetrics(reg, Policy())
    HostMetrics(reg, "h")
    served = set()
    for fam in reg.collect():
        base = fam.name + ("_total" if fam.type == "counter" else "")
        served |= {base, f"{fam.name}_sum", f"{fam.name}_count", f"{fam.name}_bucket"}
    dash = json.loads((ROOT / "deploy" / "grafana" / "nonstop-dashboard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"nonstop_[a-z_]+", t["expr"])}
    assert used and not used - served, used - served
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
