"""A warm spare's sharding decisions made ahead (runtime/propagation.py): a record written in one
place is read back on meshes equal to the job's, its decisions land in DTensor's cache where an
equal operation finds them, the meshes are seen from the rank the spare takes, and anything that
is not a rank's record is refused whole. Real DTensor specs and sharding propagation in this
process (no process group is needed for either)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from nonstop.runtime import propagation
from nonstop import torch_internals as ti
from nonstop.runtime.propagation import BadRecord, Warmth

AXES = (((2,), (2,)), ((2,), (1,)))  # a (2, 2) mesh, row-major
NAMES = ("nonstop:dp_shard", "nonstop:tp")


def _schema(warmth: Warmth, rows: int = 8) -> OpSchema:
    mesh = warmth.mesh(NAMES, AXES, (0, 1, 2, 3), "cpu", ("dp_shard", "tp"))
    meta = TensorMeta(torch.Size([rows, 4]), (4, 1), torch.float32)
    a = DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=meta)
    b = DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=meta)
    return OpSchema(torch.ops.aten.mul.Tensor, (a, b), {})


def _record(*schemas: OpSchema) -> bytes:
    rec = propagation.Recorder.__new__(propagation.Recorder)
    rec.schemas = list(schemas)
    out = rec.dumps()
    assert out is not None
    return out


def test_a_record_read_elsewhere_makes_the_decision_an_equal_operation_then_finds():
    here = Warmth()
    original = _schema(here, rows=24)
    object.__setattr__(original.args_schema[0], "_hash", 12345)  # another process's hash
    raw = _record(original)

    spare = Warmth()
    (read,) = spare.loads(raw)
    assert read == original and read is not original
    assert read.args_schema[0].mesh is not original.args_schema[0].mesh
    assert hash(read) == hash(_schema(Warmth(), rows=24))  # the hash made here, not carried
    cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    before = cache.cache_info()
    spare._pending.append(read)
    assert spare.decide() == 1 and spare.decided == 1
    assert cache.cache_info().currsize == before.currsize + 1
    cache(_schema(Warmth(), rows=24))  # the job's own, equal: found
    assert cache.cache_info().hits == before.hits + 1
    spare._pending.append(read)
    assert spare.decide() == 0  # made once


def test_a_spare_stops_deciding_when_it_is_given_a_rank_and_goes_on_later():
    spare = Warmth()
    spare._pending.extend(_schema(spare, rows=r) for r in range(32, 64, 2))
    calls = []
    made = spare.decide(lambda: calls.append(1) or len(calls) > 2)
    assert made == 2 * propagation.CALLED_OFF_EVERY and len(spare._pending) == 16 - made
    assert spare.decide() == 16 - made and not spare._pending


def test_the_spares_meshes_are_seen_from_the_rank_it_takes():
    spare = Warmth()
    root = spare.mesh(NAMES, AXES, (0, 1, 2, 3), "cpu", ("dp_shard", "tp"))
    tp = spare.mesh(NAMES[1:], AXES[1:], (0, 1, 2, 3), "cpu", ("tp",))  # a slice of it
    assert tuple(root.get_coordinate()) == (0, 0) and tp.mesh.tolist() == [0, 1]
    spare.adopt(3)
    assert tuple(root.get_coordinate()) == (1, 1)
    assert tp.mesh.tolist() == [2, 3] and tuple(tp.get_coordinate()) == (1,)
    assert root._dim_group_names == list(NAMES)  # its collectives go to the job's groups


class _Foreign(pickle.Pickler):
    def persistent_id(self, obj):
        if obj == "MESH":
            return ("mesh", ("default_pg_0",), AXES, (0, 1, 2, 3), "cpu", ("dp", "tp"))
        return None


def _foreign() -> bytes:
    import io

    buf = io.BytesIO()
    _Foreign(buf).dump("MESH")
    return pickle.dumps((str(torch.__version__), [buf.getvalue()]))


@pytest.mark.parametrize("raw, says", [
    (b"not a pickle", "unreadable record"),
    (pickle.dumps(("1.0.0", [])), "a record of torch 1.0.0"),
    (pickle.dumps((str(torch.__version__), "x")), "a list of operations"),
    (pickle.dumps((str(torch.__version__), [pickle.dumps(os.system)])), "may not make"),
    (pickle.dumps((str(torch.__version__), [pickle.dumps(3)])), "not an operation"),
    (_foreign(), "not the job's"),
])
def test_what_is_not_a_ranks_record_is_refused_whole(raw, says):
    with pytest.raises(BadRecord, match=says):
        Warmth().loads(raw)


def test_an_operation_on_the_scripts_own_mesh_is_not_recorded():
    ours = _schema(Warmth())
    theirs = _schema(Warmth(), rows=12)
    theirs.args_schema[0].mesh._dim_group_names = ["default_pg_1", "default_pg_2"]
    rec = propagation.Recorder.__new__(propagation.Recorder)
    rec.schemas = [theirs]
    assert rec.dumps() is None
    rec.schemas = [ours]
    assert len(Warmth().loads(rec.dumps())) == 1


def test_a_spare_reads_the_records_there_are_and_never_waits_for_one_not_written():
    """The number of a record is taken before the record is written: a writer that died between
    the two leaves a hole the spare skips (a spare blocked on it would miss its rank), and a
    record written later is read at the next look. A real store, served here."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    assert store.add(propagation.COUNT_KEY, 1) == 1  # a writer took 0 and died
    store.add(propagation.COUNT_KEY, 1)
    store.set(propagation.record_key(1), _record(_schema(Warmth(), rows=40)))
    spare = Warmth()
    assert spare.take(store) == 1 and spare.read == {1}
    store.add(propagation.COUNT_KEY, 1)
    store.set(propagation.record_key(2), b"garbage")
    assert spare.take(store) == 0 and spare.read == {1, 2}
    assert len(spare.refused) == 1 and "unreadable record" in spare.refused[0]
    assert spare.take(store) == 0  # nothing new: nothing read again


