"""dtdsl.cost (see docs/architecture.md)."""
