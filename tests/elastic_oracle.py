"""The oracle of elastic runs (see test_scale.py): the samples each step trained on, the world
size of each step, and how far two sets of final parameters are apart."""

from __future__ import annotations

import json
import os

import torch

from nonstop import GlobalBatchSampler

BATCH, SAMPLES = 48, 1024  # train_elastic.py's --global-batch and --samples in the tests
TOLERANCE = 1e-5  # relative, final parameters against the fault-free run at full size


def committed(samples_dir):
    """step -> (generation, the entries of the generation that completed it last): a step redone
    after a failure supersedes its earlier attempt."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for name in os.listdir(samples_dir):
        for line in (samples_dir / name).read_text().splitlines():
            e = json.loads(line)
            by_step.setdefault(e["step"], {}).setdefault(e["gen"], []).append(e)
    return {s: (max(gens), gens[max(gens)]) for s, gens in by_step.items()}


def check_samples(samples_dir, steps):
    """Every step trained on exactly its global batch of the fault-free stream, split over the
    ranks of its world; returns step -> world size.

    Every rank of a step's world logged its share, except at the last step of a generation that a
    fault ended: a rank whose reduction completed applies the whole global batch's gradient, and
    its peers cut off in that same reduction do not log the step (the next generation resumes
    after it, from that rank's state). There, each share logged is still checked."""
    stream = GlobalBatchSampler(SAMPLES, global_batch=BATCH, seed=0)
    done = committed(samples_dir)
    assert sorted(done) == list(range(steps))  # every optimizer step, once
    last = {}
    for s, (gen, _) in done.items():
        last[gen] = max(last.get(gen, -1), s)
    worlds = {}
    for s, (gen, entries) in done.items():
        entries = sorted(entries, key=lambda e: e["rank"])
        world = entries[0]["world"]
        ranks = [e["rank"] for e in entries]
        assert len(set(ranks)) == len(ranks) and all(e["world"] == world for e in entries)
        for e in entries:
            assert e["ids"] == stream.share(s, e["rank"], world), f"step {s} rank {e['rank']}"
        if ranks != list(range(world)):  # only where a fault cut a generation short
            assert s == last[gen] and gen != max(last), (s, entries)
        else:
            assert [i for e in entries for i in e["ids"]] == stream.global_indices(s)
        worlds[s] = world
    return worlds


def max_rel_diff(a, b):
    x, y = torch.load(a), torch.load(b)
    return max(((x[k] - y[k]).abs().max() / x[k].abs().max()).item() for k in x)


def segments(worlds):
    """[(world, first step, end step)] of a run's world sizes by step."""
    out = []
    for s in sorted(worlds):
        if out and out[-1][0] == worlds[s]:
            out[-1][2] = s + 1
        else:
            out.append([worlds[s], s, s + 1])
    return out


# no spare: the job shrinks at once and grows back half a second after new processes are up
SCALE_IN = "recover:\n  levels:\n    scale_in:\n      when: no_warm_spare\n      grow_after_s: 0.5\n"


def assert_shrank_by_a_group_and_grew_back(run, out, ref, step: int) -> None:
    """A 4-rank mesh job that lost a rank at ``step`` with no spare: its group of 2 left
    (the other went on at once, from its own live state), then came back at a step boundary
    with its parts from their twins; nothing lost, the weights within the elastic oracle's
    tolerance of the fault-free run (``ref``)."""
    assert [d["level"] for d in run.of("decision")] == ["scale-in", "scale-out"]
    worlds = [len(g["ranks"]) for g in run.of("generation")]
    assert worlds == [4, 2, 4], worlds
    (shrunk,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert shrunk["step"] == step and shrunk["sources"] == {"0": "live", "1": "live"}
    (grown,) = [r for r in run.of("restore") if r["gen"] == 2]
    assert set(grown["sources"].values()) == {"live"} and grown["bytes"] > 0  # from the twins
    assert run.summary["steps_lost"] == 0
    diff = max_rel_diff(out, ref)
    assert diff < TOLERANCE, diff
