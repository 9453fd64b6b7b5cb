"""Conformance suites a tier or registry author runs against their own implementation:
:func:`check_tier` and :func:`check_registry`, or the pytest classes :class:`TierConformance`
and :class:`RegistryConformance`."""

from __future__ import annotations

from tpusync._src.testing.conformance import (
    REGISTRY_CASES,
    TIER_CASES,
    RegistryConformance,
    TierConformance,
    check_registry,
    check_tier,
    conformance_layout,
)

__all__ = [
    "REGISTRY_CASES",
    "TIER_CASES",
    "RegistryConformance",
    "TierConformance",
    "check_registry",
    "check_tier",
    "conformance_layout",
]
