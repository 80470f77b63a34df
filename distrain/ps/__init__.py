"""Parameter-server training on Ray actors: sync, async (optionally bounded), Hogwild and EASGD.

No torch.distributed here: sharded server actors hold the weights and optimizer state, workers
pull weights through the object store and push gradients (or, in EASGD, exchange weights) with
Ray calls. `driver.ParameterServerRun` places both, replaces dead workers while the others go on,
restores dead servers from checkpoints, and writes the same metrics and run directory as every
other strategy.
"""
