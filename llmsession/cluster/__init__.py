"""Several replicas of the engine behind one address, on Ray Serve (``llmsession serve
--replicas N``): each conversation is routed to the replica that holds its state.

``keys`` finds a request's conversation and ranks the replicas for it (pure: no Ray, no model);
``router`` is the Ray Serve ``RequestRouter`` that applies that ranking; ``deployment`` holds the
two deployments (a thin front that reads each request's key, and the engine replicas, each a
``Model`` with the server's app); ``run`` starts or joins Ray and stops what it started. Ray is
imported only here, and only when the command runs (``pip install 'llmsession[cluster]'``).
"""
