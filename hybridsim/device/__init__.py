"""Device helpers below both the executor (engine/) and the kernels: host-to-device uploads that
never make the host wait (``transfer``), verdicts read back one step late (``verdicts``),
float32 products on the tensor cores for a block of code (``matmul``), and the kernel variants
Triton built while a loop ran (``builds``)."""
