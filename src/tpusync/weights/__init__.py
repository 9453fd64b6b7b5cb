"""RL weight sync (issue 24, in progress): publish a version of sharded weights once, pull it
resharded into each sampler's own layout, verified and committed atomically.

Built so far: :mod:`tpusync.weights.plan`, the reshard plan (which bytes of which source shard
each target shard needs)."""

from tpusync.weights.plan import Box, LeafPlan, Piece, leaf_plan, shard_boxes

__all__ = ["Box", "LeafPlan", "Piece", "leaf_plan", "shard_boxes"]
