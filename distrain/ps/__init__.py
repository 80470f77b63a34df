"""Parameter-server training on Ray actors: sync, async (optionally bounded), Hogwild and EASGD.

No process group here: sharded server actors hold the weights and optimizer state, workers pull
weights through the object store and push gradients (or, in EASGD, exchange weights) with Ray
calls. `engine.ParameterServerEngine` plugs into the one supervisor (distrain/cluster/): it starts
the servers, restores them from checkpoints, turns the workers' records into the same metrics and
run directory as every other strategy; the supervisor replaces a dead worker while the others go on.
A worker's step is the trainer's own (train/learner.py).
"""
