"""attn-sparse: two attention backends that change which keys a query attends to, with their Triton kernels.

- `double_sparsity` (`attn_sparse.double_sparsity`): at decode, each query head scores every cached key
  cheaply from a few "heavy" channels kept in a label cache (`DoubleSparseKVPool`), keeps the top
  `heavy_token_num` keys and attends exactly to those; below a length threshold, and in every extend-like
  step, it attends densely.
- `dual_chunk` (`attn_sparse.dual_chunk`): dual chunk attention (Qwen2.5-1M's long-context method): keys in
  chunks, a query attending its own chunk, the previous chunk and all earlier chunks with three query
  variants the engine supplies, the three parts merged exactly by LSE.

Import-light: importing the package imports neither torch nor triton (the registry reads `spec` during
discovery); kernels load with the backends.
"""

__version__ = "0.1.0"
