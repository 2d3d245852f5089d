"""Policy files: defaults, validation, one clear error line naming the file line and the field,
the example policies, `nonstop policy check/show`, and fuzzing for anything but UsageError."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from nonstop import policy
from nonstop.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "examples" / "policies"
EXAMPLES = sorted(POLICIES.glob("*.yaml"))
DOC = ROOT / "docs" / "policy.md"
SRC = "policy file p.yaml"


def error_of(text: str) -> str:
    with pytest.raises(UsageError) as info:
        policy.load_text(text, SRC)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and "\n" not in msg, msg
    return msg


# -- the basics ------------------------------------------------------------------------------------
def test_defaults_without_a_file():
    p = policy.load(None)
    assert p == policy.Policy()
    assert p.timeouts.teardown_s > 0 and p.rules.user_error_retries >= 1


def test_file_overrides_and_cli_overrides(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("detect:\n  hang:\n    timeout_s: 5\nrecover:\n  levels:\n    job_restart:\n      budget: 1\n")
    p = policy.load(f).with_overrides(**{"recover.timeouts.teardown_s": 0.5, "detect.hang.timeout_s": None})
    assert p.detect.hang.timeout_s == 5 and p.timeouts.teardown_s == 0.5
    assert p.levels.job_restart.budget == 1


def test_a_bad_override_is_one_usage_line():
    with pytest.raises(UsageError) as info:
        policy.Policy().with_overrides(**{"recover.levels.job_restart.budget": -1})
    assert str(info.value) == ("policy override: recover.levels.job_restart.budget: "
                               "Input should be greater than or equal to 0 (got -1)")
    with pytest.raises(KeyError):
        policy.Policy().with_overrides(**{"recover.levels.job_restart.budgets": 1})


@pytest.mark.parametrize("text, words", [
    ("detect:\n  hang:\n    timeout: 5\n", "unknown key 'detect.hang.timeout'"),
    ("detect:\n  hang:\n    timeout_s: -1\n", "detect.hang.timeout_s"),
    ("timeouts: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("rules:\n  hang_restarts: many\n", "rules.hang_restarts"),
])
def test_bad_policies_are_one_line(tmp_path, text, words):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(UsageError, match=re.escape(words)) as info:
        policy.load(f)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"policy file {f}")


def test_missing_policy_file(tmp_path):
    with pytest.raises(UsageError, match="No such file"):
        policy.load(tmp_path / "nope.yaml")


def test_unreadable_policy_files_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="Is a directory"):
        policy.load(tmp_path)
    f = tmp_path / "binary.yaml"
    f.write_bytes(b"detect:\n  \xff\xfe\x00garbage\n")
    with pytest.raises(UsageError, match=r"line 2: not UTF-8 text \(byte 0xff\)"):
        policy.load(f)
    with pytest.raises(UsageError):
        policy.load("bad\0path.yaml")
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        policy.load("/dev/zero")


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "~\n", "---\n"])
def test_an_empty_file_is_the_defaults(text):
    assert policy.load_text(text, SRC) == policy.Policy()


# -- line numbers and field paths ----------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    # unknown keys, with a suggestion: a close name here, or the same name at another level
    ("detect:\n  hang:\n    auto: true\n    steady:\n      floor_s: 2\n\n      florr_s: 3\n",
     "line 7: unknown key 'detect.hang.steady.florr_s' (did you mean 'floor_s'?)"),
    ("rules:\n  hang_restart: 2\n", "line 2: unknown key 'rules.hang_restart' (did you mean 'hang_restarts'?)"),
    ("timeouts:\n  teardown_s: 1\n", "line 1: unknown key 'timeouts' (did you mean 'recover.timeouts'?)"),
    ("detect:\n  hang:\n    floor_s: 1\n",
     "line 3: unknown key 'detect.hang.floor_s' (did you mean 'detect.hang.steady.floor_s'?)"),
    ("recover:\n  budgets: {}\n", "line 2: unknown key 'recover.budgets'"),
    ("detect:\n  yes: 1\n", "line 2: unknown key 'detect.yes'"),
    ("1: x\n", "line 1: unknown key '1'"),
    # bad values: the line of the value, what is expected, what was written
    ("detect:\n  hang:\n    steady:\n      floor_s: -1\n",
     "line 4: detect.hang.steady.floor_s: Input should be greater than 0 (got -1)"),
    ("detect:\n  hang:\n    timeout_s:\n      -1\n", "line 4: detect.hang.timeout_s: Input should be greater than 0 (got -1)"),
    ("rules:\n  hang_restarts: many\n",
     "line 2: rules.hang_restarts: Input should be a valid integer, unable to parse string as an integer (got 'many')"),
    ("detect:\n  straggler:\n    action: replce\n",
     "line 3: detect.straggler.action: Input should be 'report', 'replace' or 'drain' (got 'replce'; did you mean 'replace'?)"),
    ("detect:\n  hang:\n    timeout_s: .inf\n", "line 3: detect.hang.timeout_s: Input should be a finite number (got .inf)"),
    ("detect:\n  hang:\n    window: 0x" + "f" * 40 + "\n", "line 3: integer too large (0x" + "f" * 40 + ")"),
    ("detect: 5\n", "line 1: detect: Input should be a mapping of fields (got 5)"),
    ("detect:\n  loss_rules:\n    name: x\n", "line 2: detect.loss_rules: Input should be a list (got a mapping)"),
    # nested list items: missing fields at the item, bad values at the value
    ("detect:\n  loss_rules:\n    - name: spike\n      operator: '>'\n",
     "line 3: detect.loss_rules.0: missing field 'threshold'"),
    ("detect:\n  health_checks:\n    - name: gpu\n      command: nvidia-smi\n    - name: disk\n      command: df\n"
     "      every_s: 0\n", "line 7: detect.health_checks.1.every_s: Input should be greater than 0 (got 0)"),
    ("detect:\n  log_rules:\n    - {name: a, pattern: ok}\n    - name: b\n      pattern: '(unclosed'\n",
     "line 5: detect.log_rules.1.pattern: not a valid regular expression: missing ), unterminated subpattern "
     "at position 0 (got '(unclosed')"),
    ("detect:\n  log_rules:\n    - name: a\n      pattern: ok\n      code: 137\n",
     "line 5: detect.log_rules.0.code: Input should be a valid string (got 137; quote it to make it text)"),
    # cross-field checks: the line of the mapping's key
    ("detect:\n  hang:\n    first_step:\n      floor_s: 50\n      ceiling_s: 5\n",
     "line 3: detect.hang.first_step: floor_s (50) is above ceiling_s (5)"),
    ("hooks:\n  on_give_up:\n    url: ftp://host\n",
     "line 3: hooks.on_give_up.url: must start with http:// or https:// (got 'ftp://host')"),
    # YAML itself
    ("detect:\n  hang: x: 1\n", "line 2: not valid YAML (mapping values are not allowed here)"),
    ("detect:\n\thang: {}\n", "line 2: not valid YAML (found character '\\t' that cannot start any token; "
                              "indent with spaces, not tabs)"),
    ("detect:\n  hang:\n    window: 5\n    window: 6\n", "line 4: duplicate key 'detect.hang.window' (first at line 3)"),
    ("a: 1\n---\nb: 2\n", "line 2: not valid YAML (expected a single document in the stream, but found another document)"),
    ("- 1\n- 2\n", "line 1: expected a mapping at the top level (got a list)"),
])
def test_errors_name_the_line_and_the_field(text, expected):
    assert error_of(text) == f"{SRC} {expected}"


def test_the_first_problem_in_the_file_is_reported():
    text = "rules:\n  hang_restarts: 0\ndetect:\n  hang:\n    window: 0\n"
    assert error_of(text).startswith(f"{SRC} line 2: rules.hang_restarts")


def test_anchors_aliases_and_merge_keys():
    text = ("detect:\n  hang:\n    steady: &tight\n      floor_s: 0.5\n      ceiling_s: 60\n"
            "    first_step:\n      <<: *tight\n      ceiling_s: 600\n")
    hang = policy.load_text(text, SRC).detect.hang
    assert (hang.steady.floor_s, hang.steady.ceiling_s) == (0.5, 60)
    assert (hang.first_step.floor_s, hang.first_step.ceiling_s) == (0.5, 600)
    merged_bad = "base: &b {floor_s: 1, bogus: 2}\n"
    assert error_of(merged_bad) == f"{SRC} line 1: unknown key 'base'"
    # a bad key merged in from an anchor is reported where it is written
    bad = "detect:\n  hang:\n    steady:\n      <<: &b {floor_s: 1, bogus: 2}\n    first_step: *b\n"
    assert error_of(bad) == f"{SRC} line 4: unknown key 'detect.hang.steady.bogus'"


# -- the example policies and the documentation --------------------------------------------------------
def test_there_are_three_example_policies():
    assert [p.name for p in EXAMPLES] == ["aggressive.yaml", "conservative.yaml", "default.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_policy_loads(path):
    p = policy.load(path)
    assert policy.load_text(policy.show_text(p, str(path)), "shown") == p


def test_the_default_example_is_the_defaults_spelt_out():
    text = (POLICIES / "default.yaml").read_text()
    assert policy.load_text(text, "default.yaml") == policy.Policy()
    shown = yaml.safe_load(policy.show_text(policy.Policy()))
    assert yaml.safe_load(text) == shown  # every field is there, none is missing


def test_aggressive_and_conservative_differ_as_promised():
    fast = policy.load(POLICIES / "aggressive.yaml")
    slow = policy.load(POLICIES / "conservative.yaml")
    base = policy.Policy()
    assert fast.detect.hang.steady.ceiling_s < base.detect.hang.steady.ceiling_s
    assert fast.detect.straggler.action == "replace" and fast.detect.loss_rules and fast.detect.log_rules
    assert fast.levels.job_restart.budget < base.levels.job_restart.budget
    assert slow.detect.hang.steady.ceiling_s > base.detect.hang.steady.ceiling_s
    assert slow.detect.straggler.action == "report" and slow.detect.health_checks
    assert all(r.action == "report" for r in slow.detect.loss_rules + slow.detect.log_rules)
    assert slow.levels.job_restart.budget > base.levels.job_restart.budget


def _paths(model: Any, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        tp = field.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out += _paths(tp, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_the_documentation_names_every_field():
    doc = DOC.read_text()
    # a field is named in full, or (the levels' table) its parent in full and its own name
    missing = [p for p in _paths(policy.Policy) if f"`{p}`" not in doc
               and not (f"`{p.rsplit('.', 1)[0]}`" in doc and f"`{p.rsplit('.', 1)[1]}`" in doc)]
    for item in (policy.LossRule, policy.LogRule, policy.HealthCheck):
        missing += [f"{item.__name__}.{n}" for n in item.model_fields if f"`{n}`" not in doc]
    assert not missing


def test_the_documented_example_loads():
    block = re.search(r"## The file\s+```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    p = policy.load_text(block.group(1), "docs example")
    assert p.detect.loss_rules[0].action == "restart" and p.hooks.on_give_up.url


# -- show -----------------------------------------------------------------------------------------------
def test_show_round_trips_and_keeps_schema_order():
    p = policy.load_text("detect:\n  loss_rules:\n    - {name: 'weird: ñ \"q\"', threshold: -1e-9}\n"
                         "hooks:\n  on_give_up:\n    command: \"echo '#1' | cat\"\n", SRC)
    text = policy.show_text(p, "p.yaml")
    assert policy.load_text(text, "shown") == p
    assert text.isascii()
    tops = [line[:-1] for line in text.splitlines() if re.match(r"^\w+:$", line)]
    assert tops == ["detect", "recover", "rules", "state", "hooks", "hosts"]
    assert text.index("steady:") < text.index("first_step:") < text.index("heartbeat_s:")


def test_state_fields():
    p = policy.load_text("state:\n  snapshot:\n    every_steps: 4\n  checkpoint:\n    dir: ck\n", SRC)
    assert p.state.snapshot.every_steps == 4 and p.state.checkpoint.dir == "ck"
    assert policy.Policy().state.snapshot.every_steps == "auto"
    assert error_of("state:\n  snapshot:\n    every_steps: 0\n") == (
        f"{SRC} line 3: state.snapshot.every_steps: must be 'auto' or a whole number of steps "
        ">= 1 (got 0)")
    assert "must be 'auto'" in error_of("state:\n  snapshot:\n    every_steps: often\n")
    assert "needs snapshot.enabled" in error_of(
        "state:\n  snapshot:\n    enabled: false\n  checkpoint:\n    dir: ck\n")


def test_snapshot_replicas_and_the_older_spelling():
    def replicas(text):
        return policy.load_text(f"state:\n  snapshot:\n{text}", SRC).state.snapshot.replicas

    assert policy.Policy().state.snapshot.replicas == 1
    assert replicas("    replicas: 2\n") == 2 and replicas("    replicas: 0\n") == 0
    # replicate: false, the older spelling of replicas: 0, is read; true leaves replicas as it is
    assert replicas("    replicate: false\n") == 0
    assert replicas("    replicate: true\n") == 1 and replicas("    replicate: true\n    replicas: 3\n") == 3
    shown = policy.show_text(policy.load_text("state:\n  snapshot:\n    replicate: false\n", SRC))
    assert "replicate" not in shown and policy.load_text(shown, "shown").state.snapshot.replicas == 0
    assert error_of("state:\n  snapshot:\n    replicas: 9\n") == (
        f"{SRC} line 3: state.snapshot.replicas: Input should be less than or equal to 8 (got 9)")
    assert "replicas" in error_of("state:\n  snapshot:\n    replicas: -1\n")
    assert error_of("state:\n  snapshot:\n    replicate: false\n    replicas: 2\n") == (
        f"{SRC} line 2: state.snapshot: replicate: false (the older spelling of replicas) "
        "contradicts replicas: 2")
    assert "must be true or false, got 'yes please'" in error_of(
        "state:\n  snapshot:\n    replicate: yes please\n")


# -- the command line -----------------------------------------------------------------------------------
def nonstop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nonstop", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.integration
def test_cli_policy_check_good_and_bad(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("rules:\n  hang_restarts: 5\n")
    proc = nonstop("policy", "check", str(good))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{good}: OK\n", "")

    bad = tmp_path / "bad.yaml"
    bad.write_text("detect:\n  hang:\n    steady:\n      florr_s: 1\n")
    proc = nonstop("policy", "check", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"nonstop: error: policy file {bad} line 4: unknown key "
                           "'detect.hang.steady.florr_s' (did you mean 'floor_s'?)\n")

    proc = nonstop("policy", "check", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "No such file" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("args, words", [
    (["policy"], "required: ACTION"),
    (["policy", "lint", "x.yaml"], "invalid choice: 'lint'"),
    (["policy", "check"], "required: FILE"),
])
@pytest.mark.integration
def test_cli_policy_usage_errors(args, words):
    proc = nonstop(*args)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.integration
def test_cli_policy_show(tmp_path):
    proc = nonstop("policy", "show")
    assert proc.returncode == 0 and proc.stderr == ""
    assert policy.load_text(proc.stdout, "shown") == policy.Policy()
    path = POLICIES / "aggressive.yaml"
    proc = nonstop("policy", "show", str(path))
    assert proc.returncode == 0 and policy.load_text(proc.stdout, "shown") == policy.load(path)


# -- fuzzing: anything but a Policy or one UsageError line is a bug -------------------------------------
def load_or_usage_error(text: str) -> policy.Policy | None:
    try:
        return policy.load_text(text, SRC)
    except UsageError as exc:
        msg = str(exc)
        assert msg.startswith(SRC) and len(msg.splitlines()) == 1 and "\n" not in msg, repr(msg)
        assert len(msg) < 1000, msg
        return None


FIELD_NAMES = sorted({p.split(".")[-1] for p in _paths(policy.Policy)} | {"detect", "recover", "rules"})
TOKENS = FIELD_NAMES + [
    ":", ": ", "\n", "  ", "    ", "- ", "-", "&a ", "*a", "<<: ", "{", "}", "[", "]", ", ", "'", '"',
    "\t", "# c", "!!int ", "!!str ", "!!binary ", "!!python/object:os.system ", "!!timestamp ",
    "!!set ", "!!omap ", "!foo ", "~", "null", "yes", "0x", "0o7", "1e999", ".inf", ".nan", "-1", "0",
    "3.5", "99999999999999999999", "1:2:3", "2001-13-01", "---", "...", "? ", "%YAML 1.1\n", "\x00",
    "\ufeff", "\u2028", "\x85", "\r", "|\n", ">\n", "\\", "\ud800", "é", "report", "replace",
]
yamlish = st.lists(st.sampled_from(TOKENS) | st.text(max_size=4), max_size=40).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), yamlish, st.binary().map(lambda b: b.decode("latin-1"))))
def test_fuzz_any_text(text):
    load_or_usage_error(text)


BASES = [policy.Policy().model_dump()] + [yaml.safe_load(p.read_text()) for p in EXAMPLES]
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats() | st.text(max_size=12) | st.sampled_from(TOKENS + ["report", "fail", ">"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELD_NAMES), inner, max_size=3),
                      max_leaves=6)


def mutate(draw: Any, doc: Any) -> Any:
    """Walk down a random path and change, add or delete one entry there."""
    doc = copy.deepcopy(doc)
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        k = draw(st.sampled_from(keys))
        if isinstance(node[k], (dict, list)) and draw(st.booleans()):
            node = node[k]
            continue
        break
    action = draw(st.sampled_from(["change", "add", "delete"]))
    if isinstance(node, dict):
        keys = list(node)
        if action == "add" or not keys:
            near = draw(st.sampled_from([k for k in keys if isinstance(k, str) and k] or ["x"]))
            new_key = draw(st.sampled_from([near + "x", near[:-1], near.upper()]) | st.text(max_size=8)
                           | st.integers() | st.none())
            node[new_key] = draw(values)
        elif action == "delete":
            del node[draw(st.sampled_from(keys))]
        else:
            node[draw(st.sampled_from(keys))] = draw(values)
    else:
        if action == "add" or not node:
            node.append(draw(values))
        elif action == "delete":
            del node[draw(st.integers(0, len(node) - 1))]
        else:
            node[draw(st.integers(0, len(node) - 1))] = draw(values)
    return doc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_policies(data):
    doc = data.draw(st.sampled_from(BASES))
    for _ in range(data.draw(st.integers(1, 3))):
        doc = mutate(data.draw, doc)
    style = data.draw(st.sampled_from([False, None, True]))
    try:  # libyaml is fast, but cannot write lone surrogates: PyYAML writes them as they are
        text = yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
                         default_flow_style=style, allow_unicode=True)
    except UnicodeEncodeError:
        text = yaml.dump(doc, Dumper=yaml.SafeDumper, sort_keys=False, default_flow_style=style,
                         allow_unicode=True)
    p = load_or_usage_error(text)
    if p is not None:  # whatever loads also shows and loads back the same
        assert policy.load_text(policy.show_text(p), "shown") == p
