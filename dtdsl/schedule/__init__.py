"""dtdsl.schedule (see docs/architecture.md)."""
