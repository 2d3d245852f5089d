"""A canary per private torch name nonstop uses (``nonstop/torch_internals.py``): each resolves
in the installed torch, with every attribute nonstop reads or writes on it - in every suite, so
a torch release that moves one fails here, not in a job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nonstop import torch_internals as ti

@pytest.mark.parametrize("name", sorted(ti.NAMES))
def test_every_private_torch_name_resolves(name):
    assert ti.get(name) is not None


def _instances() -> dict[str, object]:
    """A real instance of each declared class whose instances nonstop reaches into."""
    import torch
    from torch.distributed.tensor import Replicate

    flat, layout = ti.get("mesh.FlatLayout"), ti.get("mesh.MeshLayout")
    mesh = ti.get("mesh.DeviceMesh")("cpu", _layout=layout([flat(2, 1)]),
                                    _rank_map=torch.tensor([0, 1], dtype=torch.int),
                                    mesh_dim_names=("dp",), _init_backend=False, _rank=0)
    mesh._dim_group_names = ["nonstop:dp"]  # (set by nonstop, as a spare's mesh has it)
    spec = ti.get("dtensor.DTensorSpec")(mesh, (Replicate(),))
    return {"mesh.DeviceMesh": mesh, "ops.OpOverload": torch.ops.aten.add.Tensor,
            "dtensor.DTensorSpec": spec}


def test_every_attribute_nonstop_uses_on_an_instance_is_there():
    made = _instances()
    for name, spec in ti.NAMES.items():
        if spec.on_instances:
            assert name in made, f"no instance of {name} made to look at"
            gone = [a for a in spec.on_instances if not hasattr(made[name], a)]
            assert gone == [], f"torch's {name} instances lack {gone}"
    mesh = made["mesh.DeviceMesh"]
    assert list(mesh._compute_coordinate_on_dim()) == [0]  # (what a spare's adopt() calls)


def test_a_name_torch_does_not_have_is_said_loudly_with_what_needed_it():
    gone = ti.Internal("torch.distributed.distributed_c10d", "_no_such_registry",
                       "the process-group registry")
    with pytest.raises(ti.TorchInternalsChanged) as e:
        ti.resolve(gone)
    text = str(e.value)
    assert "torch.distributed.distributed_c10d._no_such_registry" in text
    assert "the process-group registry" in text and "tested on torch 2.13" in text
    lacking = ti.Internal("torch.distributed.distributed_c10d", "_world", "the registry",
                          ("pg_map", "no_such_map"))
    with pytest.raises(ti.TorchInternalsChanged, match="it has no no_such_map"):
        ti.resolve(lacking)
    no_keyword = ti.Internal("torch.distributed.device_mesh", "DeviceMesh", "a spare's mesh",
                             keywords=("_layout", "_no_such_keyword"))
    with pytest.raises(ti.TorchInternalsChanged, match="it has no keyword _no_such_keyword"):
        ti.resolve(no_keyword)
    with pytest.raises(ti.TorchInternalsChanged, match="ModuleNotFoundError"):
        ti.resolve(ti.Internal("torch.no_such_module", "x", "nothing"))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _is_private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])


def private_names(tree: ast.AST) -> set[str]:
    """The private torch names a module's code uses: imported from a private module, or an
    attribute that starts with an underscore reached from ``torch`` (or its ``c10d``, ``dist``).
    A module's name in a string (the zygote's list of what to import ahead) is not a use."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found |= {n for n in (f"{node.module}.{a.name}" for a in node.names) if _is_private(n)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names
                      if a.name.startswith("torch.") and _is_private(a.name)}
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.split(".")[0] in ("torch", "c10d", "dist") and _is_private(name):
                found.add(name)
    return found


def test_the_code_reaches_torchs_private_names_only_through_the_door():
    src = Path(ti.__file__).parent
    found = {}
    for p in sorted(src.rglob("*.py")):
        rel = str(p.relative_to(src))
        if p.name == "torch_internals.py":
            continue
        hits = private_names(ast.parse(p.read_text()))
        if hits:
            found[rel] = sorted(hits)
    assert found == {}


def test_the_door_check_finds_a_private_name_however_it_is_reached():
    code = "\n".join([
        "from torch.distributed import distributed_c10d as c10d",
        "from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter",
        "import torch.distributed as dist",
        "x = c10d._world",
        "y = dist.distributed_c10d._get_default_group()",
        "z = torch._foreach_norm",
        "w = torch.nn.Linear",
        "v = 'torch._dynamo'",
        "u = torch.__version__",
        "from torchft._torchft import lighthouse_main",
    ])
    assert private_names(ast.parse(code)) == {
        "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter", "c10d._world",
        "dist.distributed_c10d._get_default_group", "torch._foreach_norm"}


def test_every_name_the_code_asks_the_door_for_is_declared():
    """A call ``torch_private("...")`` names an entry of the door's table (a typo would be a
    KeyError in a job, at the first use)."""
    src = Path(ti.__file__).parent
    asked = set()
    for p in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "torch_private" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                asked.add(node.args[0].value)
    assert asked and asked <= set(ti.NAMES), asked - set(ti.NAMES)
    assert set(ti.NAMES) <= asked  # and nothing is declared that nothing uses


def test_a_torch_release_nonstop_is_not_tested_on_is_named_in_a_warning():
    assert ti.untested("2.13.0+cpu") is None and ti.untested("2.13.1") is None
    text = ti.untested("2.15.0")
    assert text is not None and "torch 2.15.0 is not a release nonstop is tested on (2.13)" in text
    import tomllib

    pyproject = tomllib.loads((Path(ti.__file__).parents[2] / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert pin == f"torch>={ti.TESTED[0]},<2.{int(ti.TESTED[-1].split('.')[1]) + 1}"
