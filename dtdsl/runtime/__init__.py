"""dtdsl.runtime (see docs/architecture.md)."""
