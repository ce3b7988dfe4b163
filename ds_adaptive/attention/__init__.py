"""DSV dynamic sparse attention for the Wan DiT (docs/SPARSE.md).

cube_order (token permutation into 3D cubes), predictor (rank-r q/k projections), selection (block
top-k), profiler (exact density / recall on sampled rows), backends (the block-sparse kernels behind
one interface: flex, reference, ...), attention (shared op pieces, dense SDPA), schedule (two
stages), runtime (the per-model attention fn), telemetry (density PNG).
"""
