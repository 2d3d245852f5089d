"""The NaN verdict of a job with no twin, carried by FSDP2's own gradient reduce-scatter
(runtime/verdict.py): two real ranks on gloo, no commit all-reduced."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, rank_processes

pytestmark = pytest.mark.integration  # starts processes

SCRIPT = ROOT / "tests" / "scripts" / "verdict_ranks.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    store = tmp_path_factory.mktemp("verdict") / "store"
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in rank_processes(
        lambda r: [sys.executable, str(SCRIPT), str(r), str(store)], timeout=120)]


def test_every_rank_reaches_the_verdict_of_any_with_no_message_of_its_own(ranks):
    """A finite step is finite on both ranks, and its gradients are bit for bit those of the
    same model without the check; a NaN in rank 1's loss is rank 0's verdict too (the whole
    unit's reduction became NaN); no flag was all-reduced for any of it."""
    for seen in ranks:
        assert seen["before_any"] is None  # no reduction yet: the step would commit
        assert seen["finite"] is True and seen["same_grads"] is True
        assert seen["nan_on_rank_1"] is False and seen["own_grads_finite"] is False
        # a second optimizer of the step: the same verdict; the next step, nothing reduced yet
        assert seen["second_optimizer"] is False and seen["next_step_without_reductions"] is None
        assert seen["all_reduces"] == 0


def test_a_rank_whose_part_of_a_unit_is_empty_still_sees_its_nan(ranks):
    """The last unit's [1, 16] weight and [1] bias are all rank 0's: rank 1's own gradients of it
    are empty, so its own check would find nothing. A NaN of rank 0's there still reaches rank
    1's verdict: every rank's part of a reduction is the same padded size."""
    rank0, rank1 = ranks
    assert rank0["own_part_of_last_unit"] == [16, 1] and rank1["own_part_of_last_unit"] == [0, 0]
    assert rank0["nan_in_last_unit_of_rank_0"] is False
    assert rank1["nan_in_last_unit_of_rank_0"] is False
    for seen in ranks:  # a new attempt starts with nothing of the old one's; padding is zeros
        assert seen["forgotten_then_finite"] is True
        assert seen["group_not_the_world"] is None


def test_it_is_installed_only_where_every_rank_would_see_every_nan(ranks):
    """HSDP (its replicas' all-reduce comes after the reduce-scatter the check sees), an
    optimizer with a parameter no unit reduces, or no optimizer: not installed (the commit
    stays)."""
    for seen in ranks:
        assert seen["hsdp"] is False
        assert seen["a_parameter_of_no_unit"] is False
        assert seen["no_optimizer"] is False
