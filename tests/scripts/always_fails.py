"""A training function with a bug: it raises on every attempt at step 2."""

import torch

import nonstop

model = torch.nn.Linear(4, 1)
state = nonstop.State(model=model)


def broken_loss(step):
    if step == 2:
        raise ValueError(f"bad batch at step {step}")
    return model(torch.ones(1, 4)).sum()


@nonstop.wrap(state)
def train(ctx):
    for step in ctx.steps(10):
        broken_loss(step).backward()


train()
