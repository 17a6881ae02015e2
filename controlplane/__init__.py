"""heteroplane's control plane: the composition root (CLI now; API, scheduler and serving later).

It composes the pure libraries (``estimator``, ``matching``) and the adapters (``provisioners``).
"""

__version__ = "0.1.0"
