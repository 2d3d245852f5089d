"""Checkpoints on disk: one plain torch.distributed.checkpoint (DCP) directory per rank's part,
a step made complete by an atomic rename, every file checksummed at write and verified at read."""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import os
import pickle
import re
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator

import xxhash

from ..errors import exception_line
from ..torch_internals import get as torch_private

FORMAT = "nonstop-checkpoint/1"
MANIFEST = "manifest.json"

# The extra top-level DCP entry holding what DCP cannot keep: the original structure (key types,
# OrderedDict `_metadata`, empty containers) and the part's info. A bytes value, because DCP would
# flatten a dict into one entry per key.
_ENTRY = "nonstop"
_STEP_RE = re.compile(r"^step-(\d{10})$")
_TEMP_RE = re.compile(r"^\.tmp-step-(\d+)")
_CHUNK = 8 << 20
_RESERVED = ("format", "step", "world", "sharded", "created", "torch", "parts", "dcp")
DCP_METADATA = ".metadata"  # DCP's own name: a sharded step's directory is one DCP checkpoint


class CorruptCheckpoint(Exception):
    """A checkpoint part failed verification (checksum, size, missing file, unreadable)."""


def step_dir_name(step: int) -> str:
    """The directory name of a complete step: ``step-0000000040``."""
    return f"step-{step:010d}"


def temp_dir(root: Path, step: int) -> Path:
    """``root / ".tmp-step-<step>"``, where a step is written before it is complete; created
    (0700, with any missing parents) if missing. Several processes may call it for one step."""
    path = Path(root) / f".tmp-{step_dir_name(step)}"
    _mkdirs(path)
    return path


def warm() -> None:
    """Load what writing a part needs (torch and DCP: seconds), so that the first write does not
    wait for it."""
    from torch.distributed.checkpoint import FileSystemWriter, save  # noqa: F401


def warm_in_background() -> None:
    """``warm`` on a thread of its own (errors are said again where the import is needed)."""
    import threading

    def run() -> None:
        try:
            warm()
        except Exception:  # noqa: BLE001
            pass

    threading.Thread(target=run, name="nonstop-import-dcp", daemon=True).start()