def _scalar_op(warmth: Warmth, op, scalar, placement=Shard(0)) -> OpSchema:
    mesh = warmth.mesh(NAMES, AXES, (0, 1, 2, 3), "cpu", ("dp_shard", "tp"))
    meta = TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
    prop = DTensor._op_dispatcher.sharding_propagator  # the schema info a live operation has
    info = prop.op_to_schema_info_for_single_dim_strategy.get(op) or prop.op_to_schema_info.get(op)
    return OpSchema(op, (DTensorSpec(mesh, (placement, Replicate()), tensor_meta=meta), scalar),
                    {}, schema_info=info)


def test_a_pointwise_decision_with_a_float_holds_for_every_float():
    """Adam divides by a bias correction that changes every step, and DTensor's cache keys the
    float's value: a spare's decision made at the recorded step would never be found at the
    step its rank resumes. A pointwise operation's rules never read a scalar's value, so the
    decision is kept by its operands' specs alone - and it is the one DTensor makes for the new
    float. Not for an int operand, an operation that is not pointwise, or a decision that moves
    an operand (it carries the values it moves with)."""
    from torch.distributed.tensor import Partial

    aten = torch.ops.aten
    spare = Warmth()
    recorded, resumed = (_scalar_op(spare, aten.div.Tensor, v) for v in (0.0316, 0.2230))
    assert recorded != resumed  # DTensor's own key: not found
    assert propagation._valueless(recorded) == propagation._valueless(resumed)
    assert propagation._valueless(_scalar_op(spare, aten.div.Tensor, 3)) is None
    assert propagation._valueless(_scalar_op(spare, aten.div.Tensor, 3)) is None
    mesh = spare.mesh(NAMES, AXES, (0, 1, 2, 3), "cpu", ("dp_shard", "tp"))
    meta = TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
    view = OpSchema(aten.view.default, (DTensorSpec(mesh, (Shard(0), Replicate()),
                                                    tensor_meta=meta), [32]), {})
    assert propagation._valueless(view) is None  # not pointwise

    moves = _scalar_op(spare, aten.add.Tensor, 1.5, placement=Partial())
    spare._pending.extend([recorded, moves])
    assert spare.decide() == 2
    assert list(spare.valueless) == [propagation._valueless(resumed)]  # the add is not kept
    kept = spare.valueless[propagation._valueless(resumed)]
    fresh = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached(resumed)
    assert kept.output_spec == fresh.output_spec and not kept.needs_redistribute


def test_a_torch_without_what_the_warm_up_needs_says_so_once_and_warms_nothing(monkeypatch, capsys):
    assert propagation.supported()  # this torch has all of it: never a silent skip here
    monkeypatch.setitem(ti.NAMES, "gone", ti.Internal(
        "torch.distributed.tensor", "DTensor._no_such_dispatcher", "a test's missing name"))
    monkeypatch.setattr(ti, "_resolved", {})
    monkeypatch.setattr(propagation, "NEEDS", (*propagation.NEEDS, "gone"))
    monkeypatch.setattr(propagation, "_verdict", [])
    assert not propagation.supported() and not propagation.supported()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "DTensor._no_such_dispatcher" in err
    assert "a test's missing name" in err and "tested on torch" in err
