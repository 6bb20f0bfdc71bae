"""The hot path: the ordinary requests of ``POST /v1/detect``, ``/v1/detect/batch`` and
``/v2/models/{name}/infer`` answered below FastAPI's routing, validation and middlewares
(``front.py``), each through the same code FastAPI's routes call (``app/api/detection.py``,
``app/api/oip/rest.py``). Anything unusual goes to the FastAPI app untouched, before a byte of
its body is read, and is answered there as before.
"""
