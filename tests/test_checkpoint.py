"""Disk checkpoints in DCP format: bitwise round trips, plain-DCP compatibility, atomicity,
verification, retention."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nonstop.state import checkpoint as ck


def make_model_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    model(torch.randn(8, 6)).square().sum().backward()
    opt.step()
    return model, opt


def rich_state(seed: int = 0) -> dict:
    model, opt = make_model_opt(seed)
    g = torch.Generator().manual_seed(seed)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": {"epoch": 3, "name": "run", "ratio": 0.25, "flag": True, "none": None,
                  "ints": [1, 2, 3], "pair": (1, "a"), "empty": {}, "empty_list": [],
                  7: "int key", "nested": {"deeper": {1: torch.arange(3)}}},
        "step_tensor": torch.tensor(40),
        "dtypes": {"bool": torch.tensor([True, False, True]),
                   "f16": torch.randn(5, generator=g).half(),
                   "bf16": torch.randn(2, 3, generator=g).bfloat16(),
                   "scalar": torch.tensor(1.5, dtype=torch.float64),
                   "empty": torch.empty(0, 4), "i8": torch.tensor([-128, 127], dtype=torch.int8)},
        "mixed": [torch.ones(2), 5, {"k": torch.zeros(1)}, "s"],
    }


def assert_same(a, b, path: str = "") -> None:
    """Same types, keys (with their types), `_metadata`, and tensors bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def save_step(root: Path, step: int, states: dict[int, dict], sharded: bool = False,
              **extra) -> dict[int, dict]:
    tmp = ck.temp_dir(root, step)
    parts = {r: ck.write_part(sd, tmp, r, {"rank": r, "step": step}) for r, sd in states.items()}
    ck.finalize(root, step, parts, world=max(states) + 1, sharded=sharded, extra=extra or None)
    return parts


@pytest.fixture
def saved(tmp_path):
    """A complete step 40 with one replicated part (rank 0) of a rich state."""
    root = tmp_path / "ckpt"
    state = rich_state()
    save_step(root, 40, {0: state})
    return root, state


def part_dir(root: Path, step: int = 40, rank: int = 0) -> Path:
    return root / ck.step_dir_name(step) / f"rank-{rank}"


def test_names_and_temp_dir_private_and_idempotent(tmp_path):
    assert ck.step_dir_name(40) == "step-0000000040"
    root = tmp_path / "a" / "b"
    t = ck.temp_dir(root, 60)
    assert t == root / ".tmp-step-0000000060" and t.is_dir()
    assert ck.temp_dir(root, 60) == t
    for d in (tmp_path / "a", root, t):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_round_trip_bitwise_with_key_types_and_metadata(saved):
    root, state = saved
    got, info = ck.read_part(root, 40, 0)
    assert info == {"rank": 0, "step": 40}
    assert_same(state, got)
    assert isinstance(got["model"], OrderedDict) and got["model"]._metadata
    assert set(got["optimizer"]["state"]) == {0, 1, 2, 3}
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    model, opt = make_model_opt(seed=5)  # same shapes, other values
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(got["optimizer"])
    assert_same(fresh.state_dict(), state["optimizer"])
    model.load_state_dict(got["model"])
    assert_same(model.state_dict(), state["model"])


def test_views_into_one_shared_buffer(tmp_path):
    buf = bytearray(1 << 20)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    base.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(1)))
    state = {"w": base[4096:4096 + 4 * 600].view(torch.float32).view(20, 30),
             "h": base[65536:65536 + 2 * 50].view(torch.bfloat16),
             "t": base[131072:131072 + 4 * 64].view(torch.int32).view(8, 8).t(),  # strided
             "b": base[200000:200016]}
    root = tmp_path / "ckpt"
    parts = save_step(root, 1, {0: state})
    got, _ = ck.read_part(root, 1, 0)
    assert_same(state, got)
    # Only each view's own bytes are written, never the whole buffer per tensor.
    assert parts[0]["bytes"] < 64 * 1024


def test_plain_dcp_load_into_model_and_optimizer(saved):
    root, state = saved
    model, opt = make_model_opt(seed=9)
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=part_dir(root), no_dist=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    assert_same(model.state_dict(), state["model"])
    assert_same(opt.state_dict(), state["optimizer"])


