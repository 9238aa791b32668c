"""CPU kernels: numba (`numba_kernels.py`) and C built at first use with the machine's compiler (`native.py`,
sources in `csrc/`), each with a plain torch path or reference beside it. Map: engine/kernels/__init__.py."""
