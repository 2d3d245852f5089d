"""State moved without pickle: a state dict as a JSON skeleton and one flat buffer of raw bytes.

Round trips are bitwise and keep every container and key type; a value JSON cannot carry is
refused when packing, with its path; metadata that is malformed or hostile is refused with a
clear exception, before anything is allocated for it; and neither packing nor restore's network
path unpickles anything."""

from __future__ import annotations

import ast
import base64
import json
import math
import os
import pickle
import random
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

import nonstop
from nonstop.state import packing
from nonstop.state.packing import BadMeta, UnsupportedState, layout, pack, unpack, unpack_with_info

STATE_DIR = Path(packing.__file__).resolve().parent


# -- helpers -------------------------------------------------------------------------------------
def same(a, b, path="state"):
    """Bitwise equality of two state trees, container and key types included."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        both_nan = math.isnan(a) and math.isnan(b)
        assert struct.pack("<d", a) == struct.pack("<d", b) or both_nan, path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
        assert getattr(a, "__dict__", {}) == getattr(b, "__dict__", {}), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def roundtrip(sd, info=None):
    meta, buf = pack(sd, info)
    assert isinstance(meta, bytes) and meta.startswith(b"{")
    json.loads(meta)  # plain JSON: no NaN, no Infinity literals
    out, got_info = unpack_with_info(meta, buf)
    same(sd, out)
    return out, got_info, meta, buf


def trained(steps=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.ReLU(),
                                torch.nn.Linear(7, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
    return model, opt


def meta_doc(sd, info=None):
    meta, buf = pack(sd, info)
    return json.loads(meta), buf


def dumps(doc):
    return json.dumps(doc).encode()


# -- round trips ---------------------------------------------------------------------------------
def test_a_model_and_adam_come_back_bitwise_and_keep_training_alike():
    model, opt = trained()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # inf in its state
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}
    out, _, _, _ = roundtrip(sd)
    assert type(out["model"]) is OrderedDict and out["model"]._metadata == sd["model"]._metadata
    assert list(out["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys stay int
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)  # a tuple stays a tuple
    assert out["sched"]["best"] == math.inf

    model2, opt2 = trained(0)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optimizer"])
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(1)
        o.zero_grad()
        m(torch.randn(8, 5)).pow(2).mean().backward()
        o.step()
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_values_keep_their_types_and_bits():
    sd = {
        "ints": {0: "zero", -1: "minus one", 2**80: "big", 7: {3: {1: None}}},
        "mixed": {(1, "a"): 1, None: 2, 1.5: 3, True: 4, b"k": 5, "s": 6},
        "floats": [0.1, -0.0, 1e308, 5e-324, math.nan, math.inf, -math.inf],
        "tuples": ((1, 2), [3, (4,)], ()),
        "empty": [{}, [], (), OrderedDict()],
        "none": None, "bools": [True, False], "str": "ünïcödé \ud800 \x00 \"quoted\"",
        "size": torch.Size([2, 3]), "size0": torch.Size([]),
        "bytes": b"\x00\xff raw", "bytearray": bytearray(b"abc"), "bytes0": b"",
        "big": 3**2000, "neg": -(2**63),
    }
    roundtrip(sd)


def test_tensors_of_every_kind_come_back_bitwise():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    weird = torch.tensor([math.nan, -0.0, math.inf, -math.inf, 1e-45])
    sd = {
        "bf16": torch.randn(5, 3).bfloat16(), "f16": torch.randn(7).half(),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]), "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(255, dtype=torch.uint8),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "f64": torch.randn(3, dtype=torch.float64), "c64": torch.randn(2, dtype=torch.complex64),
        "nan": weird, "nan_bf16": weird.bfloat16(),
        "scalar": torch.tensor(3.5), "scalar_int": torch.tensor(7),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0), "empty2d": torch.empty(0, 5, dtype=torch.bfloat16),
        "transposed": base.t(), "strided": base[:, ::2], "expanded": torch.randn(1, 3).expand(4, 3),
        "offset_view": base[2:, 1:], "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }
    out, _, _, buf = roundtrip(sd)
    assert out["transposed"].is_contiguous() and torch.equal(out["transposed"], base.t())
    # the tensors view the buffer: no copy
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert all(start <= t.data_ptr() < end for t in out.values() if t.numel())
    lay = layout(sd)
    assert all(off % packing.ALIGN == 0 for _, _, off, _ in lay.specs)


def test_the_same_tensor_twice_comes_back_as_two_equal_tensors():
    w = torch.randn(3, 3)
    out, _, _, _ = roundtrip({"embed.weight": w, "head.weight": w})  # tied weights
    assert torch.equal(out["embed.weight"], out["head.weight"])


def test_numpy_arrays_and_scalars_come_back_as_numpy():
    sd = {"arr": np.arange(12, dtype=np.uint32).reshape(3, 4)[:, ::2],
          "f16": np.array([1.5, -0.0], dtype=np.float16), "zero_d": np.array(2.5),
          "empty": np.zeros((0, 3), dtype=np.int16), "b": np.array([True, False]),
          "f64": np.float64(0.1), "i32": np.int32(-5), "bool_": np.bool_(True),
          "c": np.complex128(1 + 2j)}
    out, _, _, buf = roundtrip(sd)
    assert not any(np.shares_memory(v, buf.numpy()) for v in out.values()
                   if isinstance(v, np.ndarray))  # copies of their own, as unpickled ones were
    buf.zero_()
    assert out["f16"].tobytes() == sd["f16"].tobytes()  # unaffected by the buffer's reuse


def test_rng_state_round_trips_and_replays():
    np.random.seed(3)
    random.seed(4)
    torch.manual_seed(5)
    rng = nonstop.RNGState()
    sd = {"rng": rng.state_dict()}
    assert "numpy" in sd["rng"]
    meta, buf = pack(sd)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.load_state_dict(unpack(meta, buf)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_info_rides_along_and_only_plain_values_go_there():
    _, info, _, _ = roundtrip({"w": torch.ones(2)}, {"step": 9, "rank": 1, "sharded": False,
                                                     "gen": 2, "world": 4})
    assert info == {"step": 9, "rank": 1, "sharded": False, "gen": 2, "world": 4}
    with pytest.raises(UnsupportedState, match=r"info\['t'\] is a torch.Tensor"):
        pack({}, {"t": torch.ones(1)})


def test_the_skeleton_is_small_and_versioned():
    model, opt = trained()
    meta, buf = pack({"model": model.state_dict(), "optimizer": opt.state_dict()})
    doc = json.loads(meta)
    assert doc["format"] == packing.FORMAT and set(doc) == {"format", "tree", "specs", "info"}
    assert len(meta) < 4096 and buf.numel() > 0


# -- refused when packing ------------------------------------------------------------------------
class Custom:
    pass


@pytest.mark.parametrize("sd, path, what", [
    ({"x": {"y": Custom()}}, r"state\['x'\]\['y'\]", "Custom"),
    ({"x": [1, {2: {3}}]}, r"state\['x'\]\[1\]\[2\]", "set"),
    ({"opt": {"state": {0: {"fn": print}}}}, r"state\['opt'\]\['state'\]\[0\]\['fn'\]", "builtin"),
    ({"p": namedtuple("P", "a b")(1, 2)}, r"state\['p'\]", "P"),
    ({"k": {frozenset(): 1}}, r"state\['k'\]", "frozenset"),
    ({"t": torch.randn(3).to_sparse()}, r"state\['t'\]", "sparse"),
    ({"t": torch.empty(3, device="meta")}, r"state\['t'\]", "meta"),
    (lambda: {"q": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)},
     r"state\['q'\]", "qint8"),
    ({"s": np.array(["a", "b"])}, r"state\['s'\]", "<U1"),
    ({"o": np.array([object()])}, r"state\['o'\]", "object"),
    ({"be": np.arange(3, dtype=">i4")}, r"state\['be'\]", ">i4"),
    ({"m": OrderedDict(a=1), "d": type("D", (dict,), {})()}, None, None),
])
def test_a_value_json_cannot_carry_is_refused_with_its_path(sd, path, what):
    if callable(sd):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated
            sd = sd()
    if path is None:  # a dict subclass is carried as a dict; one with attributes is refused
        sd["d"].extra = 1
        path, what = r"state\['d'\]", "attributes"
    with pytest.raises(UnsupportedState, match=path) as err:
        pack(sd)
    assert what in str(err.value) and "without pickle" in str(err.value)
    with pytest.raises(UnsupportedState):
        layout(sd)  # a snapshot is refused before anything is copied


def test_attributes_other_than_plain_names_and_oversized_skeletons_are_refused(monkeypatch):
    od = OrderedDict(a=1)
    od.__dict__["__evil"] = 1
    with pytest.raises(UnsupportedState, match=r"state\['m'\] .*attribute named '__evil'"):
        pack({"m": od})
    monkeypatch.setattr(packing, "MAX_META", 200)
    with pytest.raises(UnsupportedState, match="more than 200"):
        pack({str(i): torch.ones(1) for i in range(20)})


# -- refused when unpacking ----------------------------------------------------------------------
SAMPLE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": {1: [2.5, None]},
          "b": torch.tensor([True])}


def refused(meta, buf, match=None):
    t0 = time.monotonic()
    with pytest.raises(BadMeta, match=match) as err:
        unpack(meta, buf)
    assert time.monotonic() - t0 < 2
    return str(err.value)


def with_tree(tree):
    doc, buf = meta_doc({"w": torch.ones(2)})
    doc["tree"] = tree
    return dumps(doc), buf


@pytest.mark.parametrize("tree, match", [
    ({"d": [["w", {"X": 0}]]}, "unknown tag 'X'"),
    ({"d": [["w", {"T": 0, "i": 1}]]}, "tags"),
    ({"d": [["w", {"T": 0}], ["x", {"T": 0}]]}, "referenced twice"),
    ({"d": [["w", {"T": 1}]]}, "tensor reference"),
    ({"d": [["w", {"T": -1}]]}, "tensor reference"),
    ({"d": [["w", {"T": "0"}]]}, "tensor reference"),
    ({"d": []}, "never used"),
    ({"d": [["w", {"T": 0}], ["i", {"i": "1"}]]}, "'i' node holds a str"),
    ({"d": [["w", {"T": 0}], ["f", {"f": "NaN!"}]]}, "'f' node"),
    ({"d": [["w", {"T": 0}], ["f", {"f": "BIG"}]]}, "'f' node"),  # 1e999: JSON's way to inf
    ({"d": [["w", {"T": 0}], ["f", {"b": 1}]]}, "'b' node"),
    ({"d": [["w", {"T": 0}], ["x", 5]]}, "not a tagged object"),
    ({"d": [["w", {"T": 0}], [{"l": []}, {"i": 1}]]}, "a key is"),
    ({"d": [["w", {"T": 0}], ["w", {"i": 1}]]}, "a key twice"),
    ({"d": [["w", {"T": 0}], ["x"]]}, "pair"),
    ({"d": {"w": {"T": 0}}}, "'d' node holds a dict"),
    ({"d": [["w", {"T": 0}], ["y", {"B": "!!not base64"}]]}, "base64"),
    ({"d": [["w", {"T": 0}], ["y", {"S": [-1]}]]}, "torch.Size"),
    ({"d": [["w", {"G": 0}]]}, "numpy scalar"),
    ({"o": [["w", {"T": 0}]], "a": [["__class__", {"s": "os.system"}]]}, "attribute"),
    ({"o": [["w", {"T": 0}]], "a": [["not an identifier", {"i": 1}]]}, "attribute"),
    ({"d": [["w", {"T": 0}], ["x", {"c": ["os", "system"]}]]}, "unknown tag"),
])
def test_a_malformed_tree_is_refused(tree, match):
    meta, buf = with_tree(tree)
    refused(meta.replace(b'"BIG"', b"1e999"), buf, match=match)


def test_nesting_too_deep_is_refused_not_a_crash():
    deep = {"T": 0}
    for _ in range(packing.MAX_DEPTH + 5):
        deep = {"l": [deep]}
    refused(*with_tree(deep), match="deeper")
    meta, buf = with_tree({"d": []})
    refused(b'{"format":"nonstop-state/2","tree":' + b'{"l":[' * 100_000, buf)
    with pytest.raises(UnsupportedState, match="deeper"):
        x = []
        x.append(x)  # a cycle
        pack({"x": x})


@pytest.mark.parametrize("spec, match", [
    (["float32; import os", [2], 0, 8], "unknown dtype"),
    (["torch.float32", [2], 0, 8], "unknown dtype"),
    (["qint8", [2], 0, 2], "unknown dtype"),
    (["__import__('os')", [2], 0, 8], "unknown dtype"),
    ([float, [2], 0, 8], None),
    (["float32", [2], 64, 8], "outside the buffer"),
    (["float32", [2], -16, 8], "outside the buffer"),
    (["float32", [2], 2**70, 8], "outside the buffer"),
    (["float32", [3], 0, 8], "is not 8 bytes"),
    (["float32", [2**40, 2**40], 0, 2**82], "dimension|too large"),
    (["float32", [2**62], 0, 2**64], "dimension"),
    (["float32", [0, 2**47, 2**47], 0, 0], "too large"),
    (["float32", [1] * 65, 0, 4], "shape"),
    (["float32", [2.0], 0, 8], "dimension"),
    (["float32", [True, 2], 0, 8], "dimension"),
    (["float32", "2", 0, 8], "shape"),
    (["float32", [2], 2, 8], "not aligned"),
    (["float32", [2], 0], "spec"),
    ({"dtype": "float32"}, "spec"),
])
def test_a_malformed_tensor_spec_is_refused_before_any_allocation(spec, match):
    doc, buf = meta_doc({"w": torch.ones(2)})
    assert buf.numel() == 16
    if isinstance(spec, list) and spec[0] is float:
        spec = [1.5, [2], 0, 8]
        match = "unknown dtype"
    doc["specs"] = [spec]
    refused(dumps(doc), buf, match)


def test_overlapping_tensors_are_refused():
    doc, buf = meta_doc({"a": torch.ones(4), "b": torch.ones(4)})
    doc["specs"][1][2] = 0  # b on top of a
    refused(dumps(doc), buf, "overlapping")


def test_an_unknown_or_missing_format_is_refused():
    doc, buf = meta_doc(SAMPLE)
    for fmt in ("nonstop-state/3", "nonstop-state/1", None, 2):
        doc["format"] = fmt
        msg = refused(dumps(doc), buf, "unknown state format")
        assert packing.FORMAT in msg
    doc["format"] = packing.FORMAT
    doc["extra"] = 1
    refused(dumps(doc), buf, "fields")
    del doc["extra"], doc["info"]
    refused(dumps(doc), buf, "fields")


@pytest.mark.parametrize("meta", [
    b"", b"[]", b"null", b"not json", b"{", b'{"format": NaN}', b'{"format": Infinity}',
    b"\xff\xfe{}", b'{"format":"nonstop-state/2","tree":{"i":' + b"9" * 5000 + b"}}",
])
def test_metadata_that_is_not_our_json_is_refused(meta):
    refused(meta, torch.zeros(0, dtype=torch.uint8))


def test_an_info_that_is_not_a_dict_or_holds_tensors_is_refused():
    doc, buf = meta_doc({"w": torch.ones(2)})
    doc["info"] = {"l": []}
    refused(dumps(doc), buf, "info")
    doc["info"] = {"d": [["t", {"T": 0}]]}
    refused(dumps(doc), buf, "tensor reference")


def test_too_much_metadata_is_refused_without_parsing(monkeypatch):
    doc, buf = meta_doc(SAMPLE)
    monkeypatch.setattr(packing, "MAX_META", 100)
    refused(dumps(doc), buf, "more than 100")


class Trap:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_metadata_is_refused_never_unpickled(tmp_path):
    marker = str(tmp_path / "unpickled")
    evil = pickle.dumps(({"w": Trap(marker)}, [], {}))  # the old form, with a payload
    msg = refused(evil, torch.zeros(16, dtype=torch.uint8), "never unpickled")
    assert "JSON" in msg and not os.path.exists(marker)
    pickle.loads(evil)  # the trap was live
    assert os.path.exists(marker)


def test_the_base64_and_string_decoders_do_not_execute_anything():
    payload = base64.b64encode(pickle.dumps(Trap("/nonexistent/x"))).decode()
    out, _, _, _ = roundtrip({"blob": base64.b64decode(payload), "code": "__import__('os')"})
    assert isinstance(out["blob"], bytes) and out["code"] == "__import__('os')"


# -- no pickle in the source ---------------------------------------------------------------------
_UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
               "joblib"}
_OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                       "scatter_object_list", "send_object_list", "recv_object_list"}


def _names(path):
    tree = ast.parse(path.read_text())
    imports, attrs, calls = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            attrs.add(node.id)
        if isinstance(node, ast.Import):
            imports |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imports.add((node.module or "").split(".")[0])
            imports |= {a.name for a in node.names}
        elif isinstance(node, ast.Attribute):
            attrs.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.add(node.func.id)
    return imports, attrs, calls


def test_packing_imports_no_pickle_and_evaluates_nothing():
    imports, attrs, calls = _names(STATE_DIR / "packing.py")
    assert not imports & (_UNPICKLERS | {"importlib", "pydoc", "pickletools"}), imports
    assert not attrs & {"Unpickler", "import_module", "locate"}, attrs
    assert not calls & {"eval", "exec", "__import__", "compile"}, calls
    assert "torch.load" not in (STATE_DIR / "packing.py").read_text()
    # dtypes are looked up in a fixed allowlist of names, every one a torch dtype
    assert set(packing._dtypes()) <= set(packing.DTYPE_NAMES)
    assert all(isinstance(d, torch.dtype) for d in packing._dtypes().values())


def test_restore_network_path_unpickles_nothing():
    source = (STATE_DIR / "restore.py").read_text()
    imports, attrs, _ = _names(STATE_DIR / "restore.py")
    assert not any("pickle" in n for n in imports | attrs) and not imports & _UNPICKLERS
    assert not attrs & _OBJECT_COLLECTIVES, attrs & _OBJECT_COLLECTIVES  # they pickle inside
    assert "torch.load" not in source
    keeper = STATE_DIR.parent / "keeper"
    for path in (keeper / "server.py", keeper / "replicas.py", *(STATE_DIR / name for name in (
            "memory.py", "snapshot.py", "shm.py", "wire.py"))):
        imports, attrs, _ = _names(path)
        assert not imports & _UNPICKLERS and not attrs & _OBJECT_COLLECTIVES, path.name


_PEERS = textwrap.dedent("""
    import os, pickle, sys
    import torch, torch.distributed as dist
    from nonstop.state import packing, restore
    from nonstop.state.plan import Action

    rank, init, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
    got = restore._all_gather_json({"rank": rank, "steps": [1, 2.5, None], "k": {"1": True}}, 2)
    assert got == [{"rank": r, "steps": [1, 2.5, None], "k": {"1": True}} for r in range(2)], got
    # one rank's text longer than the one-collective buffer: gathered whole, by a second one
    big = "x" * (restore.GATHER_BYTES + 10 * rank + 1)
    assert restore._all_gather_json({"r": rank, "s": big if rank else "y"}, 2) == [
        {"r": 0, "s": "y"}, {"r": 1, "s": "x" * (restore.GATHER_BYTES + 11)}]
    sd = {"w": torch.arange(5.0), "opt": {"state": {0: {"step": torch.tensor(3.0)}},
                                         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}

    class Trap:
        def __reduce__(self):
            return (os.mkdir, (marker,))

    class State:
        loaded = None
        def load_state_dict(self, sd):
            self.loaded = sd

    if rank == 0:
        meta, buf = packing.pack(sd)
        restore._send_parts(1, restore._header(True, len(meta), buf.numel()), meta, buf)
        evil = pickle.dumps({"w": Trap()})
        restore._send_parts(1, restore._header(True, len(evil), buf.numel()), evil, buf)
        doc = __import__("json").loads(meta)
        doc["specs"][0][0] = "os.system"
        bad = __import__("json").dumps(doc).encode()
        restore._send_parts(1, restore._header(True, len(bad), buf.numel()), bad, buf)
        dist.send(restore._header(True, packing.MAX_META + 1, 0), 1)
    else:
        a, state = Action(rank=1, source="live", holder=0), State()
        restore._receive(a, state, restore.Where())
        assert torch.equal(state.loaded["w"], sd["w"])
        assert state.loaded["opt"]["state"][0]["step"] == 3
        assert state.loaded["opt"]["param_groups"][0]["betas"] == (0.9, 0.99)
        for why in ("never unpickled", "unknown dtype", "announced"):
            try:
                restore._receive(a, State(), restore.Where())
            except restore._Bad as exc:
                assert why in str(exc), exc
            else:
                raise AssertionError("accepted: " + why)
        assert not os.path.exists(marker)
        print("peer ok")
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.integration
def test_state_between_ranks_is_json_and_bytes_and_bad_copies_are_refused(tmp_path):
    script = tmp_path / "peers.py"
    script.write_text(_PEERS)
    marker = str(tmp_path / "unpickled")
    env = {**os.environ, "PYTHONPATH": str(STATE_DIR.parent.parent)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init"), marker],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "peer ok" in outs[1] and not os.path.exists(marker)
