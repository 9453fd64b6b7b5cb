"""RL weight sync: a trainer publishes each version of its (sharded) weights once
(:class:`Publisher`); samplers pull it resharded into their own layouts, verified, and switch to
it atomically (:class:`Subscriber`).

:mod:`tpusync.weights.plan` is the reshard plan (which bytes of which source shard each target
shard needs); :mod:`tpusync.weights.manifest` the version's manifest (its commit record)."""

from tpusync.weights.manifest import LeafEntry, Manifest
from tpusync.weights.plan import Box, LeafPlan, Piece, leaf_plan, shard_boxes
from tpusync.weights.publisher import Publisher, PublishReport
from tpusync.weights.subscriber import PullReport, Subscriber

__all__ = [
    "Box",
    "LeafEntry",
    "LeafPlan",
    "Manifest",
    "Piece",
    "PublishReport",
    "Publisher",
    "PullReport",
    "Subscriber",
    "leaf_plan",
    "shard_boxes",
]
