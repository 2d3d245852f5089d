"""``nonstop run``: from the command's flags, checked, to the processes of a job.

- ``one_host``: a job on this host alone - the store hosted here, the agent and the controller.
- ``hosts``: one host of a job across hosts (``--rdzv-endpoint``): its agent.
- ``config``: one host's settings for a job across hosts, and how to reach the job's etcd.
"""
