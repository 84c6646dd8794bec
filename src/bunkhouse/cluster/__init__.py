"""Scale-out on a Ray cluster (``bunkhouse serve --ray ADDRESS``): every alive Ray node is a
residency node; a worker placed on one runs there in a Ray actor, behind an authenticated
relay the front reaches over TCP (docs/scaling.md).

Nothing here is imported without ``--ray``; only cluster/agent.py and cluster/host.py's
actor import Ray, and only in the agent process and on the nodes.
"""
