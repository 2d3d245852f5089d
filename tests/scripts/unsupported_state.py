"""A module whose state holds a value nonstop cannot keep (a set, in its extra state): its
snapshot fails in nonstop's own state code, which must say the error is its own."""

import argparse

import torch

import nonstop

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()


class Tagged(torch.nn.Linear):
    def get_extra_state(self):
        return {"tags": {"a", "b"}}  # a set: not a tensor, not a plain value

    def set_extra_state(self, state):
        pass


torch.manual_seed(0)
model = Tagged(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = nonstop.State(model=model, optimizer=opt)


@nonstop.wrap(state)
def train(ctx):
    for step in ctx.steps(args.steps):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ctx.rank


train()
