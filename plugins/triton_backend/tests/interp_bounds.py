"""A bounds guard for the Triton interpreter: on a GPU a load or store outside every tensor a kernel was given
is an illegal memory access (it poisons the CUDA context); the interpreter reads and writes host memory
unchecked. `strict_bounds()` makes each interpreted launch record the storages of its tensor arguments and
fails every load, store or atomic whose unmasked addresses fall outside all of them, naming the kernel
(`raise_on_hit=False`: records them and runs the access without those lanes).

    with strict_bounds() as hits:
        run_the_step()
    assert not hits  # or: strict_bounds(raise_on_hit=True) raises at the first one

Only for CPU tests under TRITON_INTERPRET=1 (it patches the interpreter's builder and launcher for the
duration of the block)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np


def _storage_ranges(args) -> list[tuple[int, int]]:
    """[begin, end) byte ranges of the storages of the tensors among `args` (tuples searched)."""
    out = []
    for a in args:
        if isinstance(a, tuple):
            out += _storage_ranges(a)
        elif hasattr(a, "untyped_storage"):
            s = a.untyped_storage()
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return out


@contextlib.contextmanager
def strict_bounds(raise_on_hit: bool = True) -> Iterator[list[str]]:
    """Check every interpreted memory access against the launch's tensor storages (see the module docstring).
    Yields the list of out-of-bounds descriptions (kernel, access, first bad address offset)."""
    import triton.runtime.interpreter as itp

    hits: list[str] = []
    state: dict = {"ranges": [], "kernel": "?"}
    builder_cls = itp.InterpreterBuilder
    real_init, real_call = itp.GridExecutor._init_args_hst, itp.GridExecutor.__call__
    real_load, real_store = builder_cls.create_masked_load, builder_cls.create_masked_store
    real_rmw, real_cas = builder_cls.create_atomic_rmw, builder_cls.create_atomic_cas

    def check(what: str, ptrs, mask, itemsize: int):
        """Record the accesses outside every storage; returns the mask with them switched off (the access
        then runs without them, so a recorded hit never touches memory it does not own)."""
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        live = np.ones(addr.shape, dtype=bool) if mask is None else np.broadcast_to(mask.data, addr.shape)
        ok = np.zeros(addr.shape, dtype=bool)
        for beg, end in state["ranges"]:
            ok |= (addr >= beg) & (addr + itemsize <= end)
        bad = live & ~ok
        if not bad.any():
            return mask
        first = int(addr[bad].reshape(-1)[0])
        near = min(state["ranges"], key=lambda r: min(abs(first - r[0]), abs(first - r[1])), default=(0, 0))
        msg = (
            f"{state['kernel']}: {what} of {int(bad.sum())} element(s) outside every tensor argument "
            f"(first at byte {first - near[0]} of the nearest storage of {near[1] - near[0]} bytes)"
        )
        hits.append(msg)
        if raise_on_hit:
            raise AssertionError(msg)
        return itp.TensorHandle(live & ok, itp.tl.int1)

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        state["ranges"] = _storage_ranges(list(args_hst) + list(kwargs_hst.values()))
        state["kernel"] = getattr(self.fn, "__name__", "?")
        return args_hst, kwargs_hst

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        mask = check("load", ptrs, mask, np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return real_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        mask = check("store", ptrs, mask, value.data.dtype.itemsize)
        return real_store(self, ptrs, value, mask, cache_policy)

    def rmw(self, op, ptr, val, mask, sem, scope):
        mask = check("atomic", ptr, mask, val.data.dtype.itemsize)
        return real_rmw(self, op, ptr, val, mask, sem, scope)

    def cas(self, ptr, cmp, val, sem, scope):  # no mask to narrow: a hit always raises
        if check("atomic_cas", ptr, None, val.data.dtype.itemsize) is not None:
            raise AssertionError(hits[-1])
        return real_cas(self, ptr, cmp, val, sem, scope)

    def call(self, *args, **kwargs):
        try:
            return real_call(self, *args, **kwargs)
        except itp.InterpreterError as exc:  # the interpreter wraps what the kernel raised
            if isinstance(exc.__cause__, AssertionError):
                raise exc.__cause__ from None
            raise

    patches = [
        (itp.GridExecutor, "_init_args_hst", init_args),
        (itp.GridExecutor, "__call__", call),
        (builder_cls, "create_masked_load", load),
        (builder_cls, "create_masked_store", store),
        (builder_cls, "create_atomic_rmw", rmw),
        (builder_cls, "create_atomic_cas", cas),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield hits
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
