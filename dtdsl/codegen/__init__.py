"""dtdsl.codegen (see docs/architecture.md)."""
