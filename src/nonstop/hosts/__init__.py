"""nonstop across hosts: one agent per host, etcd for membership, leases and the election of one
controller, an authenticated channel from the controller to each agent.

- ``keys``: what lives in etcd (host records, the job record, the controller's journal).
- ``config``: one host's settings, and how to reach the job's etcd.
- ``launch``: ``run_host``, the command's entry on one host of many (the flags, checked).
- ``agent``: the per-host process (``nonstop run`` with ``--rdzv-endpoint``): supervises its
  ranks and spares, relays their events, fences itself when it loses its lease.
- ``cluster``: the controller's view of many agents (the same interface as one host's agent and
  mail), so the controller's decisions are the ones it makes on one host.
- ``leader``: the controller process: elected, it rebuilds from the journal and runs the job.
- ``takeover``: what a controller taking office makes of the journal and the hosts (pure).
- ``journal``: the controller's journal in etcd, fenced by its epoch, history kept short.
- ``netif``: which interface holds an address; which address reaches etcd.
"""
