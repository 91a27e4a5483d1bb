"""Planning: price every strategy of every layer, then search for the fastest plan that fits.

``pricing`` turns the cost models and the contract into per-layer prices;
the solver searches configurations and solves one CP-SAT model per
configuration; ``api`` is the public face (``solve``, ``compare``, ``reprice``).
"""
