"""RL weight sync: a trainer publishes each version of its (sharded) weights once
(:class:`Publisher`); samplers pull it resharded into their own layouts, verified, and switch to
it atomically (:class:`Subscriber`). A version is an ``int`` that rises (the training step).
What a version looks like, for a sampler that builds its target from it:
:func:`published_structure` (a :class:`PublishedStructure`). Many samplers: :class:`Relay`
nodes serve each version's chunks, so the trainer's link carries one copy per relay.

Options, grouped: :class:`WeightsPoolOptions`, :class:`WeightsServerOptions`,
:class:`WeightsClientOptions` and :class:`TlsOptions`. See docs/weights.md."""

from __future__ import annotations

from tpusync._src.weights.manifest import LeafEntry, Manifest
from tpusync._src.weights.options import (
    TlsOptions,
    WeightsClientOptions,
    WeightsPoolOptions,
    WeightsServerOptions,
)
from tpusync._src.weights.plan import Box, LeafPlan, Piece, leaf_plan, shard_boxes
from tpusync._src.weights.publisher import Publisher, PublishReport
from tpusync._src.weights.relay import Relay, RelayReport
from tpusync._src.weights.structure import PublishedLeaf, PublishedStructure
from tpusync._src.weights.subscriber import PullReport, Subscriber, published_structure

__all__ = [
    "Box",
    "LeafEntry",
    "LeafPlan",
    "Manifest",
    "Piece",
    "PublishReport",
    "PublishedLeaf",
    "PublishedStructure",
    "Publisher",
    "PullReport",
    "Relay",
    "RelayReport",
    "Subscriber",
    "TlsOptions",
    "WeightsClientOptions",
    "WeightsPoolOptions",
    "WeightsServerOptions",
    "leaf_plan",
    "published_structure",
    "shard_boxes",
]
