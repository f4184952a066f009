"""dtdsl.reorder (see docs/architecture.md)."""
