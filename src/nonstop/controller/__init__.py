"""The controller process: turns what the job reports into generations and incidents.

On one host it runs in the launcher's process; across hosts every host keeps one in standby and
the one elected in etcd runs the job (``elected``), keeps its journal (``journal``), and sees the
hosts through ``cluster`` (the same interface as one host's agent and mail), reading every host's
channel with one thread (``readers``) and reaching node memory through the agents
(``remote_keepers``).
"""
