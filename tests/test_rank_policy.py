"""The policy as a rank reads it (protocol/rank_policy.py): the launcher's validated policy, read
strictly into frozen records with no default of their own - so the rank's view of any policy,
the default one included, is the schema's, field by field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from nonstop import protocol
from nonstop.policy import Policy, load
from nonstop.protocol import rank_policy
from nonstop.protocol.rank_policy import RankPolicy
from nonstop.protocol.records import BadRecord
from nonstop.state.digest import Digests
from nonstop.state.snapshot import Snapshots

POLICIES = Path(__file__).resolve().parent.parent / "examples" / "policies"


def _as_the_rank_gets_it(policy: Policy) -> RankPolicy:
    """Through the job's settings in the store: the schema's dump, as JSON."""
    return rank_policy.read(protocol.loads(protocol.dumps({"policy": policy.model_dump()}))["policy"])


def _same(view: object, schema: object, path: str) -> list[str]:
    """Where the rank's view differs from the schema's object (every field of the view)."""
    if dataclasses.is_dataclass(view):
        out = []
        for f in dataclasses.fields(view):
            assert f.name in type(schema).model_fields, f"{path}.{f.name} is not in the schema"
            out += _same(getattr(view, f.name), getattr(schema, f.name), f"{path}.{f.name}")
        return out
    if isinstance(view, tuple):
        if len(view) != len(schema):
            return [path]
        return [d for i, (v, s) in enumerate(zip(view, schema)) for d in _same(v, s, f"{path}[{i}]")]
    return [] if type(view) is type(schema) and view == schema else [f"{path}: {view!r} != {schema!r}"]


def _policies() -> list[tuple[str, Policy]]:
    custom = Policy().with_overrides(**{
        "state.snapshot.every_steps": 7, "state.snapshot.max_overhead_pct": 2.5,
        "state.checkpoint.dir": "/ckpt", "state.checkpoint.every_steps": 20,
        "state.checkpoint.at_end": False, "detect.sdc.action": "report",
        "detect.sdc.max_overhead_pct": 0.25, "detect.nan.enabled": False,
        "recover.levels.scale_in.batch": "scale_lr", "recover.timeouts.abort_s": 12.0})
    rules = Policy.model_validate({"detect": {"loss_rules": [
        {"name": "spike", "operator": ">=", "threshold": 10, "data_points": 3,
         "action": "restart"}, {"name": "low", "operator": "<", "threshold": -1.5}]}})
    return [("default", Policy()), ("custom", custom), ("loss_rules", rules)] + \
        [(p.stem, load(p)) for p in sorted(POLICIES.glob("*.yaml"))]


@pytest.mark.parametrize("name, policy", _policies(), ids=[n for n, _ in _policies()])
def test_the_ranks_view_of_a_policy_is_the_schemas_field_by_field(name, policy):
    assert _same(_as_the_rank_gets_it(policy), policy, "policy") == []


def test_the_default_policy_is_read_as_the_schema_defaults_it():
    view = _as_the_rank_gets_it(Policy())
    # (the digests' share was read with a default of 1% where the schema says 0.5%)
    assert Digests(view.detect.sdc).max_share == Policy().detect.sdc.max_overhead_pct / 100
    snaps = Snapshots(view.state, None, sdc=view.detect.sdc)
    assert snaps.auto and snaps.max_share == Policy().state.snapshot.max_overhead_pct / 100
    assert snaps.digests is not None and snaps.root is None


def _choices(hint: object) -> set[object]:
    """The fixed values a field may take (its Literal's), through unions."""
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    return {c for a in typing.get_args(hint) for c in _choices(a)}


def test_each_choice_the_rank_reads_allows_what_the_schema_allows():
    def walk(cls: type, model: type, path: str) -> list[str]:
        out = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            theirs = model.model_fields[f.name].annotation
            ours = hints[f.name]
            if typing.get_origin(ours) is tuple:  # a list of records
                ours, theirs = typing.get_args(ours)[0], typing.get_args(theirs)[0]
            if dataclasses.is_dataclass(ours):
                out += walk(ours, theirs, f"{path}.{f.name}")
            elif _choices(ours) != _choices(theirs):
                out.append(f"{path}.{f.name}: {_choices(ours)} != {_choices(theirs)}")
        return out

    assert walk(RankPolicy, Policy, "policy") == []


def test_a_field_missing_or_of_another_type_is_an_error_never_a_default():
    dump = Policy().model_dump()
    del dump["detect"]["sdc"]["max_overhead_pct"]
    with pytest.raises(BadRecord, match=r"policy.detect.sdc: field 'max_overhead_pct' is missing"):
        rank_policy.read(dump)
    dump = Policy().model_dump()
    dump["state"]["snapshot"]["every_steps"] = "often"
    with pytest.raises(BadRecord, match=r"policy.state.snapshot.every_steps: 'often' is not"):
        rank_policy.read(dump)
    dump = Policy().model_dump()
    dump["detect"]["loss_rules"] = [{"name": "x", "operator": "!=", "threshold": 1.0,
                                     "data_points": 1, "action": "report"}]
    with pytest.raises(BadRecord, match=r"policy.detect.loss_rules\[0\].operator"):
        rank_policy.read(dump)
    with pytest.raises(BadRecord, match="policy: None is not an object"):
        rank_policy.read(None)


def test_the_rest_of_the_policy_is_not_the_ranks_concern():
    dump = Policy().model_dump()
    dump["hosts"] = {"anything": "else"}  # read by the controller and the agents only
    assert rank_policy.read(dump) == rank_policy.read(Policy().model_dump())


@pytest.mark.integration
def test_a_rank_process_reads_its_policy_without_importing_the_schema():
    code = ("import sys, nonstop.runtime.bootstrap, nonstop.runtime.worker, nonstop.runtime.wrap, "
            "nonstop.decide.detect, nonstop.protocol.rank_policy; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' "
            "or m == 'nonstop.policy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
