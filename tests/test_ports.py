"""The declared interfaces between the controller and what runs its processes (one host's agent,
or the cluster of hosts' agents), and between the cluster and the office it reports to
(``controller/ports.py``): each class that stands in one of those places has every member, so the
controller never asks which one it holds."""

from __future__ import annotations

import inspect

import pytest

from nonstop.agent.agent import Agent
from nonstop.controller import ports
from nonstop.controller.cluster import Cluster
from nonstop.controller.elected import Leader


def _members(protocol: type) -> set[str]:
    names = {n for n, v in vars(protocol).items()
             if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("cls", [Agent, Cluster])
def test_both_sides_that_run_the_processes_have_every_member_the_controller_calls(cls):
    made = set(dir(cls))
    init = inspect.getsource(cls.__init__)  # (attributes set on the instance)
    missing = sorted(n for n in _members(ports.Processes)
                     if n not in made and f"self.{n} =" not in init and f"self.{n}:" not in init)
    assert missing == [], f"{cls.__name__} lacks {missing}"


def test_the_leader_is_the_office_its_cluster_reports_to():
    missing = sorted(n for n in _members(ports.Office) if not callable(getattr(Leader, n, None)))
    assert missing == []


def test_nothing_in_the_controller_asks_which_side_it_holds():
    """No ``getattr(agent, ...)``/``hasattr(agent, ...)``: a member is declared, or not used."""
    from pathlib import Path

    import nonstop.controller as pkg

    for p in sorted(Path(pkg.__file__).parent.glob("*.py")):
        text = p.read_text()
        for probe in ("getattr(self.agent", "hasattr(self.agent", "getattr(agent", "hasattr(agent"):
            assert probe not in text, f"{p.name}: {probe}"
