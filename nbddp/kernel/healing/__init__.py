"""A pool that survives a lost rank (``%ddp start --on-loss heal|shrink|end``): the loss known at once, said, and
the pool mended without the user doing anything. Each concern a module of its own, all of them in the kernel:

- losses.py: the losses recorded (``Losses``, the one state two threads share, and its owner) and watched between
  cells on the kernel's event loop (``LossWatch``);
- mending.py: the pool's side (``Mending``): ``--on-loss`` acted on (options.OnLoss, the pool's gang's
  ``on_loss``), ``%ddp resize``, what is said in the pool's view and the next cell;
- orchestrate.py: the steps of healing, shrinking and resizing, and of making DDP models anew on a fresh group;
- steps.py: one step, a ``Call`` of rank/heal.py's on some ranks, answered within a deadline (``HealFailed``);
- verdict.py: which names a new rank may be given, from the survivors' fingerprints (pure);
- report.py: what mending did, in words (``Mended``).

Nothing is re-exported here: a module that needs a part imports it by name.
"""
