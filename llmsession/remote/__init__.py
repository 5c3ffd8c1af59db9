"""A model in a worker process: the parent's backend and proxies (``isolated``) and the worker
(``worker``), so that what kills llama.cpp ends the worker, not the caller."""
