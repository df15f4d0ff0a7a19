"""A pool across the nodes of a Ray cluster (``%ddp start --cluster ray --nodes N``): placement, the agent
that forks each other node's ranks, the kernel's store over pipes and Ray, the agents' event streams."""
