"""The name ``--profile``'s rank side had until nbddp 0.56 (now rank/profile_session.py): a loop without an
optimizer that counts its steps with ``nbddp.rank.profiling.step()`` goes on working."""
from .profile_session import step

__all__ = ["step"]
