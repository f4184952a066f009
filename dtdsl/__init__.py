"""dtdsl: a compiler for disaggregated multimodal LLM training jobs.

The public entry points are the ``dtc`` command (``dtdsl.cli``) and the
pipeline stages in ``dtdsl.driver``.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
