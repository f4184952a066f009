"""Intermediate representations: Program, and later StageGraph, Plan and Schedule."""
