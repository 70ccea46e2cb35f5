"""Custom Metal kernels. Each kernel module pairs a build-once `mx.fast.metal_kernel` with
the pure-MLX twin it must match, and dispatches to the twin off Metal."""
