"""Which rank a NaN came from: a rank's forward outputs of the step, each micro-batch's (a
pipeline's schedule, gradient accumulation) and not only the last, are kept track of without a
host sync and read only when the step's gradients turned out non-finite. No process."""

from __future__ import annotations

import torch

from nonstop.runtime.registered import State


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, State]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, State(model=model, optimizer=opt)


def test_a_non_finite_micro_batch_is_seen_though_the_last_one_was_finite():
    model, opt, state = _state()
    state.begin_step()
    model(torch.full((2, 4), float("nan")))  # the first micro-batch's output turns NaN
    model(torch.ones(2, 4))  # the second is finite
    assert state.forward_finite() is False


def test_every_micro_batch_finite_and_each_step_counted_afresh():
    model, opt, state = _state()
    state.begin_step()
    for _ in range(3):
        model(torch.ones(2, 4))
    assert state.forward_finite() is True
    # a NaN in one step, then the next step's outputs alone: the optimizer's step (or a new
    # ctx.steps step, or the read) starts the count again
    model(torch.full((2, 4), float("nan")))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    model(torch.ones(2, 4))
    model(torch.ones(2, 4))
    assert state.forward_finite() is True
    model(torch.full((2, 4), float("nan")))
    state.begin_step()
    model(torch.ones(2, 4))
    assert state.forward_finite() is True
    assert state.forward_finite() is None  # read: forgotten (the step is redone)