def write_part(state_dict: Mapping[str, Any], tmp: Path, rank: int, info: dict) -> dict:
    """Write one rank's state dict as a plain DCP checkpoint into ``tmp / "rank-<rank>"``.

    Written under a private name, fsynced and checksummed, then renamed into place: ``rank-<rank>``
    is only ever seen complete. One left by an earlier attempt is replaced.

    Args:
        state_dict: Nested dicts, lists, tensors (views into a larger buffer too) and plain values;
            the top-level key ``"nonstop"`` is reserved.
        tmp: The step's temporary directory (from ``temp_dir``).
        rank: The rank this part belongs to.
        info: JSON-serializable facts about the part, given back by ``read_part``.

    Returns:
        The part record: ``{"dir", "files": {name: {"bytes", "xxh3"}}, "bytes", "seconds", "info"}``,
        and for sharded state (DTensors kept as local shards: ``shards.KEY``) ``"dtensors"``:
        each shard's DCP name -> [the whole tensor's shape, the shard's offset].

    Raises:
        ValueError: Two leaves would get the same DCP name, or the reserved key is used.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    t0 = time.monotonic()
    if any(str(k) == _ENTRY for k in state_dict):
        raise ValueError(f"the top-level key {_ENTRY!r} is reserved for nonstop's own entry")
    blob = pickle.dumps({"format": FORMAT, "info": info, "skeleton": _skeleton(state_dict)},
                        protocol=pickle.HIGHEST_PROTOCOL)
    tmp = Path(tmp)
    name = f"rank-{rank}"
    staging = tmp / f"{name}.partial-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)  # DCP's own mkdir(exist_ok=True) then leaves the mode alone
    try:
        with warnings.catch_warnings():
            _quiet()
            save({**state_dict, _ENTRY: blob},
                 storage_writer=FileSystemWriter(staging, sync_files=True), no_dist=True)
        files = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            size, digest = _hash_file(path, sync=True)
            files[path.relative_to(staging).as_posix()] = {"bytes": size, "xxh3": digest}
        _fsync_dir(staging)
        _replace_dir(staging, tmp / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record = {"dir": name, "files": files, "bytes": sum(f["bytes"] for f in files.values()),
              "seconds": round(time.monotonic() - t0, 6), "info": info}
    from . import shards

    dtensors = shards.layout(state_dict)
    record["dtensors"] = {fqn: [shape, offset] for fqn, (shape, offset) in dtensors.items()} \
        if dtensors else None
    return record


def _dcp_metadata(tmp: Path, parts: dict[int, dict]) -> dict | None:
    """For parts holding DTensor shards: one DCP metadata file in the step's directory that
    describes every shard as a chunk of its whole tensor, each read from its part's own file.
    The step's directory is then a plain DCP checkpoint: ``dcp.load`` into a freshly built
    sharded model (any mesh: DCP reshards) reads it without nonstop. Returns its file record."""
    if not any(part.get("dtensors") for part in parts.values()):
        return None  # (torch is not even loaded: a launcher finishes plain jobs' manifests)
    import dataclasses

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorStorageMetadata)
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    version = None
    for rank in sorted(parts):
        part = parts[rank]
        layout = part.get("dtensors") or {}
        meta = FileSystemReader(tmp / part["dir"]).read_metadata()
        version = meta.version
        for fqn, planned in (meta.planner_data or {}).items():
            planner.setdefault(fqn, planned)
        for fqn, md in meta.state_dict_metadata.items():
            if fqn in layout:
                shape, offset = layout[fqn]
                whole = tensors.setdefault(fqn, TensorStorageMetadata(
                    md.properties, torch.Size(shape), []))
                whole.chunks.append(ChunkStorageMetadata(torch.Size(offset), md.size))
            else:  # replicated (a step counter, a hyperparameter): any part's, the first
                tensors.setdefault(fqn, md)
        for index, info in meta.storage_data.items():
            moved = dataclasses.replace(info, relative_path=f"{part['dir']}/{info.relative_path}")
            if index.fqn in layout:
                storage[MetadataIndex(index.fqn, torch.Size(layout[index.fqn][1]))] = moved
            elif not any(k.fqn == index.fqn for k in storage):
                storage[index] = moved
    merged = Metadata(state_dict_metadata=tensors, planner_data=planner, storage_data=storage)
    if version is not None:
        merged.version = version
    path = tmp / DCP_METADATA
    with open(path, "wb") as fh:
        pickle.dump(merged, fh, protocol=pickle.HIGHEST_PROTOCOL)
    size, digest = _hash_file(path, sync=True)
    return {"bytes": size, "xxh3": digest}


def finalize(root: Path, step: int, parts: dict[int, dict], *, world: int, sharded: bool,
             extra: dict | None = None) -> Path:
    """Make step ``step`` complete: write its manifest, then rename its temp dir into place.

    Args:
        root: The checkpoint root.
        step: The step; its temp dir must hold every part in ``parts``.
        parts: Part records from ``write_part``, by rank.
        world: The world size that wrote the step.
        sharded: Each rank's state is its own shard (else: replicated).
        extra: More JSON-serializable manifest fields (not the reserved ones).

    Returns:
        The complete step's directory.

    Raises:
        FileExistsError: The step is already complete.
        CorruptCheckpoint: A file of a part is missing or has the wrong size.
        ValueError: No parts, or ``extra`` overrides a reserved field.
    """
    root = Path(root)
    tmp = root / f".tmp-{step_dir_name(step)}"
    final = root / step_dir_name(step)
    if final.exists():
        raise FileExistsError(f"step {step} is already complete: {final}")
    if not parts:
        raise ValueError(f"step {step}: no parts to finalize")
    if set(extra or {}) & set(_RESERVED):
        raise ValueError(f"extra manifest fields may not be any of {_RESERVED}")
    for rank, part in parts.items():
        _check(tmp, step, rank, part, checksums=False)
    keep = {part["dir"] for part in parts.values()}
    for entry in tmp.iterdir():  # debris of crashed attempts: never read, only taking space
        if entry.name not in keep and (".partial-" in entry.name or ".old-" in entry.name):
            _remove(entry)
    manifest = {"format": FORMAT, "step": step, "world": world, "sharded": sharded,
                "created": time.time(), "torch": _torch_version(),
                "parts": {str(r): parts[r] for r in sorted(parts)}, **(extra or {})}
    dcp = _dcp_metadata(tmp, parts) if sharded else None
    if dcp is not None:
        manifest["dcp"] = dcp
    try:
        with open(tmp / MANIFEST, "wb") as fh:
            fh.write(json.dumps(manifest, indent=1).encode())
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
    except BaseException:
        # A half-written manifest must not wait there for a retry to rename it into place.
        with contextlib.suppress(OSError):
            (tmp / MANIFEST).unlink(missing_ok=True)
        raise
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(f"step {step} is already complete: {final}") from e
        raise
    _fsync_dir(root)
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps with a readable manifest of this format, newest first; ``[]`` if root is missing."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for m in filter(None, map(_STEP_RE.match, names)):
        with contextlib.suppress(CorruptCheckpoint):
            read_manifest(Path(root), int(m[1]))
            steps.append(int(m[1]))
    return sorted(steps, reverse=True)


def sharded_steps(root: Path | None) -> Iterator[tuple[int, int, dict]]:
    """(step, world size, manifest) of the complete checkpoints of sharded state under ``root``
    (a ZeRO-1 optimizer's, a mesh job's), newest first; unreadable manifests are passed over."""
    if root is None:
        return
    for step in complete_steps(root):
        try:
            manifest = read_manifest(root, step)
        except CorruptCheckpoint:
            continue
        if manifest.get("sharded") and isinstance(manifest.get("world"), int):
            yield step, manifest["world"], manifest


def read_manifest(root: Path, step: int) -> dict:
    """The manifest of a complete step.

    Raises:
        CorruptCheckpoint: It is missing, unreadable, or not of this format and step.
    """
    path = Path(root) / step_dir_name(step) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"step {step}: {MANIFEST}: missing") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"step {step}: {MANIFEST}: unreadable ({exception_line(e)})") from e
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or manifest.get("step") != step or not isinstance(manifest.get("parts"), dict)):
        raise CorruptCheckpoint(f"step {step}: {MANIFEST}: not a {FORMAT} manifest of this step")
    return manifest


def part_rank_for(manifest: dict, rank: int) -> int | None:
    """Which part a rank restores from (None: there is none for it): its own for sharded state;
    for replicated state its own if present, else the lowest."""
    ranks = sorted(int(r) for r in manifest.get("parts", {}))
    if rank in ranks:
        return rank
    if manifest.get("sharded") or not ranks:
        return None
    return ranks[0]


def verify_part(root: Path, step: int, part_rank: int) -> None:
    """Check every file of a part against the sizes and checksums in the step's manifest.

    Raises:
        CorruptCheckpoint: One line naming the step, the part, the file and what is wrong.
    """
    part = _part(read_manifest(root, step), step, part_rank)
    _check(Path(root) / step_dir_name(step), step, part_rank, part)


def read_part(root: Path, step: int, part_rank: int,
              verify: bool = True) -> tuple[dict[str, Any], dict]:
    """Load a part back as it was written.

    Args:
        root: The checkpoint root.
        step: A complete step.
        part_rank: The part to read (see ``part_rank_for``).
        verify: Check sizes and checksums first.

    Returns:
        ``(state_dict, info)``: the original nesting, container and key types, tensors bit for bit
        (contiguous, on the CPU); ``info`` as given to ``write_part``.

    Raises:
        CorruptCheckpoint: Anything fails, verification or reading: never garbage.
    """
    root = Path(root)
    part = _part(read_manifest(root, step), step, part_rank)
    if verify:
        _check(root / step_dir_name(step), step, part_rank, part)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        flat = read_entries(root / step_dir_name(step) / part["dir"])
        ours = pickle.loads(flat.pop(_ENTRY))
        if ours.get("format") != FORMAT:
            raise ValueError(f"format {ours.get('format')!r}")
        return rebuild(ours["skeleton"], flat), ours["info"]
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CorruptCheckpoint(
            f"step {step} part {part_rank}: {part['dir']}: unreadable ({exception_line(e)})") from e


def retain(root: Path, keep: int) -> list[int]:
    """Delete complete steps beyond the newest ``keep`` and return them; temp dirs are left to
    ``clean_temp``."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, not {keep}")
    root = Path(root)
    removed = []
    for step in complete_steps(root)[keep:]:
        # Out of the listing first, under a temp name: a crash during the deletion leaves debris
        # for clean_temp, never a step that looks complete with files missing.
        doomed = root / f".tmp-{step_dir_name(step)}.deleted-{secrets.token_hex(6)}"
        try:
            os.rename(root / step_dir_name(step), doomed)
        except FileNotFoundError:  # someone else removed it
            continue
        _fsync_dir(root)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(step)
    return removed


