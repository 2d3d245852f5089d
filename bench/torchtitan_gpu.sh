#!/usr/bin/env bash
# torchtitan under nonstop on one GPU, once: does torchtitan 0.3.0's trainer (its Llama 3 debug
# model, FSDP over 2 ranks, a checkpoint every 10 steps) train under `nonstop run` unchanged
# (adoption step 1, docs/usage.md), and does a rank killed by SIGKILL after the step-20 checkpoint
# end in a job restart that resumes from that checkpoint and finishes step 40 with the loss of a
# fault-free run? Both rank processes share the one GPU (each its own host to NCCL).
#
#   bash bench/torchtitan_gpu.sh      # on the device machine; prints one JSON line last
#   (through the device tool: carry [".whl", ".tt"], both git-ignored; timeout_s about 280)
#
# Carried, not fetched (the machine has no network): .whl/ (torchtitan 0.3.0 and what it and
# nonstop need beyond the machine's image; never torch) and .tt/ (the tokenizer of torchtitan's
# tests/assets and a small JSON-lines text set in c4_test's format). Logs go to $OUT/tt/ if $OUT
# is set. The whole script keeps within TT_BUDGET_S (default 235 s): every step has a timeout.
# Making them, where pip reaches PyPI: `pip download --no-deps --only-binary=:all: --python-version
# 3.12 -d .whl torchtitan==0.3.0 torchdata torch_checkpointing "datasets<4.8" "dill<0.4.1"
# "multiprocess<0.70.19" tyro docstring_parser typeguard shtab spmd_types==0.2.3 pydantic
# pydantic_core annotated_types typing_inspection typing_extensions orjson` (with the machine's
# --platform manylinux tags); `.tt/tokenizer` is torchtitan's tests/assets/tokenizer (its git
# repository); `.tt/c4_test/data.json` any JSON lines of {"text": ...}.
#
# Knobs (for a local dry run on CPU, where FlexAttention cannot train, TT_CPU=1 swaps in plain
# causal attention and gloo): PY, TT_SITE (where the wheels go; TT_SKIP_INSTALL=1 to use it as
# it is), TT_EXTRA_PYTHONPATH, TT_WORK, TT_STEPS (40), TT_KILL_AFTER (20), TT_CKPT_EVERY (10),
# TT_SEQ (512), TT_BATCH (4), TT_SERIAL=1 (run B after A, not beside it), TT_BUDGET_S,
# TT_DETERMINISTIC (default --debug.deterministic; " " to leave it out),
# TT_RUN_S (155: the most a nonstop run may take), TT_FORCE_FALLBACK=1 (run the fallback anyway).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PY:-python3}
T0=$(date +%s)
BUDGET=${TT_BUDGET_S:-235}
STEPS=${TT_STEPS:-40}
KILL_AFTER=${TT_KILL_AFTER:-20}
CKPT_EVERY=${TT_CKPT_EVERY:-10}
SEQ=${TT_SEQ:-512}
BATCH=${TT_BATCH:-4}
NPROC=${TT_NPROC:-2}  # rank processes (TT_PARALLEL: torchtitan's parallelism flags for them)
KILL_RANK=$(( NPROC > 1 ? 1 : 0 ))
OUT_NAME=${TT_OUT_NAME:-tt}
SITE=${TT_SITE:-/tmp/site}
WORK=${TT_WORK:-/tmp/tt_gpu}
TT_ASSETS=$ROOT/.tt

