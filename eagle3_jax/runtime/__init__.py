"""What the program runs on: the device mesh, logical-axis sharding rules and multi-host start-up
(runtime/sharding.py), the choice between XLA and the GPU kernels (runtime/kernels.py), and the optional packages
an entry point needs (extras.py)."""
