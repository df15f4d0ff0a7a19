"""Runs in a rank (a fork or a spawned interpreter of the kernel): the worker's life, its stdio, the
jobs, the command server, what a fork inherits, the user's own process group, launchers inside a rank.
Imports only the wire, the IPython helpers and the hardware seams."""
