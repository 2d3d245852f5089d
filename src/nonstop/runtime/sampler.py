"""Which samples each step trains on, whatever the world size.

The samples form one stream: epoch 0's order, then epoch 1's, and so on (each epoch a permutation
of the dataset seeded by ``(seed, epoch)``, or ``0..size-1`` unshuffled). Step ``s`` trains on the
next ``global_batch`` samples of that stream, its *global batch*, which does not depend on how
many ranks there are. The ranks of the current world split it into contiguous shares that differ by
at most one sample. Across any sequence of replacements, scale-in and scale-out, every sample of an
epoch is seen exactly once, in the same global order, and every step sees the same global batch.

The position in the stream is the step, which nonstop restores with the rest of the state; the
sampler's ``state_dict`` carries the stream's definition and its position, so a resumed job that
would read another stream (another dataset size, batch or seed) is stopped with a clear error
instead of silently training on other samples.

Use it with a plain ``DataLoader`` as its ``batch_sampler``, built inside the wrapped function::

    sampler = nonstop.GlobalBatchSampler(len(dataset), global_batch=256, seed=0)
    state = nonstop.State(model=model, optimizer=opt, sampler=sampler)

    @nonstop.wrap(state)
    def train(ctx):
        loader = DataLoader(dataset, batch_sampler=sampler.for_rank(ctx))
        for step, batch in zip(ctx.steps(total), loader):
            ...
"""

from __future__ import annotations

from typing import Any, Iterator


class GlobalBatchSampler:
    def __init__(self, size: int, global_batch: int, *, seed: int = 0, shuffle: bool = True):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"GlobalBatchSampler: size must be a positive int, not {size!r}")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError("GlobalBatchSampler: global_batch must be a positive int, not "
                             f"{global_batch!r}")
        self.size, self.global_batch = size, global_batch
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.position = 0  # the next step a share was asked for (informational: the step rules)
        self._orders: dict[int, list[int]] = {}

    # == the stream =============================================================================
    def order(self, epoch: int) -> list[int]:
        """The samples of ``epoch``, in the order they are trained on."""
        if epoch not in self._orders:
            if self.shuffle:
                import torch

                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders = {epoch: torch.randperm(self.size, generator=g).tolist()}
            else:
                self._orders = {epoch: list(range(self.size))}
        return self._orders[epoch]

    def epoch(self, step: int) -> int:
        """The epoch step ``step``'s first sample belongs to."""
        return step * self.global_batch // self.size

    def global_indices(self, step: int) -> list[int]:
        """The global batch of ``step``: the next ``global_batch`` samples of the stream (a batch
        may end one epoch and begin the next)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        start = step * self.global_batch
        out: list[int] = []
        while len(out) < self.global_batch:
            epoch, offset = divmod(start + len(out), self.size)
            order = self.order(epoch)
            out += order[offset:offset + self.global_batch - len(out)]
        return out

    def share(self, step: int, rank: int, world: int) -> list[int]:
        """Rank ``rank``'s part of step ``step``'s global batch, in a world of ``world`` ranks:
        contiguous, sizes differing by at most one sample (a rank may get none when the world is
        larger than the batch)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        q, r = divmod(self.global_batch, world)
        begin = rank * q + min(rank, r)
        self.position = max(self.position, step + 1)
        return self.global_indices(step)[begin:begin + q + (rank < r)]  # as ctx.share

    def for_rank(self, ctx: Any, start: int | None = None) -> Iterator[list[int]]:
        """This rank's shares from ``start`` (default: the step the job resumes at), one list
        per step: a ``DataLoader``'s ``batch_sampler``. Built anew in each generation, it follows
        the world as it is then."""
        return _Shares(self, ctx.rank, ctx.world_size, ctx.step if start is None else start)

    # == what is snapshotted =====================================================================
    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "global_batch": self.global_batch, "seed": self.seed,
                "shuffle": self.shuffle, "position": self.position,
                "samples_consumed": self.position * self.global_batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        mine = (self.size, self.global_batch, self.seed, self.shuffle)
        theirs = (sd.get("size"), sd.get("global_batch"), sd.get("seed"), sd.get("shuffle"))
        if mine != theirs:
            raise ValueError(
                "GlobalBatchSampler: the saved state reads another sample stream "
                f"(size, global_batch, seed, shuffle) = {theirs}, this run {mine}: resuming "
                "would train on other samples")
        self.position = int(sd.get("position") or 0)


class _Shares:
    """One rank's shares, step after step (an endless ``batch_sampler``: the loop's
    ``ctx.steps`` says when to stop)."""

    def __init__(self, sampler: GlobalBatchSampler, rank: int, world: int, start: int):
        self.sampler, self.rank, self.world, self.start = sampler, rank, world, start

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.sampler.share(step, self.rank, self.world)
            step += 1
