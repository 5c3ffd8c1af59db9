"""``llmsession bench``: the session benchmark against a peer (``main``, ``report``) and its
variants (``memory``, ``concurrent``, ``structured``, ``rpc``), on shared helpers (``common``)."""
