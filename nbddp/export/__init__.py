"""From notebook to cluster: %%ddp cells as a torchrun script, IPython syntax turned into plain Python."""