def clean_temp(root: Path, below_step: int | None = None, step: int | None = None) -> list[Path]:
    """Remove temp dirs (``.tmp-step-*``) and return their paths: all of them (only when no step
    is being written), those for steps below ``below_step`` (a newer step completed: they will
    never finish), or those of ``step`` (given up)."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    removed = []
    for name in names:
        m = _TEMP_RE.match(name)
        if m and (below_step is None or int(m[1]) < below_step) and step in (None, int(m[1])):
            _remove(Path(root) / name)
            removed.append(Path(root) / name)
    return removed


def drop_page_cache(path: Path) -> None:
    """Evict every file under ``path`` (or the file itself) from the page cache, best effort, so
    the next read comes from the disk: for honest restore timings in benchmarks."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    advise = getattr(os, "posix_fadvise", None)  # not on every platform
    for f in files:
        with contextlib.suppress(OSError), open(f, "rb") as fh:
            os.fsync(fh.fileno())  # dirty pages cannot be dropped
            if advise is not None:
                advise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _skeleton(state_dict: Mapping[str, Any]) -> Any:
    """The structure with every DCP leaf replaced by its DCP name (FQN)."""
    traverse_state_dict = torch_private("dcp.traverse_state_dict")

    leaves: dict[tuple, str] = {}
    seen: set[str] = set()

    def visit(path: tuple, _value: Any) -> None:
        fqn = ".".join(map(str, path))
        if fqn in seen:  # DCP would refuse it too, less clearly
            raise ValueError(f"two entries of the state dict share the DCP name {fqn!r}")
        seen.add(fqn)
        leaves[path] = fqn

    traverse_state_dict(state_dict, visit)

    # Mirrors DCP's traversal: a leaf is whatever its visitor saw there (a tuple, a list holding
    # no tensor nor mapping, any plain value); only mappings and other lists are walked into.
    def build(path: tuple, value: Any) -> Any:
        if path in leaves:
            return leaves[path]
        if isinstance(value, Mapping):
            return _like(value, {k: build(path + (str(k),), v) for k, v in value.items()})
        if isinstance(value, list):
            return [build(path + (i,), v) for i, v in enumerate(value)]
        raise TypeError(f"cannot place {type(value).__name__} at {'.'.join(map(str, path))}")

    return build((), state_dict)


