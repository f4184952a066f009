"""dtdsl.sim (see docs/architecture.md)."""
