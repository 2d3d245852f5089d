"""The ``nonstop`` command: run | demo | bench | chaos | drain | report | status | policy.

Errors a user can cause print one line and exit with code 2; nothing is started before the input
is known to be good.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from .errors import USAGE_EXIT, UsageError, one_line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"nonstop: error: {one_line(message)} (see nonstop {self._sub_name()}--help)\n")
        sys.exit(USAGE_EXIT)

    def _sub_name(self) -> str:
        parts = self.prog.split()[1:]
        return " ".join(parts) + " " if parts else ""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _chaos_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", type=int, default=10, help="chaos: faults in the schedule (default 10)")
    p.add_argument("--seed", type=int, default=1, help="chaos: the schedule's seed (default 1)")
    p.add_argument("--spares", dest="spares_chaos", type=_non_negative, metavar="K",
                   help="chaos: warm spares (default 2; --hosts: 1 per host)")
    p.add_argument("--kinds", metavar="LIST",
                   help="chaos --hosts: comma-separated fault kinds to draw from (default: all)")
    p.add_argument("--etcd-members", type=int, default=1, metavar="N",
                   help="chaos --hosts: etcd members, each on a test host of its own (default 1; "
                        "3: one member lost or its disk full leaves a quorum)")
    p.add_argument("--snapshot-every", dest="chaos_snapshot_every", metavar="N|auto",
                   help="chaos (one host): steps between memory snapshots (default 4: every "
                        "snapshot fault fires; auto: the policy's own interval)")


def _json_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON, last on stdout")
    p.add_argument("--out", metavar="DIR", help="keep the runs here (default: a temporary dir)")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _etcd_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a job's etcd: TLS and a user (``run`` and ``status`` alike)."""
    p.add_argument("--etcd-cacert", metavar="FILE",
                   help="CA that signed etcd's certificate (TLS; https:// endpoints)")
    p.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcd (TLS)")
    p.add_argument("--etcd-key", metavar="FILE", help="its private key")
    p.add_argument("--etcd-user", metavar="NAME",
                   help="etcd user (authentication on); its password in $NONSTOP_ETCD_PASSWORD")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nonstop", description="Distributed PyTorch training that keeps going.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="run a training script on N ranks, recovering from faults",
                         description="Run SCRIPT on --nproc rank processes with warm spares; "
                                     "survive crashes and hangs.")
    run.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="rank processes on one host (default 1)")
    run.add_argument("--nproc-per-node", type=int, metavar="P",
                     help="rank processes per host, as torchrun (one host: the same as --nproc)")
    run.add_argument("--nnodes", metavar="N|MIN:MAX",
                     help="hosts that hold ranks, as torchrun (needs --rdzv-endpoint when > 1)")
    run.add_argument("--rdzv-endpoint", metavar="etcd://HOST:PORT[,...]",
                     help="the etcd the hosts of the job meet in (many hosts; none: one host, "
                          "no external service)")
    run.add_argument("--rdzv-id", metavar="JOB", help="the job's id in etcd (the same on every host)")
    run.add_argument("--node-addr", metavar="ADDR",
                     help="this host's address for the job's traffic (default: the address "
                          "that reaches etcd)")
    run.add_argument("--node-id", metavar="NAME",
                     help="this host's name in the job (default: hostname-address)")
    run.add_argument("--failure-domain", metavar="LABEL",
                     help="this host's failure domain (a rack, a switch; default "
                          "$NONSTOP_FAILURE_DOMAIN, else the host itself): no two copies of a "
                          "snapshot in one where the labels allow")
    run.add_argument("--secret-file", metavar="FILE",
                     help="the job's shared secret (many hosts; else $NONSTOP_JOB_SECRET): every "
                          "channel between hosts is authenticated with it")
    _etcd_flags(run)
    run.add_argument("--spares", type=int, default=0, metavar="K",
                     help="warm spare processes kept ready to replace a rank (default 0)")
    run.add_argument("--nodes", type=int, default=1, metavar="K",
                     help="split the ranks into K nodes (on one machine: agent groups) (default 1)")
    run.add_argument("--spare-nodes", type=int, default=0, metavar="M",
                     help="whole spare nodes, warm, to take over a failed node's ranks (default 0)")
    run.add_argument("--policy", metavar="FILE", help="recovery policy (YAML)")
    run.add_argument("--run-dir", metavar="DIR",
                     help="where the event log, logs and summary go (default nonstop-runs/<stamp>)")
    run.add_argument("--inject", action="append", default=[], metavar="SPEC",
                     help="fault to inject, e.g. crash:rank=2,step=50 (repeatable; ';' joins several)")
    run.add_argument("--hang-timeout", type=_positive_float, metavar="S",
                     help="a fixed steady-state hang timeout instead of the tuned one (the first "
                          "step of a generation keeps the policy's allowance)")
    run.add_argument("--teardown-timeout", type=_positive_float, metavar="S",
                     help="seconds a rank has to leave a failed generation before it is killed")
    run.add_argument("--max-restarts", type=int, metavar="N",
                     help="job restarts allowed (every rank restarted) before giving up")
    run.add_argument("--checkpoint-dir", metavar="DIR",
                     help="write disk checkpoints (DCP format) here, and resume from the newest "
                          "one found there")
    run.add_argument("--checkpoint-every", type=int, metavar="N",
                     help="steps between disk checkpoints (default 100)")
    run.add_argument("--snapshot-every", metavar="N|auto",
                     help="steps between memory snapshots (default auto: as often as stays under "
                          "1%% of step time)")
    run.add_argument("--metrics-port", type=_port, metavar="PORT",
                     help="serve Prometheus metrics on this port (0: one from the OS, printed)")
    run.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                     help="the address the metrics are served on (default 127.0.0.1)")
    run.add_argument("--quiet", action="store_true", help="no rank output or progress")
    run.add_argument("--no-live", action="store_true", help="plain progress lines, no live status")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    demo = sub.add_parser("demo", help="4 ranks + 1 spare, a crash and a hang, checked bitwise")
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--run-dir", metavar="DIR")

    bench = sub.add_parser("bench", help="measure recovery against peers")
    bench.add_argument("scenario",
                       choices=["crash", "hang", "state", "second", "hosts", "elastic", "chaos",
                                "goodput", "scale", "overhead", "control-plane", "gpu"])
    bench.add_argument("--ranks", type=int, help="rank processes (default 4; state: 2)")
    bench.add_argument("--repeat", type=int,
                       help="runs of each system (default 5; hosts, elastic: 3)")
    bench.add_argument("--steps", type=int,
                       help="steps of each run (default 100; hosts: 200; elastic: 300)")
    bench.add_argument("--kill-step", type=int,
                       help="the step of the fault (default 50; hosts: 50)")
    bench.add_argument("--systems", help="comma-separated subset to run (default: all)")
    bench.add_argument("--parallel", metavar="LIST", default="ddp",
                       help="crash: comma-separated layouts, each the same job: ddp, fsdp "
                            "(FSDP2 over every rank), hsdp (2 replica groups of FSDP2 shards), "
                            "2d and 3d (fsdp and hsdp with tensor parallel of degree 2), pp (2 "
                            "pipeline stages x data parallel); elastic: ddp, hsdp and pp "
                            "shrink (fsdp and 2d are listed as not yet); overhead: ddp, fsdp or "
                            "hsdp (default ddp)")
    bench.add_argument("--false-positive-minutes", type=float, default=10.0,
                       help="hang: minutes of fault-free jittery training to count false alarms")
    bench.add_argument("--collective-timeout", type=float, default=10.0,
                       help="hang: torchrun's gloo timeout, its only way to notice a hang")
    bench.add_argument("--hidden", type=int, default=4096,
                       help="state: width of the big model's hidden layers (default 4096)")
    bench.add_argument("--layers", type=int, default=6,
                       help="state: hidden layers of the big model (default 6: ~100M parameters)")
    bench.add_argument("--state-steps", type=int, default=20,
                       help="state: steps of each big-model restore run (default 20)")
    bench.add_argument("--snapshot-steps", type=int, default=100,
                       help="state: steps of each snapshot-cost run; steps from 31 on are timed "
                            "(default 100)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="state: where the state lives (cuda: the GPU copies, against the "
                            "device's own memcpy bandwidth)")
    bench.add_argument("--phases", default="snapshot,restore,restart",
                       help="state: which measurements (default all: snapshot,restore,restart)")
    bench.add_argument("--hosts", type=int, metavar="H",
                       help="hosts: test hosts that hold ranks (default 3); elastic: run across "
                            "H test hosts instead of one host")
    bench.add_argument("--ranks-per-host", type=int, default=2, metavar="P",
                       help="hosts: ranks on each host (default 2)")
    bench.add_argument("--spare-hosts", type=int, default=1, metavar="S",
                       help="hosts: spare hosts (default 1)")
    bench.add_argument("--cases", metavar="LIST",
                       help="hosts: comma-separated subset of rank_crash,host_loss,partition,"
                            "controller_kill,etcd_restart,startup (default: all); elastic --hosts: "
                            "rank_crash (default) or host_loss; gpu: a subset of crash,frozen,"
                            "assert,oom,fsdp,hsdp,state (default: all)")
    bench.add_argument("--sleep-ms", type=float, metavar="MS",
                       help="hosts: sleep per step, a stand-in for accelerator work (default 15)")
    bench.add_argument("--grow-after", type=float, default=1.0, metavar="S",
                       help="elastic: seconds the job runs degraded before it grows back "
                            "(scale_in.grow_after_s; default 1)")
    bench.add_argument("--minutes", type=_positive_float, default=10.0,
                       help="goodput: minutes of training of each run (default 10)")
    bench.add_argument("--every", type=_positive_float, default=30.0, metavar="S",
                       help="goodput: seconds of training between two faults (default 30)")
    bench.add_argument("--sizes", metavar="LIST",
                       help="scale: world sizes on this host (default 2,4,8,16); control-plane: "
                            "simulated ranks (default 1024,4096,16384)")
    bench.add_argument("--placement", metavar="LIST",
                       help="control-plane: shared (every process on every core) and/or split "
                            "(the controller and etcd on core 0, the simulated hosts on the "
                            "others, as on a cluster); default shared,split")
    bench.add_argument("--host-sizes", metavar="LIST",
                       help="scale: test host counts, each with --ranks-per-host ranks "
                            "(default 2,4,8)")
    bench.add_argument("--step-ms", metavar="LIST",
                       help="overhead: step times to measure at, in ms (default 25,250)")
    _chaos_args(bench)
    _json_out(bench)
    bench.add_argument("--script", nargs=argparse.REMAINDER, metavar="SCRIPT ...",
                       help="crash, hang: measure a job of your own - SCRIPT and its arguments, "
                            "last on the line - instead of the comparison with peers")

    chaos = sub.add_parser("chaos", help="a seeded fault schedule thrown at a job (yours, or "
                                         "nonstop's own example)",
                           description="Run a job under a seeded schedule of faults (one host) "
                                       "and check that it completes, every incident closed, "
                                       "nothing left running: SCRIPT, your own (with --steps, "
                                       "the steps it runs, and --compare FILE to check what it "
                                       "writes against a fault-free run), or without SCRIPT "
                                       "nonstop's example job, checked bitwise (the benchmarks' "
                                       "soak; --hosts: across test hosts).")
    chaos.add_argument("--nproc", type=int, metavar="N",
                       help="your script: rank processes (default 2)")
    chaos.add_argument("--compare", metavar="FILE",
                       help="your script: the file it writes at its end (under {out} in its "
                            "arguments), compared bit for bit with a fault-free run's")
    chaos.add_argument("--ranks", type=int, help="rank processes (default 3)")
    chaos.add_argument("--steps", type=int, help="steps of the job (your script: the steps it "
                                                 "runs; default: enough for the faults)")
    chaos.add_argument("--hosts", type=int, metavar="H",
                       help="run across H test hosts (network namespaces) that hold ranks, plus a "
                            "spare host and etcd's host, with faults of hosts, etcd and the "
                            "controller too")
    chaos.add_argument("--ranks-per-host", type=int, default=2, metavar="P",
                       help="with --hosts: ranks on each host (default 2)")
    _chaos_args(chaos)
    _json_out(chaos)
    chaos.add_argument("script", nargs="?", help="your training script (a nonstop.wrap job)")
    chaos.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    drain = sub.add_parser("drain", help="move ranks of a running job to warm spares, no fault",
                           description="Ask the job running in RUN_DIR to move ranks (or every "
                                       "rank of a node, which is then released) to warm spares "
                                       "at their next step boundary: no fault, no step lost. "
                                       "Waits for the outcome.")
    drain.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run directory")
    what = drain.add_mutually_exclusive_group(required=True)
    what.add_argument("--rank", type=_non_negative, action="append", metavar="R",
                      help="a rank to move (repeat for several)")
    what.add_argument("--node", type=_non_negative, metavar="N",
                      help="a node whose ranks all move to a spare node; it is released")
    drain.add_argument("--why", default="asked", help="the reason, for the event log")
    drain.add_argument("--timeout", type=_positive_float, default=120.0, metavar="S",
                       help="how long to wait for the outcome (default 120)")

    report = sub.add_parser("report", help="show the summary of a finished run, draw its picture",
                            description="Print the summary of the run in RUN_DIR and draw it as "
                                        "a picture, RUN_DIR/timeline.png.")
    report.add_argument("run_dir")
    report.add_argument("--html", action="store_true",
                        help="also write RUN_DIR/report.html: one self-contained page (the "
                             "picture, incidents, goodput account, policy)")
    report.add_argument("--no-picture", action="store_true",
                        help="print the summary only: no timeline.png (unless --html)")

    status = sub.add_parser("status", help="the status of a running job, live",
                            description="Show a running job's generation, ranks, hosts, spares, "
                                        "step and rate, open incident and budgets left, "
                                        "refreshed live (one host: RUN_DIR; many hosts: the "
                                        "job's etcd).")
    status.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                        help="the job's run directory (one host, or the controller's host)")
    status.add_argument("--rdzv-endpoint", metavar="etcd://HOST:PORT[,...]",
                        help="the etcd of a job across hosts")
    status.add_argument("--rdzv-id", metavar="JOB", help="its job id")
    _etcd_flags(status)
    status.add_argument("--json", action="store_true", help="print the status once as JSON")
    status.add_argument("--once", action="store_true", help="print it once, not live")
    status.add_argument("--interval", type=_positive_float, default=1.0, metavar="S",
                        help="seconds between refreshes (default 1)")

    pol = sub.add_parser("policy", help="check a policy file, or show the effective policy",
                         description="Validate a recovery policy file, or print the policy a run "
                                     "would use (defaults filled in) as YAML.")
    pol_sub = pol.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser,
                                 required=True)
    check = pol_sub.add_parser("check", help="validate FILE: prints 'FILE: OK' or one error line")
    check.add_argument("file", metavar="FILE")
    show = pol_sub.add_parser("show", help="print the effective policy as YAML")
    show.add_argument("file", metavar="FILE", nargs="?",
                      help="policy file (default: show the defaults)")
    return parser


