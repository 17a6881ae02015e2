"""When things run: the reconciler (the one code that acts on provisioners), the live tuner, the
live gear switcher, the capacity replanner, the metric roll-up and the scheduler that runs them."""
