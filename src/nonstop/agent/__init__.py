"""The agent process: one per host, over that host's processes (start, watch, signal), their
mailboxes and health checks.

- ``agent``: the processes of one host (ranks, spares, keepers), forked from a warm zygote.
- ``mail``: the ranks' mailboxes, events and progress in the host's store.
- ``host``: the agent of one host of many (``nonstop run --rdzv-endpoint``): registers the host in
  etcd, keeps a standby controller ready, carries out the elected controller's orders and relays
  its processes' reports.
- ``fencing``: that host's membership in etcd (its lease, record and incarnation; cut off, or etcd
  down?), told to the agent as verdicts it carries out.
- ``host_keepers``: the agent's end of node memory reached across hosts.
"""