def _terminate_as_exit() -> None:
    """SIGTERM raises SystemExit (143) in the main thread, so that the ``finally`` of each
    running job ends it and its children (``nonstop_bench.common.run_child``): by default the bench
    died at once, its job left running alone."""
    import signal
    import threading

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # (a handler is the main's)
        signal.signal(signal.SIGTERM, leave)


def _bench(name: str) -> Any:
    """A benchmark's module, from the benchmarks beside the package (``nonstop_bench``, a
    distribution of its own: the wheel is the product, not its lab)."""
    import importlib

    try:
        return importlib.import_module(f"nonstop_bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("nonstop_bench", f"nonstop_bench.{name}"):
            raise
        raise UsageError("the benchmarks and soaks are not installed: they live beside the "
                         "package (in a checkout: make, or pip install -e bench); at a job of "
                         "your own: nonstop bench crash --script SCRIPT, nonstop chaos --steps N "
                         "SCRIPT") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            code = _run(args)
            if argv is None:  # the command itself, not a call from Python
                _exit_now(code)
            return code
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(steps=args.steps, run_dir=args.run_dir)
        if args.command in ("bench", "chaos"):  # a bench ended by SIGTERM ends its jobs first
            _terminate_as_exit()
        if args.command == "bench" and args.script is not None:  # a job of the user's own
            from .measure import own as measure_own

            if not args.script:
                raise UsageError("--script: give the training script (and its arguments)")
            args.script, args.script_args = args.script[0], args.script[1:]
            return measure_own(args)
        if args.command == "bench" and args.parallel != "ddp" and args.scenario not in (
                "crash", "overhead", "elastic"):
            raise UsageError(f"--parallel is for bench crash, elastic and overhead (not "
                             f"{args.scenario})")
        if args.command == "chaos" and args.script is not None:  # a job of the user's own
            if args.hosts:
                raise UsageError("chaos SCRIPT runs on one host (--hosts is the benchmarks' soak "
                                 "across test hosts)")
            from .chaos import own

            return own(args)
        if args.command == "chaos" or (args.command == "bench" and args.scenario == "chaos"):
            # the same soak across test hosts, or on one host
            return _bench("chaos_hosts" if getattr(args, "hosts", None) else "chaos").main(args)
        if args.command == "bench" and args.scenario in ("goodput", "control-plane", "gpu"):
            return _bench(args.scenario.replace("-", "_")).main(args)
        if args.command == "bench" and args.scenario == "overhead":
            overhead = _bench("overhead")
            if args.systems is None:
                args.systems = ",".join(overhead.SYSTEMS)
            return overhead.main(args)
        if args.command == "bench":
            module = _bench(args.scenario)
            if args.scenario == "hosts":  # its own defaults (steps, fault step: the driver's)
                if args.repeat is None:
                    args.repeat = 3
                if args.hosts is None:
                    args.hosts = 3
            else:
                if args.ranks is None:
                    args.ranks = 2 if args.scenario == "state" else 4
                elastic_run = args.scenario == "elastic"
                for name, default in (("repeat", 3 if elastic_run else 5),
                                      ("steps", 300 if elastic_run else 100), ("kill_step", 50)):
                    if getattr(args, name) is None:
                        setattr(args, name, default)
            if args.systems is None:
                args.systems = ",".join(module.SYSTEMS)
            return module.main(args)
        if args.command == "drain":
            from .drain import drain

            return drain(args.run_dir, tuple(args.rank or ()), args.node, args.why, args.timeout)
        if args.command == "report":
            from .observe.report import show

            return show(args.run_dir, html_page=args.html, picture=not args.no_picture)
        if args.command == "status":
            return _status(args)
        if args.command == "policy":
            return _policy(args)
        parser.print_help()
        return USAGE_EXIT
    except UsageError as exc:
        sys.stderr.write(f"nonstop: error: {one_line(exc)}\n")
        return USAGE_EXIT
    except KeyboardInterrupt:
        return 130


def _exit_now(code: int) -> None:
    """End the launcher without the interpreter's teardown: every process it started has ended,
    its files are closed and written, and tearing down what importing torch built costs ~0.5 s of
    CPU that is spent after the job is over."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    from .launch.one_host import RunConfig, run
    from .torch_internals import untested

    warning = untested()
    if warning:
        print(f"nonstop: warning: {warning}", file=sys.stderr, flush=True)

    cfg = RunConfig(script=args.script, script_args=list(args.script_args), nproc=args.nproc,
                    spares=args.spares, nodes=args.nodes, spare_nodes=args.spare_nodes,
                    policy_file=args.policy, run_dir=args.run_dir,
                    inject=args.inject, hang_timeout=args.hang_timeout,
                    teardown_timeout=args.teardown_timeout, max_restarts=args.max_restarts,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    snapshot_every=args.snapshot_every,
                    quiet=args.quiet, live=False if args.no_live else None,
                    nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                    rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                    node_addr=args.node_addr, node_id=args.node_id,
                    failure_domain=args.failure_domain, secret_file=args.secret_file,
                    etcd_cacert=args.etcd_cacert, etcd_cert=args.etcd_cert,
                    etcd_key=args.etcd_key, etcd_user=args.etcd_user,
                    metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)
    if cfg.across_hosts:  # one host of many: its agent
        from .launch.hosts import run_host

        return run_host(cfg)
    if cfg.failure_domain is not None:
        raise UsageError("--failure-domain labels one host of a job across hosts (with "
                         "--rdzv-endpoint); on one host each of --nodes is its own domain")
    return run(cfg)


def _status(args: argparse.Namespace) -> int:
    from .observe import status

    if bool(args.run_dir) == bool(args.rdzv_endpoint or args.rdzv_id):
        raise UsageError("give RUN_DIR, or --rdzv-endpoint and --rdzv-id (a job across hosts)")
    if args.run_dir:
        fetch = lambda: status.read_file(args.run_dir)  # noqa: E731
    else:
        from .observe.hosts_status import etcd_fetcher

        fetch = etcd_fetcher(args.rdzv_endpoint, args.rdzv_id, args.etcd_cacert, args.etcd_cert,
                             args.etcd_key, args.etcd_user)
    watch = not args.once and sys.stdout.isatty()
    return status.show(fetch, args.json, watch, args.interval)


def _policy(args: argparse.Namespace) -> int:
    from . import policy

    loaded = policy.load(args.file)
    if args.action == "check":
        print(f"{args.file}: OK")
    else:
        sys.stdout.write(policy.show_text(loaded, args.file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
