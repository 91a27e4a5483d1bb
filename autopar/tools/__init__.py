"""Tools around the compiler: the CLI, ``verify``, ``calibrate``, model SPEC loading, host checks."""
