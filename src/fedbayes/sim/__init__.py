"""The simulator: the cohort of a round trained inside one program, client-state stores, scenario knobs.

Importing this package imports nothing else, so that :mod:`fedbayes.sim.hostdevices` can set XLA's flags
before JAX starts."""
