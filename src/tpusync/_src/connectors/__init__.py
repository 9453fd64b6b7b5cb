"""The serving-engine connectors' implementations: each imports its engine; importing this package
imports none of them."""
