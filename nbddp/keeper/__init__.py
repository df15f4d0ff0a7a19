"""A kept pool's keeper: the small process that lets a pool outlive its kernel (``%ddp start --keep``).

It runs on its own (``python -m nbddp.keeper``, ``nbddp-keeper`` in ps), a fresh interpreter in a session of its
own, never a fork of the kernel: it holds no copy of the kernel's heap, imports no torch, and Jupyter's signals
to the kernel's process group never reach it. Its ranks die with it (rank/worker.py ties them to its pidfd).
See keeper/keeper.py.
"""
