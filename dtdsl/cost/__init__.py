"""dtdsl.cost: FLOPs, memory and communication of each unit, analytic or from a measured
profile (see docs/architecture.md and docs/profile.md)."""
