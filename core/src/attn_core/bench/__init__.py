"""`attn-core bench`: time attention backends on the standard shapes of docs/design.md §8.

`workloads` names the shapes (scaled down on CPU), `env` builds pools and a batch for one shape,
`timing` measures (CUDA events on GPU, wall clock on CPU), `runner` checks each backend against the
float64 reference once and then times it, `report` prints the table and writes the JSON.
"""
