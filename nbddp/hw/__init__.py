"""Hardware seams, one small module each: CUDA, the CUDA driver watch, NVML, NCCL, OpenMP, free-GPU picking.
Nothing else in nbddp touches that hardware."""
