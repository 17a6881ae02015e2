"""The worker agent's side of a provisioned instance: the models it loads and serves.

Like the rest of ``provisioners/``, it imports nothing else from this repository; torch is
imported here (and in the profiler) only.
"""