def test_dcp_to_torch_save(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, state = saved
    out = tmp_path / "out.pt"
    dcp_to_torch_save(part_dir(root), out)
    loaded = torch.load(out, weights_only=False)
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    # Plain DCP gives optimizer state keys back as strings: the reason for the skeleton.
    assert torch.equal(loaded["optimizer"]["state"]["0"]["exp_avg"],
                       state["optimizer"]["state"][0]["exp_avg"])


def test_unfinished_step_is_never_listed(tmp_path):
    root = tmp_path / "ckpt"
    assert ck.complete_steps(root) == []
    save_step(root, 20, {0: {"x": torch.ones(3)}})
    tmp = ck.temp_dir(root, 40)
    ck.write_part({"x": torch.zeros(3)}, tmp, 0, {})  # crash before finalize
    (tmp / "rank-1.partial-dead").mkdir()  # crash inside write_part
    assert ck.complete_steps(root) == [20]
    assert sorted(p.name for p in tmp.iterdir()) == ["rank-0", "rank-1.partial-dead"]


def test_finalize_manifest_and_listing(tmp_path):
    root = tmp_path / "ckpt"
    parts = save_step(root, 20, {0: {"x": torch.ones(3)}, 1: {"x": torch.zeros(3)}},
                      sharded=True, note="hi")
    save_step(root, 40, {0: {"x": torch.ones(3)}})
    assert ck.complete_steps(root) == [40, 20]
    assert not ck.temp_dir(root, 20).joinpath("rank-0").exists()  # the temp dir became the step
    m = ck.read_manifest(root, 20)
    assert (m["format"], m["step"], m["world"], m["sharded"], m["note"]) == \
        (ck.FORMAT, 20, 2, True, "hi")
    assert m["torch"] == torch.__version__ and abs(m["created"] - __import__("time").time()) < 60
    assert m["parts"]["1"] == parts[1]
    assert set(parts[1]["files"]) == {".metadata", "__0_0.distcp"}
    assert parts[1]["bytes"] == sum(f["bytes"] for f in parts[1]["files"].values())
    assert stat.S_IMODE(part_dir(root, 20, 1).stat().st_mode) == 0o700
    assert stat.S_IMODE((root / ck.step_dir_name(20)).stat().st_mode) == 0o700
    got, info = ck.read_part(root, 20, 1)
    assert torch.equal(got["x"], torch.zeros(3)) and info == {"rank": 1, "step": 20}
    with pytest.raises(FileExistsError):
        save_step(root, 40, {0: {"x": torch.ones(3)}})
    with pytest.raises(ck.CorruptCheckpoint, match="part 0: rank-0"):
        ck.finalize(root, 60, {0: parts[0]}, world=1, sharded=False)  # part not in its temp dir
    assert ck.complete_steps(root) == [40, 20]


def test_finalize_sweeps_debris_of_crashed_attempts(tmp_path):
    root = tmp_path / "ckpt"
    tmp = ck.temp_dir(root, 5)
    (tmp / "rank-0.partial-0123").mkdir()
    part = ck.write_part({"x": torch.ones(2)}, tmp, 0, {})
    final = ck.finalize(root, 5, {0: part}, world=1, sharded=False)
    assert sorted(p.name for p in final.iterdir()) == [ck.MANIFEST, "rank-0"]


def test_part_rank_for():
    sharded = {"sharded": True, "parts": {"0": {}, "1": {}}}
    replicated = {"sharded": False, "parts": {"2": {}, "5": {}}}
    assert ck.part_rank_for(sharded, 1) == 1
    assert ck.part_rank_for(sharded, 2) is None
    assert ck.part_rank_for(replicated, 5) == 5
    assert ck.part_rank_for(replicated, 0) == 2
    assert ck.part_rank_for({"sharded": False, "parts": {}}, 0) is None


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_any_flipped_bit_is_caught(saved, name):
    root, _ = saved
    path = part_dir(root) / name
    original = path.read_bytes()
    for offset in (0, len(original) // 3, len(original) // 2, len(original) - 1):
        flip_bit(path, offset)
        with pytest.raises(ck.CorruptCheckpoint, match=rf"step 40 part 0: rank-0/{name}: checksum"):
            ck.verify_part(root, 40, 0)
        with pytest.raises(ck.CorruptCheckpoint):
            ck.read_part(root, 40, 0)
        path.write_bytes(original)
    ck.verify_part(root, 40, 0)


def test_truncated_and_missing_files(saved):
    root, _ = saved
    data = part_dir(root) / "__0_0.distcp"
    original = data.read_bytes()
    data.write_bytes(original[:-100])
    with pytest.raises(ck.CorruptCheckpoint, match=r"rank-0/__0_0.distcp: size \d+ bytes"):
        ck.verify_part(root, 40, 0)
    with pytest.raises(ck.CorruptCheckpoint, match="unreadable"):
        ck.read_part(root, 40, 0, verify=False)  # DCP itself fails: still CorruptCheckpoint
    data.write_bytes(original)
    (part_dir(root) / ".metadata").unlink()
    with pytest.raises(ck.CorruptCheckpoint, match=r"step 40 part 0: rank-0/.metadata: missing"):
        ck.read_part(root, 40, 0)
    with pytest.raises(ck.CorruptCheckpoint, match="unreadable"):
        ck.read_part(root, 40, 0, verify=False)


def test_garbage_metadata_without_verification(saved):
    root, _ = saved
    (part_dir(root) / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ck.CorruptCheckpoint, match="step 40 part 0: rank-0: unreadable"):
        ck.read_part(root, 40, 0, verify=False)


def test_missing_or_garbled_manifest(saved):
    root, _ = saved
    manifest = root / ck.step_dir_name(40) / ck.MANIFEST
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(ck.CorruptCheckpoint, match="step 40: manifest.json: unreadable"):
        ck.read_part(root, 40, 0)
    assert ck.complete_steps(root) == []
    manifest.write_text(json.dumps({**json.loads(text), "format": "other/9"}))
    with pytest.raises(ck.CorruptCheckpoint, match="not a nonstop-checkpoint/1 manifest"):
        ck.read_manifest(root, 40)
    manifest.unlink()
    with pytest.raises(ck.CorruptCheckpoint, match="step 40: manifest.json: missing"):
        ck.verify_part(root, 40, 0)
    assert ck.complete_steps(root) == []
    with pytest.raises(ck.CorruptCheckpoint, match="step 41: manifest.json: missing"):
        ck.read_part(root, 41, 0)


def test_part_not_in_manifest(saved):
    root, _ = saved
    with pytest.raises(ck.CorruptCheckpoint, match="step 40 part 3: manifest.json: no such part"):
        ck.read_part(root, 40, 3)


def test_retain_keeps_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    for step in (10, 20, 30, 40, 50):
        save_step(root, step, {0: {"x": torch.full((2,), float(step))}})
    tmp = ck.temp_dir(root, 60)
    assert ck.retain(root, 2) == [30, 20, 10]
    assert ck.complete_steps(root) == [50, 40]
    assert tmp.is_dir()
    assert sorted(os.listdir(root)) == [".tmp-step-0000000060", "step-0000000040",
                                        "step-0000000050"]
    assert torch.equal(ck.read_part(root, 40, 0)[0]["x"], torch.full((2,), 40.0))
    assert ck.retain(root, 5) == []
    assert ck.retain(root, 0) == [50, 40] and ck.complete_steps(root) == []
    with pytest.raises(ValueError):
        ck.retain(root, -1)


def test_clean_temp(tmp_path):
    root = tmp_path / "ckpt"
    assert ck.clean_temp(root) == []
    temps = {s: ck.temp_dir(root, s) for s in (10, 20, 30)}
    ck.write_part({"x": torch.ones(1)}, temps[20], 0, {})
    save_step(root, 25, {0: {"x": torch.ones(1)}})
    assert ck.clean_temp(root, below_step=30) == [temps[10], temps[20]]
    assert temps[30].is_dir() and not temps[20].exists()
    assert ck.complete_steps(root) == [25]
    assert ck.clean_temp(root) == [temps[30]]
    assert sorted(os.listdir(root)) == ["step-0000000025"]


def test_write_part_replaces_a_stale_part(tmp_path):
    root = tmp_path / "ckpt"
    tmp = ck.temp_dir(root, 7)
    ck.write_part({"x": torch.zeros(1000), "old_only": 1}, tmp, 0, {"attempt": 1})
    part = ck.write_part({"x": torch.ones(3)}, tmp, 0, {"attempt": 2})
    assert sorted(p.name for p in tmp.iterdir()) == ["rank-0"]
    ck.finalize(root, 7, {0: part}, world=1, sharded=False)
    got, info = ck.read_part(root, 7, 0)
    assert info == {"attempt": 2}
    assert list(got) == ["x"] and torch.equal(got["x"], torch.ones(3))


def test_write_part_failure_leaves_nothing(tmp_path):
    tmp = ck.temp_dir(tmp_path / "ckpt", 3)
    with pytest.raises(ValueError, match="share the DCP name 'a.b'"):
        ck.write_part({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp, 0, {})
    with pytest.raises(ValueError, match="reserved"):
        ck.write_part({"nonstop": 1}, tmp, 0, {})
    assert list(tmp.iterdir()) == []


def test_drop_page_cache_keeps_data_readable(saved):
    root, state = saved
    ck.drop_page_cache(root)
    ck.drop_page_cache(part_dir(root) / "__0_0.distcp")
    ck.drop_page_cache(root / "missing")  # best effort: no error
    assert_same(ck.read_part(root, 40, 0)[0], state)


@pytest.mark.integration
def test_import_does_not_import_torch():
    code = "import nonstop.state.checkpoint, sys; assert 'torch' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_part_record_is_what_the_keepers_reader_takes_sharded_or_not(tmp_path):
    """The writer's part record crosses a process (keeper -> controller): it must read back as
    a PartWritten whether the state holds shards or not."""
    from nonstop.protocol import keeper_messages as km
    from nonstop.state import shards

    tmp = ck.temp_dir(tmp_path, 8)
    plain = km.read(km.PartWritten, ck.write_part({"x": torch.ones(2)}, tmp, 0, {}))
    assert plain.dtensors is None
    sharded = {"model": {"w": torch.ones(2, 3)}, shards.KEY: {"model": [[["w"], [4, 3], [2, 0]]]}}
    part = km.read(km.PartWritten, ck.write_part(sharded, tmp, 1, {}))
    assert part.dtensors == {"model.w": [[4, 3], [2, 0]]}
