"""The public API's top: ``Model``, which holds an in-process or a worker backend."""
