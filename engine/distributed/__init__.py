"""The parts that span worker processes: the torch.distributed group (group.py) and its
rendezvous store, data-parallel lockstep, and expert parallelism (the expert placement and EPLB,
the all-to-all backends, the expert-parallel MoE layer that dispatches through them).

An architecture supplies its own expert-parallel MoE through its `Architecture`
(engine/models/base.py); everything here serves any architecture.
"""
