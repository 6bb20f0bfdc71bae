"""GPU code: kernels, decode, buffers, the staged pipeline's parts. Importing the package loads
nothing heavy and changes nothing; the process's CUDA setting is made explicitly, before any
CUDA context exists (``app.gpu.device.configure_process``, called by the runtime)."""
