"""Runs in the kernel: options, launch checks, starters, the supervisor, the one cell engine, the pool,
failure reports, the magics. May import every other subpackage."""
