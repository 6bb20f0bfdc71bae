"""The Open Inference Protocol (KServe v2 REST, with Triton's binary tensor extension) beside ``/v1``."""
