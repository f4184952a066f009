"""Parallelism: rank grids and process groups (``mesh``), tensor parallelism with DTensor
(``tp``), the cross-unit broker (``broker``) and point-to-point transfers."""
