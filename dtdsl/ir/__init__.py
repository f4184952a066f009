"""Intermediate representations: Program (program.py), the stage graph (graph.py) and
Plan (plan.py); the Schedule follows."""