def rebuild(skeleton: Any, flat: dict[str, Any]) -> Any:
    """A skeleton (``write_part``'s: each leaf its DCP name) with its leaves from ``flat``."""
    # Every str in a skeleton is a leaf's name: real str values are leaves themselves.
    if isinstance(skeleton, str):
        return flat[skeleton]
    if isinstance(skeleton, Mapping):
        return _like(skeleton, {k: rebuild(v, flat) for k, v in skeleton.items()})
    if isinstance(skeleton, list):
        return [rebuild(v, flat) for v in skeleton]
    raise TypeError(f"unexpected {type(skeleton).__name__} in the skeleton")


def _like(mapping: Mapping, items: dict) -> Mapping:
    # Same type and attributes (a module state dict's `_metadata`) as `mapping`, with `items`.
    try:
        out = copy.copy(mapping)
        out.clear()  # type: ignore[attr-defined]
        out.update(items)  # type: ignore[attr-defined]
        return out
    except Exception:  # an immutable or unusual mapping: its items are what matters
        return dict(items)


def read_entries(path: Path, like: Callable[[str, Any], Any] | None = None,
                 only: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The entries of the DCP checkpoint at ``path`` (a part, or a sharded step's directory)
    under their DCP names (``only``: those it accepts), each read into what ``like(name,
    metadata)`` gives - a DTensor takes the chunks its shard covers, from whichever files hold
    them - or, where it gives None, into a template made from the checkpoint's own metadata.
    DCP keeps the dotted keys of a flat dict as they are. Raises what DCP raises."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    flat: dict[str, Any] = {}
    for fqn, md in reader.read_metadata().state_dict_metadata.items():
        if only is not None and not only(fqn):
            continue
        given = like(fqn, md) if like is not None else None
        if given is not None:
            flat[fqn] = given
        elif isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:  # BytesStorageMetadata: DCP puts the unpickled value in place of this
            flat[fqn] = None
    with warnings.catch_warnings():
        _quiet()
        load(flat, storage_reader=reader, no_dist=True)
    return flat


def shard_layout(root: Path, step: int) -> tuple[Any, dict[str, Any]]:
    """What a sharded step's parts were made of, read from its first part's own entries (every
    part has the same): the state dict's nesting (``rebuild`` puts the leaves back into it) and
    the record of its shards (``shards.KEY``: object name -> [path, shape, offset] entries).
    Raises CorruptCheckpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    from . import shards

    manifest = read_manifest(root, step)
    first = _part(manifest, step, min(int(p) for p in manifest["parts"]))
    part_dir = Path(root) / step_dir_name(step) / first["dir"]
    try:
        flat = read_entries(part_dir, only=lambda fqn: fqn == _ENTRY
                            or fqn.startswith(shards.KEY + "."))
        skeleton = pickle.loads(flat.pop(_ENTRY))["skeleton"]
        names = skeleton.pop(shards.KEY)
        return skeleton, {name: flat[leaf] for name, leaf in names.items()}
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CorruptCheckpoint(f"step {step} part {first['dir']}: no record of its shards "
                                f"({exception_line(e)})") from e


def unreadable(what: str, exc: BaseException) -> CorruptCheckpoint:
    """The error to raise when reading ``what`` failed with ``exc``."""
    return CorruptCheckpoint(f"{what}: unreadable ({exception_line(exc)})")


def _part(manifest: dict, step: int, part_rank: int) -> dict:
    part = manifest["parts"].get(str(part_rank))
    if (not isinstance(part, dict) or not isinstance(part.get("dir"), str)
            or not isinstance(part.get("files"), dict)):
        raise CorruptCheckpoint(f"step {step} part {part_rank}: {MANIFEST}: no such part")
    return part


def _check(step_dir: Path, step: int, part_rank: int, part: dict, checksums: bool = True) -> None:
    directory = step_dir / part["dir"]
    for name, rec in sorted(part["files"].items()):
        where = f"step {step} part {part_rank}: {part['dir']}/{name}"
        try:
            expected_size, expected_hash = int(rec["bytes"]), str(rec["xxh3"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{where}: bad record in {MANIFEST}") from None
        try:
            size = os.stat(directory / name).st_size
            if size != expected_size:
                raise CorruptCheckpoint(f"{where}: size {size} bytes, expected {expected_size}")
            digest = _hash_file(directory / name)[1] if checksums else expected_hash
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{where}: missing") from None
        except OSError as e:
            raise CorruptCheckpoint(f"{where}: unreadable ({exception_line(e)})") from e
        if digest != expected_hash:
            raise CorruptCheckpoint(f"{where}: checksum {digest}, expected {expected_hash}")


@functools.lru_cache(maxsize=1)
def _torch_version() -> str:
    """torch's version as ``torch.__version__`` says it, read from its installed metadata
    (without loading torch: a launcher finishes the manifests of plain jobs without it)."""
    import importlib.metadata

    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return str(torch.__version__)


def _hash_file(path: Path, sync: bool = False) -> tuple[int, str]:
    # With sync, fsynced first: the record then describes what is on the disk.
    h, size = xxhash.xxh3_64(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        if sync:
            os.fsync(fh.fileno())
        while n := fh.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _replace_dir(src: Path, dst: Path) -> None:
    # rename(2) does not replace a non-empty directory: an earlier attempt's is moved aside first.
    old = None
    if dst.exists():
        old = dst.with_name(f"{dst.name}.old-{secrets.token_hex(6)}")
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _mkdirs(path: Path) -> None:
    # Path.mkdir(parents=True) gives the parents default permissions: every level we create is 0700.
    if not path.exists():
        _mkdirs(path.parent)
        with contextlib.suppress(FileExistsError):  # another process made it first
            path.mkdir(mode=0o700)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # makes the renames and new entries in it durable
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _quiet() -> None:
    # With no_dist, DCP warns that it assumes a single process: that is exactly what we ask for.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
