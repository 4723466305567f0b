"""Device helpers below both the executor (engine/) and the kernels: host-to-device uploads that
never make the host wait (``transfer``), and verdicts read back one step late (``verdicts``)."""
