"""The node's memory: a process of its own on each host (``python -m nonstop.keeper``, pure
Python, no torch), started by the agent. It holds its ranks' snapshot slots (``slots.py``) so a
snapshot outlives the rank that wrote it, copies them to buddy hosts' keepers and takes theirs in
(``replicas.py``), and writes them to disk through a writer process of its own (``disk.py``,
``writer.py``); ``server.py`` serves its clients. What its clients send and what it answers are
typed records (``protocol/keeper_messages.py``); the slots' format and the local socket are the
ranks' as much as its own (``state/shm.py``, ``state/wire.py``)."""
