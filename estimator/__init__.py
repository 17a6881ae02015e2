"""The estimator: a pure library that predicts how a fleet serves a workload.

Instance catalog and prices, latency profiles, traces and their generators, arrival envelopes
(network calculus), and the discrete-event simulator (InferLine's estimator, generalised to
heterogeneous fleets and dispatch policies). No I/O beyond reading and writing the files a user
names, no clock reads, no globals; randomness only through an explicit ``numpy.random.Generator``.
"""