say() { echo "tt: $*"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# cap a step's timeout at what the budget has left, less a reserve for what follows
cap() { local want=$1 reserve=$2 l; l=$(( $(left) - reserve )); [ "$l" -lt 5 ] && l=5; [ "$want" -lt "$l" ] && echo "$want" || echo "$l"; }

rm -rf "$WORK"
mkdir -p "$WORK"

# -- the machine ----------------------------------------------------------------------------------
say "start $(date -u +%FT%TZ), budget ${BUDGET}s, work $WORK"
timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/tt: gpu: /'
timeout 30 "$PY" -c "import sys, torch; print('tt: python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1 | tail -1

# -- 1. the carried wheels ------------------------------------------------------------------------
INSTALL_RC=0
if [ "${TT_SKIP_INSTALL:-0}" != 1 ]; then
    rm -rf "$SITE"
    timeout "$(cap 60 150)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$ROOT"/.whl/*.whl > "$WORK/install.log" 2>&1
    INSTALL_RC=$?
    tail -5 "$WORK/install.log" | sed 's/^/tt: pip: /'
fi
say "wheels into $SITE: rc=$INSTALL_RC ($(ls "$ROOT"/.whl/*.whl 2>/dev/null | wc -l) wheels), $(( $(date +%s) - T0 ))s"
export PYTHONPATH="$SITE:$ROOT/src${TT_EXTRA_PYTHONPATH:+:$TT_EXTRA_PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TT_SHARE_GPU=1 NONSTOP_SHARE_GPU=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there: never wait on a lookup
export TT_CPU=${TT_CPU:-0}

# -- helpers, written next to the runs ------------------------------------------------------------
cat > "$WORK/tt_launch.py" <<'EOF'
"""Run torchtitan's trainer (torchtitan/train.py's main) in this rank process, unchanged.

TT_SHARE_GPU=1: several rank processes on one GPU - each gets its own NCCL host id, so NCCL forms
their communicator over its socket transport instead of refusing the duplicate GPU (what
NONSTOP_SHARE_GPU does for nonstop's wrapped scripts; a plain script gets nothing from nonstop).
torchtitan itself picks cuda:0 when one device is visible. TT_COMPAT=1 (default): fill the torch
APIs torchtitan 0.3.0 names that this torch lacks but has an older equivalent of. TT_CPU=1 (local
dry runs only): CPU and gloo, plain causal attention in place of FlexAttention.
"""
import importlib  # torchtitan by name only: nonstop's bootstrap imports what a script imports
import os  # before it runs the script, and the patches below must come first
import socket
import sys


def compat():
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    filled = []
    if not hasattr(dist, "set_timeout") and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
        filled.append("torch.distributed.set_timeout=_set_pg_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        # built only by the full_dtensor/spmd_types backends; partial_dtensor passes none
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        filled.append("torch.distributed.fsdp.DataParallelMeshDims=placeholder")
    import inspect

    from torch.nn.attention import flex_attention as fa

    if "separate_full_blocks" not in inspect.signature(fa.create_block_mask).parameters:
        # a newer torch's switch; this one always keeps the full blocks apart (its default)
        make_mask = fa.create_block_mask

        def create_block_mask(*args, separate_full_blocks=True, **kwargs):
            return make_mask(*args, **kwargs)

        fa.create_block_mask = create_block_mask
        filled.append("flex_attention.create_block_mask(separate_full_blocks=) dropped")
    if filled:
        print(f"tt_launch: torch {torch.__version__}: filled {', '.join(filled)}",
              file=sys.stderr, flush=True)
    return filled


def cpu():
    import types

    import torch
    import torch._utils
    import torch.nn.functional as F

    torch._utils._get_available_device_type = lambda: "cpu"
    c = torch.cpu
    c.get_device_name = lambda *a: "cpu"
    c.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=1 << 34)
    c.reset_peak_memory_stats = lambda *a: None
    c.empty_cache = lambda *a: None
    c.memory_stats = lambda *a: {}
    c.current_device = lambda: 0
    attn = importlib.import_module("torchtitan.models.common.attention")

    def sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa)
        return out, types.SimpleNamespace(lse=None, max_scores=None)

    attn.FlexAttention.compiled_flex_attn = staticmethod(sdpa)
    # gloo has no PREMUL_SUM: a divide factor of 1 is a plain SUM
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        set_factor(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


if __name__ == "__main__":
    if os.environ.get("TT_SHARE_GPU") == "1" and "NCCL_HOSTID" not in os.environ:
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-tt-{os.getpid()}"
    if os.environ.get("TT_COMPAT", "1") == "1":
        compat()
    if os.environ.get("TT_CPU") == "1":
        cpu()
    importlib.import_module("torchtitan.train").main()
EOF

cat > "$WORK/tt_apis.py" <<'EOF'
"""What torchtitan 0.3.0's llama3 training path needs of this torch: the raw import of its
trainer, then (compat filled in) every `from torch.X import Y` and `torch.a.b.c` chain in the
torchtitan, torch_checkpointing, spmd_types and torchdata modules it loaded, resolved here."""
import ast
import importlib
import json
import sys

import torch

MODULES = ("torchtitan.trainer", "torchtitan.models.llama3.config_registry",
           "torchtitan.components.checkpoint", "torchtitan.hf_datasets.text_datasets")
OURS = ("torchtitan", "torch_checkpointing", "spmd_types", "torchdata")


def load():
    errors = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"[:400]
    return errors


raw = load()
for name in [n for n in sys.modules if n.split(".")[0] in OURS]:
    del sys.modules[name]
import tt_launch  # noqa: E402

filled = tt_launch.compat()
after = load()
files = sorted({m.__file__ for n, m in list(sys.modules.items())
                if n.split(".")[0] in OURS and getattr(m, "__file__", None)})


def chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch":
        return ["torch"] + parts[::-1]
    return None


def resolves(parts):
    obj = torch
    for i in range(1, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except BaseException:  # noqa: BLE001
            return False
    return True


missing = {}
for path in files:
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        continue
    short = "/".join(path.split("/")[-3:])
    for node in ast.walk(tree):
        wanted = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "torch":
            wanted = [node.module.split(".") + [a.name] for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            wanted = [a.name.split(".") for a in node.names if a.name.startswith("torch.")]
        elif isinstance(node, ast.Attribute):
            c = chain(node)
            if c and len(c) > 1:
                wanted = [c]
        for parts in wanted:
            key = ".".join(parts)
            if key not in missing and not resolves(parts):
                missing[key] = f"{short}:{node.lineno}"
keys = sorted(missing)
gaps = {k: missing[k] for k in keys if not any(k != p and k.startswith(p + ".") for p in keys)}
# what the scan above cannot see: methods called on objects, and keyword arguments
import inspect  # noqa: E402

lacks = []
try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for cls, names in ((DeviceMesh, ("_unflatten", "_flatten", "_concatenate")),
                       (FSDPModule, ("set_force_sum_reduction_for_comms",
                                     "set_gradient_divide_factor", "set_modules_to_forward_prefetch",
                                     "set_requires_gradient_sync", "set_reshard_after_backward",
                                     "set_symm_mem_for_comm"))):
        lacks += [f"{cls.__name__}.{n}" for n in names if not hasattr(cls, n)]
    for fn, kw in ((torch.distributed.init_process_group, "_ranks"), (fully_shard, "dp_mesh_dims")):
        try:
            if kw not in inspect.signature(inspect.unwrap(fn)).parameters:
                lacks.append(f"{fn.__name__}({kw}=)")
        except (TypeError, ValueError):
            pass
except BaseException as exc:  # noqa: BLE001
    lacks.append(f"check failed: {type(exc).__name__}: {exc}"[:200])
print(json.dumps({"torch": torch.__version__, "raw_import_errors": raw, "filled": filled,
                  "import_errors_after_compat": after, "files_scanned": len(files),
                  "missing": gaps, "methods_or_kwargs_missing": lacks}))
EOF

cat > "$WORK/tt_pid.py" <<'EOF'
"""The pid of rank RANK in the newest generation of a nonstop run directory (its events.jsonl)."""
import json
import sys

run_dir, rank = sys.argv[1], sys.argv[2]
pids, wid = {}, None
try:
    with open(f"{run_dir}/events.jsonl") as fh:
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("type") == "spawn":
                pids[ev.get("wid")] = ev.get("pid")
            elif ev.get("type") == "generation" and isinstance(ev.get("ranks"), dict):
                wid = ev["ranks"].get(rank, wid)
except OSError:
    pass
print(pids.get(wid, ""))
EOF

cat > "$WORK/tt_report.py" <<'EOF'
"""Read the runs back: exit codes, nonstop's summaries, the loss lines; print one JSON line."""
import json
import os
import re
import sys

work = sys.argv[1]
steps = int(sys.argv[2])
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+|nan|inf)")
ERR = re.compile(r"(Error|error:|Traceback|FAILED|refus|fault:|NCCL WARN|Killed)")
NOISE = re.compile(r"lspci")


def read(name):
    try:
        with open(os.path.join(work, name), errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def losses(text):
    """step -> loss, rank 0's lines (nonstop prefixes '[rank 0]'; torchrun '[default0]:')."""
    out = {}
    for line in text.splitlines():
        if "rank 1]" in line or "default1]" in line or "[rank1]" in line:
            continue
        m = LOSS.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def summary(run):
    try:
        with open(os.path.join(work, run, "summary.json")) as fh:
            s = json.load(fh)
    except (OSError, ValueError):
        return None
    keep = ("exit_code", "incidents", "attempt", "wall_s", "steps_lost", "diagnosis")
    out = {k: s.get(k) for k in keep}
    out["incident_list"] = [{k: i.get(k) for k in ("faults", "levels", "replaced", "gen_from",
                                                   "gen_to", "mttr_s", "outcome") if k in i}
                            for i in (s.get("incident_list") or [])][:5]
    return out


def run(name, log, rc_file):
    text = read(log)
    rc = read(rc_file).strip()
    ls = losses(text)
    starts = [int(m) for m in re.findall(r"Training starts at step (\d+)", text)]
    resumed = sorted(set(re.findall(r"[Ll]oading (?:the )?checkpoint[^\n]*?step[- ]?(\d+)", text)))
    return {"rc": int(rc) if rc.lstrip("-").isdigit() else None, "summary": summary(name),
            "last_step": max(ls) if ls else None,
            "final_loss": ls.get(steps), "losses_tail": {k: ls[k] for k in sorted(ls)[-3:]},
            "starts_at": starts[:6], "loaded": resumed[:4],
            "errors": [l[-300:] for l in text.splitlines()
                       if ERR.search(l) and not NOISE.search(l)][-6:]}


res = {"check": "torchtitan_gpu", "steps": steps}
res["preflight"] = None
pre = read("preflight.json").strip().splitlines()
for line in reversed(pre):
    try:
        res["preflight"] = json.loads(line)
        break
    except ValueError:
        continue
res["a"] = run("run_a", "a.log", "a.rc")
res["b"] = run("run_b", "b.log", "b.rc")
try:
    res["b"]["kill"] = json.loads(read("kill.json") or "null")
except ValueError:
    res["b"]["kill"] = read("kill.json")[:200]
fa, fb = res["a"]["final_loss"], res["b"]["final_loss"]
res["final_loss_equal"] = None if fa is None or fb is None else fa == fb
res["final_loss_diff"] = None if fa is None or fb is None else abs(fa - fb)
for name in ("fallback1", "fallback2"):
    if read(f"{name}.log"):
        res[name] = run(name, f"{name}.log", f"{name}.rc")
a_ok = res["a"]["rc"] == 0 and res["a"]["final_loss"] is not None
kill = res["b"].get("kill") or {}
b_ok = (res["b"]["rc"] == 0 and fb is not None and bool(kill.get("killed"))
        and (res["b"]["summary"] or {}).get("incidents", 0) >= 1)
res["ok"] = {"trains_under_nonstop": a_ok, "restart_resumed_and_finished": b_ok,
             "bitwise_same_final_loss": bool(res["final_loss_equal"])}
print(json.dumps(res, default=str))
EOF

# -- 2. what this torch lacks (in the background, beside the runs) --------------------------------
( cd "$WORK" && timeout "$(cap 90 100)" "$PY" tt_apis.py > preflight.json 2> preflight.err; echo $? > preflight.rc ) &
PRE_PID=$!

# -- 3. the runs ----------------------------------------------------------------------------------
tt_args() {  # $1: dump folder
    echo --module llama3 --config llama3_debugmodel \
        --hf-assets-path "$TT_ASSETS/tokenizer" \
        --dataloader.dataset c4_test --dataloader.dataset-path "$TT_ASSETS/c4_test" \
        --dump-folder "$1" \
        --training.steps "$STEPS" --training.seq-len "$SEQ" --training.local-batch-size "$BATCH" \
        ${TT_PARALLEL:---parallelism.data-parallel-shard-degree 2 --parallelism.spmd-backend partial_dtensor} \
        --checkpoint.enable --checkpoint.interval "$CKPT_EVERY" --checkpoint.folder checkpoint \
        --debug.seed 42 ${TT_DETERMINISTIC:---debug.deterministic} --debug.no-enable-structured-logging \
        --metrics.log-freq 1 --metrics.no-enable-tensorboard --metrics.disable-color-printing \
        --validator.no-enable --comm.trace-buf-size 0 \
        --comm.init-timeout-seconds 60 --comm.train-timeout-seconds 60
}

nonstop_run() {  # $1: name (run_a / run_b), $2: log, $3: rc file, $4: timeout
    local name=$1
    # shellcheck disable=SC2046
    timeout -k 10 "$4" "$PY" -m nonstop run --nproc "$NPROC" --no-live --run-dir "$WORK/$name" \
        "$WORK/tt_launch.py" $(tt_args "$WORK/out_${name#run_}") > "$WORK/$2" 2>&1
    echo $? > "$WORK/$3"
}

killer() {  # SIGKILL rank 1 of run B once its step-$KILL_AFTER checkpoint is complete
    local meta="$WORK/out_b/checkpoint/step-$KILL_AFTER/.metadata" pid="" t
    while [ ! -f "$WORK/b.rc" ]; do
        if [ -f "$meta" ]; then
            pid=$("$PY" "$WORK/tt_pid.py" "$WORK/run_b" "$KILL_RANK")
            if [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; then
                t=$(( $(date +%s) - T0 ))
                echo "{\"killed\": true, \"pid\": $pid, \"rank\": $KILL_RANK, \"after\": \"step-$KILL_AFTER/.metadata\", \"at_s\": $t}" > "$WORK/kill.json"
                say "run B: SIGKILL to rank 1 (pid $pid) at ${t}s, after its step-$KILL_AFTER checkpoint"
                return
            fi
        fi
        sleep 0.05
    done
    echo "{\"killed\": false, \"pid\": \"$pid\", \"why\": \"run B ended first\"}" > "$WORK/kill.json"
}

RUN_T=$(cap "${TT_RUN_S:-155}" 40)
say "run A (fault-free) and run B (rank 1 killed after step $KILL_AFTER): timeout ${RUN_T}s each"
if [ "${TT_SERIAL:-0}" = 1 ]; then
    nonstop_run run_a a.log a.rc "$RUN_T"
    RUN_T=$(cap "${TT_RUN_S:-155}" 40)
    killer & KILL_PID=$!
    nonstop_run run_b b.log b.rc "$RUN_T"
else
    nonstop_run run_a a.log a.rc "$RUN_T" & A_PID=$!
    killer & KILL_PID=$!
    nonstop_run run_b b.log b.rc "$RUN_T"
    wait "$A_PID"
fi
wait "$KILL_PID" 2>/dev/null
say "run A rc=$(cat "$WORK/a.rc"), run B rc=$(cat "$WORK/b.rc"), $(( $(date +%s) - T0 ))s"
for r in a b; do
    echo "tt: --- run ${r^^}: last lines"
    grep -a -E "step: *[0-9]+ +loss|Training starts|[Ll]oading|checkpoint|nonstop|Error|error" "$WORK/$r.log" \
        | grep -v "^\s*$" | tail -14 | cut -c1-240
    [ -f "$WORK/run_$r/summary.json" ] && echo "tt: run ${r^^} summary: $(head -c 1500 "$WORK/run_$r/summary.json" | tr -d '\n ')"
done

# -- 4. fallback: torchtitan alone under torchrun, if it did not train under nonstop ---------------
# one rank first (does it train on this GPU and torch at all?), then two sharing the GPU (NCCL)
if [ "${TT_FORCE_FALLBACK:-0}" = 1 ] || ! grep -a -q -E "step: *$STEPS +loss" "$WORK/a.log"; then
    FB_STEPS=5
    for n in 1 2; do
        [ "$(left)" -lt 25 ] && { say "fallback ($n ranks): no time left"; break; }
        say "fallback: torchrun --nproc_per_node $n, $FB_STEPS steps"
        # shellcheck disable=SC2046
        timeout -k 5 "$(cap 60 12)" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" \
            "$WORK/tt_launch.py" $(tt_args "$WORK/out_fb$n") --training.steps "$FB_STEPS" \
            --checkpoint.no-enable --parallelism.data-parallel-shard-degree "$n" \
            > "$WORK/fallback$n.log" 2>&1
        echo $? > "$WORK/fallback$n.rc"
        echo "tt: --- fallback ($n ranks) rc=$(cat "$WORK/fallback$n.rc"): loss and error lines"
        grep -a -E "step: *[0-9]+ +loss|Error|error|Traceback|NCCL WARN" "$WORK/fallback$n.log" | tail -16 | cut -c1-240
        grep -a -q -E "step: *$FB_STEPS +loss" "$WORK/fallback$n.log" || break
    done
fi

# -- 5. report ------------------------------------------------------------------------------------
wait "$PRE_PID" 2>/dev/null
echo "tt: --- preflight (rc $(cat "$WORK/preflight.rc" 2>/dev/null)): $(head -c 3000 "$WORK/preflight.json")"
tail -3 "$WORK/preflight.err" 2>/dev/null | cut -c1-300 | sed 's/^/tt: preflight: /'
timeout 20 "$PY" "$WORK/tt_report.py" "$WORK" "$STEPS" > "$WORK/result.json" 2> "$WORK/report.err"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/$OUT_NAME"
    cp "$WORK/result.json" "$OUT/$OUT_NAME/" 2>/dev/null
    (cd "$WORK" && tar czf "$OUT/$OUT_NAME/tt_logs.tgz" --exclude='*.distcp' --exclude='tt_*.py' \
        ./*.log ./*.rc ./*.json ./*.err run_a run_b 2>/dev/null)
fi
say "done in $(( $(date +%s) - T0 ))s"
if [ -s "$WORK/result.json" ]; then
    tail -1 "$WORK/result.json"
else
    echo "{\"check\": \"torchtitan_gpu\", \"error\": \"report failed: $(tail -1 "$WORK/report.err" 2>/dev/null | tr -d '"\\' | cut -c1-200)\"}"
fi
