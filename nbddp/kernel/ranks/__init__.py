"""The ranks' life in the kernel: gangs, start methods, the forkserver's end, the supervisor, rendezvous, stores,
logs."""
