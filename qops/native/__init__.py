"""Native CUDA C++ kernels (no torch headers) compiled at run time with NVRTC (``compiler``), and the
lowerings built on them (``int_weight``: the ``native_w4a16`` lowering of ``qops::mm_int_weight``)."""
