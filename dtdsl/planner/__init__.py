"""dtdsl.planner (see docs/architecture.md)."""
